"""GPU sessions for the engine and the pool: check, then time, then write JSON and print a table.

python3 scripts/gpu_foundation.py --out $OUT [--sections ceilings,kernels,tests,engine,pool,graphs,hybrid]

Sections (each records its own error and the run goes on):
- ceilings: pinned H2D/D2H memcpy and HBM copy bandwidth;
- kernels: Triton paged decode vs SDPA, and the engine's CUDA backend vs its SDPA
  reference on tiny random models (bf16);
- engine: shape:gemma3-27b cold prefill at 32k and 128k, decode at batch 1 and 32;
- pool: store and restore 128k tokens of the gemma3-27b layout through the real pool;
- graphs: decode replayed from CUDA graphs vs eager (`--graphs-model`, gemma3-27b by
  default): same tokens, step times;
- restore27b: the same for shape:gemma3-27b (--hybrid-lengths/--hybrid-restore), with a
  host profile and a CUDA trace of one restore per length;
- hybrid: shape:qwen3.5-27b cold prefill at 32k/128k/256k and its restore (KV + recurrent
  state) from the pool, beside the bytes floor; a 32k restore checked against recompute,
  and against the broken variant that restores the KV without the state.
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
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(),
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
    for hq, hkv, d, window in (
        (32, 16, 128, None),
        (32, 16, 128, 1024),
        (24, 4, 256, None),
        (9, 3, 64, None),
    ):
        k = torch.randn(nb * bs, hkv, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        ctx = [1, 17, 1000, 4096, 3001, 200] * 6
        perm = torch.randperm(nb).tolist()
        tables, at = [], 0
        for c in ctx:
            n = -(-c // bs)
            tables.append(tuple(perm[at : at + n]))
            at += n
        q = torch.randn(len(ctx), hq, d, device="cuda", dtype=torch.bfloat16)
        meta = StepMeta(
            q_lens=(1,) * len(ctx),
            ctx_lens=tuple(ctx),
            block_tables=tuple(tables),
            block_size=bs,
            device=torch.device("cuda"),
        )
        ref = SDPABackend().attend(q.float(), k.float(), v.float(), meta, d**-0.5, window)
        t, c = meta.paged()
        got = paged_decode_attention(q, k, v, t, c, bs, d**-0.5, window).float()
        out[f"decode_rel_err_h{hq}_{hkv}_d{d}_w{window}"] = rel_error(got, ref)
    out.update(short_queries())
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    for shape in ("tiny-gemma3", "tiny-qwen3", "tiny-llama"):
        runs = {}
        for backend in ("varlen", "sdpa"):
            llm = LLM(
                f"shape:{shape}",
                device="cuda",
                dtype="bfloat16",
                attention_backend=backend,
                max_num_batched_tokens=64,
                kv_cache_memory=64 << 20,
            )
            prompts = [
                [(i * 13 + j * 7) % 500 + 3 for i in range(n)] for j, n in enumerate((150, 31, 90))
            ]
            runs[backend] = (
                engine_last_logits(llm, prompts[0]),
                [list(o.token_ids) for o in llm.generate(prompts, greedy)],
            )
        out[f"{shape}_logits_rel_err"] = rel_error(runs["varlen"][0], runs["sdpa"][0])
        out[f"{shape}_greedy_equal"] = runs["varlen"][1] == runs["sdpa"][1]
    llm = LLM("smollm2-135m", device="cuda") if _has_smollm2() else None
    if llm is not None:
        reply = llm.chat(
            [{"role": "user", "content": "What is the capital of France?"}],
            SamplingParams(max_tokens=24, temperature=0.0),
        )
        out["smollm2_cuda_reply"] = reply.text
    return out


def short_queries() -> dict:
    """A few new tokens over a long paged context (the step after a restore): the paged
    split-K kernel against a float32 SDPA reference, and its time against varlen flash."""
    from kvshare.engine.attention import SDPABackend, StepMeta, VarlenBackend
    from tests.engine.test_parity import rel_error

    out: dict[str, object] = {}
    bs, hq, hkv, d = 16, 32, 16, 128
    paged, flash = VarlenBackend(131072), VarlenBackend(131072, paged_decode=False)
    for q_lens, ctx, window in (
        ((32, 17, 1), (32768, 4097, 1000), None),
        ((32, 3), (32768, 2000), 1024),
        ((32,), (131072,), None),
    ):
        nb = sum(-(-c // bs) for c in ctx) + 1
        k = torch.randn(nb * bs, hkv, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        perm, tables, at = torch.randperm(nb).tolist(), [], 0
        for c in ctx:
            tables.append(tuple(perm[at : at + -(-c // bs)]))
            at += -(-c // bs)
        q = torch.randn(sum(q_lens), hq, d, device="cuda", dtype=torch.bfloat16)
        meta = StepMeta(
            q_lens=q_lens,
            ctx_lens=ctx,
            block_tables=tuple(tables),
            block_size=bs,
            device=torch.device("cuda"),
        )
        name = f"q{'-'.join(map(str, q_lens))}_ctx{max(ctx)}_w{window}"
        if max(ctx) <= 32768:
            ref = SDPABackend().attend(q.float(), k.float(), v.float(), meta, d**-0.5, window)
            out[f"short_{name}_rel_err_paged"] = rel_error(
                paged.attend(q, k, v, meta, d**-0.5, window).float(), ref
            )
            out[f"short_{name}_rel_err_flash"] = rel_error(
                flash.attend(q, k, v, meta, d**-0.5, window).float(), ref
            )
        for label, backend in (("paged", paged), ("flash", flash)):
            backend.attend(q, k, v, meta, d**-0.5, window)
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(10):
                backend.attend(q, k, v, meta, d**-0.5, window)
            torch.cuda.synchronize()
            out[f"short_{name}_{label}_ms"] = (time.perf_counter() - start) * 100
        print(name, {k2: v2 for k2, v2 in out.items() if name in k2}, flush=True)
        del k, v
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


def engine_perf(
    prefill_lengths: list[int], decode_batches: list[int], decode_context: int, out_dir: Path
) -> dict:
    from kvshare import LLM
    from kvshare.bench.ceilings import hbm_bandwidth
    from kvshare.bench.engine_perf import decode_bytes_per_step, decode_throughput, prefill_seconds

    start = time.perf_counter()
    llm = LLM(
        "shape:gemma3-27b",
        device="cuda",
        dtype="bfloat16",
        max_num_batched_tokens=16384,
        max_num_seqs=64,
        gpu_memory_fraction=0.96,
        max_model_len=max(prefill_lengths) + 64,
    )
    out: dict[str, object] = {
        "load_s": time.perf_counter() - start,
        "kv_cache_blocks": llm.engine.runner.num_blocks,
    }
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
    config = PoolProcessConfig(
        size_bytes=arena_gib << 30,
        socket_path=str(folder / "pool.sock"),
        arena_path=f"/dev/shm/kvshare-gpu-{uuid.uuid4().hex[:8]}.arena",
        ready_timeout=120,
    )
    with PoolProcess(config) as pool:
        ceiling = pcie_bandwidth()
        res = measure_pool_bandwidth(pool.address)
    res.update(ceiling)
    res["load_ratio"] = res["load_GBps"] / ceiling["h2d_GBps"]
    res["store_ratio"] = res["store_GBps"] / ceiling["d2h_GBps"]
    return res


def graphs_vs_eager(model: str, batches: list[int], context: int) -> dict:
    """Decode from CUDA graphs and eagerly on one model: greedy ids equal, step times. A
    hybrid model's steps are captured up to 16 sequences: larger batches run eagerly."""
    from kvshare import LLM
    from kvshare.bench.engine_perf import decode_throughput, first_token, random_prompt

    llm = LLM(
        model,
        device="cuda",
        dtype="bfloat16",
        max_num_batched_tokens=16384,
        max_num_seqs=64,
        gpu_memory_fraction=0.9,
        max_model_len=8192,
    )
    graphs = llm.engine.runner.graphs
    assert graphs is not None, "CUDA graphs are off"
    prompt = random_prompt(1500, llm.loaded.config.vocab_size, 5)
    out: dict[str, object] = {}
    for name, runner_graphs in (("graphs", graphs), ("eager", None)):
        llm.engine.runner.graphs = runner_graphs
        llm.engine.reset_prefix_cache()
        decode_throughput(llm, 1, 256, steps=4, seed=98)  # warm-up (and capture)
        llm.engine.reset_prefix_cache()
        res = first_token(
            llm, prompt, max_tokens=48, logprobs=True, request_id=f"same-{name}"
        ).output
        out[f"{name}_ids"] = list(res.token_ids)
        out[f"{name}_logprobs"] = list(res.logprobs)
        for b in batches:
            out[f"{name}_b{b}"] = decode_throughput(llm, b, context, steps=32, seed=b)
            print(name, out[f"{name}_b{b}"], flush=True)
    out["ids_equal"] = out["graphs_ids"] == out["eager_ids"]
    out["max_logprob_diff"] = max(
        abs(a - b) for a, b in zip(out["graphs_logprobs"], out["eager_logprobs"])
    )  # type: ignore[arg-type]
    for b in batches:
        out[f"speedup_b{b}"] = out[f"eager_b{b}"]["step_ms"] / out[f"graphs_b{b}"]["step_ms"]  # type: ignore[index]
    return out


def _compare(reference: object, other: object) -> dict:
    return {
        "ids_equal": reference.token_ids == other.token_ids,  # type: ignore[attr-defined]
        "max_logprob_diff": max(abs(a - b) for a, b in zip(reference.logprobs, other.logprobs)),
    }  # type: ignore[attr-defined]


def profile_restore(llm: object, prompt: list[int], out: Path, name: str) -> None:
    """Where one restore's time goes: host functions (cProfile) and the CUDA timeline
    (torch profiler, a Chrome trace)."""
    import cProfile
    import gzip
    import io
    import pstats

    from torch.profiler import ProfilerActivity, profile

    from kvshare.bench.engine_perf import restore_first_token

    host = cProfile.Profile()
    host.enable()
    restore_first_token(llm, prompt, f"{name}-cprofile")  # type: ignore[arg-type]
    host.disable()
    text = io.StringIO()
    pstats.Stats(host, stream=text).sort_stats("cumulative").print_stats(60)
    (out / f"{name}_cprofile.txt").write_text(text.getvalue())
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        restore_first_token(llm, prompt, f"{name}-trace")  # type: ignore[arg-type]
    trace = out / f"{name}_trace.json"
    prof.export_chrome_trace(str(trace))
    with open(trace, "rb") as src, gzip.open(f"{trace}.gz", "wb") as dst:
        dst.write(src.read())
    trace.unlink()


def restore_perf(
    lengths: list[int],
    restore_lengths: list[int],
    repeats: int,
    arena_gib: int,
    deadline: float,
    model: str = "shape:qwen3.5-27b",
    device: str = "cuda",
    profile_dir: Path | None = None,
) -> dict:
    """A model's cold prefill per length (pool on: it stores), then its restore; for a hybrid
    model also the restore without its recurrent state (the broken variant)."""

    from kvshare import LLM
    from kvshare.bench.ceilings import pcie_bandwidth
    from kvshare.bench.engine_perf import first_token, random_prompt, restore_first_token
    from kvshare.kvpool.launch import PoolProcess, PoolProcessConfig

    folder = Path(f"/tmp/kvshare-gpu-{uuid.uuid4().hex[:8]}")
    folder.mkdir()
    config = PoolProcessConfig(
        size_bytes=arena_gib << 30,
        socket_path=str(folder / "pool.sock"),
        arena_path=f"/dev/shm/kvshare-gpu-{uuid.uuid4().hex[:8]}.arena",
        ready_timeout=180,
        preallocate=True,
    )
    out: dict[str, object] = {}
    with PoolProcess(config) as pool:
        out.update(pcie_bandwidth())
        torch.cuda.empty_cache()
        start = time.perf_counter()
        llm = LLM(
            model,
            device=device,
            dtype="bfloat16" if device == "cuda" else "float32",
            kv_pool=pool.address,
            max_num_batched_tokens=16384,
            max_num_seqs=4,
            gpu_memory_fraction=0.92,
            max_model_len=max(lengths) + 256,
        )
        connector = llm.engine.connector
        assert connector is not None
        if connector.registration is not None:  # type: ignore[attr-defined]
            connector.registration.wait()  # type: ignore[attr-defined]
        out["load_and_register_s"] = time.perf_counter() - start
        vocab = llm.loaded.config.vocab_size
        state_bytes = llm.loaded.config.state_bytes_per_sequence(2 if device == "cuda" else 4)
        out["state_bytes"] = state_bytes
        connector.set_enabled(False)
        first_token(llm, random_prompt(min(2048, lengths[0]), vocab, 1), request_id="warm-up")
        # Correctness at the first length: full recompute, pool restore, broken restore.
        n = lengths[0]
        prompt, follow_up = random_prompt(n, vocab, n), random_prompt(32, vocab, 3)
        llm.engine.reset_prefix_cache()
        timed = first_token(
            llm, prompt + follow_up, max_tokens=8, logprobs=True, request_id="reference"
        )
        out["cold_pool_off_s"], reference = timed.ttft_s, timed.output
        connector.set_enabled(True)
        rate = out["cold_pool_off_s"] / lengths[0]  # type: ignore[operator]
        for i, n in enumerate(lengths):
            # Prefill grows faster than linearly: skip a length that would overrun the call.
            if time.monotonic() + 2.5 * rate * n + 30 > deadline:
                out[f"cold_{n}_s"] = "skipped: not enough time left in this call"
                continue
            prompt = random_prompt(n, vocab, n)
            llm.engine.reset_prefix_cache()
            out[f"cold_{n}_s"] = first_token(llm, prompt, request_id=f"cold-{n}").ttft_s
            rate = out[f"cold_{n}_s"] / n  # type: ignore[operator]
            connector.wait_idle()
            print(f"cold prefill {n}: {out[f'cold_{n}_s']:.2f} s", flush=True)
            if i == 0:
                restored = restore_first_token(
                    llm, prompt + follow_up, "check", max_tokens=8, logprobs=True
                )
                out["restore_check"] = {**_compare(reference, restored.pop("output")), **restored}
            if i == 0 and state_bytes:
                opts = connector.faults  # type: ignore[attr-defined]
                from kvshare.kvpool.faults import FaultInjection

                connector.faults = FaultInjection(skip_state_restore=True)  # type: ignore[attr-defined]
                broken = restore_first_token(
                    llm, prompt + follow_up, "broken", max_tokens=8, logprobs=True
                )
                connector.faults = opts  # type: ignore[attr-defined]
                out["broken_check"] = {**_compare(reference, broken.pop("output")), **broken}
                print(
                    "restore check", out["restore_check"], "broken", out["broken_check"], flush=True
                )
            if n not in restore_lengths:
                continue
            runs = [
                restore_first_token(llm, prompt + follow_up, f"restore-{n}-{r}")
                for r in range(repeats)
            ]
            for r in runs:
                r.pop("output")
            ttft = sorted(r["ttft_s"] for r in runs)[len(runs) // 2]  # type: ignore[type-var]
            loaded = runs[0]["loaded_bytes"]
            floor = loaded / (out["h2d_GBps"] * 1e9)  # type: ignore[operator]
            out[f"restore_{n}"] = {
                "runs": runs,
                "median_ttft_s": ttft,
                "loaded_bytes": loaded,
                "floor_s": floor,
                "ratio_to_floor": ttft / floor,
                "cold_over_restore": out[f"cold_{n}_s"] / ttft,
            }  # type: ignore[operator]
            print(f"restore {n}: {out[f'restore_{n}']}", flush=True)
            if profile_dir is not None:
                profile_restore(llm, prompt + follow_up, profile_dir, f"restore_{n}")
        out["connector"] = connector.stats()
        connector.close()
    return out


def cuda_tests(out: Path, paths: list[str]) -> dict:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-s",
            "-m",
            "cuda",
            "-p",
            "no:cacheprovider",
            *paths,
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=Path(__file__).resolve().parents[1],
        timeout=500,
    )
    (out / "cuda_tests.log").write_text(done.stdout + done.stderr)
    return {"returncode": done.returncode, "tail": done.stdout[-1500:]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--sections", default="ceilings,kernels,tests,engine,pool")
    parser.add_argument("--prefill", default="32768,131071")
    parser.add_argument("--decode-batches", default="1,32")
    parser.add_argument("--decode-context", type=int, default=2048)
    parser.add_argument("--graphs-model", default="shape:gemma3-27b")
    parser.add_argument("--arena-gib", type=int, default=72)
    parser.add_argument("--tests", default="tests/kvpool/test_bytes_check.py")
    parser.add_argument("--hybrid-lengths", default="32768,131072,261888")
    parser.add_argument("--hybrid-restore", default="131072,261888")
    parser.add_argument("--hybrid-repeats", type=int, default=3)
    parser.add_argument(
        "--budget-s", type=float, default=1e9, help="hybrid: skip lengths past this"
    )
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
        section("cuda_tests", out)(cuda_tests)(out, args.tests.split(","))
    if "engine" in wanted:
        section("engine", out)(engine_perf)(
            [int(x) for x in args.prefill.split(",")],
            [int(x) for x in args.decode_batches.split(",")],
            args.decode_context,
            out,
        )
    if "pool" in wanted:
        section("pool", out)(pool_perf)(args.arena_gib)
    if "graphs" in wanted:
        section("graphs", out)(graphs_vs_eager)(
            args.graphs_model,
            [int(x) for x in args.decode_batches.split(",")],
            args.decode_context,
        )
    if "restore27b" in wanted:
        section("restore27b", out)(restore_perf)(
            [int(x) for x in args.hybrid_lengths.split(",")],
            [int(x) for x in args.hybrid_restore.split(",")],
            args.hybrid_repeats,
            args.arena_gib,
            time.monotonic() + args.budget_s,
            model="shape:gemma3-27b",
            profile_dir=out,
        )
    if "hybrid" in wanted:
        section("hybrid", out)(restore_perf)(
            [int(x) for x in args.hybrid_lengths.split(",")],
            [int(x) for x in args.hybrid_restore.split(",")],
            args.hybrid_repeats,
            args.arena_gib,
            time.monotonic() + args.budget_s,
        )
    print(json.dumps(RESULTS, indent=1, default=str))


if __name__ == "__main__":
    main()
