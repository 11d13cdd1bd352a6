"""`kvshare up --device cuda`: two replicas share one GPU (a memory fraction each) and the
pool; a prompt prefilled on one is restored on the other. Random weights (no download)."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import httpx
import pytest

from kvshare.serve.launcher import Cluster, UpConfig

MODEL = "shape:gemma3-1b"  # sliding-window layers: the restore path with partial pages
VOCAB = 262144


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def complete(url: str, prompt: list[int], replica: int | None = None, **fields: object) -> dict:
    headers = {} if replica is None else {"x-kvshare-replica": str(replica)}
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": 16,
        "temperature": 0,
        "ignore_eos": True,
        **fields,
    }
    resp = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=300)
    assert resp.status_code == 200, resp.text
    return resp.json()


async def _concurrent(url: str, n: int) -> list[int]:
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        bodies = [
            {
                "model": MODEL,
                "prompt": ids(300 + 50 * i, 100 + i),
                "max_tokens": 32,
                "ignore_eos": True,
                "stream": True,
            }
            for i in range(n)
        ]
        responses = await asyncio.gather(*(client.post("/v1/completions", json=b) for b in bodies))
    return [r.status_code for r in responses if not r.text.rstrip().endswith("[DONE]")]


@pytest.mark.cuda
@pytest.mark.slow
def test_two_replicas_on_one_gpu_share_prefixes_through_the_pool(tmp_path: Path) -> None:
    config = UpConfig(
        replicas=2,
        model=MODEL,
        device="cuda",
        port=0,
        pool_size=4 << 30,
        gpu_memory_fraction=0.45,
        engine_args=("--max-model-len", "16384"),
        ready_timeout=600,
    )
    with (tmp_path / "cluster.log").open("w") as log, Cluster(config, log=log) as cluster:
        stats = [httpx.get(u + "/admin/stats").json()["engine"] for u in cluster.replica_urls]
        assert all(s["num_blocks"] > 1000 for s in stats), stats
        prompt = ids(3000, 7)
        first = complete(cluster.url, prompt, replica=0)
        moved = complete(cluster.url, prompt, replica=1)
        n = first["usage"]["prompt_tokens"]
        assert first["usage"]["kv"]["computed_tokens"] == n
        assert moved["usage"]["kv"]["pool_hit_tokens"] == (n - 1) // 256 * 256
        assert len(moved["choices"][0]["token_ids"]) == 16
        # bf16 with random weights: recomputing the last 184 tokens in another batch shape
        # may flip a near-tied argmax, so the ids are reported, not required equal.
        same = first["choices"][0]["token_ids"] == moved["choices"][0]["token_ids"]
        print(f"cross-replica greedy ids equal: {same}")
        assert asyncio.run(_concurrent(cluster.url, 16)) == []
        served = [httpx.get(u + "/admin/stats").json()["kv_pool"] for u in cluster.replica_urls]
        assert served[1]["hit_tokens"] >= 2816 and served[0]["stored_bytes"] > 0
