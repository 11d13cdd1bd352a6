"""One GPU session for issues 2 and 3: check, then time, then write JSON and print a table.

python3 scripts/gpu_foundation.py --out $OUT [--sections ceilings,kernels,engine,pool]

Sections (each records its own error and the run goes on):
- ceilings: pinned H2D/D2H memcpy and HBM copy bandwidth;
- kernels: Triton paged decode vs SDPA, and the engine's CUDA backend vs its SDPA
  reference on tiny random models (bf16);
- engine: shape:gemma3-27b cold prefill at 32k and 128k, decode at batch 1 and 32;
- pool: store and restore 128k tokens of the gemma3-27b layout through the real pool.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
import traceback
import uuid
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RESULTS: dict[str, object] = {}


def save(out: Path) -> None:
    (out / "gpu_foundation.json").write_text(json.dumps(RESULTS, indent=1, default=str))


def section(name: str, out: Path):
    def wrap(fn):
        def run(*args, **kwargs):
            start = time.perf_counter()
            print(f"== {name}", flush=True)
            try:
                RESULTS[name] = fn(*args, **kwargs)
            except Exception as exc:
                traceback.print_exc()
                RESULTS[name] = {"error": repr(exc)}
            RESULTS.setdefault("seconds", {})[name] = time.perf_counter() - start  # type: ignore[union-attr]
            save(out)
            gc.collect()
            torch.cuda.empty_cache()
        return run
    return wrap


def environment() -> dict:
    shm = os.statvfs("/dev/shm")
    return {
        "torch": torch.__version__, "gpu": torch.cuda.get_device_name(),
        "gpu_memory_GiB": torch.cuda.get_device_properties(0).total_memory / 2**30,
        "shm_GiB": shm.f_blocks * shm.f_frsize / 2**30,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def ceilings() -> dict:
    from kvshare.bench.ceilings import hbm_bandwidth, pcie_bandwidth

    return {**pcie_bandwidth(), "hbm_GBps": hbm_bandwidth()}


def kernels() -> dict:
    from kvshare import LLM, SamplingParams
    from kvshare.engine.attention import SDPABackend, StepMeta
    from kvshare.engine.paged_decode import paged_decode_attention
    from tests.engine.test_parity import engine_last_logits, rel_error

    out: dict[str, object] = {}
    torch.manual_seed(0)
    bs, nb = 16, 4096
    for hq, hkv, d, window in ((32, 16, 128, None), (32, 16, 128, 1024), (24, 4, 256, None), (9, 3, 64, None)):
        k = torch.randn(nb * bs, hkv, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        ctx = [1, 17, 1000, 4096, 3001, 200] * 6
        perm = torch.randperm(nb).tolist()
        tables, at = [], 0
        for c in ctx:
            n = -(-c // bs)
            tables.append(tuple(perm[at:at + n]))
            at += n
        q = torch.randn(len(ctx), hq, d, device="cuda", dtype=torch.bfloat16)
        meta = StepMeta(q_lens=(1,) * len(ctx), ctx_lens=tuple(ctx), block_tables=tuple(tables),
                        block_size=bs, device=torch.device("cuda"))
        ref = SDPABackend().attend(q.float(), k.float(), v.float(), meta, d**-0.5, window)
        t, c = meta.paged()
        got = paged_decode_attention(q, k, v, t, c, bs, d**-0.5, window).float()
        out[f"decode_rel_err_h{hq}_{hkv}_d{d}_w{window}"] = rel_error(got, ref)
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    for shape in ("tiny-gemma3", "tiny-qwen3", "tiny-llama"):
        runs = {}
        for backend in ("varlen", "sdpa"):
            llm = LLM(f"shape:{shape}", device="cuda", dtype="bfloat16", attention_backend=backend,
                      max_num_batched_tokens=64, kv_cache_memory=64 << 20)
            prompts = [[(i * 13 + j * 7) % 500 + 3 for i in range(n)] for j, n in enumerate((150, 31, 90))]
            runs[backend] = (engine_last_logits(llm, prompts[0]),
                             [list(o.token_ids) for o in llm.generate(prompts, greedy)])
        out[f"{shape}_logits_rel_err"] = rel_error(runs["varlen"][0], runs["sdpa"][0])
        out[f"{shape}_greedy_equal"] = runs["varlen"][1] == runs["sdpa"][1]
    llm = LLM("smollm2-135m", device="cuda") if _has_smollm2() else None
    if llm is not None:
        reply = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                         SamplingParams(max_tokens=24, temperature=0.0))
        out["smollm2_cuda_reply"] = reply.text
    return out


def _has_smollm2() -> bool:
    try:
        from kvshare.models.packaged import packaged_model_path

        packaged_model_path("smollm2-135m")
        return True
    except (FileNotFoundError, ValueError):
        return False


def profile_prefill(llm: object, num_tokens: int, out: Path) -> None:
    """Top CUDA kernels of one cold prefill, for finding where prefill time goes."""
    from torch.profiler import ProfilerActivity, profile

    from kvshare.bench.engine_perf import prefill_seconds

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        prefill_seconds(llm, num_tokens, seed=7)  # type: ignore[arg-type]
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30)
    (out / "prefill_profile.txt").write_text(table)


def engine_perf(prefill_lengths: list[int], decode_batches: list[int], decode_context: int,
                out_dir: Path) -> dict:
    from kvshare import LLM
    from kvshare.bench.ceilings import hbm_bandwidth
    from kvshare.bench.engine_perf import decode_bytes_per_step, decode_throughput, prefill_seconds

    start = time.perf_counter()
    llm = LLM("shape:gemma3-27b", device="cuda", dtype="bfloat16", max_num_batched_tokens=16384,
              max_num_seqs=64, gpu_memory_fraction=0.96, max_model_len=max(prefill_lengths) + 64)
    out: dict[str, object] = {"load_s": time.perf_counter() - start,
                              "kv_cache_blocks": llm.engine.runner.num_blocks}
    prefill_seconds(llm, 2048, seed=99)  # warm-up: kernels compiled, caches allocated
    estimates = {32768: 2.9, 131071: 14.2, 131072: 14.2}
    for n in prefill_lengths:
        seconds = prefill_seconds(llm, n, seed=n)
        out[f"prefill_{n}_s"] = seconds
        if n in estimates:
            out[f"prefill_{n}_ratio_to_estimate"] = seconds / estimates[n]
        print(f"prefill {n}: {seconds:.2f} s", flush=True)
    profile_prefill(llm, 32768, out_dir)
    hbm = hbm_bandwidth(1 << 30)
    out["hbm_GBps"] = hbm
    decode_throughput(llm, 1, 256, steps=4, seed=98)  # warm-up
    for b in decode_batches:
        res = decode_throughput(llm, b, decode_context, steps=32, seed=b)
        floor_s = decode_bytes_per_step(llm, b, decode_context) / (hbm * 1e9)
        res["floor_step_ms"] = 1e3 * floor_s
        res["floor_tokens_per_s"] = b / floor_s
        res["ratio_to_floor"] = res["step_ms"] / res["floor_step_ms"]
        out[f"decode_b{b}"] = res
        print(f"decode b{b}: {res}", flush=True)
    return out


def pool_perf(arena_gib: int) -> dict:
    from kvshare.bench.ceilings import pcie_bandwidth
    from kvshare.bench.pool_perf import measure_pool_bandwidth
    from kvshare.kvpool.launch import PoolProcess, PoolProcessConfig

    folder = Path(f"/tmp/kvshare-gpu-{uuid.uuid4().hex[:8]}")
    folder.mkdir()
    config = PoolProcessConfig(size_bytes=arena_gib << 30, socket_path=str(folder / "pool.sock"),
                               arena_path=f"/dev/shm/kvshare-gpu-{uuid.uuid4().hex[:8]}.arena",
                               ready_timeout=120)
    with PoolProcess(config) as pool:
        ceiling = pcie_bandwidth()
        res = measure_pool_bandwidth(pool.address)
    res.update(ceiling)
    res["load_ratio"] = res["load_GBps"] / ceiling["h2d_GBps"]
    res["store_ratio"] = res["store_GBps"] / ceiling["d2h_GBps"]
    return res


def cuda_tests(out: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider",
                           "tests/kvpool/test_bytes_check.py"], capture_output=True, text=True, env=env,
                          cwd=Path(__file__).resolve().parents[1], timeout=400)
    (out / "cuda_tests.log").write_text(done.stdout + done.stderr)
    return {"returncode": done.returncode, "tail": done.stdout[-1500:]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--sections", default="ceilings,kernels,tests,engine,pool")
    parser.add_argument("--prefill", default="32768,131071")
    parser.add_argument("--decode-batches", default="1,32")
    parser.add_argument("--decode-context", type=int, default=2048)
    parser.add_argument("--arena-gib", type=int, default=72)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    RESULTS["environment"] = environment()
    print(RESULTS["environment"], flush=True)
    wanted = args.sections.split(",")
    if "ceilings" in wanted:
        section("ceilings", out)(ceilings)()
    if "kernels" in wanted:
        section("kernels", out)(kernels)()
    if "tests" in wanted:
        section("cuda_tests", out)(cuda_tests)(out)
    if "engine" in wanted:
        section("engine", out)(engine_perf)([int(x) for x in args.prefill.split(",")],
                                            [int(x) for x in args.decode_batches.split(",")],
                                            args.decode_context, out)
    if "pool" in wanted:
        section("pool", out)(pool_perf)(args.arena_gib)
    print(json.dumps(RESULTS, indent=1, default=str))


if __name__ == "__main__":
    main()
