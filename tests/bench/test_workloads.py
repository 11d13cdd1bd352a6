"""The workload drivers against the fake cluster: admin calls, pinning, TTFT, prompts, results."""

from __future__ import annotations

import asyncio
import itertools
import statistics

import pytest

from kvshare.bench.cross_replica import CrossReplica
from kvshare.bench.design import Block, Design
from kvshare.bench.driver import BenchOptions, run_bench
from kvshare.bench.records import PREFILL, BenchRun, BlockResult, RequestRecord
from kvshare.bench.report import markdown, timing_table, to_json
from kvshare.bench.runner import Workload
from kvshare.bench.sessions import Sessions
from kvshare.bench.shared_prefix import SharedPrefix
from kvshare.bench.stats import BootstrapSpec
from kvshare.bench.summary import SESSION, TTFT, block_row, compare, prompt_shares
from kvshare.bench.synthetic import PromptModel, load_prompt_model
from tests.bench.fake_server import Event, FakeCluster, RunningFake


class RecordingObserver:
    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []

    def block_started(self, block: Block, planned_requests: int) -> None:
        self.calls.append(("start", (block, planned_requests)))

    def request_done(self, record: RequestRecord) -> None:
        self.calls.append(("request", record))

    def block_done(self, result: BlockResult) -> None:
        self.calls.append(("done", result))


def run(
    workload: Workload,
    fake: RunningFake,
    model: PromptModel,
    design: str = "OFF-ON-ON-OFF",
    observer: RecordingObserver | None = None,
    warmup_tokens: int = 0,
) -> BenchRun:
    options = BenchOptions(
        Design.parse(design), seed=5, bootstrap=BootstrapSpec(200), warmup_tokens=warmup_tokens
    )
    return asyncio.run(
        run_bench(workload, fake.url, options, observer or RecordingObserver(), model)
    )


def split_blocks(events: list[Event]) -> list[list[Event]]:
    """Events cut at each block's first admin call (the kv_pool switch of replica 0 or 1)."""
    blocks: list[list[Event]] = []
    for e in events:
        starts_block = (
            e.kind == "admin"
            and e.path == "kv_pool"
            and (not blocks or blocks[-1][-1].kind != "admin" or blocks[-1][-1].path != "kv_pool")
        )
        if starts_block:
            blocks.append([])
        blocks[-1].append(e)
    return blocks


def check_block_setup(events: list[Event], enabled: bool) -> list[Event]:
    """The block starts with: pool switched on every replica, then cleared, then caches reset,
    all through the router (so that its cache-aware index forgets too)."""
    setup, rest = events[:6], events[6:]
    assert all(e.via_router for e in setup)
    assert {(e.replica, e.path, e.body["enabled"]) for e in setup[:2]} == {
        (0, "kv_pool", enabled),
        (1, "kv_pool", enabled),
    }
    assert {(e.replica, e.path) for e in setup[2:4]} == {(0, "clear_pool"), (1, "clear_pool")}
    assert {(e.replica, e.path) for e in setup[4:]} == {
        (0, "reset_prefix_cache"),
        (1, "reset_prefix_cache"),
    }
    return rest


def test_cross_replica_prefills_on_a_and_measures_b_with_resets_between(
    fake: RunningFake, smollm2: PromptModel
) -> None:
    workload = CrossReplica(
        lengths=(40, 80), requests_per_block=2, question_tokens=8, output_tokens=3
    )
    observer = RecordingObserver()
    result = run(workload, fake, smollm2, observer=observer)
    design = Design.parse("OFF-ON-ON-OFF")

    *blocks, after = split_blocks(fake.cluster.events)
    assert len(blocks) == 4
    # The run ends OFF; then it puts the pool back on, as it found it, in one call.
    assert [(e.replica, e.path, e.body, e.via_router) for e in after] == [
        (0, "kv_pool", {"enabled": True}, True),
        (1, "kv_pool", {"enabled": True}, True),
    ]
    assert fake.cluster.enabled == [True, True]
    contexts = []
    for block, events in zip(design.blocks, blocks):
        rest = check_block_setup(events, block.pool_enabled)
        assert len(rest) == 4 * 4  # per pair: prefill on A, reset A and B, follow-up on B
        for i in range(0, len(rest), 4):
            prefill, resets, follow = rest[i], rest[i + 1 : i + 3], rest[i + 3]
            assert (prefill.kind, prefill.replica, prefill.pinned) == ("request", 0, True)
            assert prefill.body["max_tokens"] == 1
            assert {(e.replica, e.path) for e in resets} == {
                (0, "reset_prefix_cache"),
                (1, "reset_prefix_cache"),
            }
            assert (follow.kind, follow.replica, follow.pinned) == ("request", 1, True)
            context = prefill.body["tokens"]
            assert follow.body["tokens"][: len(context)] == context
            assert len(follow.body["tokens"]) > len(context)
            contexts.append(context)
    assert len(set(contexts)) == 16  # unique per (block, request)

    # Records: A then B, TTFT after the fake's empty first chunk and its delay, hits when ON.
    for record in result.records():
        assert record.replica == (0 if record.tag.role == PREFILL else 1)
        assert record.result.served_by == str(record.replica)
        assert record.result.ttft_s is not None
        assert record.result.ttft_s >= fake.cluster.first_content_delay_s
        assert record.result.ttft_s < record.result.total_s
        assert record.result.text.startswith(f" w{record.replica}x0")
        engine_s = record.result.server_timing["engine"] / 1e3
        assert fake.cluster.first_content_delay_s <= engine_s <= record.result.ttft_s
    follow_ups = [r for r in result.records() if r.measured]
    assert all(
        (r.usage_int("kv", "pool_hit_tokens") > 0) == (r.condition == "ON") for r in follow_ups
    )
    # Each follow-up waited for A's stores to commit (the fake takes 50 ms), and only when ON.
    for r in follow_ups:
        assert r.settle_s is not None
        assert (r.settle_s >= 0.03) if r.condition == "ON" else r.settle_s < 0.03
    for b in result.blocks:
        moved = (b.pool_bytes("loaded_bytes") or 0, b.pool_bytes("stored_bytes") or 0)
        assert (moved[0] > 0 and moved[1] > 0) if b.block.pool_enabled else moved == (0, 0)
        # computed/ideal: each follow-up shares its context with its prefill, no more.
        ordered = sorted(b.records, key=lambda r: r.start_s)
        shared = [share.shared_tokens for share in prompt_shares(ordered)]
        assert shared == [r.tag.x if r.measured else 0 for r in ordered]

    # Randomized order within blocks, same set of lengths in each.
    orders = [[r.tag.x for r in b.records if r.measured] for b in result.blocks]
    assert (
        all(sorted(o) == [40, 40, 80, 80] for o in orders) and len({tuple(o) for o in orders}) > 1
    )

    comparisons = compare(result.blocks, design, BootstrapSpec(200))
    assert [(c.metric, c.x) for c in comparisons] == [(TTFT, 40), (TTFT, 80)]
    # The report's timing table: per condition, the medians of the follow-ups' phases.
    timing = timing_table(result.records())
    assert timing is not None and timing.headers == ("pool", "requests", "client TTFT", "engine")
    for row, condition in zip(timing.rows, ("OFF", "ON")):
        group = [r for r in follow_ups if r.condition == condition]
        engine_ms = statistics.median(r.result.server_timing["engine"] for r in group)
        assert row[:2] == (condition, str(len(group))) and row[3] == f"{engine_ms:.1f}"
    assert float(timing.rows[1][3]) < float(timing.rows[0][3])  # ON computes less
    assert all(c.ratio is not None and c.ratio.value < 1.0 for c in comparisons)
    assert all(c.hit_rates[0] == 0.0 and (c.hit_rates[1] or 0.0) > 0.5 for c in comparisons)

    kinds = [kind for kind, _ in observer.calls]
    assert kinds == (["start"] + ["request"] * 8 + ["done"]) * 4
    assert [payload for kind, payload in observer.calls if kind == "start"] == [
        (b, 8) for b in design.blocks
    ]


def test_sessions_resend_history_with_actual_answers_and_pin_by_placement(
    fake: RunningFake, smollm2: PromptModel
) -> None:
    workload = Sessions(
        sessions=2,
        context_tokens=60,
        turns=3,
        question_tokens=5,
        output_tokens=2,
        placements=("alternate", "fixed"),
    )
    result = run(workload, fake, smollm2, design="OFF-ON")
    requests = fake.cluster.requests()
    assert len(requests) == 2 * 2 * 2 * 3 and all(
        r.path == "/v1/chat/completions" for r in requests
    )
    by_session: dict[tuple[int, str], list[Event]] = {}
    block = -1
    for e in fake.cluster.events:
        if e.kind == "admin" and e.path == "clear_pool" and e.replica == 0:
            block += 1
        if e.kind == "request":
            by_session.setdefault((block, e.body["session"]), []).append(e)
    assert len(by_session) == 8
    for (block, session), turns in by_session.items():
        _, placement, _ = session.split("-")
        assert session.startswith(f"block{block}-")  # unique across blocks
        expected = [0, 1, 0] if placement == "alternate" else [0, 0, 0]
        assert [t.replica for t in turns] == expected and all(t.pinned for t in turns)
        for k in range(1, len(turns)):
            before, after = turns[k - 1].body["tokens"], turns[k].body["tokens"]
            answer = ["<assistant>", f"w{turns[k - 1].replica}x0", f"w{turns[k - 1].replica}x1"]
            assert after[: len(before) + 3] == (*before, *answer)  # the whole history, then more

    comparisons = compare(result.blocks, Design.parse("OFF-ON"), BootstrapSpec(100))
    assert {(c.metric, c.series) for c in comparisons if c.metric == SESSION} == {
        (SESSION, "alternate"),
        (SESSION, "fixed"),
    }
    assert {c.x for c in comparisons if c.metric == TTFT} == {0, 1, 2}
    alternate_turn1 = next(c for c in comparisons if c.series == "alternate" and c.x == 1)
    assert alternate_turn1.hit_rates[0] == 0.0 and (alternate_turn1.hit_rates[1] or 0.0) > 0.5


def test_sessions_without_a_tokenizer_send_token_ids_and_append_answer_ids(
    fake: RunningFake,
) -> None:
    model = load_prompt_model("shape:tiny-llama")
    workload = Sessions(sessions=1, context_tokens=20, turns=3, question_tokens=4, output_tokens=2)
    result = run(workload, fake, model, design="ON")
    requests = fake.cluster.requests()
    assert [r.path for r in requests] == ["/v1/completions"] * 3
    for before, after in itertools.pairwise(requests):
        prior = before.body["tokens"]
        assert after.body["tokens"][: len(prior) + 2] == (*prior, 1000, 1001)
        assert len(after.body["tokens"]) == len(prior) + 2 + 4
    # Content is the streamed ids: TTFT still skips the empty first chunk.
    assert all(
        (r.result.ttft_s or 0.0) >= fake.cluster.first_content_delay_s for r in result.records()
    )


def test_shared_prefix_bounds_concurrency_and_shares_few_documents(
    fake: RunningFake, smollm2: PromptModel
) -> None:
    workload = SharedPrefix(
        documents=2, users=12, concurrency=3, doc_tokens=64, question_tokens=6, output_tokens=2
    )
    fake.cluster.commit_delay_s = 0.0  # concurrent requests do not wait for commits: no racing here
    result = run(workload, fake, smollm2, design="OFF-ON")
    assert fake.cluster.max_in_flight == 3
    requests = fake.cluster.requests()
    assert len(requests) == 24 and not any(r.pinned for r in requests)
    assert {r.replica for r in requests} == {0, 1}
    for block in (requests[:12], requests[12:]):
        assert len({r.body["tokens"][:40] for r in block}) == 2  # two documents per block
    assert not {r.body["tokens"][:40] for r in requests[:12]} & {
        r.body["tokens"][:40] for r in requests[12:]
    }
    # The same users in the same order in every block: block medians compare conditions,
    # not which documents the first questions happened to ask about.
    orders = [[r.tag.label for r in b.records] for b in result.blocks]
    assert orders[0] == orders[1] and orders[0] != sorted(orders[0])
    [ttft] = compare(result.blocks, Design.parse("OFF-ON"), BootstrapSpec(100))
    assert ttft.counts == (12, 12) and (ttft.hit_rates[1] or 0.0) > (ttft.hit_rates[0] or 0.0)


def test_a_warm_up_per_replica_comes_first_and_is_reported_but_never_pooled(
    fake: RunningFake, smollm2: PromptModel
) -> None:
    workload = SharedPrefix(
        documents=2, users=6, concurrency=2, doc_tokens=64, question_tokens=6, output_tokens=2
    )
    fake.cluster.commit_delay_s = 0.0
    result = run(workload, fake, smollm2, design="OFF-ON", warmup_tokens=40)
    # Before block 0's setup: the pool on, one pinned request per replica, then each prompt
    # on the other replica after a cache reset, restored from the pool.
    first = [(e.kind, e.replica, e.path, e.pinned) for e in fake.cluster.events[:9]]
    requests = [e for e in first if e[0] == "request"]
    assert first[:2] == [("admin", 0, "kv_pool", False), ("admin", 1, "kv_pool", False)]
    assert [(e[1], e[3]) for e in requests] == [(0, True), (1, True), (1, True), (0, True)]
    assert first[4:6] == [
        ("admin", 0, "reset_prefix_cache", False),
        ("admin", 1, "reset_prefix_cache", False),
    ]
    assert [r.replica for r in result.warmup] == [0, 1, 1, 0]
    assert [r.tag.label for r in result.warmup] == ["replica0", "replica1", "restore0", "restore1"]
    assert all(r.result.ttft_s is not None for r in result.warmup)
    hits = [r.usage_int("kv", "pool_hit_tokens") for r in result.warmup]
    assert hits == [0, 0, 36, 36]  # each chunk but the last: one token is always computed
    assert not {id(r) for r in result.warmup} & {id(r) for r in result.records()}
    [ttft] = compare(result.blocks, Design.parse("OFF-ON"), BootstrapSpec(100))
    assert ttft.counts == (6, 6)  # the blocks' users only
    assert "warm-up before block 0" in markdown(result, [ttft], BootstrapSpec(100), None)
    assert len(to_json(result, [ttft], BootstrapSpec(100))["warmup"]) == 4
    # Every report states computed/ideal; the OFF block computes each document per replica.
    rows = [block_row(b) for b in result.blocks]
    assert all(r.computed_over_ideal is not None for r in rows)
    assert rows[0].computed_over_ideal >= rows[1].computed_over_ideal


def test_setup_errors_stop_the_run_with_their_message(smollm2: PromptModel) -> None:
    from kvshare.bench.client import BenchError
    from tests.bench.fake_server import serve_in_thread

    for fake in serve_in_thread(FakeCluster(replicas=1)):
        with pytest.raises(ValueError, match="needs replicas 0 and 1"):  # before any request
            run(CrossReplica((16,), 1), fake, smollm2)
        assert not fake.cluster.requests()
    for fake in serve_in_thread(FakeCluster(fail_admin="clear_pool")):
        with pytest.raises(BenchError, match="clear_pool: HTTP 502"):
            run(CrossReplica((16,), 1), fake, smollm2)
        assert not fake.cluster.requests()
    for fake in serve_in_thread(FakeCluster(ignore_pins=True)):
        with pytest.raises(BenchError, match="pinned to replica 0, but replica 1 served it"):
            run(CrossReplica((16,), 1), fake, smollm2)


def test_a_run_sets_the_pool_switches_back_as_it_found_them(
    smollm2: PromptModel, caplog: pytest.LogCaptureFixture
) -> None:
    from kvshare.bench.client import BenchError
    from tests.bench.fake_server import serve_in_thread

    # Replicas set differently: each is set back at its own URL, not through the router.
    for fake in serve_in_thread(FakeCluster(switches=(False, True))):
        run(CrossReplica((16,), 1), fake, smollm2)
        assert fake.cluster.enabled == [False, True]
        assert [(e.replica, e.body, e.via_router) for e in fake.cluster.events[-2:]] == [
            (0, {"enabled": False}, False),
            (1, {"enabled": True}, False),
        ]
    # A run that fails inside its first block, after switching the pool off, still puts it
    # back, and its own error is the one raised.
    for fake in serve_in_thread(FakeCluster(fail_admin="clear_pool")):
        with pytest.raises(BenchError, match="clear_pool: HTTP 502"):
            run(CrossReplica((16,), 1), fake, smollm2)
        assert fake.cluster.enabled == [True, True]
    # A pool that cannot be switched back on fails a run that measured everything ...
    for fake in serve_in_thread(FakeCluster(refuse_pool_on=True)):
        with pytest.raises(
            BenchError, match=r"could not set the pool switches back .*replica 0: on"
        ):
            run(CrossReplica((16,), 1), fake, smollm2, design="OFF")
        assert fake.cluster.enabled == [False, False]
    # ... and is a warning beside the error of a run that failed already.
    for fake in serve_in_thread(FakeCluster(refuse_pool_on=True)):
        with caplog.at_level("WARNING"), pytest.raises(BenchError, match="kv_pool: HTTP 502"):
            run(CrossReplica((16,), 1), fake, smollm2, design="OFF-ON")
        assert "could not set the pool switches back" in caplog.text


def test_demo_headlines_name_the_longest_context_and_the_session_time(
    fake: RunningFake, smollm2: PromptModel
) -> None:
    from kvshare.bench.demo import headline

    design = Design.paired(2)
    cross = run(
        CrossReplica(lengths=(40, 80), requests_per_block=1), fake, smollm2, design=design.label
    )
    line = headline(cross, compare(cross.blocks, design, BootstrapSpec(100)))
    assert line.startswith("cross-replica TTFT at 80 context tokens: OFF ")
    assert "s (n=2), ON " in line and "ON/OFF 0." in line and " over 2 block pairs, " in line
    assert "% less [" in line
    sessions = run(
        Sessions(sessions=1, context_tokens=40, turns=2, output_tokens=2),
        fake,
        smollm2,
        design="OFF-ON",
    )
    line = headline(sessions, compare(sessions.blocks, Design.parse("OFF-ON"), BootstrapSpec(100)))
    assert line.startswith("alternate session time (2 turns, 40-token document): OFF ")
    assert "(too few block pairs for a paired interval)" in line


def test_cross_replica_shared_context_prefills_once_per_length_in_pool_on_blocks(
    fake: RunningFake, smollm2: PromptModel
) -> None:
    workload = CrossReplica(
        lengths=(40, 80),
        requests_per_block=3,
        question_tokens=8,
        output_tokens=3,
        source=0,
        target=0,
        shared_context=True,
    )
    result = run(workload, fake, smollm2, observer=RecordingObserver())
    design = Design.parse("OFF-ON-ON-OFF")
    for b in result.blocks:  # computed/ideal: each length's context is shared, once computed
        ordered = sorted(b.records, key=lambda r: r.start_s)
        shared = [share.shared_tokens for share in prompt_shares(ordered)]
        firsts = [r.tag.x for r in ordered if r.tag.role == PREFILL] or [40, 80]
        expected = []
        for r in ordered:
            first = r.tag.x in firsts
            # (the fake counts a text prompt's tokens by its own rule: at most what it says)
            expected.append(0 if first else min(r.tag.x, r.usage_int("prompt_tokens")))
            if first:
                firsts.remove(r.tag.x)
        assert shared == expected
    for block, events in zip(design.blocks, split_blocks(fake.cluster.events)):
        requests = [e for e in check_block_setup(events, block.pool_enabled) if e.kind == "request"]
        prefills = [e for e in requests if e.body["max_tokens"] == 1]
        follow_ups = [e for e in requests if e.body["max_tokens"] == 3]
        assert len(prefills) == (2 if block.pool_enabled else 0)
        assert len(follow_ups) == 6 and all(e.replica == 0 for e in requests)
        contexts = [p.body["tokens"] for p in prefills]
        for follow in follow_ups:
            # Every follow-up extends its length's one context (known in pool-on blocks).
            tokens = follow.body["tokens"]
            assert not contexts or sum(tokens[: len(c)] == c for c in contexts) == 1
        assert len({tuple(f.body["tokens"]) for f in follow_ups}) == 6  # own question each
