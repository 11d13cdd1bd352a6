"""The router keys a request on exactly the token ids the replica will run (docs/architecture.md F12)."""

from __future__ import annotations

import pytest

from kvshare.engine.block_manager import block_hashes
from kvshare.engine.sampling_params import SamplingParams
from kvshare.engine.sequence import Sequence
from kvshare.models.loader import load_tokenizer
from kvshare.models.tokenizer import Tokenizer
from kvshare.serve.policies import CacheAware, PolicyConfig, RouteRequest
from kvshare.serve.protocol import ModelInfo, parse_generate
from kvshare.serve.routing_keys import Prefix, RoutingKeys

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
TURN1 = [
    {"role": "system", "content": "You are a terse geography tutor. " * 6},
    {"role": "user", "content": "Name three rivers of Europe, with a line about each."},
]
TURN2 = [
    *TURN1,
    {"role": "assistant", "content": "Danube, Rhine, Loire: long, busy, royal."},
    {"role": "user", "content": "Which is the longest, and by how much? Explain briefly."},
]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    loaded = load_tokenizer("smollm2-135m")
    assert loaded is not None
    return loaded


def test_router_keys_are_the_replicas_prompt_ids(tokenizer: Tokenizer) -> None:
    keys = RoutingKeys(tokenizer, 16)
    model = ModelInfo("m", tokenizer, 8192, tokenizer.vocab_size, "float32")
    for path, body in (
        (CHAT, {"model": "m", "messages": TURN2}),
        (COMPLETIONS, {"model": "m", "prompt": "The river Danube " * 20}),
    ):
        served = parse_generate(body, path == CHAT, model).prompt_token_ids
        prefix = keys.prefix_of(path, body)
        assert prefix.num_tokens == len(served)
        assert prefix.hashes == tuple(block_hashes(list(served), 16))
    # The chat template's generation prompt is part of both.
    assert tokenizer.decode(list(served)[-5:], skip_special_tokens=False)


def test_a_later_turn_extends_the_earlier_turns_keys(tokenizer: Tokenizer) -> None:
    keys = RoutingKeys(tokenizer, 16)
    first, second = (
        keys.prefix_of(CHAT, {"messages": TURN1}),
        keys.prefix_of(CHAT, {"messages": TURN2}),
    )
    # SmolLM2's template renders turn 1 (generation prompt included) as a prefix of turn 2.
    ids1, ids2 = tokenizer.encode_chat(TURN1), tokenizer.encode_chat(TURN2)
    assert ids2[: len(ids1)] == ids1
    assert len(first.hashes) >= 4 and second.hashes[: len(first.hashes)] == first.hashes
    assert len(second.hashes) > len(first.hashes)


def test_token_id_prompts_are_exact_without_a_tokenizer() -> None:
    keys = RoutingKeys(None, 16)
    ids = list(range(5, 105))
    prefix = keys.prefix_of(COMPLETIONS, {"prompt": [ids]})
    assert prefix.num_tokens == 100 and prefix.hashes == tuple(block_hashes(ids, 16))


def test_text_falls_back_to_byte_blocks_that_keep_the_prefix_property() -> None:
    keys = RoutingKeys(None, 16)
    first, second = (
        keys.prefix_of(CHAT, {"messages": TURN1}),
        keys.prefix_of(CHAT, {"messages": TURN2}),
    )
    assert first.num_tokens == 0 and len(first.hashes) >= 2
    assert second.hashes[: len(first.hashes)] == first.hashes
    text = keys.prefix_of(COMPLETIONS, {"prompt": "x" * 640})
    assert len(text.hashes) == 10  # 64 bytes a block


def test_unusable_bodies_have_no_key(tokenizer: Tokenizer) -> None:
    keys = RoutingKeys(tokenizer, 16)
    for path, body in (
        (CHAT, {"messages": []}),
        (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}),
        (COMPLETIONS, {"prompt": 3}),
        (COMPLETIONS, ["not", "an", "object"]),
    ):
        assert keys.prefix_of(path, body).hashes == ()


def test_tokenizer_sources() -> None:
    assert load_tokenizer(None) is None
    assert load_tokenizer("shape:tiny-llama") is None
    with pytest.raises(FileNotFoundError):
        load_tokenizer("no-such-model")


def test_the_router_keys_a_salted_request_as_the_engine_hashes_it() -> None:
    keys = RoutingKeys(None, 16)
    ids = list(range(5, 105))
    for salt in (None, "tenant-a"):
        body = {"prompt": ids} if salt is None else {"prompt": ids, "cache_salt": salt}
        seq = Sequence("r", list(ids), SamplingParams(), cache_salt=salt)
        seq.update_block_hashes(16)
        assert keys.prefix_of(COMPLETIONS, body).hashes == tuple(seq.block_hashes)


def test_salts_separate_routing_keys_and_cache_aware_scores() -> None:
    """Another tenant's prefix neither raises a request's score nor is revealed by it."""
    keys = RoutingKeys(None, 16)
    ids = list(range(5, 305))
    prefixes = {
        salt: keys.prefix_of(COMPLETIONS, {"prompt": ids, "cache_salt": salt})
        for salt in ("tenant-a", "tenant-b")
    }
    prefixes[None] = keys.prefix_of(COMPLETIONS, {"prompt": ids})
    every_hash = [h for p in prefixes.values() for h in p.hashes]
    assert len(every_hash) == 3 * 18 and len(set(every_hash)) == len(every_hash)
    text = [
        keys.prefix_of(COMPLETIONS, {"prompt": "x" * 640, "cache_salt": s}).hashes
        for s in ("tenant-a", "tenant-b")
    ]
    assert len(text[0]) == 10 and not set(text[0]) & set(text[1])  # the byte fallback too

    policy = CacheAware(2, PolicyConfig(chunk_tokens=256))

    def route(salt: str | None) -> RouteRequest:
        return RouteRequest(prefix=prefixes[salt].hashes, block_tokens=16)

    policy.record(route("tenant-a"), 0)
    assert (
        policy.gpu_tokens(route("tenant-a"), 0) == 288
        and policy.pool_tokens(route("tenant-a")) == 256
    )
    for other in ("tenant-b", None):
        assert policy.gpu_tokens(route(other), 0) == 0 and policy.pool_tokens(route(other)) == 0


@pytest.mark.parametrize("salt", ["", 3, ["a"], "x" * 1025])
def test_a_malformed_salt_has_no_routing_key(salt: object) -> None:
    body = {"prompt": list(range(64)), "cache_salt": salt}
    assert RoutingKeys(None, 16).prefix_of(COMPLETIONS, body) == Prefix()
