"""Deliberate faults, so the checks and tests can prove they catch what each one breaks.

Production code never builds a `FaultInjection`: the pool's connector and transfers take
one as an optional constructor argument whose default, None, means no fault. Only
`kvshare.validate`, the tests, and the hidden `--unsafe-*` flags of `kvshare serve` (the way
`kvshare validate regression` breaks a served replica) build one; the vLLM connector, which
vLLM constructs, takes one from its config's `faults` entry (`faults_from_config`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal

BreakOrder = Literal["", "store", "load", "load_target", "load_slots"]
# The broken variants, for test-only flags.
BREAK_ORDERS = ("store", "load", "load_target", "load_slots")


@dataclass(frozen=True)
class FaultInjection:
    """Each field breaks one guarantee; the default of each is "not broken".

    - `break_order`: drop the stream dependency of stores ("store": the copy may read the
      blocks before the compute wrote them) or loads ("load": compute may read the blocks
      before the copy wrote them, and the load reports done at once; "load_target": the
      copy may write its target blocks or state row before compute work issued earlier on
      them, such as zeroing a fresh state slot, has run, which then overwrites the copy;
      "load_slots": compute may read restored cache slots before their copies ended, the
      waits a load owes the compute side (whole, or per group of layers) being dropped,
      while the load itself still reports done only once its copies are).
    - `load_delay`: seconds every load copy waits first (on CUDA as GPU sleep cycles), so a
      broken order shows as wrong bytes.
    - `skip_checksums`: a restore whose header or checksums disagree is kept.
    - `skip_state_restore`: hybrid models restore the KV but not the recurrent state.
    - `keep_lost_lease_restores`: a restore is kept although its lease was lost.
    """

    break_order: BreakOrder = ""
    load_delay: float = 0.0
    skip_checksums: bool = False
    skip_state_restore: bool = False
    keep_lost_lease_restores: bool = False

    def __post_init__(self) -> None:
        if self.break_order not in ("", *BREAK_ORDERS):
            raise ValueError(f"unknown break_order {self.break_order!r}")
        if self.load_delay < 0:
            raise ValueError(f"load_delay must be >= 0, got {self.load_delay}")


def injected(faults: FaultInjection) -> FaultInjection | None:
    """`faults`, or None when it breaks nothing (None is what production passes)."""
    return None if faults == FaultInjection() else faults


def breaks(faults: FaultInjection | None, order: BreakOrder) -> bool:
    """Whether `faults` drops the stream dependency of `order` ("store" or "load")."""
    return faults is not None and faults.break_order == order


def injected_delay(faults: FaultInjection | None) -> float:
    """Seconds every load copy waits first (0: none)."""
    return 0.0 if faults is None else faults.load_delay


def faults_from_config(
    config: Mapping[str, Any] | None, honoured: frozenset[str]
) -> FaultInjection | None:
    """The faults a JSON config entry asks for (None: none). A component built by another
    engine (no constructor of ours to pass an object to) names the switches it implements
    in `honoured`; asking for any other is a ValueError, never a silent no-op, so a broken
    variant cannot pass its test by not being broken."""
    if not config:
        return None
    known = {f.name for f in fields(FaultInjection)}
    unknown = sorted(set(config) - known)
    unsupported = sorted(set(config) & known - honoured)
    if unknown or unsupported:
        raise ValueError(
            f"faults: unknown {unknown}, not implemented here {unsupported}; "
            f"this component honours {sorted(honoured)}"
        )
    return injected(FaultInjection(**config))
