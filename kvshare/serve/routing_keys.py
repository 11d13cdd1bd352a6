"""The router's view of a prompt: chained block hashes of its token ids.

Token ids come from `kvshare.serve.prompts`, the code the replicas run, with the model's
own tokenizer and chat template (docs/architecture.md F12), and the hashes are the engine's GPU
prefix-cache hashes (`prompt_block_hashes`), so a router block and an engine block name the same
prefix. A model without a tokenizer (`shape:NAME`) has exact keys for token-id prompts;
for text (which such a replica refuses anyway) and for chat messages the router falls back
to hashing the raw UTF-8 text, or the messages as one JSON line each, in blocks of
4 x block_tokens bytes (about block_tokens tokens of English).

A request's `cache_salt` seeds its chain as it seeds the engine's, so the cache-aware
index never scores one tenant's request against another tenant's prefixes (the replica
would not hit them, and routing on them would leak which prompts were sent). A malformed
salt gives no keys: the replica answers its 400.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import xxhash

from kvshare.engine.block_manager import check_cache_salt, prompt_block_hashes, salted_root
from kvshare.models.tokenizer import Tokenizer
from kvshare.serve.prompts import PromptError, TokenIds, request_prompt_ids, tokenizes_text

BYTES_PER_TOKEN = 4  # the fallback's estimate
_BYTE_ROOT = b"kvshare-router-bytes"


def byte_block_hashes(data: bytes, block_bytes: int, parent: bytes = _BYTE_ROOT) -> list[bytes]:
    out = []
    for i in range(len(data) // block_bytes):
        parent = xxhash.xxh3_128_digest(parent + data[i * block_bytes : (i + 1) * block_bytes])
        out.append(parent)
    return out


@dataclass(frozen=True)
class Prefix:
    hashes: tuple[bytes, ...] = ()
    num_tokens: int = 0  # the prompt's exact token count; 0 when unknown (fallback or none)


class RoutingKeys:
    def __init__(self, tokenizer: Tokenizer | None, block_tokens: int) -> None:
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
        self.tokenizer = tokenizer
        self.block_tokens = block_tokens
        # Names the tokenizer to replicas that are sent its ids (kvshare.serve.packed_request).
        self.tokenizer_digest = tokenizer.digest if tokenizer is not None else ""

    def prefix_of(self, path: str, body: object) -> Prefix:
        """The prefix of a parsed request body; empty when it has no usable prompt (the
        replica will answer its 4xx)."""
        return self.prompt_of(path, body)[0]

    def prompt_of(self, path: str, body: object) -> tuple[Prefix, TokenIds | None]:
        """The prefix of a parsed request body, and the ids the tokenizer made of its text
        prompt or chat messages (None: it made none, the prompt was ids or unusable)."""
        if not isinstance(body, dict):
            return Prefix(), None
        try:
            cache_salt = check_cache_salt(body.get("cache_salt"))
        except ValueError:
            return Prefix(), None
        try:
            ids = request_prompt_ids(self.tokenizer, path, body)
        except PromptError:
            fallback = (
                self._fallback(path, body, cache_salt) if self.tokenizer is None else Prefix()
            )
            return fallback, None
        prefix = Prefix(tuple(prompt_block_hashes(ids, self.block_tokens, cache_salt)), len(ids))
        return prefix, ids if tokenizes_text(path, body) else None

    def _fallback(self, path: str, body: dict[str, object], cache_salt: str | None) -> Prefix:
        if path.endswith("/chat/completions"):
            messages = body.get("messages")
            if not isinstance(messages, list):
                return Prefix()
            # One line per message: a longer conversation's text extends a shorter one's.
            text = "".join(
                json.dumps(m, sort_keys=True, ensure_ascii=False) + "\n" for m in messages
            )
        else:
            prompt = body.get("prompt")
            prompt = prompt[0] if isinstance(prompt, list) and len(prompt) == 1 else prompt
            if not isinstance(prompt, str):
                return Prefix()
            text = prompt
        hashes = byte_block_hashes(
            text.encode(), BYTES_PER_TOKEN * self.block_tokens, salted_root(_BYTE_ROOT, cache_salt)
        )
        return Prefix(tuple(hashes))
