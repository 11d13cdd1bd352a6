"""One vLLM replica process for the tests: `python replica.py MODEL_DIR POOL|none [OPTIONS]`.

OPTIONS is JSON: {"dtype": ..., "extra": {...}} (the connector's extra config, merged over
the defaults). Reads one JSON request per line on stdin ({"tokens": [...], "max_tokens": n,
"salt": s}, or {"reset_prefix_cache": true}), answers one JSON line on stdout ({"tokens":
[...], "cached": n, "logprobs": [...]}, or {"reset": bool}); the engine's log goes to
stderr. Runs vLLM in this process (no engine-core child).
"""

from __future__ import annotations

import json
import os
import sys


def build(model_dir: str, pool: str, options: dict):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    transfer = None
    if pool != "none":
        extra = {"kv_pool": pool, "chunk_tokens": 256, **options.get("extra", {})}
        transfer = KVTransferConfig(
            kv_connector="KVShareConnector",
            kv_connector_module_path="kvshare.integrations.vllm",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config=extra,
        )
    return LLM(
        model_dir,
        skip_tokenizer_init=True,
        max_model_len=2048,
        max_num_seqs=2,
        dtype=options.get("dtype", "float32"),
        enforce_eager=True,
        kv_transfer_config=transfer,
        seed=0,
        # A fixed KV cache (1,024 blocks): vLLM CPU otherwise claims a share of the host's memory.
        kv_cache_memory_bytes=256 * 1024 * 1024,
    )


def main() -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    # Answers get stdout to themselves: whatever vLLM prints goes to stderr.
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    model_dir, pool = sys.argv[1], sys.argv[2]
    llm = build(model_dir, pool, json.loads(sys.argv[3]) if len(sys.argv) > 3 else {})
    print(json.dumps({"ready": True}), file=answers, flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        if request.get("reset_prefix_cache"):
            print(json.dumps({"reset": llm.reset_prefix_cache()}), file=answers, flush=True)
            continue
        prompt = TokensPrompt(prompt_token_ids=request["tokens"])
        if request.get("salt"):
            prompt["cache_salt"] = request["salt"]
        params = SamplingParams(
            max_tokens=request["max_tokens"], temperature=0.0, logprobs=1, detokenize=False
        )
        (output,) = llm.generate([prompt], params, use_tqdm=False)
        completion = output.outputs[0]
        logprobs = [
            step[token].logprob for step, token in zip(completion.logprobs, completion.token_ids)
        ]
        answer = {
            "tokens": list(completion.token_ids),
            "cached": output.num_cached_tokens,
            "logprobs": logprobs,
        }
        print(json.dumps(answer), file=answers, flush=True)


if __name__ == "__main__":
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    main()
