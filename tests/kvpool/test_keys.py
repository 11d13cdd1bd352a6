from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvshare.kvpool.keys import KEY_BYTES, Namespace, chain_seed, chunk_keys

NAMESPACE = Namespace(
    architecture="LlamaForCausalLM",
    config_digest="cfg-0123",
    weights_digest="random:smollm2-135m:0",
    kv_dtype="bfloat16",
    layout_version=1,
    chunk_tokens=16,
)

# Pinned: these change only if the key format changes, which must bump layout_version.
GOLDEN_NAMESPACE_DIGEST = "f2c98902e30c8b51db1154fd0c10c33a"
GOLDEN_KEYS_OF_RANGE_40 = ["5a778ac9b7bc52ff5e616cf594792ceb", "7e4a55527db014843f0074d9e8f4eecd"]


def test_golden_digest_and_keys_are_stable() -> None:
    assert NAMESPACE.digest().hex() == GOLDEN_NAMESPACE_DIGEST
    assert [key.hex() for key in chunk_keys(NAMESPACE, list(range(40)))] == GOLDEN_KEYS_OF_RANGE_40


def test_key_definition_is_the_documented_chain() -> None:
    import xxhash

    tokens = list(range(100, 148))
    expected = []
    previous = NAMESPACE.digest()
    for start in range(0, 48, 16):
        chunk = np.asarray(tokens[start : start + 16], dtype="<i4").tobytes()
        previous = xxhash.xxh3_128_digest(previous + chunk)
        expected.append(previous)
    assert chunk_keys(NAMESPACE, tokens) == expected
    assert all(len(key) == KEY_BYTES for key in expected)


@pytest.mark.parametrize(
    ("length", "count"), [(0, 0), (15, 0), (16, 1), (17, 1), (31, 1), (32, 2), (600, 37)]
)
def test_only_full_chunks_get_keys(length: int, count: int) -> None:
    assert len(chunk_keys(NAMESPACE, list(range(length)))) == count


def test_chunk_boundaries_are_exact() -> None:
    """Token 15 belongs to chunk 0, token 16 to chunk 1, and the tail to none."""
    tokens = list(range(40))
    base = chunk_keys(NAMESPACE, tokens)
    for position, first_changed in [(0, 0), (15, 0), (16, 1), (31, 1)]:
        changed = list(tokens)
        changed[position] += 1000
        keys = chunk_keys(NAMESPACE, changed)
        assert keys[:first_changed] == base[:first_changed]
        assert all(a != b for a, b in zip(keys[first_changed:], base[first_changed:], strict=True))
    tail_changed = list(tokens)
    tail_changed[32] += 1000
    assert chunk_keys(NAMESPACE, tail_changed) == base


@settings(max_examples=50, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2**31 - 1), min_size=16, max_size=96),
    data=st.data(),
)
def test_changing_a_token_changes_its_chunk_key_and_all_later_ones(
    tokens: list[int], data: st.DataObject
) -> None:
    position = data.draw(st.integers(0, len(tokens) - 1))
    replacement = data.draw(st.integers(0, 2**31 - 1).filter(lambda t: t != tokens[position]))
    changed = list(tokens)
    changed[position] = replacement
    before, after = chunk_keys(NAMESPACE, tokens), chunk_keys(NAMESPACE, changed)
    chunk = position // NAMESPACE.chunk_tokens
    assert after[:chunk] == before[:chunk]
    assert all(a != b for a, b in zip(after[chunk:], before[chunk:], strict=True))


@settings(max_examples=50, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2**31 - 1), min_size=32, max_size=96),
    data=st.data(),
    salt=st.sampled_from([None, "tenant-a"]),
)
def test_keys_chained_on_from_a_chunk_are_the_keys_of_the_whole_prompt(
    tokens: list[int], data: st.DataObject, salt: str | None
) -> None:
    """A restore keys its first chunks, then the rest from the last key it has: the same
    keys as the whole prompt keyed at once."""
    chunk = NAMESPACE.chunk_tokens
    split = data.draw(st.integers(1, len(tokens) // chunk - 1)) * chunk
    first = chunk_keys(NAMESPACE, tokens[:split], salt)
    rest = chunk_keys(NAMESPACE, np.array(tokens[split:]), salt, previous=first[-1])
    assert first + rest == chunk_keys(NAMESPACE, tokens, salt)


def test_every_namespace_field_separates_keys() -> None:
    tokens = list(range(64))
    variants = [
        NAMESPACE,
        dataclasses.replace(NAMESPACE, architecture="Qwen3ForCausalLM"),
        dataclasses.replace(NAMESPACE, config_digest="cfg-other"),
        dataclasses.replace(NAMESPACE, weights_digest="random:smollm2-135m:1"),
        dataclasses.replace(NAMESPACE, kv_dtype="float16"),
        dataclasses.replace(NAMESPACE, layout_version=2),
        dataclasses.replace(NAMESPACE, tp_size=2),
        dataclasses.replace(NAMESPACE, tp_size=2, tp_rank=1),
        dataclasses.replace(NAMESPACE, cache_salt="tenant-a"),
        dataclasses.replace(NAMESPACE, cache_salt="tenant-b"),
    ]
    digests = {ns.digest() for ns in variants}
    assert len(digests) == len(variants)
    all_keys = [key for ns in variants for key in chunk_keys(ns, tokens)]
    assert len(set(all_keys)) == len(all_keys)


def test_chunk_size_is_part_of_the_namespace() -> None:
    wide = dataclasses.replace(NAMESPACE, chunk_tokens=32)
    tokens = list(range(64))
    assert not set(chunk_keys(wide, tokens)) & set(chunk_keys(NAMESPACE, tokens))


def test_list_tuple_and_arrays_of_any_int_dtype_agree() -> None:
    tokens = list(range(1000, 1064))
    expected = chunk_keys(NAMESPACE, tokens)
    assert chunk_keys(NAMESPACE, tuple(tokens)) == expected
    for dtype in (np.int32, np.int64, np.uint32):
        assert chunk_keys(NAMESPACE, np.asarray(tokens, dtype=dtype)) == expected


@pytest.mark.parametrize(
    "tokens",
    [[-1] * 16, [2**31] * 16, np.zeros((2, 16), dtype=np.int64), np.zeros(16, dtype=np.float32)],
)
def test_rejects_tokens_that_are_not_int32_ids(tokens: object) -> None:
    with pytest.raises(ValueError):
        chunk_keys(NAMESPACE, tokens)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "change",
    [
        {"architecture": ""},
        {"kv_dtype": ""},
        {"chunk_tokens": 0},
        {"layout_version": -1},
        {"tp_size": 0},
        {"tp_rank": 1},
        {"tp_rank": -1},
        {"chunk_tokens": 16.0},
        {"cache_salt": None},
    ],
)
def test_namespace_validation(change: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        dataclasses.replace(NAMESPACE, **change)


_PRINT_KEYS = """
from kvshare.kvpool.keys import Namespace, chunk_keys
ns = Namespace("LlamaForCausalLM", "cfg-0123", "random:smollm2-135m:0", "bfloat16", 1, 16,
               cache_salt="s")
print(ns.digest().hex(), *[k.hex() for k in chunk_keys(ns, list(range(64)))])
"""


def test_processes_with_different_hash_seeds_agree() -> None:
    """docs/architecture.md F4: a per-process hash seed would make replicas never share a hit."""
    outputs = set()
    for seed in ("1", "2", "random"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        result = subprocess.run(
            [sys.executable, "-c", _PRINT_KEYS], env=env, capture_output=True, text=True, check=True
        )
        outputs.add(result.stdout)
    assert len(outputs) == 1
    assert len(outputs.pop().split()) == 5


def test_256k_tokens_key_in_a_few_milliseconds() -> None:
    namespace = dataclasses.replace(NAMESPACE, chunk_tokens=256)
    tokens = np.random.default_rng(0).integers(0, 150_000, 256 * 1024)
    chunk_keys(namespace, tokens)
    timings = []
    for _ in range(5):
        start = time.perf_counter()
        keys = chunk_keys(namespace, tokens)
        timings.append(time.perf_counter() - start)
    assert len(keys) == 1024
    print(f"chunk_keys: 262,144 tokens -> 1,024 keys in {min(timings) * 1e3:.2f} ms")
    assert min(timings) < 0.05


SALTS = (None, "tenant-a", "tenant-b", "tenant-a ", "é")


def test_different_request_salts_share_no_key_at_any_chunk() -> None:
    tokens = list(range(80))  # 5 chunks
    chains = [chunk_keys(NAMESPACE, tokens, salt) for salt in SALTS]
    assert all(len(chain) == 5 for chain in chains)
    every_key = [key for chain in chains for key in chain]
    assert len(set(every_key)) == len(every_key)
    assert chunk_keys(NAMESPACE, tokens, "tenant-a") == chains[1]  # the same salt agrees


def test_no_request_salt_keeps_the_namespace_chain_exactly() -> None:
    """Regression guard: unsalted keys are the deployment's keys of before salts existed."""
    assert chain_seed(NAMESPACE) == NAMESPACE.digest()
    keys = [key.hex() for key in chunk_keys(NAMESPACE, list(range(40)), cache_salt=None)]
    assert keys == GOLDEN_KEYS_OF_RANGE_40


def test_a_request_salt_is_separate_from_the_namespace_salt() -> None:
    """A request salt never lands on the chain of a deployment salted with the same text."""
    tokens = list(range(32))
    salted_deployment = dataclasses.replace(NAMESPACE, cache_salt="tenant-a")
    assert not set(chunk_keys(NAMESPACE, tokens, "tenant-a")) & set(
        chunk_keys(salted_deployment, tokens)
    )


@pytest.mark.parametrize("salt", ["", 7, b"tenant"])
def test_malformed_request_salts_are_refused(salt: object) -> None:
    with pytest.raises(ValueError, match="cache_salt"):
        chunk_keys(NAMESPACE, list(range(32)), salt)  # type: ignore[arg-type]
