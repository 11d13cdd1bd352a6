"""A pool named explicitly but unreachable at start: a loud warning, or with
`require_kv_pool` / `--require-kv-pool` a one-sentence error; a reachable pool says nothing."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from kvshare import LLM
from kvshare.cli import main
from kvshare.kvpool.launch import PoolProcess
from kvshare.llm import KVPoolUnreachable
from tests.kvpool.pool_fixture import PoolFactory

MODEL = "shape:tiny-llama"
MISSING = "unix:/nonexistent-kvshare-dir/pool.sock"


@pytest.fixture(scope="module")
def pool() -> Iterator[PoolProcess]:
    factory = PoolFactory()
    yield factory.start()
    factory.close()


def pool_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.WARNING and "kv pool" in r.getMessage()
    ]


def test_an_unreachable_pool_is_one_warning_naming_the_address_and_the_reason(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING):
        llm = LLM(MODEL, dtype="float32", kv_pool=MISSING)
    [warning] = pool_warnings(caplog)
    assert warning.startswith(
        f"kv pool {MISSING} unreachable (No such file or directory): running without"
    )
    assert "--require-kv-pool" in warning
    assert llm.generate([[5, 6, 7]])[0].token_ids  # and the engine serves without it


def test_a_reachable_pool_prints_no_warning(
    pool: PoolProcess, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        LLM(MODEL, dtype="float32", kv_pool=pool.address, require_kv_pool=True)
    assert not pool_warnings(caplog)


def test_require_kv_pool_makes_it_an_error(caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(KVPoolUnreachable, match=f"kv pool {MISSING} unreachable .No such file"):
        LLM(MODEL, dtype="float32", kv_pool=MISSING, require_kv_pool=True)
    assert not pool_warnings(caplog)


@pytest.mark.parametrize("command", [["generate", "7 8 9"], ["serve", "--port", "0"]])
def test_the_commands_exit_2_with_one_sentence_and_no_traceback(
    command: list[str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main([*command, "--model", MODEL, "--kv-pool", MISSING, "--require-kv-pool"]) == 2
    err = " ".join(capsys.readouterr().err.split())  # rich wraps long lines
    assert (
        f"kv pool {MISSING} unreachable (No such file or directory) and a pool is required" in err
    )
    assert "Traceback" not in err


def test_serve_refuses_require_with_no_pool(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--model", MODEL, "--no-kv-pool", "--require-kv-pool"]) == 2
    assert "contradict" in capsys.readouterr().err
