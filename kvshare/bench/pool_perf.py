"""Pool bandwidth: store a long prefix into the pool, restore it into paged blocks, time both.

Model-free: a KV cache with a shape preset's layout is filled with a pattern, stored
through the real connector and daemon, poisoned, restored (global layers + the sliding
window, as the engine restores a prefix), and checked slot by slot against per-block
checksums taken before. Reported as ratios to pinned memcpy measured in the same run.
"""

from __future__ import annotations

import time
import uuid

import torch

from kvshare.engine.block_manager import BlockManager
from kvshare.engine.connector import KVCacheLayout, PagedKVCache
from kvshare.engine.sliding import SlidingBlocks
from kvshare.kvpool.client import PoolClient
from kvshare.kvpool.connector import ConnectorOptions, PoolConnector
from kvshare.kvpool.keys import Namespace
from kvshare.kvpool.layout import LAYOUT_VERSION
from kvshare.models.presets import shape_preset
from kvshare.spec import DEFAULT_CHUNK_TOKENS


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _block_sums(kv: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """int64 sum per (slot, K|V, block): a cheap fingerprint of every block of every slot."""
    as_int = {2: torch.int16, 4: torch.int32}[kv.element_size()]
    sums = [
        kv[slot].view(as_int).sum(dim=(2, 3, 4), dtype=torch.int64) for slot in range(kv.shape[0])
    ]
    return torch.stack(sums).index_select(2, blocks)


def measure_pool_bandwidth(
    pool: str,
    shape: str = "gemma3-27b",
    num_tokens: int = 131072,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    block_size: int = 16,
    device: str = "cuda",
) -> dict[str, float]:
    config = shape_preset(shape)
    dev = torch.device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    num_blocks = num_tokens // block_size + 1
    # A block's sliding block has its id (null: the sliding tensor's extra last block).
    layout = KVCacheLayout.allocate(config, num_blocks, block_size, dtype, dev, num_blocks + 1)
    caches = [layout.kv] + ([] if layout.sliding_kv is None else [layout.sliding_kv])
    for kv in caches:
        for slot in range(kv.shape[0]):
            kv[slot].normal_()
    blocks = BlockManager(num_blocks, block_size)
    sliding = None
    if config.sliding_window is not None:
        sliding = SlidingBlocks(num_blocks, block_size, config.sliding_window, chunk_tokens)
    namespace = Namespace(
        architecture=config.architecture,
        config_digest=config.digest(),
        weights_digest=f"pool-perf:{uuid.uuid4().hex}",
        kv_dtype=str(dtype),
        layout_version=LAYOUT_VERSION,
        chunk_tokens=chunk_tokens,
    )
    connector = PoolConnector(
        PoolClient(pool, timeout=30.0), namespace, ConnectorOptions(chunk_tokens=chunk_tokens)
    )
    connector.bind(PagedKVCache(layout, blocks, sliding=sliding))
    start = time.perf_counter()
    if connector.registration is not None:
        connector.registration.wait()
    register_s = time.perf_counter() - start

    tokens = [(i * 7 + 3) % 30000 for i in range(num_tokens + 1)]
    table = blocks.allocate(blocks.blocks_needed(num_tokens))
    _sync(dev)
    start = time.perf_counter()
    connector.store("store", tokens, table, num_tokens, sliding_table=table if sliding else [])
    store_enqueue_s = time.perf_counter() - start
    connector.wait_idle()
    store_s = time.perf_counter() - start
    stored = connector.counters["stored_bytes"]
    connector.forget("store")

    ids = torch.tensor(table, device=dev)
    before = torch.cat([_block_sums(kv, ids) for kv in caches])
    for kv in caches:
        kv.index_fill_(2, ids, -7.0)  # poison: a restore that misses a byte shows
    _sync(dev)
    start = time.perf_counter()
    hit = connector.match("load", tokens, 0).num_tokens
    match_s = time.perf_counter() - start
    # Sliding slots are restored only inside the window before the resume point.
    window = config.sliding_window
    full_from = (
        0
        if window is None
        else (max(0, hit - window + 1) // chunk_tokens) * chunk_tokens // block_size
    )
    null = sliding.null if sliding is not None else 0
    sliding_table = [null if i < full_from else b for i, b in enumerate(table)] if sliding else []
    connector.load("load", table, sliding_table=sliding_table)
    enqueue_s = time.perf_counter() - start - match_s
    ok = connector.finish_load("load")
    _sync(dev)
    load_s = time.perf_counter() - start
    loaded = connector.counters["loaded_bytes"]
    after = torch.cat([_block_sums(kv, ids) for kv in caches])
    expect_equal = torch.ones_like(before, dtype=torch.bool)
    expect_equal[layout.num_global_slots :, :, :full_from] = False
    mismatched_blocks = int(((before != after) & expect_equal).sum())
    registered = connector.registration.registered_bytes if connector.registration else 0
    connector.close()
    return {
        "shape": shape,
        "tokens": num_tokens,
        "hit_tokens": hit,
        "load_ok": bool(ok),
        "register_s": register_s,
        "registered_bytes": registered,
        "load_match_s": match_s,
        "load_enqueue_s": enqueue_s,
        "store_s": store_s,
        "store_enqueue_s": store_enqueue_s,
        "stored_bytes": stored,
        "store_GBps": stored / store_s / 1e9,
        "load_s": load_s,
        "loaded_bytes": loaded,
        "load_GBps": loaded / load_s / 1e9,
        "mismatched_blocks": mismatched_blocks,
        "checksum_failures": connector.counters["checksum_failures"],
        "page_bytes": connector.layout.payload_bytes if connector.layout else 0,
    }
