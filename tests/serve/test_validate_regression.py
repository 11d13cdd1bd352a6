"""`kvshare validate regression` passes on a healthy cluster and fails on a broken restore.

The broken cluster's replicas run the pool connector with its load ordering removed, the
copy delayed and checksums ignored (hidden test-only flags; with checksums on, the
unfinished copy fails verification and is recomputed, which hides the race from the
answers): the engine then computes on blocks the restore has not written yet, so answers
differ from the pool-off answers, and the check must say so.

The healthy check runs on the suite's SmolLM2 cluster (text prompts and chats) and on a
tokenizer-less model (a tiny Gemma 3 shape: window 64, random weights), whose prompts and
chats are token ids. The broken cluster runs the tokenizer-less model only: the check
compares token ids either way, and that cluster starts in seconds where a SmolLM2 one
takes a minute of the suite.
"""

from __future__ import annotations

from dataclasses import replace

import httpx

from kvshare.serve.launcher import Cluster, UpConfig
from kvshare.validate.regression import (
    CHAT_TURN_TOKENS,
    TOKEN_LENGTHS,
    Prompt,
    default_prompts,
    default_token_prompts,
    prompts_for,
    run_regression_check,
)

BROKEN_RESTORE = (
    "--unsafe-break-stream-order",
    "load",
    "--unsafe-load-delay",
    "0.5",
    "--unsafe-skip-checksums",
)
# No tokenizer, no chat template; starts in seconds. Its own cluster: the suite's serves SmolLM2.
TOKENIZER_LESS = UpConfig(
    replicas=2,
    model="shape:tiny-gemma3",
    port=0,
    pool_size=64 << 20,
    engine_args=("--kv-cache-memory", "32MiB", "--max-num-batched-tokens", "1024"),
    router_args=("--health-interval", "0.5"),
    ready_timeout=300.0,
)


def prompts() -> list[Prompt]:
    everything = {p.name: p for p in default_prompts(seed=5)}
    return [everything["completion-900w"], everything["chat-0"]]


def test_regression_check_passes_on_a_healthy_cluster(cluster: Cluster) -> None:
    result = run_regression_check(cluster.url, prompts=prompts(), max_tokens=12)
    assert result.passed, result.failures
    assert result.counts["answers_equal"] == result.counts["answers_compared"] == 4
    assert result.counts["pool_hit_tokens"] > 0


def test_token_prompts_reach_past_the_window_and_several_chunks() -> None:
    prompts = default_token_prompts(seed=3, vocab_size=512)
    assert prompts == default_token_prompts(seed=3, vocab_size=512)  # seeded
    ids = [i for p in prompts for turn in p.turns for i in turn]
    assert min(ids) >= 10 and max(ids) < 512
    assert [len(p.turns[0]) for p in prompts if not p.chat] == list(TOKEN_LENGTHS)
    assert max(TOKEN_LENGTHS) > 512 and max(TOKEN_LENGTHS) > 4 * 256
    assert [tuple(map(len, p.turns)) for p in prompts if p.chat] == [CHAT_TURN_TOKENS] * 2


def test_token_prompts_follow_what_v1_models_says() -> None:
    """The served model's /v1/models entry names tokenizer, vocab and context: no request."""
    entry = {
        "id": "m",
        "tokenizer": False,
        "chat_template": False,
        "vocab_size": 300,
        "max_model_len": 2000,
    }
    prompts = prompts_for(entry, max_tokens=16)
    assert [p.name for p in prompts] == [
        "tokens-20",
        "tokens-300",
        "tokens-700",
        "tokens-1500",
        "token-chat-0",
        "token-chat-1",
    ]
    assert max(i for p in prompts for turn in p.turns for i in turn) < 300


def pool_switches(url: str) -> list[bool]:
    stats = httpx.get(f"{url}/admin/all/stats", timeout=30).json()["replicas"]
    return [replica["body"]["engine"]["kv_pool_enabled"] for replica in stats]


def test_regression_check_passes_without_a_tokenizer() -> None:
    with Cluster(TOKENIZER_LESS) as running:
        # One replica's pool switched off: the check switches both, then sets each back.
        [replica0, _] = httpx.get(f"{running.url}/admin/replicas", timeout=30).json()
        httpx.post(f"{replica0['url']}/admin/kv_pool", json={"enabled": False}, timeout=30)
        assert pool_switches(running.url) == [False, True]
        result = run_regression_check(running.url, max_tokens=16)
        assert pool_switches(running.url) == [False, True]
    assert result.passed, result.failures
    prompts = len(TOKEN_LENGTHS) + 2
    assert result.counts["prompts"] == result.counts["token_id_prompts"] == prompts
    turns = len(TOKEN_LENGTHS) + 2 * len(CHAT_TURN_TOKENS)
    assert result.counts["answers_equal"] == result.counts["answers_compared"] == turns
    assert result.counts["pool_hit_tokens"] > 0


def test_regression_check_fails_without_a_tokenizer_when_restores_are_not_waited_for() -> None:
    broken = replace(TOKENIZER_LESS, engine_args=(*TOKENIZER_LESS.engine_args, *BROKEN_RESTORE))
    # Prompts of several chunks each; every restore of them waits out the delayed copy.
    restored = default_token_prompts(seed=0, vocab_size=512, lengths=(700, 1500), chats=1)
    with Cluster(broken) as running:
        result = run_regression_check(running.url, prompts=restored, max_tokens=16)
    assert not result.passed
    assert result.counts["token_id_prompts"] == result.counts["prompts"] == 3
    assert any("first differing token" in failure for failure in result.failures), result.failures
