"""How the paged attention kernel's tile sets the time of a short step over a long context
(the question after a 128k-token restore), on the GPU.

    PYTHONPATH=$PWD python3 scripts/gpu_paged_rows.py --out $OUT

A step of q new tokens has q x group query rows per KV head; a program takes a tile of
them (paged_decode.SplitTile: keys per iteration, query rows, warps), so a step of 32 tokens
of shape:qwen3.5-27b (group 6: 192 rows) runs 192 / rows query blocks, each reading every
key of its split. This script times `paged_attention` with the kernel's own tile
(paged_decode.split_tile) and with each other variant (a tile, and for an fp8 cache the
dots' dtype: float16 or the query's) at shape:qwen3.5-27b's attention shape (4 KV heads, 24
query heads, head dim 256, bf16 and fp8 caches, 16-token blocks in shuffled order), against
a float32 reference of the same attention (each variant must match it before it is
timed), and beside the GPU's device-to-device copy rate measured in the same run. Prints a
table; writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from kvshare.engine import kv_fp8, paged_decode

KV_HEADS, GROUP, HEAD_DIM, BLOCK = 4, 6, 256, 16
# (name, tile: None for the kernel's own, fp8 dots in float16); the first is the kernel's.
VARIANTS: list[tuple[str, paged_decode.SplitTile | None, bool]] = [
    ("own", None, True),
    ("own, fp8 dots in bf16", None, False),
    ("64 keys x 64 rows x 8 warps", paged_decode.SplitTile(64, 64, 8), True),
    ("128 keys x 64 rows x 4 warps", paged_decode.SplitTile(128, 64, 4), True),
    ("64 keys x 128 rows x 8 warps", paged_decode.SplitTile(64, 128, 8), True),
    ("64 keys x 64 rows x 4 warps", paged_decode.SplitTile(64, 64, 4), True),
]


def timed(fn: Callable[[], object], repeats: int) -> float:
    """Median seconds of fn on the GPU."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def copy_rate(nbytes: int = 1 << 30) -> float:
    """Device-to-device bytes/s (read + write counted once each: 2 x nbytes moved)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * nbytes / timed(lambda: dst.copy_(src), 10)


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of q [T, Hq, D] (the last T of the keys) over k, v [N, Hkv, D], fp32."""
    tokens, n = q.shape[0], k.shape[0]
    kk = k.float().repeat_interleave(GROUP, dim=1).transpose(0, 1)  # [Hq, N, D]
    vv = v.float().repeat_interleave(GROUP, dim=1).transpose(0, 1)
    scores = torch.einsum("thd,hnd->htn", q.float(), kk) * scale
    pos = torch.arange(n, device=q.device)
    mask = pos[None, :] > (n - tokens + torch.arange(tokens, device=q.device))[:, None]
    scores.masked_fill_(mask[None], float("-inf"))
    return torch.einsum("htn,hnd->thd", scores.softmax(-1), vv)


def run_case(context: int, tokens: int, fp8: bool, repeats: int) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(context + tokens)
    blocks = context // BLOCK
    k = torch.randn(
        (context, KV_HEADS, HEAD_DIM), device="cuda", dtype=torch.bfloat16, generator=gen
    )
    v = torch.randn_like(k)
    q = torch.randn(
        (tokens, KV_HEADS * GROUP, HEAD_DIM), device="cuda", dtype=torch.bfloat16, generator=gen
    )
    # The cache holds the context in shuffled blocks, as a paged cache does.
    order = torch.randperm(blocks, device="cuda", generator=gen)
    k_cache = torch.empty_like(k).view(blocks, BLOCK, KV_HEADS, HEAD_DIM)
    v_cache = torch.empty_like(k_cache)
    k_cache[order] = k.view(blocks, BLOCK, KV_HEADS, HEAD_DIM)
    v_cache[order] = v.view(blocks, BLOCK, KV_HEADS, HEAD_DIM)
    k_cache, v_cache = k_cache.flatten(0, 1), v_cache.flatten(0, 1)
    if fp8:
        k_cache, v_cache = kv_fp8.packed_cache(k_cache, BLOCK), kv_fp8.packed_cache(v_cache, BLOCK)
        # A row's stored bytes depend on that row only: the keys the kernel reads, in order.
        k = kv_fp8.dequantize(*kv_fp8.quantize(k), torch.bfloat16)
        v = kv_fp8.dequantize(*kv_fp8.quantize(v), torch.bfloat16)
    tables = order.to(torch.int32)[None, :]
    ctx = torch.tensor([context], dtype=torch.int32, device="cuda")
    cu_q = torch.tensor([0, tokens], dtype=torch.int32, device="cuda")
    scale = HEAD_DIM**-0.5
    expected = reference(q, k, v, scale)
    kv_bytes = k_cache.numel() * k_cache.element_size() * 2
    rows = []
    for variant, (name, chosen, f16) in enumerate(VARIANTS):
        if not fp8 and not f16:
            continue  # the dot dtype of a bf16 cache is the query's either way
        paged_decode.FP8_DOT_F16 = f16
        tile = chosen or paged_decode.split_tile(GROUP, tokens, HEAD_DIM, fp8, q.element_size())
        q_blocks = -(-tokens * GROUP // tile.rows)
        splits = paged_decode.num_splits_for(q_blocks, KV_HEADS, context, tile.keys)

        def step(splits: int = splits, tile: paged_decode.SplitTile = tile) -> torch.Tensor:
            return paged_decode.paged_attention(
                q,
                k_cache,
                v_cache,
                tables,
                ctx,
                BLOCK,
                scale,
                None,
                cu_q,
                tokens,
                splits,
                tile=tile,
            )

        try:
            err = (step().float() - expected).abs().max().item()
        except Exception as exc:  # a variant that does not compile (registers) is a result
            err, failure = float("inf"), f"{type(exc).__name__}: {str(exc)[-300:]}"
        else:
            failure = ""
        row = {
            "variant": variant,
            "name": name,
            "context": context,
            "tokens": tokens,
            "kv": "fp8" if fp8 else "bf16",
            "keys": tile.keys,
            "rows": tile.rows,
            "warps": tile.warps,
            "fp8_dot_f16": f16,
            "splits": splits,
            "q_blocks": q_blocks,
            "max_abs_err": err,
            "ok": err < 3e-2,
            "failure": failure,
        }
        if row["ok"]:
            row["seconds"] = timed(step, repeats)
            row["kv_bytes_per_s"] = kv_bytes / row["seconds"]
        rows.append(row)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--contexts", default="131072")
    parser.add_argument("--tokens", default="16,32,64")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rate = copy_rate()
    rows = []
    for fp8 in (False, True):
        for context in map(int, args.contexts.split(",")):
            for tokens in map(int, args.tokens.split(",")):
                rows += run_case(context, tokens, fp8, args.repeats)
                print(json.dumps(rows[-1]), flush=True)
    base = {(r["context"], r["tokens"], r["kv"]): r for r in rows if r["variant"] == 0}
    print(f"device-to-device copy: {rate / 1e9:.0f} GB/s")
    print(
        "kv    context tokens keys rows warps f16 splits qblk  err      ms   KV GB/s  /copy  /own"
    )
    for r in rows:
        own = base[(r["context"], r["tokens"], r["kv"])]
        ms = f"{r['seconds'] * 1e3:7.3f}" if r["ok"] else "   FAIL"
        gbs = r.get("kv_bytes_per_s", 0) / 1e9
        speed = own.get("seconds", 0) / r["seconds"] if r["ok"] and own["ok"] else 0.0
        print(
            f"{r['kv']:5} {r['context']:7d} {r['tokens']:6d} {r['keys']:4d} {r['rows']:4d} "
            f"{r['warps']:5d} {'y' if r['fp8_dot_f16'] else 'n':>3} {r['splits']:6d} "
            f"{r['q_blocks']:4d} {r['max_abs_err']:.0e} {ms} {gbs:9.0f} "
            f"{gbs * 1e9 / rate:6.2f} {speed:5.2f}x"
        )
    (args.out / "paged_rows.json").write_text(
        json.dumps({"copy_bytes_per_s": rate, "rows": rows}, indent=1)
    )
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
