"""TTFT of a ~2k-token prompt on replica 1 after replica 0 computed it, pool OFF vs ON,
against `kvshare up --engine vllm` (switching the pool at the daemon, no engine call).

    python scripts/vllm_cross_replica.py --router http://127.0.0.1:18480 \
        --kv-pool unix:/path/up-XXXX.sock --model /tmp/smol-hf --out docs/results/vllm.json
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time

import httpx

from kvshare.kvpool.client import PoolClient

WORDS = "the of and to in is was for on with as by at from his her an that this which".split()


def prompt_text(seed: int, words: int) -> str:
    rng = random.Random(seed)
    return " ".join(f"{rng.choice(WORDS)}{rng.randrange(1000)}" for _ in range(words))


def ask(client: httpx.Client, router: str, model: str, text: str, replica: int) -> dict:
    body = {
        "model": model,
        "prompt": text,
        "max_tokens": 8,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start, first, pieces, usage = time.perf_counter(), None, [], {}
    with client.stream(
        "POST", f"{router}/v1/completions", json=body, headers={"x-kvshare-replica": str(replica)}
    ) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                first = first or time.perf_counter()
                pieces.append(chunk["choices"][0]["text"])
            usage = chunk.get("usage") or usage
    details = usage.get("prompt_tokens_details") or {}
    return {
        "ttft_s": (first or time.perf_counter()) - start,
        "text": "".join(pieces),
        "prompt_tokens": usage.get("prompt_tokens"),
        "cached_tokens": details.get("cached_tokens"),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--router", required=True)
    parser.add_argument("--kv-pool", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--words", type=int, default=1500)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    pool = PoolClient(args.kv_pool)
    runs = []
    with httpx.Client(timeout=600) as client:
        for trial in range(args.trials):
            for enabled in (False, True):
                pool.set_enabled(enabled)
                text = prompt_text(1000 * trial + enabled, args.words)
                computed = ask(client, args.router, args.model, text, 0)
                time.sleep(1.0)  # the stores of replica 0 commit
                second = ask(client, args.router, args.model, text, 1)
                runs.append(
                    {
                        "trial": trial,
                        "pool": "ON" if enabled else "OFF",
                        "replica0": computed,
                        "replica1": second,
                        "same_text": computed["text"] == second["text"],
                    }
                )
                print(json.dumps(runs[-1]), flush=True)
    pool.set_enabled(True)
    off = [r["replica1"]["ttft_s"] for r in runs if r["pool"] == "OFF"]
    on = [r["replica1"]["ttft_s"] for r in runs if r["pool"] == "ON"]
    summary = {
        "ttft_off_s": sorted(off)[len(off) // 2],
        "ttft_on_s": sorted(on)[len(on) // 2],
        "all_same_text": all(r["same_text"] for r in runs),
    }
    result = {
        "machine": platform.node() + " " + platform.processor(),
        "cpus": __import__("os").cpu_count(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "args": vars(args),
        "summary": summary,
        "runs": runs,
    }
    with open(args.out, "w") as out:
        json.dump(result, out, indent=1)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
