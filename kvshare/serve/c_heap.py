"""How a serving process keeps the C heap it frees: for the next request's buffers, not
handed back to the kernel.

A long prompt passes through buffers of a megabyte and more that live for milliseconds:
the body as read, its text, the token array's pieces, byte masks and ids, the block
hashes, the restore's tables. glibc serves a request of 128 KiB or more with fresh mmap'd
memory (it raises that bar to the size of a freed mmap'd block, so a buffer of the same
size is mapped afresh each time) and hands freed memory at a heap's top back to the kernel
once there is 2x the bar of it. Either way each request faults its buffers' pages in again,
zeroed page by page by the kernel: four 1 MiB arrays made and dropped cost ~1,000 page
faults a round on a thread, none with `keep_freed_heap`; 131,072 token ids read on two
threads took 4.3 ms, 2.4 ms with it (2-vCPU machine).

`keep_freed_heap` raises the mmap bar to glibc's own ceiling for it and lets each heap keep
up to TRIM_THRESHOLD_BYTES free at its top: memory a process touched for one request stays
for the next, a bounded amount a heap (the arenas are per thread, a few in a replica).
Outside glibc it changes nothing.
"""

from __future__ import annotations

import ctypes
import logging

_log = logging.getLogger(__name__)

# mallopt's parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

# Requests at least this large still get their own mapping: glibc's ceiling for the
# dynamic mmap bar on 64-bit (4 MiB x sizeof(long)), far above a 256k-token prompt's buffers.
MMAP_THRESHOLD_BYTES = 32 << 20
# Free memory a heap keeps at its top before it gives the rest back.
TRIM_THRESHOLD_BYTES = 64 << 20


def keep_freed_heap() -> bool:
    """Set glibc's malloc to keep freed memory for reuse (see the module's doc); True when
    it took both settings, False where there is no glibc mallopt (the process runs on as
    it was)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        _log.debug("no mallopt in this process's C library: the C heap keeps its defaults")
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    took = [
        mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES),
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES),
    ]
    if took != [1, 1]:
        _log.debug("mallopt refused the C heap's settings (%s)", took)
    return took == [1, 1]
