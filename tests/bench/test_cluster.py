"""`--up ARGS`: `kvshare up`'s own parser builds the cluster config; and one real run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvshare.bench.cluster import up_config
from kvshare.cli import main

GIB = 1 << 30


def test_up_args_parse_like_kvshare_up_with_free_ports_by_default() -> None:
    config = up_config("--replicas 3 --pool-size 1GiB --dtype float32 --no-kv-pool")
    assert (config.replicas, config.pool_size, config.kv_pool, config.port) == (3, GIB, False, 0)
    engine = config.engine_args  # every `kvshare serve` engine flag, with its value
    assert engine[engine.index("--dtype") + 1] == "float32"
    assert (config.model, config.device) == ("smollm2-135m", "cpu")
    assert up_config("--port 9100").port == 9100
    with pytest.raises(SystemExit):
        up_config("--replicas")


@pytest.mark.slow
def test_a_real_cluster_loads_the_context_from_the_pool(tmp_path: Path) -> None:
    """`--up ARGS` starts a real `kvshare up` (2 CPU replicas of a tiny random Llama: no
    tokenizer, so prompts are token ids, and a start in seconds): the follow-up on replica 1
    finds the 2,048-token context replica 0 stored, only with the pool on, and its TTFT
    drops (a 2k prefill on one core against a copy of 8 pages)."""
    out = tmp_path / "r.json"
    assert (
        main(
            [
                "bench",
                "cross-replica",
                "--up=--model shape:tiny-llama --pool-size 64MiB",
                "--lengths",
                "2048",
                "--requests-per-block",
                "1",
                "--design",
                "OFF-ON",
                "--resamples",
                "50",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    data = json.loads(out.read_text())
    follow = {r["condition"]: r for r in data["requests"] if r["role"] == "measure"}
    assert follow["OFF"]["usage"]["kv"]["pool_hit_tokens"] == 0
    assert follow["ON"]["usage"]["kv"]["pool_hit_tokens"] == 2048  # eight 256-token chunks
    assert all(r["usage"]["prompt_tokens"] == 2048 + 32 for r in follow.values())  # exact
    assert follow["ON"]["ttft_s"] < follow["OFF"]["ttft_s"] / 2
    assert follow["ON"]["served_by"] == "1"
