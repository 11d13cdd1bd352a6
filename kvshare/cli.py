"""The `kvshare` command: one entry point, one subcommand per part of the system."""

from __future__ import annotations

import argparse
import importlib
import sys

# Each module here defines `register(subparsers)`, which adds its subcommands and sets
# `func` on them. Handlers import heavy modules (torch) themselves, so `kvshare --help`
# stays fast.
SUBCOMMAND_MODULES: tuple[str, ...] = (
    "kvshare.engine.cli",
    "kvshare.kvpool.cli",
    "kvshare.serve.cli",
    "kvshare.validate.cli",
    "kvshare.bench.cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvshare",
        description="Share prefix KV cache between LLM inference replicas through one host-memory pool.",
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module_name in SUBCOMMAND_MODULES:
        importlib.import_module(module_name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
