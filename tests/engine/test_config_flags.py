"""EngineConfig is the one definition of the engine flags: every flagged field is a flag of
each command that runs an engine, and rendering a config for a child process and parsing
it back gives the same config."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvshare.cli import build_parser
from kvshare.engine.cli import add_model_arguments, engine_argv, engine_options
from kvshare.engine.config import EngineConfig


@st.composite
def engine_configs(draw: st.DrawFn) -> EngineConfig:
    block_size = 1 << draw(st.integers(0, 8))
    optional_int = st.none() | st.integers(1, 1 << 40)
    return EngineConfig(
        device=draw(st.sampled_from(("cpu", "cuda", "cuda:1"))),
        dtype=draw(st.sampled_from(("auto", "float32", "bfloat16", "float16"))),
        block_size=block_size,
        max_num_batched_tokens=draw(st.integers(block_size, 1 << 20)),
        max_num_seqs=draw(st.integers(1, 4096)),
        max_model_len=draw(optional_int),
        kv_cache_memory=draw(optional_int),
        gpu_memory_fraction=draw(st.floats(0.05, 1.0)),
        enable_prefix_caching=draw(st.booleans()),
        attention_backend=draw(st.sampled_from(("auto", "sdpa", "varlen"))),
        kv_cache_dtype=draw(st.sampled_from(("auto", "fp8"))),
        cuda_graphs=draw(st.booleans()),
    )


def _model_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_model_arguments(parser)
    return parser


@settings(max_examples=200, deadline=None)
@given(engine_configs(), st.integers(0, 1 << 31))
def test_rendered_options_parse_back_to_the_same_config(
    config: EngineConfig, weights_seed: int
) -> None:
    parser = argparse.ArgumentParser()
    EngineConfig.add_arguments(parser)
    assert EngineConfig.from_args(parser.parse_args(list(config.to_argv()))) == config
    assert EngineConfig.from_argv([*config.to_argv(), "--unrelated-flag"]) == config
    # What `kvshare up` hands its replicas: the `kvshare serve` model flags.
    model = _model_parser()
    argv = engine_argv(model.parse_args([*config.to_argv(), "--weights-seed", str(weights_seed)]))
    options = engine_options(model.parse_args(list(argv)))
    assert options.pop("weights_seed") == weights_seed
    assert EngineConfig(**options) == config  # type: ignore[arg-type]


@pytest.mark.parametrize("command", [["serve"], ["up"], ["generate", "hi"]])
def test_every_flagged_field_is_a_flag_of_every_engine_command(command: list[str]) -> None:
    args = build_parser({}).parse_args(command)
    flagged = EngineConfig.flag_values(EngineConfig())
    assert flagged.keys() >= {
        "block_size",
        "cuda_graphs",
        "enable_prefix_caching",
        "kv_cache_memory",
    }
    assert {name: getattr(args, name) for name in flagged} == flagged | (
        {"gpu_memory_fraction": None} if command == ["up"] else {}
    )


def test_fields_without_a_flag_keep_their_defaults() -> None:
    assert (
        not {"seed", "num_state_snapshots", "snapshot_interval_tokens"}
        & EngineConfig.flag_values(EngineConfig()).keys()
    )
    defaults = EngineConfig()
    config = EngineConfig.from_argv(dataclasses.replace(defaults, block_size=32).to_argv())
    assert (config.block_size, config.seed, config.num_state_snapshots) == (32, 0, 8)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--block-size", "12"], "block_size must be a power of two"),
        (["--kv-cache-memory", "lots"], "--kv-cache-memory"),
        (["--attention-backend", "flash"], "invalid choice"),
        (["--pool-load-layer-groups", "-1"], "pool_load_layer_groups must be >= 0"),
    ],
)
def test_invalid_engine_flags_say_why(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_argv(argv)
