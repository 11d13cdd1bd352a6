"""Cross-process restore: process A stores a prompt; a fresh process B restores it.

B's pool hits must cover every full chunk (never the last token), and its greedy output
must be token-identical to B without a pool. Parametrized over chunk sizes equal to and
larger than the block size, prompts aligned to neither (docs/architecture.md F3), a sliding-window
model with prompts longer than its window, and concurrent requests sharing the restored
prefix (docs/architecture.md F2).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvshare.kvpool.launch import PoolProcess
from tests.kvpool.pool_fixture import PoolFactory

REPO = Path(__file__).resolve().parents[2]
SHORT_ANSWER = ("--max-tokens", "8")


@pytest.fixture(scope="module")
def pool() -> Iterator[PoolProcess]:
    factory = PoolFactory()
    config = factory.config(size_bytes=1 << 30, slab_bytes=128 << 20)
    yield factory.start(config)
    factory.close()


@dataclass
class EngineRun:
    """An engine_worker process started by `start_engine`; its output goes to files (a pipe
    nobody reads while it runs could fill and stall it)."""

    process: subprocess.Popen
    stdout: Path
    stderr: Path


def start_engine(
    tmp_path: Path,
    model: str,
    prompts: list[list[int]],
    pool: str | None,
    chunk_tokens: int = 256,
    hash_seed: str = "0",
    *extra: str,
) -> EngineRun:
    """Start a fresh engine process on `prompts`; `finish_engine` collects its report. A
    reference run without a pool can go on while other processes store and restore."""
    name = uuid.uuid4().hex
    prompt_file = tmp_path / f"prompts-{name}.json"
    prompt_file.write_text(json.dumps(prompts))
    args = [
        sys.executable,
        "-m",
        "tests.kvpool.engine_worker",
        "--model",
        model,
        "--prompts",
        str(prompt_file),
        "--chunk-tokens",
        str(chunk_tokens),
    ]
    if pool:
        args += ["--pool", pool]
    args += list(extra)
    env = {**os.environ, "PYTHONHASHSEED": hash_seed, "HF_HUB_OFFLINE": "1"}
    stdout, stderr = tmp_path / f"out-{name}.txt", tmp_path / f"err-{name}.txt"
    with stdout.open("w") as out, stderr.open("w") as err:
        process = subprocess.Popen(args, cwd=REPO, stdout=out, stderr=err, text=True, env=env)
    return EngineRun(process, stdout, stderr)


def finish_engine(run: EngineRun) -> dict:
    try:
        returncode = run.process.wait(timeout=600)
    except subprocess.TimeoutExpired:
        run.process.kill()
        run.process.wait()
        raise
    assert returncode == 0, run.stderr.read_text()[-3000:]
    return json.loads(run.stdout.read_text().strip().splitlines()[-1])


def run_engine(*args: Any) -> dict:
    """`start_engine(*args)`, waited for: the engine's report."""
    return finish_engine(start_engine(*args))


def random_tokens(seed: int, n: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


@pytest.mark.parametrize(
    "model, vocab, chunk, context",
    [
        ("shape:tiny-llama", 512, 256, 1000),
        ("shape:tiny-llama", 512, 16, 203),
        (
            "shape:tiny-gemma3",
            512,
            256,
            700,
        ),  # window 64: earlier chunks restore global layers only
        ("shape:tiny-gemma3", 512, 32, 301),
        ("shape:tiny-qwen3.5", 512, 256, 600),  # hybrid: KV + the state snapshot at 512
    ],
)
def test_fresh_process_restores_every_full_chunk(
    pool: PoolProcess, tmp_path: Path, model: str, vocab: int, chunk: int, context: int
) -> None:
    prefix = random_tokens(context, context, vocab)
    follow_up = prefix + random_tokens(context + 1, 37, vocab)
    # Different hash seeds: keys must not depend on Python's hash() (docs/architecture.md F4).
    reference = start_engine(tmp_path, model, [follow_up], None, chunk)
    run_engine(tmp_path, model, [prefix], pool.address, chunk, "1")
    with_pool = run_engine(tmp_path, model, [follow_up], pool.address, chunk, "2")
    without = finish_engine(reference)
    out = with_pool["outputs"][0]
    assert out["pool_hit"] == (context // chunk) * chunk
    assert out["gpu_hit"] == 0
    assert out["computed"] == len(follow_up) - out["pool_hit"]
    assert out["token_ids"] == without["outputs"][0]["token_ids"]
    assert with_pool["stats"].get("checksum_failures", 0) == 0


def test_smollm2_2k_prompt_restored_in_fresh_process(pool: PoolProcess, tmp_path: Path) -> None:
    """A real model's 2,048-token chat context, stored by one process, restored by a fresh one.

    The storing process answers the same follow-up with nothing to restore (zero pool hits), so
    its answer is the recomputed reference: SmolLM2's 2k prefill, most of this test's minute on
    two cores, runs once instead of twice. The cases above keep a reference from a process
    without a pool. Eight tokens and their log-probabilities are a finer comparison than the
    tokens alone of a longer answer."""
    from kvshare.models.gguf_file import read_gguf_tokenizer
    from kvshare.models.packaged import packaged_model_path

    tok = read_gguf_tokenizer(packaged_model_path("smollm2-135m"))
    story = " ".join(
        f"Chapter {i}: the harbor town kept its lamps lit through the winter storms."
        for i in range(150)
    )
    context = tok.encode_chat([{"role": "user", "content": story}], add_generation_prompt=False)[
        :2048
    ]
    question = tok.encode_chat([{"role": "user", "content": "Summarize the story in one line."}])
    follow_up = context + question
    assert len(question) < 256  # so the follow-up's full chunks are the context's eight
    runs = [
        run_engine(tmp_path, "smollm2-135m", [follow_up], pool.address, 256, "0", *SHORT_ANSWER)
        for _ in range(2)
    ]
    computed, restored = (run["outputs"][0] for run in runs)
    assert computed["pool_hit"] == 0 and computed["computed"] == len(follow_up)
    assert restored["pool_hit"] == 2048 and restored["gpu_hit"] == 0
    assert restored["token_ids"] == computed["token_ids"]
    # The restored bytes are exact (the bytes checks); the question is computed in another
    # batch shape, which moves float32 log-probabilities by up to 3e-4 (seen in a loaded CI
    # run; usually under 1e-4). A wrong restore moves them by far more, and the tokens.
    assert max(abs(a - b) for a, b in zip(restored["logprobs"], computed["logprobs"])) < 1e-3


def test_concurrent_requests_sharing_a_restored_prefix(pool: PoolProcess, tmp_path: Path) -> None:
    prefix = random_tokens(11, 600, 512)
    prompts = [prefix + random_tokens(12 + i, 20 + 7 * i, 512) for i in range(3)]
    reference = start_engine(tmp_path, "shape:tiny-gemma3", prompts, None)
    run_engine(tmp_path, "shape:tiny-gemma3", [prefix], pool.address)
    with_pool = run_engine(tmp_path, "shape:tiny-gemma3", prompts, pool.address)
    without = finish_engine(reference)
    hits = [o["pool_hit"] + o["gpu_hit"] for o in with_pool["outputs"]]
    # 512 restored (two 256-token chunks); a request that waited for another's prefill
    # gets that one's 37 computed blocks (592 tokens) from the GPU cache instead.
    assert all(h in (512, 592) for h in hits) and with_pool["outputs"][0]["pool_hit"], hits
    for a, b in zip(with_pool["outputs"], without["outputs"]):
        assert a["token_ids"] == b["token_ids"]


def test_hybrid_restore_without_its_state_is_caught(pool: PoolProcess, tmp_path: Path) -> None:
    """The broken variant restores a hybrid model's KV but not its recurrent state. A tiny
    random model's greedy tokens may survive that, so the check compares the tokens'
    log-probabilities: the correct restore matches no-pool to float precision, the broken
    one does not."""
    prefix = random_tokens(21, 700, 512)
    follow_up = prefix + random_tokens(22, 30, 512)
    plain = start_engine(tmp_path, "shape:tiny-qwen3.5", [follow_up], None)
    run_engine(tmp_path, "shape:tiny-qwen3.5", [prefix], pool.address)
    correct = start_engine(tmp_path, "shape:tiny-qwen3.5", [follow_up], pool.address)
    broken = run_engine(
        tmp_path, "shape:tiny-qwen3.5", [follow_up], pool.address, 256, "0", "--skip-state-restore"
    )
    correct, without = finish_engine(correct), finish_engine(plain)
    assert correct["outputs"][0]["pool_hit"] == broken["outputs"][0]["pool_hit"] == 512
    reference = without["outputs"][0]["logprobs"]
    assert correct["outputs"][0]["token_ids"] == without["outputs"][0]["token_ids"]
    assert max(abs(a - b) for a, b in zip(correct["outputs"][0]["logprobs"], reference)) < 1e-4
    assert max(abs(a - b) for a, b in zip(broken["outputs"][0]["logprobs"], reference)) > 1e-3
