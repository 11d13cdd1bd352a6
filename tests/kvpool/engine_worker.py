"""A fresh engine process for the cross-process tests: generate once, print JSON.

python -m tests.kvpool.engine_worker --model M [--pool unix:PATH] --prompts FILE.json
FILE holds a list of token-id lists; all are submitted together (concurrent requests).
"""

from __future__ import annotations

import argparse
import json

from kvshare import LLM, SamplingParams
from kvshare.kvpool.faults import FaultInjection


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--pool", default=None)
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--chunk-tokens", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument(
        "--skip-state-restore",
        action="store_true",
        help="broken variant: restore a hybrid model's KV without its state",
    )
    args = parser.parse_args()
    with open(args.prompts) as f:
        prompts = json.load(f)
    llm = LLM(
        args.model,
        dtype="float32",
        kv_pool=args.pool,
        chunk_tokens=args.chunk_tokens,
        max_num_batched_tokens=args.max_num_batched_tokens,
        weights_seed=3,
        kv_cache_dtype=args.kv_cache_dtype,
        kv_pool_faults=FaultInjection(skip_state_restore=args.skip_state_restore),
    )
    outs = llm.generate(
        prompts,
        SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True, logprobs=True),
    )
    if llm.engine.connector is not None:
        llm.engine.connector.wait_idle()
    stats = llm.engine.connector.stats() if llm.engine.connector else {}
    print(
        json.dumps(
            {
                "outputs": [
                    {
                        "token_ids": list(o.token_ids),
                        "logprobs": list(o.logprobs),
                        "gpu_hit": o.gpu_hit_tokens,
                        "pool_hit": o.pool_hit_tokens,
                        "computed": o.computed_tokens,
                    }
                    for o in outs
                ],
                "stats": stats,
            }
        )
    )


if __name__ == "__main__":
    main()
