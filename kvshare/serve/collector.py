"""How a serving process runs Python's cyclic collector: out of the way of first tokens.

A replica's engine thread issues a restore's copies and its step's kernels from Python, so
every pause of the collector on the way to a first token delays it by as much. Two kinds:

- Full collections walk everything alive. What a process built to start (torch, Triton's
  kernels, the model, the app) lives as long as it does: `settle_startup` freezes it out of
  the walks (gc.freeze). A full collection in a CPU replica of a tiny model (320,000
  objects) took 53-69 ms before, under 0.01 ms after (2-vCPU machine).
- Young collections come every YOUNG_OBJECTS container allocations (CPython's default:
  700), and each walks the young requests' token lists. A 261,888-token hit allocates
  ~3,500 (the pool's page references, the load's plan, msgpack rows): 5 collections inside
  it at the default, sometimes one of generation 1 (1-5 ms on a 2-vCPU machine). With the
  threshold raised a lone request runs none, and `collect_idle` (the engine thread, when
  its last request finished) clears the young objects while nothing waits; under steady
  load a collection still comes every YOUNG_OBJECTS allocations.
"""

from __future__ import annotations

import gc

# Container allocations between young collections: several long-prefix hits' worth.
YOUNG_OBJECTS = 50_000


def settle_startup() -> None:
    """Freeze every object alive now and raise the young-collection threshold; call once,
    when the process has built what it serves with."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_OBJECTS, older, oldest)


def release_at_exit() -> None:
    """Unfreeze before the interpreter exits: frozen objects outlive its last collection,
    and Triton's bindings report them as leaked."""
    gc.unfreeze()


def collect_idle() -> None:
    """Collect the young generations (what requests left in cycles), between requests."""
    gc.collect(1)
