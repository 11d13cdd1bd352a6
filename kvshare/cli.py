"""The `kvshare` command: one entry point, one subcommand per part of the system."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Mapping

from kvshare.cli_env import apply_conventions
from kvshare.version import __version__

# Each module here defines `register(subparsers)`, which adds its subcommands and sets
# `func` on them. Handlers import heavy modules (torch) themselves, so `kvshare --help`
# stays fast.
SUBCOMMAND_MODULES: tuple[str, ...] = (
    "kvshare.generate_cli",
    "kvshare.kvpool.cli",
    "kvshare.serve.cli",
    "kvshare.validate.cli",
    "kvshare.bench.cli",
    "kvshare.integrations.cli",
)


def build_parser(environ: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """The parser of every subcommand; flag defaults come from `environ` (default: os.environ)."""
    parser = argparse.ArgumentParser(
        prog="kvshare",
        description="Share prefix KV cache between LLM inference replicas through one host-memory pool.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module_name in SUBCOMMAND_MODULES:
        importlib.import_module(module_name).register(subparsers)
    apply_conventions(parser, os.environ if environ is None else environ)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        parser = build_parser()
    except ValueError as error:  # a KVSHARE_* variable that cannot be a flag's value
        print(f"kvshare: {error}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
