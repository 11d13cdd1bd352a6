"""Names and defaults shared by every layer, torch-free so that the CLI, the router and the
benchmarks can use them without loading the engine."""

from __future__ import annotations

# A model spec `shape:NAME` is a preset's shape with random weights (kvshare.models.presets).
SHAPE_PREFIX = "shape:"
# Tokens per pool page: the pool stores and restores whole chunks of this many tokens.
DEFAULT_CHUNK_TOKENS = 256
