"""Where the host time of one long-prefix pool hit goes, phase by phase.

    PYTHONPATH=$PWD python3 scripts/hit_path_profile.py --model shape:tiny-qwen3.5 --tokens 131072
    PYTHONPATH=$PWD python3 scripts/hit_path_profile.py --model shape:qwen3.5-27b --device cuda \
        --tokens 131072 --arena-gib 16 --repeats 5 --json $OUT/hit_path.json --trace $OUT/hit.json

One process: a pool daemon and one engine with the pool connector. The prompt (`--tokens`
random ids) is prefilled once with the pool on (it stores every chunk and the recurrent
state at the last chunk boundary); then, `--repeats` times, the GPU-local prefix cache is
reset and prompt + `--new-tokens` new tokens is sent again, so that its prefix comes from
the pool only: the cross-replica hit of `kvshare up`, without the second replica.

Reported per phase, the minimum over the repeats of the host seconds spent inside it
(inclusive of the phases listed below it; `--json` keeps every hit's), and per hit the
milliseconds Python's cyclic collector held the GIL inside it:

- the request's JSON at the router (parse, routing keys) and at the replica (parse,
  checks, token ids): the functions `kvshare router` and `kvshare serve` run, called
  directly on the body an OpenAI client sends (token ids: shape models have no tokenizer);
- the host's time before the load's first copy: the HTTP phases plus the engine's, from
  add_request's entry to the load's first copy (its prefetch on CUDA, else its transfer);
- the engine, from add_request (given the prompt as the replica hands it over) to the
  first token: hashing, admission (prefix cache, chunk keys, the daemon's lookup, the load
  plan, issuing the copies), the step that computes the new tokens (metadata, forward,
  logits), registering the blocks, the restore's verification, the store check and
  sampling.

On CUDA the engine's phases are host time: work issued to a stream shows where the host
waits for it (the restore's verification waits for the copies; sampling for the step).
`--sync-phases` synchronizes the device after every phase, which gives each phase its
device time too but takes away the overlap of the copy with the step. `--cprofile N`
prints the N functions with the most cumulative time of the last hit; `--trace PATH`
writes a torch profiler Chrome trace of one more hit (on CUDA: the copy streams, the
step's kernels and where the host waited) and prints that hit's device time summed by
kernel or copy name (`--kernels N` names) and its copies' rates, alone and beside the
step's kernels (copy_rates).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import dataclasses
import gc
import io
import json
import pstats
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import aiohttp
import torch
from aiohttp import web

import kvshare.engine.llm_engine as llm_engine_module
import kvshare.engine.model_runner as model_runner_module
import kvshare.kvpool.connector as connector_module
from kvshare.bench.client import BenchClient, BenchError, RequestOptions
from kvshare.bench.engine_perf import random_prompt
from kvshare.engine.attention import AttentionBackend, StepMeta
from kvshare.engine.config import EngineConfig
from kvshare.engine.llm_engine import LLMEngine, PromptIds
from kvshare.engine.sampling_params import SamplingParams
from kvshare.engine.sequence import Sequence
from kvshare.kvpool.connector import PoolConnector
from kvshare.kvpool.launch import PoolProcess, PoolProcessConfig
from kvshare.kvpool.transfer import LayerGroups
from kvshare.kvpool.transfer_cuda import CudaTransfer
from kvshare.models.loader import load_model
from kvshare.ports import free_port
from kvshare.serve import collector
from kvshare.serve.http import PromptHead, parse_json_object
from kvshare.serve.protocol import ModelInfo, parse_generate
from kvshare.serve.routing_keys import RoutingKeys
from kvshare.serve.server import SERVER_KEY, ServeConfig, build_app
from kvshare.serve.server_timing import median_phases


class PhaseTimer:
    """Inclusive host seconds per phase, while `active`; a phase is a wrapped callable."""

    def __init__(self, sync: bool) -> None:
        self.sync = sync
        self.active = False
        self.seconds: defaultdict[str, float] = defaultdict(float)
        self.calls: Counter[str] = Counter()
        self.order: list[str] = []
        self.entered: dict[str, float] = {}  # perf_counter at each phase's first entry

    def wrap(self, label: str, owner: object, name: str) -> None:
        original = getattr(owner, name)
        self.order.append(label)

        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.active:
                return original(*args, **kwargs)
            start = time.perf_counter()
            self.entered.setdefault(label, start)
            try:
                return original(*args, **kwargs)
            finally:
                if self.sync:
                    torch.cuda.synchronize()
                self.seconds[label] += time.perf_counter() - start
                self.calls[label] += 1

        setattr(owner, name, timed)

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()
        self.entered.clear()

    def until(self, *labels: str) -> float:
        """Seconds from add_request's entry to the first entry of any of `labels`."""
        return (
            min(self.entered[label] for label in labels if label in self.entered)
            - (self.entered["add_request"])
        )


def instrument(engine: LLMEngine, timer: PhaseTimer) -> None:
    """Wrap the phases of a hit; labels nest with '/' (a child's time is in its parent's)."""
    connector = engine.connector
    assert isinstance(connector, PoolConnector)
    w = timer.wrap
    w("add_request", engine, "add_request")
    w("add_request/block_hashes", Sequence, "update_block_hashes")
    w("step", engine, "step")
    w("step/poll", connector, "poll")
    w("step/schedule", engine.scheduler, "schedule")
    w("step/schedule/match_prefix", engine.blocks, "match_prefix")
    w("step/schedule/pool_match", connector, "match")
    w("step/schedule/pool_match/chunk_keys", connector, "_keys")
    w("step/schedule/pool_match/state_keys", connector_module, "state_key")
    w("step/schedule/pool_match/lookup", connector.client, "lookup")
    assert connector.transfer is not None
    w("step/schedule/pool_match/prefetch", connector.transfer, "prefetch")
    w("step/schedule/allocate", engine.blocks, "allocate")
    w("step/schedule/pool_load", connector, "load")
    w("step/schedule/pool_load/plan", connector_module, "plan_load")
    w("step/schedule/pool_load/acquire", engine.blocks, "acquire")
    w("step/schedule/pool_load/transfer_load", connector.transfer, "load")
    w("step/schedule/pool_load/transfer_state", connector.transfer, "load_raw")
    w("step/schedule/pool_load/consume", connector.transfer, "consume")
    w("step/execute", engine.runner, "execute")
    w("step/execute/step_meta", model_runner_module, "StepMeta")
    w("step/execute/forward", engine.runner.model, "forward")
    if engine.runner.graphs is not None:
        w("step/execute/replay", engine.runner.graphs, "run")
    w("step/execute/logits", engine.runner.model, "compute_logits")
    w("step/register", engine, "_register")
    w("step/finish_restores", engine.scheduler, "finish_restores")
    w("step/finish_restores/headers", connector, "_header_ok")
    w("step/finish_restores/wait_copies", connector_module._Load, "wait")
    w("step/finish_restores/checksums", connector, "_checksum_mismatches")
    w("step/finish_restores/release", connector, "_release")
    w("step/store", engine, "_store")
    w("step/store/pool_store", connector, "store")
    w("step/sample", llm_engine_module, "sample")
    w("step/append_token", engine, "_append_or_fail")


class SkipAttention(AttentionBackend):
    """Fills the pool fast on a CPU: keys and values are still written to the cache (and
    stored), but the attention output is zeros. Only the cold prefill uses it; what the
    hit's tokens are does not matter to its timing."""

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: StepMeta,
        scale: float,
        window: int | None,
    ) -> torch.Tensor:
        return torch.zeros_like(q)


def build_engine(args: argparse.Namespace, address: str) -> LLMEngine:
    device = "cuda" if args.device.startswith("cuda") else "cpu"
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if device == "cuda" else "float32")
    loaded = load_model(args.model, device=args.device, dtype=dtype, seed=0)
    needed = args.tokens + args.new_tokens + args.output_tokens + 16
    if loaded.config.max_position_embeddings < needed:  # tiny test shapes stop at 8192
        config = dataclasses.replace(loaded.config, max_position_embeddings=needed)
        loaded = dataclasses.replace(loaded, config=config)
    config = EngineConfig(
        device=args.device,
        dtype=dtype,
        block_size=args.block_size,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        max_model_len=needed,
        gpu_memory_fraction=args.gpu_memory_fraction,
        kv_cache_dtype=args.kv_cache_dtype,
        kv_cache_memory=args.kv_cache_memory,
        pool_load_layer_groups=args.layer_groups,
    )
    connector = PoolConnector.for_model(
        address,
        loaded,
        chunk_tokens=args.chunk_tokens,
        kv_cache_dtype=config.kv_cache_dtype,
        layer_groups=layer_groups(config.resolved_pool_load_layer_groups, args.layer_group_min_mib),
    )
    engine = LLMEngine(loaded, config, connector)
    if connector.bind_failure is not None:
        raise SystemExit(f"pool unreachable: {connector.bind_failure}")
    if connector.registration is not None:
        connector.registration.wait()
    return engine


def layer_groups(max_groups: int, min_mib: float, shrinking: bool = True) -> LayerGroups | None:
    return LayerGroups.at_most(max_groups, int(min_mib * (1 << 20)), shrinking)


class LayerGroupSpec(NamedTuple):
    """A --compare-layer-groups item: [shrinking|even:]GROUPS[:MIN_MIB], and its text."""

    shrinking: bool
    groups: int
    min_mib: float | None
    text: str


T = TypeVar("T")

# The restore's own kernels (kvshare/kvpool/block_copy.py, checksum_kernel.py): a copy
# beside them is still a copy alone; any other kernel in a hit's trace is the step's.
RESTORE_KERNELS = frozenset({"_copy_blocks_kernel", "_checksum_kernel"})


def comma_list(item: Callable[[str], T]) -> Callable[[str], list[T]]:
    """An argparse type: a comma-separated list, each item read by `item`."""
    return lambda text: [item(part) for part in text.split(",")]


def layer_group_spec(text: str) -> LayerGroupSpec:
    parts = text.split(":")
    split = parts.pop(0) if parts[0] in ("shrinking", "even") else "shrinking"
    if not 1 <= len(parts) <= 2:
        raise argparse.ArgumentTypeError(f"{text!r}: [shrinking|even:]GROUPS[:MIN_MIB]")
    min_mib = float(parts[1]) if len(parts) == 2 else None
    return LayerGroupSpec(split == "shrinking", int(parts[0]), min_mib, text)


def alternate(
    engine: LLMEngine,
    served: PromptIds,
    args: argparse.Namespace,
    settings: dict[str, Callable[[], None]],
    pauses: CollectorPauses,
) -> dict[str, list[dict]]:
    """`--repeats` hits per setting (a function that applies it), alternating the settings
    so that drift of the machine does not favour one."""
    connector = engine.connector
    assert connector is not None
    results: dict[str, list[dict]] = {name: [] for name in settings}
    for r in range(args.repeats):
        for name, apply in settings.items():
            apply()
            engine.reset_prefix_cache()
            run = pauses.annotate(
                run_request(engine, f"hit-{name}-{r}", served, args.output_tokens)
            )
            connector.wait_idle()
            results[name].append(run)
            print(f"{name}, hit {r}: {run}", flush=True)
    return results


def compare_layer_groups(
    engine: LLMEngine, served: PromptIds, args: argparse.Namespace, pauses: CollectorPauses
) -> dict[str, list[dict]]:
    """Hits with each --compare-layer-groups setting; the engine's setting is put back."""
    transfer = engine.connector.transfer if isinstance(engine.connector, PoolConnector) else None
    assert transfer is not None

    def setting(spec: LayerGroupSpec) -> Callable[[], None]:
        min_mib = args.layer_group_min_mib if spec.min_mib is None else spec.min_mib
        groups = layer_groups(spec.groups, min_mib, spec.shrinking)
        return lambda: setattr(transfer, "layer_groups", groups)

    engines_own = transfer.layer_groups
    settings = {f"layer groups {spec.text}": setting(spec) for spec in args.compare_layer_groups}
    results = alternate(engine, served, args, settings, pauses)
    transfer.layer_groups = engines_own
    return results


# CudaTransfer counts --compare-COUNT (dashes for underscores) times hits with: what each is.
CUDA_TRANSFER_COUNTS = {
    "host_waited_groups": "a restore's first layer groups waited for by the host (the rest "
    "by the compute stream)",
    "prefetch_fills": "staging fills a restore's prefetch issues before its full lookup (0: none)",
}


def compare_cuda_transfer_counts(
    engine: LLMEngine,
    served: PromptIds,
    args: argparse.Namespace,
    pauses: CollectorPauses,
    attribute: str,
) -> dict[str, list[dict]]:
    """Hits with each count of --compare-ATTRIBUTE set on the CUDA transfer (alternated;
    CUDA_TRANSFER_COUNTS); the engine's own count is put back."""
    transfer = engine.connector.transfer if isinstance(engine.connector, PoolConnector) else None
    flag = "--compare-" + attribute.replace("_", "-")
    if not isinstance(transfer, CudaTransfer):
        raise SystemExit(f"{flag} needs a CUDA engine with the pool")
    engines_own = getattr(transfer, attribute)
    name = attribute.replace("_", " ")
    settings = {
        f"{name} {n}": (lambda n=n: setattr(transfer, attribute, n))
        for n in getattr(args, "compare_" + attribute)
    }
    results = alternate(engine, served, args, settings, pauses)
    setattr(transfer, attribute, engines_own)
    return results


def compare_graphs(
    engine: LLMEngine, served: PromptIds, args: argparse.Namespace, pauses: CollectorPauses
) -> dict[str, list[dict]]:
    """Hits whose step replays a captured graph against the same step run eagerly."""
    runner, graphs = engine.runner, engine.runner.graphs
    assert graphs is not None, "CUDA graphs are off"
    results = alternate(
        engine,
        served,
        args,
        {
            "graphs": lambda: setattr(runner, "graphs", graphs),
            "eager": lambda: setattr(runner, "graphs", None),
        },
        pauses,
    )
    runner.graphs = graphs
    return results


def compare_collector(
    engine: LLMEngine, served: PromptIds, args: argparse.Namespace, pauses: CollectorPauses
) -> dict[str, list[dict]]:
    """Hits with the collector as `kvshare serve` runs it (kvshare.serve.collector: what is
    alive frozen, the young threshold raised, a young collection between requests) against
    CPython's defaults (nothing frozen, a young collection every 700 allocations); the
    defaults are put back."""
    defaults = gc.get_threshold()

    def as_served() -> None:
        collector.settle_startup()
        collector.collect_idle()

    def as_cpython() -> None:
        gc.unfreeze()
        gc.set_threshold(*defaults)

    results = alternate(
        engine,
        served,
        args,
        {"collector as served": as_served, "collector defaults": as_cpython},
        pauses,
    )
    as_cpython()
    return results


def sync(engine: LLMEngine) -> None:
    if engine.runner.device.type == "cuda":
        torch.cuda.synchronize()


def run_request(
    engine: LLMEngine,
    request_id: str,
    prompt: PromptIds,
    max_tokens: int,
    timer: PhaseTimer | None = None,
) -> dict:
    """add_request, then steps until the first token (synchronized; `timer` stops timing
    there); the step count, time to first token and the output's KV sources."""
    sync(engine)
    start = time.perf_counter()
    engine.add_request(
        request_id, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    )
    steps, first = 0, None
    while first is None:
        steps += 1
        for out in engine.step():
            if out.token_ids:
                first = out
    sync(engine)
    ttft = time.perf_counter() - start
    if timer is not None:
        timer.active = False
    while engine.has_unfinished():
        engine.step()
    return {
        "ttft_s": ttft,
        "first_token": first.token_ids[0],
        "steps": steps,
        "pool_hit_tokens": first.pool_hit_tokens,
        "computed_tokens": first.computed_tokens,
        "window_s": (start, start + ttft),  # perf_counter; CollectorPauses.annotate reads it
    }


class CollectorPauses:
    """The cyclic collector's pauses while installed (gc.callbacks): when each began, how
    long it held the GIL and which generation it walked."""

    def __init__(self) -> None:
        self.pauses: list[tuple[float, float, int]] = []  # (start, seconds, generation)
        self._began = 0.0

    def __enter__(self) -> CollectorPauses:
        gc.callbacks.append(self._observe)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._observe)

    def _observe(self, phase: str, info: dict[str, int]) -> None:
        now = time.perf_counter()
        if phase == "start":
            self._began = now
        else:
            self.pauses.append((self._began, now - self._began, info["generation"]))

    def annotate(self, run: dict) -> dict:
        """`run` (run_request's) with the collector's ms inside its time to first token, how
        many of its collections were full ones and how many walked each generation, in place
        of its window."""
        start, end = run.pop("window_s")
        inside = [(s, g) for began, s, g in self.pauses if start <= began < end]
        run["gc_ms"] = 1e3 * sum(s for s, _ in inside)
        run["gc_by_generation"] = [sum(g == n for _, g in inside) for n in range(3)]
        run["gc_full"] = run["gc_by_generation"][2]
        return run


def best_of(repeats: int, fn: Callable[[], object]) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def device_time_by_name(trace: Any, limit: int) -> list[dict[str, Any]]:
    """The traced hit's device work (kernels, copies) summed by name, the longest first;
    printed as a table."""
    rows = sorted(
        (
            {"name": e.key, "calls": e.count, "device_ms": e.self_device_time_total / 1e3}
            for e in trace.key_averages()
            if e.self_device_time_total > 0
        ),
        key=lambda r: -r["device_ms"],
    )
    print(f"{'device ms':>10} {'calls':>6}  name (the traced hit, all streams)")
    for row in rows[:limit]:
        print(f"{row['device_ms']:10.2f} {row['calls']:6d}  {row['name'][:100]}")
    print(f"{sum(r['device_ms'] for r in rows):10.2f} {'':6}  total")
    return rows[:limit]


def copy_rates(trace_path: Path) -> dict[str, Any]:
    """The traced load's host-to-device copies over 0.5 ms, in time order: ms from the
    first device event, GB/s, and the share of the copy's time during which a kernel of
    the step ran (any kernel but the restore's own block copies and checksums), and the
    small pageable copies beside them (ms, bytes). Summed up as the median rate of the
    copies alone (a step kernel under 5% of their time) and beside the step (over half):
    on an H100 the copies ran ~55 GB/s alone and ~51 beside the step's kernels
    (docs/results/2026-12-07-h100-copies-beside-step.md)."""
    events = [e for e in json.loads(trace_path.read_text())["traceEvents"] if e.get("ph") == "X"]
    device = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy")]
    if not device:
        return {}
    t0 = min(e["ts"] for e in device)
    big = sorted(
        (e for e in device if e.get("cat") == "gpu_memcpy" and e["dur"] > 500),
        key=lambda e: e["ts"],
    )
    step = _merged_spans(
        (e["ts"], e["ts"] + e["dur"])
        for e in device
        if e.get("cat") == "kernel" and e["name"] not in RESTORE_KERNELS
    )
    copies = [
        (
            (e["ts"] - t0) / 1e3,
            e["args"]["bytes"] / e["dur"] / 1e3,
            _covered(step, e["ts"], e["ts"] + e["dur"]) / e["dur"],
        )
        for e in big
    ]
    pageable = [
        ((e["ts"] - t0) / 1e3, e["args"].get("bytes"))
        for e in device
        if e.get("cat") == "gpu_memcpy" and "Pageable" in e["name"]
    ]
    alone = [rate for _, rate, busy in copies if busy < 0.05]
    beside = [rate for _, rate, busy in copies if busy > 0.5]
    summary = {
        "copies_ms_gbps_step": copies,
        "pageable_ms_bytes": sorted(pageable),
        "alone_gbps": statistics.median(alone) if alone else None,
        "beside_step_gbps": statistics.median(beside) if beside else None,
    }
    print(
        f"copies over 0.5 ms: {len(copies)}; median GB/s of the {len(alone)} alone "
        f"{summary['alone_gbps'] or 0:.1f}, of the {len(beside)} beside the step "
        f"{summary['beside_step_gbps'] or 0:.1f}; pageable copies at ms "
        f"{[round(t, 2) for t, _ in summary['pageable_ms_bytes'][:12]]}"
    )
    return summary


def _merged_spans(spans: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Spans merged where they overlap (kernels of several streams), in time order."""
    merged: list[tuple[float, float]] = []
    for start, stop in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], stop))
        else:
            merged.append((start, stop))
    return merged


def _covered(spans: list[tuple[float, float]], start: float, stop: float) -> float:
    """How much of [start, stop) the merged `spans` cover."""
    return sum(max(0.0, min(stop, b) - max(start, a)) for a, b in spans)


def request_body(prompt: list[int], name: str) -> bytes:
    """The body an OpenAI client sends for a shape model: a token-id prompt."""
    return json.dumps(
        {"model": name, "prompt": prompt, "max_tokens": 8, "temperature": 0.0}
    ).encode()


def model_info(engine: LLMEngine, name: str) -> ModelInfo:
    return ModelInfo(
        name,
        engine.tokenizer,
        engine.max_model_len,
        engine.loaded.config.vocab_size,
        engine.config.resolved_dtype,
    )


def served_prompt(engine: LLMEngine, prompt: list[int], name: str) -> PromptIds:
    """The prompt as `kvshare serve` hands it to add_request (parsed from the body)."""
    body = parse_json_object(request_body(prompt, name))
    return parse_generate(body, False, model_info(engine, name)).prompt_token_ids


def http_phases(engine: LLMEngine, prompt: list[int], name: str, repeats: int) -> dict:
    """What `kvshare router` and `kvshare serve` do with the request's body before the
    engine sees it (token-id prompt, as an OpenAI client sends it for a shape model)."""
    body = request_body(prompt, name)
    keys = RoutingKeys(engine.tokenizer, engine.config.block_size)
    info = model_info(engine, name)
    parsed = parse_json_object(body)
    return {
        "body_bytes": len(body),
        "router/parse_json": best_of(repeats, lambda: parse_json_object(body)),
        "router/routing_keys": best_of(repeats, lambda: keys.prefix_of("/v1/completions", parsed)),
        "replica/parse_json": best_of(repeats, lambda: parse_json_object(body)),
        "replica/parse_generate": best_of(
            repeats, lambda: parse_generate(dict(parsed), False, info)
        ),
    }


class ServedEngine:
    """`engine` behind the replica's HTTP app (kvshare serve's own) on a thread's event
    loop, and `kvshare router` in a subprocess in front of it: the serving path of
    `kvshare up` around this engine (its routing keys in the engine's blocks, as `kvshare
    up` sets them). The router's port is picked free."""

    def __init__(self, engine: LLMEngine, name: str) -> None:
        transfer = (
            engine.connector.transfer if isinstance(engine.connector, PoolConnector) else None
        )
        self.engine = engine
        # None: no transfer with a count of prefetch fills to set (the CPU's prefetches none)
        self.transfer = transfer if isinstance(transfer, CudaTransfer) else None
        self._app = build_app(engine, ServeConfig(name))
        self.server = self._app[SERVER_KEY]
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self.replica_url = ""
        self._thread = threading.Thread(target=self._loop.run_until_complete, args=(self._serve(),))
        self._thread.start()
        if not self._ready.wait(60) or not self.replica_url:
            raise SystemExit("the replica app did not start")
        self.router_url = f"http://127.0.0.1:{free_port()}"
        self._router = subprocess.Popen(
            [sys.executable, "-m", "kvshare", "router", "--replica", self.replica_url,
             "--port", self.router_url.rsplit(":", 1)[1], "--health-interval", "0.5",
             "--block-tokens", str(engine.config.block_size)]
        )  # fmt: skip

    async def _serve(self) -> None:
        runner = web.AppRunner(self._app, handler_cancellation=True, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self.replica_url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        self._stop = asyncio.Event()
        self._ready.set()
        await self._stop.wait()
        await runner.cleanup()

    def close(self) -> None:
        self._router.terminate()
        self._router.wait(30)
        assert self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(60)


async def http_hits(
    served: ServedEngine,
    prompt: list[int],
    name: str,
    repeats: int,
    max_tokens: int,
    without_hints: bool = False,
    prefetch_fills: Iterable[int] = (),
) -> tuple[dict[str, list[dict]], list[Any]]:
    """`repeats` hits sent to the router as the bench sends them (streamed, timed to the
    first token), routed by the policy and pinned to the replica alternately (with
    `without_hints`, a third kind: pinned, the replica sending no prompt head to its
    engine; with `prefetch_fills`, one more kind per count: pinned, the CUDA transfer's
    prefetch of that many fills and a prompt head of their pages), each after a reset of
    the replica's GPU-local prefix cache: time to first token at the client and the
    Server-Timing phases of router and replica; and the replica's pool counters after
    them."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        client = BenchClient(session, served.router_url, name, text_content=False)
        deadline = time.monotonic() + 60
        while True:  # until the router has seen the replica healthy
            with contextlib.suppress(aiohttp.ClientError, BenchError):
                await client.complete(prompt[:16], RequestOptions(1))
                break
            if time.monotonic() > deadline:
                raise SystemExit("the router never answered")
            await asyncio.sleep(0.5)
        server, transfer = served.server, served.transfer
        if prefetch_fills and transfer is None:
            raise SystemExit("--http-prefetch-fills needs a CUDA engine with the pool")
        own_fills, own_head = transfer.prefetch_fills if transfer else 0, server.head
        pinned = RequestOptions(max_tokens, replica=0)
        kinds: list[tuple[str, RequestOptions, int, bool]] = [  # name, options, fills, hint
            ("routed", RequestOptions(max_tokens), own_fills, True),
            ("pinned", pinned, own_fills, True),
        ]
        if without_hints:
            kinds.append(("pinned, no hint", pinned, own_fills, False))
        kinds += [(f"pinned, {n} prefetch fills", pinned, n, True) for n in prefetch_fills]
        hits: dict[str, list[dict]] = {kind: [] for kind, *_ in kinds}
        for r in range(repeats):
            for kind, options, fills, hint in kinds:
                await client.admin_all("reset_prefix_cache")
                if transfer is not None:
                    transfer.prefetch_fills = fills
                head_ids = served.engine.hint_tokens if hint else 0
                server.head = PromptHead(head_ids, own_head.send) if head_ids and own_head else None
                result = await client.complete(prompt, options)
                timing = dict(result.server_timing)
                kv = (result.usage or {}).get("kv") or {}
                hit = {
                    "ttft_s": result.ttft_s,
                    "pool_hit_tokens": kv.get("pool_hit_tokens"),
                    "server_timing_ms": timing,
                }
                print(f"http hit {r}, {kind}: {hit}", flush=True)
                hits[kind].append(hit)
        if transfer is not None:
            transfer.prefetch_fills = own_fills
        server.head = own_head
        counters = [replica.get("kv_pool") for replica in await client.stats()]
        print(f"replica pool counters: {counters}", flush=True)
        return hits, counters


def print_http_hits(hits: dict[str, list[dict]], engine_ttft_s: float) -> None:
    """Per kind of hit, medians: the client's time to first token, each phase, and the
    serving path's time (the client's TTFT less the replica's engine phase, hit by hit)."""
    for kind, runs in hits.items():
        ttft = statistics.median(h["ttft_s"] for h in runs)
        serving = statistics.median(
            1e3 * h["ttft_s"] - h["server_timing_ms"]["engine"] for h in runs
        )
        print(
            f"\n{kind} through the router and the replica's HTTP app: time to first token "
            f"{ttft * 1e3:.1f} ms (median of {len(runs)}; engine only {engine_ttft_s * 1e3:.1f} "
            f"ms); outside the engine {serving:.1f} ms"
        )
        for name, ms in median_phases(h["server_timing_ms"] for h in runs).items():
            print(f"  {name:<22} {ms:9.2f} ms")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="shape:tiny-qwen3.5")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--tokens", type=int, default=131072, help="prefix tokens (the hit)")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens after the prefix")
    parser.add_argument("--output-tokens", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--chunk-tokens", type=int, default=256)
    parser.add_argument(
        "--block-size", type=int, default=EngineConfig.block_size, help="the engine's KV block"
    )
    parser.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8"))
    parser.add_argument(
        "--kv-cache-memory", type=int, default=None, help="bytes (CPU default 1 GiB)"
    )
    parser.add_argument("--gpu-memory-fraction", type=float, default=0.9)
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--arena-gib", type=int, default=2)
    parser.add_argument(
        "--layer-groups",
        type=int,
        default=0,
        help="at most this many groups of layers per load (1: whole pages; 0, the default: "
        "the engine's: kvshare.engine.config.CUDA_LAYER_GROUPS on CUDA, whole on the CPU)",
    )
    parser.add_argument(
        "--layer-group-min-mib",
        type=float,
        default=LayerGroups.min_bytes / (1 << 20),
        help="each group's part of a page at least this many MiB (default LayerGroups')",
    )
    parser.add_argument(
        "--compare-layer-groups",
        type=comma_list(layer_group_spec),
        default=[],
        metavar="[SPLIT:]G[:MIB],...",
        help="after the profile, time --repeats hits with each setting: at most G groups, "
        "shrinking toward the end (default) or even, each part of a page at least MIB "
        "(default --layer-group-min-mib)",
    )
    for attribute, counted in CUDA_TRANSFER_COUNTS.items():
        parser.add_argument(
            "--compare-" + attribute.replace("_", "-"),
            type=comma_list(int),
            default=[],
            metavar="N,...",
            help=f"after the profile, time --repeats hits with each count of {counted} "
            "(CUDA; kvshare.kvpool.transfer_cuda)",
        )
    parser.add_argument(
        "--compare-graphs",
        action="store_true",
        help="after the profile, time --repeats hits with CUDA graphs and without, alternated",
    )
    parser.add_argument(
        "--compare-collector",
        action="store_true",
        help="after the profile, time --repeats hits with Python's collector as `kvshare "
        "serve` runs it and with CPython's defaults, alternated",
    )
    parser.add_argument(
        "--exact-fill",
        action="store_true",
        help="compute the cold prefill's attention (default: skip it, the KV is still stored)",
    )
    parser.add_argument(
        "--kernels", type=int, default=30, help="with --trace: how many names to list"
    )
    parser.add_argument("--sync-phases", action="store_true")
    parser.add_argument("--cprofile", type=int, default=0, metavar="N")
    parser.add_argument(
        "--trace", type=Path, default=None, help="a torch profiler Chrome trace of one more hit"
    )
    parser.add_argument(
        "--http",
        type=int,
        default=0,
        metavar="N",
        help="at the end, N hits through the replica's HTTP app and `kvshare router` (the "
        "serving path of `kvshare up`), timed at the client, with their Server-Timing phases",
    )
    parser.add_argument(
        "--http-without-hints",
        action="store_true",
        help="with --http: one more kind of hit, pinned with the replica's prompt-head hints "
        "off, alternated with the others",
    )
    parser.add_argument(
        "--http-prefetch-fills",
        type=comma_list(int),
        default=[],
        metavar="N,...",
        help="with --http: one more kind of hit per count, pinned, with the CUDA transfer's "
        "prefetch of N staging fills (and a prompt head of their pages), alternated",
    )
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    folder = Path(tempfile.mkdtemp(prefix="kvshare-hit-"))
    pool_config = PoolProcessConfig(
        size_bytes=args.arena_gib << 30,
        socket_path=str(folder / "pool.sock"),
        arena_path=f"/dev/shm/kvshare-hit-{uuid.uuid4().hex[:8]}.arena",
        runtime_dir=str(folder),
        ready_timeout=180,
        preallocate=args.device.startswith("cuda"),
    )
    with PoolProcess(pool_config) as pool, CollectorPauses() as pauses:
        engine = build_engine(args, pool.address)
        vocab = engine.loaded.config.vocab_size
        prompt = random_prompt(args.tokens, vocab, 1)
        follow_up = prompt + random_prompt(args.new_tokens, vocab, 2)
        served = served_prompt(engine, follow_up, args.model)
        timer = PhaseTimer(args.sync_phases)
        instrument(engine, timer)
        run_request(engine, "warm-up", random_prompt(512, vocab, 3), 1)
        backend = engine.runner.backend
        if not args.exact_fill:
            engine.runner.backend = SkipAttention()
        cold = pauses.annotate(run_request(engine, "cold", prompt, 1))
        engine.runner.backend = backend
        assert engine.connector is not None
        engine.connector.wait_idle()
        print(f"cold prefill of {args.tokens} tokens: {cold['ttft_s']:.2f} s", flush=True)
        runs, phases, before_copies = [], defaultdict(list), []
        profile = cProfile.Profile() if args.cprofile else None
        for r in range(args.repeats):
            engine.reset_prefix_cache()
            timer.reset()
            timer.active = True
            if profile is not None and r == args.repeats - 1:
                profile.enable()
            run = pauses.annotate(
                run_request(engine, f"hit-{r}", served, args.output_tokens, timer)
            )
            if profile is not None:
                profile.disable()
            engine.connector.wait_idle()
            runs.append(run)
            before_copies.append(
                timer.until(
                    "step/schedule/pool_match/prefetch", "step/schedule/pool_load/transfer_load"
                )
            )
            for label in timer.order:
                phases[label].append(timer.seconds.get(label, 0.0))
            print(f"hit {r}: {run}", flush=True)
        compared = {}
        if args.compare_layer_groups:
            compared |= compare_layer_groups(engine, served, args, pauses)
        for attribute in CUDA_TRANSFER_COUNTS:
            if getattr(args, "compare_" + attribute):
                compared |= compare_cuda_transfer_counts(engine, served, args, pauses, attribute)
        if args.compare_graphs:
            compared |= compare_graphs(engine, served, args, pauses)
        if args.compare_collector:
            compared |= compare_collector(engine, served, args, pauses)
        traced_kernels: list[dict[str, Any]] = []
        traced_copies: dict[str, Any] = {}
        if args.trace is not None:
            from torch.profiler import ProfilerActivity
            from torch.profiler import profile as torch_profile

            activities = [ProfilerActivity.CPU]
            if engine.runner.device.type == "cuda":
                activities.append(ProfilerActivity.CUDA)
            engine.reset_prefix_cache()
            with torch_profile(activities=activities) as trace:
                run_request(engine, "hit-trace", served, args.output_tokens)
            engine.connector.wait_idle()
            trace.export_chrome_trace(str(args.trace))
            traced_kernels = device_time_by_name(trace, args.kernels)
            traced_copies = copy_rates(args.trace)
        result = {
            "args": {k: str(v) for k, v in vars(args).items()},
            "device": str(engine.runner.device),
            "cold": cold,
            "runs": runs,
            "ttft_s": min(r["ttft_s"] for r in runs),
            "engine_phases_s": {label: min(values) for label, values in phases.items()},
            # per phase, hit r's seconds at [r]: where a slow hit spent its extra time
            "engine_phases_per_hit_s": dict(phases),
            "engine_phase_calls": dict(timer.calls),
            "compared": compared,
            "traced_kernels": traced_kernels,
            "traced_copies": traced_copies,
            "http_phases_s": http_phases(engine, follow_up, args.model, args.repeats),
            # add_request's entry to the load's first copy (its prefetch, else its transfer)
            "engine_before_copies_s": min(before_copies),
        }
        http = result["http_phases_s"]
        result["host_before_copies_s"] = result["engine_before_copies_s"] + sum(
            seconds for label, seconds in http.items() if label != "body_bytes"
        )
        if args.http:
            timer.active = False
            serving = ServedEngine(engine, args.model)
            try:
                result["http_hits"], result["http_pool_counters"] = asyncio.run(
                    http_hits(
                        serving,
                        follow_up,
                        args.model,
                        args.http,
                        args.output_tokens,
                        args.http_without_hints,
                        args.http_prefetch_fills,
                    )
                )
            finally:
                serving.close()
        engine.connector.close()
    print(
        f"\nhit at {args.tokens} + {args.new_tokens} tokens, {result['device']}: "
        f"time to first token {result['ttft_s'] * 1e3:.1f} ms (best of {args.repeats})"
    )
    print(f"{'phase':<48} {'ms':>9} {'calls':>6}")
    for label, seconds in result["http_phases_s"].items():
        if label != "body_bytes":
            print(f"{label:<48} {seconds * 1e3:>9.2f}")
    for label, seconds in result["engine_phases_s"].items():
        depth = label.count("/")
        name = "  " * depth + label.rsplit("/", 1)[-1]
        print(f"{name:<48} {seconds * 1e3:>9.2f} {timer.calls.get(label, 0):>6}")
    print(
        f"{'engine: add_request -> first copy':<48} "
        f"{result['engine_before_copies_s'] * 1e3:>9.2f}\n"
        f"{'host before the first copy (http + engine)':<48} "
        f"{result['host_before_copies_s'] * 1e3:>9.2f}"
    )
    for name, hits in result["compared"].items():
        times = sorted(h["ttft_s"] for h in hits)
        tokens = sorted({h["first_token"] for h in hits})
        print(
            f"{name}: time to first token min {times[0] * 1e3:.1f} ms, "
            f"median {times[len(times) // 2] * 1e3:.1f} ms, max {times[-1] * 1e3:.1f} ms; "
            f"collector {sum(h['gc_ms'] for h in hits):.1f} ms in "
            f"{sum(h['gc_full'] for h in hits)} full collections over {len(hits)} hits; "
            f"first tokens {tokens}"
        )
    if args.http:
        print_http_hits(result["http_hits"], result["ttft_s"])
    if profile is not None:
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(args.cprofile)
        print(text.getvalue())
        result["cprofile"] = text.getvalue()
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
