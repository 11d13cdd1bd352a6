"""Routing policies without processes: each one's rule, checked on exact numbers."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvshare.engine.block_manager import block_hashes
from kvshare.serve.policies import (
    Alternate,
    CacheAware,
    CacheUpdate,
    HashRing,
    LeastLoad,
    Load,
    PolicyConfig,
    PrefixIndex,
    RoundRobin,
    RouteRequest,
    Session,
    StepShape,
    common_blocks,
    make_policy,
    pool_credit,
)

CONFIG = PolicyConfig(pool_credit=0.8)  # round numbers in the exact checks below


def loads(*in_flight: int) -> list[Load]:
    return [Load(i, n) for i, n in enumerate(in_flight)]


def prompt(tokens: int, seed: int = 0) -> RouteRequest:
    ids = [(seed * 7919 + i) % 30000 for i in range(tokens)]
    return RouteRequest(prefix=tuple(block_hashes(ids, 16)), block_tokens=16)


def test_round_robin_cycles_over_the_candidates() -> None:
    policy = RoundRobin()
    assert [policy.choose(RouteRequest(), loads(0, 0, 0)) for _ in range(6)] == [0, 1, 2, 0, 1, 2]
    # With replica 1 out, the turn goes over the two left.
    survivors = [Load(0), Load(2)]
    assert {policy.choose(RouteRequest(), survivors) for _ in range(4)} == {0, 2}


def test_least_load_picks_fewest_in_flight_and_rotates_ties() -> None:
    policy = LeastLoad(3)
    assert policy.choose(RouteRequest(), loads(5, 1, 3)) == 1
    picks = Counter(policy.choose(RouteRequest(), loads(2, 2, 2)) for _ in range(30))
    assert picks == {0: 10, 1: 10, 2: 10}


def test_hash_ring_moves_only_the_keys_of_a_removed_replica() -> None:
    ring = HashRing(3, CONFIG.virtual_nodes)
    keys = [f"session-{i}" for i in range(3000)]
    owner = {k: next(ring.walk(k)) for k in keys}
    share = Counter(owner.values())
    assert all(600 < share[i] < 1400 for i in range(3)), share  # roughly even
    # Replica 2 gone: its keys take the next replica on the ring, the others stay put.
    for key in keys:
        new = next(i for i in ring.walk(key) if i != 2)
        assert new == owner[key] or owner[key] == 2
    assert sorted(ring.walk("any")) == [0, 1, 2]


def test_session_is_sticky_and_stable_across_instances() -> None:
    a, b = Session(3, CONFIG), Session(3, CONFIG)
    for i in range(50):
        request = RouteRequest(session_id=f"user-{i}")
        first = a.choose(request, loads(0, 0, 0))
        assert all(a.choose(request, loads(0, 0, 0)) == first for _ in range(3))
        assert b.choose(request, loads(0, 0, 0)) == first  # stable hash: any router agrees


def test_session_moves_when_its_replica_is_down_and_comes_back() -> None:
    policy = Session(3, CONFIG)
    request = RouteRequest(session_id="user-42")
    home = policy.choose(request, loads(0, 0, 0))
    others = [Load(i) for i in range(3) if i != home]
    moved = policy.choose(request, others)
    assert moved != home
    assert policy.choose(request, others) == moved  # sticky on its second home too
    assert policy.choose(request, loads(0, 0, 0)) == home


def test_session_moves_off_an_overloaded_replica_only_past_both_thresholds() -> None:
    policy = Session(2, PolicyConfig(balance_abs=8, balance_rel=2.0))
    request = RouteRequest(session_id="user-7")
    home = policy.choose(request, loads(0, 0))
    other = 1 - home

    def with_load(home_load: int, other_load: int) -> list[Load]:
        return [Load(home, home_load), Load(other, other_load)]

    assert policy.choose(request, with_load(7, 0)) == home  # 7 more: under balance_abs
    assert policy.choose(request, with_load(8, 0)) == other  # 8 more and > 2 x 0
    assert policy.choose(request, with_load(20, 10)) == home  # 10 more but only 2 x
    assert policy.choose(request, with_load(21, 10)) == other


def test_session_without_id_goes_to_least_load() -> None:
    assert Session(3, CONFIG).choose(RouteRequest(), loads(4, 0, 9)) == 1


def test_alternate_moves_each_request_to_the_next_replica() -> None:
    policy = Alternate(3, CONFIG)
    request = RouteRequest(session_id="chat-1")
    order = []
    for _ in range(6):
        replica = policy.choose(request, loads(0, 0, 0))
        policy.record(request, replica)
        order.append(replica)
    start = order[0]
    assert order == [(start + k) % 3 for k in range(6)]


def test_alternate_skips_a_replica_that_is_down_and_only_records_success() -> None:
    policy = Alternate(3, CONFIG)
    request = RouteRequest(session_id="chat-2")
    policy.record(request, 0)
    assert policy.choose(request, loads(0, 0, 0)) == 1
    assert policy.choose(request, [Load(0), Load(2)]) == 2  # 1 is down
    # Nothing recorded since: the session still continues after replica 0.
    assert policy.choose(request, loads(0, 0, 0)) == 1
    policy.record(request, 2)
    assert policy.choose(request, loads(0, 0, 0)) == 0  # wraps around


def test_alternate_remembers_a_bounded_number_of_sessions() -> None:
    policy = Alternate(2, PolicyConfig(max_sessions=2))
    for name in ("a", "b", "c"):
        policy.record(RouteRequest(session_id=name), 0)
    ring_home = next(HashRing(2, CONFIG.virtual_nodes).walk("a"))
    assert policy.choose(RouteRequest(session_id="a"), loads(0, 0)) == ring_home  # forgotten
    assert policy.choose(RouteRequest(session_id="c"), loads(0, 0)) == 1  # remembered


def test_prefix_index_matches_leading_blocks_and_evicts_tails_first() -> None:
    index = PrefixIndex(capacity=10)
    long = prompt(160)  # 10 blocks
    index.insert(long.prefix)
    assert index.match(long.prefix) == 10
    assert index.match(prompt(160, seed=1).prefix) == 0
    assert index.match(long.prefix[:4] + prompt(96, seed=2).prefix) == 4
    other = prompt(64, seed=3)  # 4 more blocks: the long chain loses its last 4
    index.insert(other.prefix)
    assert len(index) == 10
    assert index.match(long.prefix) == 6
    assert index.match(other.prefix) == 4
    index.clear()
    assert index.match(other.prefix) == 0


def test_cache_aware_prefers_the_replica_holding_the_prefix() -> None:
    policy = CacheAware(2, CONFIG)
    request = prompt(1000)
    policy.record(request, 1)
    # 62 full blocks = 992 tokens on replica 1; pool credit on replica 0 covers 768 (3 chunks).
    assert policy.gpu_tokens(request, 1) == 992
    assert policy.pool_tokens(request) == 768
    assert policy.score(request, Load(1), 768) == 992
    assert policy.score(request, Load(0), 768) == pytest.approx(0.8 * 768)
    assert policy.choose(request, loads(0, 0)) == 1


def test_cache_aware_load_penalty_outweighs_a_small_advantage() -> None:
    policy = CacheAware(2, PolicyConfig(pool_credit=0.8, load_penalty_tokens=64.0))
    request = prompt(1000)
    policy.record(request, 1)
    # Replica 1's edge: 992 - 0.8 x 768 = 377.6 tokens, i.e. 5.9 requests' penalty.
    assert policy.choose(request, loads(0, 5)) == 1
    assert policy.choose(request, loads(0, 6)) == 0


def test_cache_aware_pool_credit_lets_any_replica_resume_a_session() -> None:
    policy = CacheAware(3, CONFIG)
    request = prompt(600)
    policy.record(request, 0)
    # Replica 0 down: replicas 1 and 2 both have 512 pool tokens; the less loaded wins.
    assert policy.choose(request, [Load(1, 1), Load(2, 0)]) == 2
    assert policy.score(request, Load(1), policy.pool_tokens(request)) == pytest.approx(0.8 * 512)
    policy.forget_pool()
    assert policy.pool_tokens(request) == 0
    policy.forget_replica(0)
    assert policy.gpu_tokens(request, 0) == 0


def test_cache_aware_spreads_unrelated_prompts() -> None:
    policy = CacheAware(2, CONFIG)
    picks = Counter(policy.choose(prompt(200, seed=s), loads(0, 0)) for s in range(10))
    assert picks == {0: 5, 1: 5}


def test_cache_aware_ranks_a_gpu_hit_over_a_pool_hit_over_a_miss() -> None:
    # Three replicas, equal load: 0 holds the prompt on its GPU, 1 uses the pool (which
    # holds it), 2 does not use the pool. The default credit, from measured costs.
    policy = CacheAware(3, PolicyConfig())
    request = prompt(1024)
    policy.record(request, 0)
    policy.observe(2, CacheUpdate(uses_pool=False))
    pool = policy.pool_tokens(request)
    assert pool == 1024
    gpu_hit, pool_hit, miss = (policy.score(request, Load(i), pool) for i in range(3))
    assert gpu_hit > pool_hit > miss == 0
    assert pool_hit == pytest.approx(PolicyConfig().pool_credit * 1024)
    assert policy.choose(request, loads(0, 0, 0)) == 0
    assert policy.choose(request, [Load(1), Load(2)]) == 1


def test_the_default_pool_credit_is_one_minus_restore_over_prefill_time() -> None:
    # 32k tokens on an H200: prefill 3.431 s, restore from the pool 0.100 s.
    assert PolicyConfig().pool_credit == pytest.approx(pool_credit(3.431, 0.100), abs=0.005)
    assert 0.0 < PolicyConfig().pool_credit < 1.0
    with pytest.raises(ValueError):
        pool_credit(1.0, 2.0)


def test_cache_aware_learns_a_replica_reset_from_its_cache_events() -> None:
    policy = CacheAware(2, CONFIG)
    request = prompt(1024)
    policy.record(request, 0)
    policy.observe(0, CacheUpdate(uses_pool=True))
    assert policy.gpu_tokens(request, 0) == 1024
    # The replica reset its cache (its next report is a snapshot, empty here): no credit.
    policy.observe(0, CacheUpdate(snapshot=True))
    assert policy.gpu_tokens(request, 0) == 0
    # It computed the first 20 blocks again, then evicted the last 10 of them.
    policy.observe(0, CacheUpdate(stored=request.prefix[:20]))
    policy.observe(0, CacheUpdate(removed=request.prefix[10:20]))
    assert policy.gpu_tokens(request, 0) == 160


def test_cache_aware_credits_prefixes_still_being_computed() -> None:
    policy = CacheAware(2, CONFIG)
    request = prompt(1024)
    policy.started(request, 1)
    policy.started(request, 1)
    assert policy.choose(request, loads(0, 2)) == 1  # 1024 - 2 x 64 beats an empty replica
    policy.ended(request, 1)
    assert policy.gpu_tokens(request, 1) == 1024
    policy.ended(request, 1)
    assert policy.gpu_tokens(request, 1) == 0  # never answered: nothing predicted


def test_cache_aware_sends_a_hit_away_from_a_replica_busy_computing_another_document() -> None:
    """On the H200 a question whose 16k document sat on a replica computing another
    document waited 0.9-1.7 s for that prefill's steps; on an idle replica, restored through
    the pool, it took 0.15 s. The score counts the prompt tokens a replica must compute for
    other documents first, from when a request is sent until its answer begins."""
    policy = CacheAware(2, CONFIG)
    question = prompt(1024, seed=1)
    policy.record(question, 0)  # document 1 is on replica 0's GPU and in the pool
    other = prompt(4096, seed=2)
    policy.started(other, 0)  # replica 0 computes document 2: 4,096 tokens queued
    assert policy.queued_tokens(question, 0) == 4096
    assert policy.queued_tokens(question, 1) == 0
    assert policy.choose(question, loads(1, 0)) == 1  # 0.8 x 1024 beats 1024 - 64 - 4096
    # A request of the same document is not queued behind its own document's work.
    assert policy.queued_tokens(prompt(4096 + 32, seed=2), 0) == 0
    policy.answered(other, 0)  # its first token: the prefill is over
    assert policy.queued_tokens(question, 0) == 0
    assert policy.choose(question, loads(1, 0)) == 0
    policy.ended(other, 0)  # answered already: nothing more to take back
    assert policy.queued_tokens(question, 0) == 0


def test_cache_aware_queues_only_what_a_replica_must_compute() -> None:
    policy = CacheAware(2, CONFIG)
    document = prompt(2048, seed=3)
    policy.record(document, 0)  # on replica 0's GPU and in the pool
    follow_up = prompt(2048 + 512, seed=3)  # the document and 512 new tokens
    policy.started(follow_up, 0)
    policy.started(follow_up, 1)
    unrelated = prompt(64, seed=4)
    # GPU hit on 0: the new 512 tokens; pool hit on 1: whole chunks, 2,048 of them.
    assert policy.queued_tokens(unrelated, 0) == 512
    assert policy.queued_tokens(unrelated, 1) == 512
    policy.ended(follow_up, 1)  # failed before answering: its work goes too
    assert policy.queued_tokens(unrelated, 1) == 0
    policy.ended(follow_up, 0)
    assert policy.queued_tokens(unrelated, 0) == 0
    with pytest.raises(ValueError, match="queued_work_weight"):
        PolicyConfig(queued_work_weight=-1.0)


def test_cache_aware_queue_leaves_out_only_the_work_a_request_shares() -> None:
    """Work counts as a request's own only if the request's prefix holds the first block
    that work computes: a common system prompt already cached does not make two
    documents' requests each other's own work."""
    policy = CacheAware(2, CONFIG)
    system = [1000 + i for i in range(64)]  # 4 blocks every prompt starts with

    def with_system(tokens: int, seed: int) -> RouteRequest:
        ids = system + [(seed * 7919 + i) % 30000 for i in range(tokens)]
        return RouteRequest(prefix=tuple(block_hashes(ids, 16)), block_tokens=16)

    policy.observe(0, CacheUpdate(stored=with_system(0, seed=0).prefix))  # the system prompt
    document_a, document_b = with_system(1024, seed=5), with_system(1024, seed=6)
    policy.started(document_a, 0)  # computes from block 4: 1,024 tokens
    assert policy.queued_tokens(document_b, 0) == 1024  # another document's work
    assert policy.queued_tokens(with_system(2048, seed=5), 0) == 0  # its own document's
    policy.ended(document_a, 0)
    policy.started(with_system(0, seed=0), 1)  # nothing cached on 1: from block 0, 64 tokens
    assert policy.queued_tokens(document_b, 1) == 0  # it waits for the system prompt too


def test_cache_aware_counts_only_the_work_queued_ahead_of_a_requests_own() -> None:
    """A replica prefills first come, first served: a question about the document it started
    first waits for none of what was sent after. On the H200 with the pool off, charging it
    all the queued prefill sent questions to the idle replica, which recomputed their
    whole documents (computed/ideal 1.50, median TTFT 0.67 -> 4.50 s)."""
    policy = CacheAware(2, CONFIG)
    for replica in (0, 1):
        policy.observe(replica, CacheUpdate(uses_pool=False))
    first, second = prompt(4096, seed=7), prompt(4096, seed=8)
    policy.started(first, 0)
    policy.started(second, 0)
    question_first = prompt(4096 + 32, seed=7)
    question_second = prompt(4096 + 32, seed=8)
    assert policy.queued_tokens(question_first, 0) == 0  # `second` is behind its document
    assert policy.queued_tokens(question_second, 0) == 4096  # `first` is ahead of its own
    assert policy.queued_tokens(prompt(64, seed=9), 0) == 8192  # shares nothing: all of it
    # No pool: the idle replica would compute the document again; the busy one computes it.
    assert policy.choose(question_first, loads(2, 0)) == 0
    # Behind another document's 4,096 tokens, it is as quick to compute its own elsewhere.
    assert policy.choose(question_second, loads(2, 0)) == 1
    # `first` answered: nothing is ahead of `second` any more, and work sent now goes last.
    policy.answered(first, 0)
    assert policy.queued_tokens(question_second, 0) == 0
    third = prompt(1024, seed=10)
    policy.started(third, 0)
    assert policy.queued_tokens(prompt(1024 + 32, seed=10), 0) == 4096
    assert policy.queued_tokens(question_second, 0) == 0


def test_short_work_waits_for_at_most_one_step_of_the_queue() -> None:
    """A replica that schedules short work first (it reports its step) puts a question
    about a document it holds into its next step, whatever prefill is queued: the question
    waits about one step, not the queue. With the pool off it stays there (elsewhere the
    document would be computed again); with it on, an idle replica's restore still wins.
    A request with more than the short work limit to compute waits for the whole queue."""
    policy = CacheAware(2, CONFIG)
    step = StepShape(step_tokens=2048, short_work_tokens=128)
    document = prompt(4096, seed=11)
    policy.record(document, 0)
    policy.started(prompt(4096, seed=12), 0)  # another document: 4,096 tokens queued
    question = prompt(4096 + 32, seed=11)
    long_prompt = prompt(1024, seed=13)
    assert policy.queued_tokens(question, 0) == 4096  # no step reported: the whole queue
    for replica in (0, 1):
        policy.observe(replica, CacheUpdate(uses_pool=False, step=step))
    assert policy.queued_tokens(question, 0) == 2048  # 32 tokens left: one step
    assert policy.queued_tokens(long_prompt, 0) == 4096  # 1,024 left: behind all of it
    assert policy.choose(question, loads(1, 0)) == 0  # 4096 - 64 - 2048 beats 0
    for replica in (0, 1):
        policy.observe(replica, CacheUpdate(uses_pool=True, step=step))
    assert policy.choose(question, loads(1, 0)) == 1  # 0.8 x 4096 beats 1984
    with pytest.raises(ValueError, match="short work"):
        StepShape(step_tokens=128, short_work_tokens=256)


def test_the_pool_view_follows_the_pool_size_and_its_clears() -> None:
    policy = CacheAware(2, CONFIG)
    request = prompt(1024)
    policy.record(request, 0)
    assert policy.pool_tokens(request) == 1024
    policy.observe(1, CacheUpdate(pool_blocks=32))  # 2 chunks of 256 tokens
    assert policy.pool_tokens(request) == 512
    policy.observe(1, CacheUpdate(pool_cleared=True))
    assert policy.pool_tokens(request) == 0


def test_make_policy_knows_every_name() -> None:
    for name in ("round-robin", "session", "alternate", "least-load", "cache-aware"):
        assert make_policy(name, 2, CONFIG).name == name
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_policy("random", 2, CONFIG)
    with pytest.raises(ValueError):
        PolicyConfig(pool_credit=1.5)


def naive_gpu_tokens(request: RouteRequest, gpu: set[bytes], computing: list[RouteRequest]) -> int:
    """The definition: leading blocks each in the GPU cache or in a prefix in flight."""
    in_flight = {h for r in computing for h in r.prefix}
    blocks = 0
    for h in request.prefix:
        if h not in gpu and h not in in_flight:
            break
        blocks += 1
    return blocks * request.block_tokens


# Prompts of a few shapes that share prefixes of every length: token i is 0 up to a
# branch point, then the prompt's own.
PROMPT_SHAPES = st.tuples(st.integers(0, 12), st.integers(0, 3), st.integers(0, 12))


def branched(shape: tuple[int, int, int]) -> RouteRequest:
    shared, branch, length = shape
    ids = [0] * min(shared, length) + [branch + 1] * max(0, length - shared)
    return RouteRequest(prefix=tuple(block_hashes(ids, 1)), block_tokens=1)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(PROMPT_SHAPES, min_size=1, max_size=6),
    st.lists(st.integers(0, 5), max_size=8),
    st.lists(st.tuples(st.integers(0, 5), st.integers(0, 12)), max_size=20),
    st.lists(st.integers(0, 5), max_size=4),
)
def test_gpu_tokens_counts_blocks_cached_or_in_flight_as_defined(
    shapes: list[tuple[int, int, int]],
    started: list[int],
    cached: list[tuple[int, int]],
    ended: list[int],
) -> None:
    """Against the definition, with GPU caches holding holes (blocks evicted from a
    chain's middle) and the same prompt in flight more than once."""
    prompts = [branched(s) for s in shapes]
    policy = CacheAware(1, CONFIG)
    flying = [prompts[i % len(prompts)] for i in started]
    for request in flying:
        policy.started(request, 0)
    for i in ended:  # end some of them (each once)
        if i < len(flying):
            policy.ended(flying.pop(i), 0)
    gpu = {
        prompts[p % len(prompts)].prefix[b]
        for p, b in cached
        if b < len(prompts[p % len(prompts)].prefix)
    }
    policy.observe(0, CacheUpdate(snapshot=True, stored=tuple(gpu)))
    for request in prompts:
        assert policy.gpu_tokens(request, 0) == naive_gpu_tokens(request, gpu, flying)


@given(PROMPT_SHAPES, PROMPT_SHAPES)
def test_common_blocks_is_the_shared_run_of_two_chains(
    a: tuple[int, int, int], b: tuple[int, int, int]
) -> None:
    x, y = branched(a).prefix, branched(b).prefix
    run = 0
    while run < min(len(x), len(y)) and x[run] == y[run]:
        run += 1
    assert common_blocks(x, y) == run
