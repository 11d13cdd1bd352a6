"""Conventions of every `kvshare` subcommand: help on every flag, defaults shown, --version,
flags from KVSHARE_* variables (the command line wins), clear one-line failures."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest
import torch

import kvshare
from kvshare import preflight
from kvshare.cli import build_parser, main
from kvshare.cli_env import parsers
from kvshare.models import loader
from tests.kvpool.pool_fixture import REPO_ROOT, child_env


def test_every_flag_of_every_subcommand_has_help() -> None:
    missing = [
        f"{sub.prog} {action.option_strings[0]}"
        for sub in parsers(build_parser({}))
        for action in sub._actions
        if action.option_strings and not action.help
    ]
    assert not missing, f"flags without help text: {missing}"


def test_help_shows_defaults_and_the_environment_rule(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser({}).parse_args(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "port to listen on (default: 8000)" in text
    assert (
        "--max-body-bytes MAX_BODY_BYTES largest request body (default: 8MiB) " in text
    )  # not twice
    assert "KVSHARE_PORT=9000 is --port 9000" in text


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"kvshare {kvshare.__version__}"


def test_flags_come_from_kvshare_variables_and_the_command_line_wins() -> None:
    env = {
        "KVSHARE_PORT": "9000",
        "KVSHARE_NO_KV_POOL": "1",
        "KVSHARE_LOG_LEVEL": "DEBUG",
        "KVSHARE_KV_CACHE_MEMORY": "1GiB",
    }
    args = build_parser(env).parse_args(["serve"])
    assert (args.port, args.no_kv_pool, args.log_level, args.kv_cache_memory) == (
        9000,
        True,
        "DEBUG",
        1 << 30,
    )
    args = build_parser(env).parse_args(["serve", "--port", "9100", "--log-level", "INFO"])
    assert (args.port, args.log_level) == (9100, "INFO")
    assert build_parser({"KVSHARE_NO_KV_POOL": "0"}).parse_args(["serve"]).no_kv_pool is False
    # An on/off pair (--cuda-graphs / --no-cuda-graphs) takes its default from one variable.
    args = build_parser(
        {"KVSHARE_CUDA_GRAPHS": "0", "KVSHARE_ENABLE_PREFIX_CACHING": "yes"}
    ).parse_args(["serve"])
    assert (args.cuda_graphs, args.enable_prefix_caching) == (False, True)
    assert (
        build_parser({"KVSHARE_CUDA_GRAPHS": "0"})
        .parse_args(["serve", "--cuda-graphs"])
        .cuda_graphs
    )
    # A variable may stand in for a required flag, also one of a required either-or pair.
    assert build_parser({"KVSHARE_SIZE": "1GiB"}).parse_args(["pool"]).size == "1GiB"
    args = build_parser({"KVSHARE_TARGET": "http://h:1"}).parse_args(["bench", "cross-replica"])
    assert args.target == "http://h:1"


@pytest.mark.parametrize(
    ("env", "argv", "message"),
    [
        ({"KVSHARE_PORT": "x"}, ["serve"], "argument --port: invalid int value: 'x'"),
        ({"KVSHARE_LOG_LEVEL": "LOUD"}, ["serve"], "argument --log-level: invalid choice: 'LOUD'"),
    ],
)
def test_bad_variables_are_usage_errors(
    env: dict[str, str], argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        build_parser(env).parse_args(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_hidden_test_only_flags_ignore_the_environment() -> None:
    args = build_parser({"KVSHARE_UNSAFE_SKIP_CHECKSUMS": "1"}).parse_args(["serve"])
    assert args.unsafe_skip_checksums is False


def test_an_on_off_variable_that_is_neither_fails_in_one_line() -> None:
    with pytest.raises(ValueError, match="KVSHARE_NO_KV_POOL='maybe'"):
        build_parser({"KVSHARE_NO_KV_POOL": "maybe"})


def _kvshare(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvshare", *argv],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env={**child_env(), **(env or {})},
        timeout=120,
    )


def test_the_environment_reaches_the_installed_command() -> None:
    done = _kvshare("serve", "--help", env={"KVSHARE_PORT": "9000"})
    assert done.returncode == 0 and "(default: 9000)" in " ".join(done.stdout.split())
    assert isinstance(build_parser({}), argparse.ArgumentParser)


_NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")


@_NO_CUDA
@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "--device", "cuda", "hi"],
        ["serve", "--device", "cuda"],
        ["up", "--device", "cuda", "--replicas", "1"],
        ["validate", "bytes", "--device", "cuda"],
        ["bench", "cross-replica", "--up=--device cuda"],
    ],
)
def test_a_missing_gpu_fails_in_one_line_without_a_traceback(argv: list[str]) -> None:
    done = _kvshare(*argv)
    output = (done.stdout + done.stderr).strip().splitlines()
    assert done.returncode == 2, output
    assert "Traceback" not in done.stderr
    assert len(output) == 1 and "--device cuda: no CUDA GPU is usable here" in output[0], output


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "--model", "shape:qwen3-8b", "hi"],
        ["serve", "--model", "shape:qwen3-8b"],
        ["up", "--model", "shape:qwen3-8b", "--replicas", "1"],
    ],
)
def test_a_model_larger_than_memory_fails_before_loading(
    argv: list[str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr(preflight, "available_bytes", lambda device: 24 << 30)
    monkeypatch.setattr(loader, "load_model", _must_not_load)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert (
        "shape:qwen3-8b needs about 31.51 GiB (weights 30.51 GiB in float32 + KV cache 1 GiB)"
        in err
    )
    assert "but cpu has 24 GiB RAM available" in err


def test_a_model_that_fits_passes_the_check(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(preflight, "available_bytes", lambda device: 24 << 30)
    preflight.check_model_fits("shape:qwen3-8b", "cpu", "bfloat16")
    with pytest.raises(ValueError, match="2 x"):
        preflight.check_model_fits("shape:qwen3-8b", "cpu", "bfloat16", engines=2)


def _must_not_load(*args: object, **kwargs: object) -> None:
    raise AssertionError("the model was loaded")
