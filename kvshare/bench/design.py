"""The blocked design: blocks run in a fixed order, each with the pool off or on.

OFF-ON-ON-OFF (the default) balances slow drift (thermal, page cache, background load): both
conditions have the same mean position in time, so a linear trend cancels in the comparison.
"""

from __future__ import annotations

from dataclasses import dataclass

OFF = "OFF"
ON = "ON"
CONDITIONS: tuple[str, ...] = (OFF, ON)
DEFAULT_DESIGN = "OFF-ON-ON-OFF"


@dataclass(frozen=True)
class Block:
    index: int  # position in the run, 0-based
    condition: str  # OFF or ON

    def __post_init__(self) -> None:
        if self.index < 0:
            raise ValueError(f"block index must be >= 0, got {self.index}")
        if self.condition not in CONDITIONS:
            raise ValueError(f"block condition must be one of {CONDITIONS}, got {self.condition!r}")

    @property
    def pool_enabled(self) -> bool:
        return self.condition == ON


@dataclass(frozen=True)
class Design:
    blocks: tuple[Block, ...]

    def __post_init__(self) -> None:
        if not self.blocks:
            raise ValueError("a design needs at least one block")
        if [b.index for b in self.blocks] != list(range(len(self.blocks))):
            raise ValueError("block indices must be 0, 1, 2, ... in order")

    @classmethod
    def parse(cls, text: str) -> Design:
        """'OFF-ON-ON-OFF' (case-insensitive, '-' or ',' between blocks) -> Design."""
        names = [name.strip().upper() for name in text.replace(",", "-").split("-")]
        if not text.strip() or any(name not in CONDITIONS for name in names):
            raise ValueError(
                f"design {text!r}: use blocks OFF and ON joined by '-', e.g. {DEFAULT_DESIGN}"
            )
        return cls(tuple(Block(i, name) for i, name in enumerate(names)))

    @property
    def label(self) -> str:
        return "-".join(b.condition for b in self.blocks)

    @classmethod
    def paired(cls, pairs: int) -> Design:
        """OFF-ON-ON-OFF repeated to 2 * pairs blocks: each pair of neighbours (0-1, 2-3, ...)
        is one OFF and one ON block run back to back, and the order alternates within pairs."""
        if pairs < 1:
            raise ValueError(f"pairs must be >= 1, got {pairs}")
        conditions = [c for i in range(pairs) for c in ((OFF, ON) if i % 2 == 0 else (ON, OFF))]
        return cls(tuple(Block(i, c) for i, c in enumerate(conditions)))

    def pairs(self) -> list[tuple[int, int]]:
        """(OFF block, ON block) of each neighbour pair 0-1, 2-3, ... that holds one of each."""
        out = []
        for first, second in zip(self.blocks[::2], self.blocks[1::2]):
            if first.condition != second.condition:
                off, on = (first, second) if first.condition == OFF else (second, first)
                out.append((off.index, on.index))
        return out

    def has_both_conditions(self) -> bool:
        return {b.condition for b in self.blocks} == set(CONDITIONS)
