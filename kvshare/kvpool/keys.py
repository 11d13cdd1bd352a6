"""Content-addressed chunk keys.

A prompt is cut into chunks of `chunk_tokens` tokens; only full chunks get keys.
Keys form a hash chain, so a key names a chunk *and* everything before it:

    key[-1] = chain_seed(namespace, cache_salt)   # namespace.digest() without a salt
    key[i]  = xxh3_128(key[i-1] || token_ids[i*C:(i+1)*C] as little-endian int32)

The hash is xxh3-128, never Python's `hash()` (seeded per process: replicas would
never agree, docs/architecture.md F4). The namespace holds everything that changes the bytes
of a page, so two namespaces never share a page (docs/architecture.md F6).

A request's `cache_salt` (a tenant's secret, None for none) is mixed into the seed on
top of the namespace, so tenants never share a page and cannot probe each other's
prompts through hits; requests without one keep the namespace's keys unchanged.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import msgpack
import numpy as np
import xxhash

KEY_BYTES = 16

# Domain separation: a namespace digest can never equal a chunk key by construction
# of its input, whatever the namespace fields hold.
_NAMESPACE_DOMAIN = b"kvshare.kvpool.namespace.v1"
# Likewise a salted seed: its input starts with its own domain.
_REQUEST_SALT_DOMAIN = b"kvshare.kvpool.request_salt.v1"

_INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class Namespace:
    """Everything that changes the bytes of a page; part of every key.

    `weights_digest` is a digest of the weights, or "random:<shape>:<seed>" for random
    weights. `cache_salt` is a salt of the whole deployment (every request); a request's
    own salt is mixed in on top by `chain_seed`.
    """

    architecture: str
    config_digest: str
    weights_digest: str
    kv_dtype: str
    layout_version: int
    chunk_tokens: int
    tp_rank: int = 0
    tp_size: int = 1
    cache_salt: str = ""

    def __post_init__(self) -> None:
        for name in ("architecture", "config_digest", "weights_digest", "kv_dtype"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"Namespace.{name} must be a non-empty string, got {value!r}")
        if not isinstance(self.cache_salt, str):
            raise ValueError(f"Namespace.cache_salt must be a string, got {self.cache_salt!r}")
        for name in ("layout_version", "chunk_tokens", "tp_rank", "tp_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"Namespace.{name} must be an int, got {value!r}")
        if self.layout_version < 0:
            raise ValueError(f"Namespace.layout_version must be >= 0, got {self.layout_version}")
        if self.chunk_tokens <= 0:
            raise ValueError(f"Namespace.chunk_tokens must be > 0, got {self.chunk_tokens}")
        if self.tp_size < 1:
            raise ValueError(f"Namespace.tp_size must be >= 1, got {self.tp_size}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(
                f"Namespace.tp_rank must be in [0, tp_size={self.tp_size}), got {self.tp_rank}"
            )

    def digest(self) -> bytes:
        """Return the 16-byte xxh3-128 digest of a canonical encoding of every field.

        Canonical: msgpack of [name, value] pairs sorted by field name, so the digest
        depends on field values only, never on declaration order or process state.
        """
        fields = sorted((f.name, getattr(self, f.name)) for f in dataclasses.fields(self))
        encoded = msgpack.packb([list(pair) for pair in fields], use_bin_type=True)
        return xxhash.xxh3_128_digest(_NAMESPACE_DOMAIN + encoded)


def chain_seed(namespace: Namespace, cache_salt: str | None = None) -> bytes:
    """key[-1] of a request's chain: the namespace's digest, or, for a salted request, a
    digest of it and the salt (a non-empty string; the digest has a fixed length, so
    the encoding is unambiguous)."""
    if cache_salt is None:
        return namespace.digest()
    if not isinstance(cache_salt, str) or not cache_salt:
        raise ValueError(f"cache_salt must be None or a non-empty string, got {cache_salt!r}")
    return xxhash.xxh3_128_digest(_REQUEST_SALT_DOMAIN + namespace.digest() + cache_salt.encode())


def chunk_keys(
    namespace: Namespace,
    token_ids: Sequence[int] | np.ndarray,
    cache_salt: str | None = None,
    *,
    previous: bytes | None = None,
) -> list[bytes]:
    """Return one 16-byte key per *full* chunk of `token_ids` (the tail is not keyed),
    chained from `chain_seed(namespace, cache_salt)`; with `previous` (the key of the
    chunk before token_ids[0]), chained on from there: the keys of a prompt's later chunks.

    Token ids must fit in int32 (they are hashed as little-endian int32).
    """
    if isinstance(token_ids, np.ndarray) and (
        token_ids.ndim != 1 or token_ids.dtype.kind not in "iu"
    ):
        raise ValueError(
            f"token_ids must be a 1-D integer array, got {token_ids.dtype} {token_ids.shape}"
        )
    seed = chain_seed(namespace, cache_salt) if previous is None else previous
    chunk = namespace.chunk_tokens
    full_chunks = len(token_ids) // chunk
    if full_chunks == 0:
        return []
    keyed = _as_int_array(token_ids, full_chunks * chunk)
    if keyed.min() < 0 or keyed.max() > _INT32_MAX:
        raise ValueError("token ids must be in [0, 2**31 - 1] to be hashed as int32")
    data = keyed.astype("<i4", copy=False).tobytes()
    chunk_bytes = chunk * 4
    digest = xxhash.xxh3_128_digest
    keys: list[bytes] = []
    previous = seed
    for start in range(0, len(data), chunk_bytes):
        previous = digest(previous + data[start : start + chunk_bytes])
        keys.append(previous)
    return keys


def _as_int_array(token_ids: Sequence[int] | np.ndarray, count: int) -> np.ndarray:
    """The first `count` token ids as an integer array (fromiter: 2x faster than asarray
    on a list; over islice, which copies no list slice first)."""
    if isinstance(token_ids, np.ndarray):
        return token_ids[:count]
    return np.fromiter(itertools.islice(token_ids, count), dtype=np.int64, count=count)
