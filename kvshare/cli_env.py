"""Conventions every `kvshare` subcommand shares: flags from KVSHARE_* variables, defaults in --help.

KVSHARE_<DEST> (the flag's destination in capitals: --kv-cache-memory is
KVSHARE_KV_CACHE_MEMORY) gives a flag's default; the flag on the command line wins.
On/off flags take 1/0, true/false, yes/no, on/off. Repeatable flags and test-only
(hidden) flags are not read from the environment.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator, Mapping

ENV_PREFIX = "KVSHARE_"
ENV_EPILOG = (
    "Every flag can also be set in the environment as KVSHARE_<FLAG>: the flag's name in "
    "capitals, '-' as '_' (KVSHARE_PORT=9000 is --port 9000, KVSHARE_NO_KV_POOL=1 is "
    "--no-kv-pool). A flag on the command line wins."
)
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Appends '(default: X)' to a flag's help unless its help already names the default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            not action.option_strings
            or "default" in text
            or default in (None, False, "", ())
            or default is argparse.SUPPRESS
        ):
            return text
        return f"{text} (default: %(default)s)"


def env_name(action: argparse.Action) -> str:
    return ENV_PREFIX + action.dest.upper()


def parsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    """`parser` and every subcommand parser under it, each once."""
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):
                yield from parsers(sub)


def apply_conventions(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    """Defaults shown in every --help, the KVSHARE_* epilog, and defaults from `environ`.

    Raises ValueError for an on/off variable that is neither on nor off. Other values are
    converted and checked by argparse like a flag's text, when that command runs.
    """
    for each in parsers(parser):
        each.formatter_class = DefaultsHelpFormatter
        each.epilog = each.epilog or ENV_EPILOG
        from_env = {a.dest for a in each._actions if _env_default(a, environ)}
        for group in each._mutually_exclusive_groups:
            if any(a.dest in from_env for a in group._group_actions):
                group.required = False


def _env_default(action: argparse.Action, environ: Mapping[str, str]) -> bool:
    """Set `action`'s default from its KVSHARE_ variable; True when there was one."""
    if (
        not action.option_strings
        or action.help == argparse.SUPPRESS
        or isinstance(
            action,
            (
                argparse._HelpAction,
                argparse._VersionAction,
                argparse._AppendAction,
                argparse._CountAction,
            ),
        )
    ):
        return False
    name = env_name(action)
    value = environ.get(name)
    if value is None:
        return False
    if action.nargs == 0:  # store_true / store_false / store_const
        if value.strip().lower() not in _TRUE + _FALSE:
            raise ValueError(f"{name}={value!r}: expected one of {', '.join(_TRUE + _FALSE[:-1])}")
        on = value.strip().lower() in _TRUE
        if isinstance(action, argparse.BooleanOptionalAction):  # --x / --no-x: the variable picks
            action.default = on
        elif on:
            action.default = action.const
        return True
    # A string default is converted by argparse like the flag's text (type errors name the flag).
    action.default = value
    action.required = False
    if action.choices is not None:
        action.type = _one_of(tuple(action.choices), action.type)
    return True


def _one_of(choices: tuple, convert: object) -> object:
    """A type that also checks choices: argparse does not check them on defaults."""

    def checked(text: str) -> object:
        value = convert(text) if callable(convert) else text
        if value not in choices:
            raise argparse.ArgumentTypeError(
                f"invalid choice: {text!r} (choose from {', '.join(map(str, choices))})"
            )
        return value

    return checked
