"""The ids of recently encoded long texts, for encoding a text that extends one of them.

Each turn of a chat sends the whole conversation again, and its rendered text extends the
last turn's: at 128k tokens the router (and a replica sent the request directly) would
tokenize ~128k tokens of it again every turn. A tokenizer that cuts safely
(kvshare.models.text_pieces) keeps, for each long text it encoded, the ids of the text up to
its last safe cut; a later text that starts with that prefix and has a space right after it
(so the cut is safe in the new text too) takes those ids and encodes only the rest.

Invariants:
- An entry is a prefix `text[:cut]` of an encoded text, `cut` a safe cut of it (a space
  after a non-space follows), and the ids the tokenizer gives that prefix. It is used only
  for a text that starts with it and has a space at `cut`: then `cut` is a safe cut of that
  text as well, and the ids of its two sides together are the ids of the whole.
- Entries are kept per scope (a request's `cache_salt`): a tenant's text never finds
  another tenant's prefix, so encoding time says nothing across tenants.
- At most `max_bytes` of texts and ids are kept (one byte a character, four an id), the
  least recently used entry goes first. Thread-safe: requests are tokenized on worker threads.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

# Texts shorter than this are not kept: encoding them again costs a few milliseconds at most.
MIN_CHARS = 16 << 10
# Entries are found by their first characters (then compared whole).
PROBE_CHARS = 1 << 10
_ID_BYTES = 4


@dataclass(frozen=True, eq=False)  # one entry is itself only: buckets remove by identity
class _Entry:
    scope: str
    text: str  # an encoded text up to a safe cut of it
    ids: np.ndarray  # int32: the ids of `text`

    @property
    def nbytes(self) -> int:
        return len(self.text) + _ID_BYTES * len(self.ids)


class EncodedPrefixes:
    def __init__(self, max_bytes: int = 64 << 20) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self.bytes = 0
        self.hits = 0  # texts that found a prefix
        self._lock = threading.Lock()
        self._by_probe: dict[tuple[str, str], list[_Entry]] = {}
        self._recent: OrderedDict[int, _Entry] = OrderedDict()  # by id(entry), oldest first

    @staticmethod
    def takes(text: str) -> bool:
        """Whether `text` is long enough to be looked up and kept."""
        return len(text) >= MIN_CHARS

    def longest(self, text: str, scope: str) -> tuple[int, list[int]]:
        """The longest kept prefix `text` extends at a safe cut: its length in characters
        and its ids ((0, []) when none)."""
        if not self.takes(text):
            return 0, []
        with self._lock:
            candidates = list(self._by_probe.get((scope, text[:PROBE_CHARS]), ()))
        best: _Entry | None = None
        for entry in candidates:
            cut = len(entry.text)
            if cut < len(text) and text[cut] == " " and text.startswith(entry.text):
                best = entry if best is None or cut > len(best.text) else best
        if best is None:
            return 0, []
        with self._lock:
            self.hits += 1
            if id(best) in self._recent:
                self._recent.move_to_end(id(best))
        return len(best.text), best.ids.tolist()

    def keep(self, text: str, ids: list[int], scope: str) -> None:
        """Keep `text` (an encoded text up to a safe cut of it) and its ids."""
        if not self.takes(text) or len(text) + _ID_BYTES * len(ids) > self.max_bytes:
            return  # before the ids become an array: ~2 ms at 140k ids on 2 cores
        entry = _Entry(scope, text, np.asarray(ids, dtype=np.int32))
        with self._lock:
            bucket = self._by_probe.setdefault((scope, text[:PROBE_CHARS]), [])
            for old in [e for e in bucket if e.text == text]:
                self._drop(old)
            bucket.append(entry)
            self._recent[id(entry)] = entry
            self.bytes += entry.nbytes
            while self.bytes > self.max_bytes:
                self._drop(next(iter(self._recent.values())))

    def _drop(self, entry: _Entry) -> None:
        key = (entry.scope, entry.text[:PROBE_CHARS])
        bucket = self._by_probe[key]
        bucket.remove(entry)
        if not bucket:
            del self._by_probe[key]
        del self._recent[id(entry)]
        self.bytes -= entry.nbytes
