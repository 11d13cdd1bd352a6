"""KVShareConnector objects on their own (no engine start): bad pool addresses and pools
shared with engines of another page layout."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

from kvshare.integrations.vllm import KVShareConnector, KVShareMetadata, StoreSpec
from tests.integrations.vllm.tiny_models import write_tiny_llama
from tests.kvpool.pool_fixture import MIB, PoolFactory

BLOCK = 128
CHUNK = 256
NUM_BLOCKS = 8
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]


@dataclass
class Request:
    """The fields of vllm.v1.request.Request the connector's scheduler side reads."""

    request_id: str
    prompt_token_ids: list[int]
    cache_salt: str | None = None


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama")


def kv_cache_config(dtype: torch.dtype) -> KVCacheConfig:
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=dtype)
    return KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(LAYERS, spec)],
    )


def connector(
    model_dir: Path, pool: str, role: KVConnectorRole, dtype: torch.dtype = torch.float32
) -> KVShareConnector:
    transfer = KVTransferConfig(
        kv_connector="KVShareConnector",
        kv_connector_module_path="kvshare.integrations.vllm",
        kv_role="kv_both",
        kv_connector_extra_config={"kv_pool": pool, "chunk_tokens": CHUNK},
    )
    config = VllmConfig(
        model_config=ModelConfig(
            model=str(model_dir), dtype="float32", max_model_len=2048, skip_tokenizer_init=True
        ),
        cache_config=CacheConfig(block_size=BLOCK),
        kv_transfer_config=transfer,
    )
    return KVShareConnector(config, role, kv_cache_config(dtype))


def prompt(seed: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 2000 + 1 for i in range(2 * CHUNK + 10)]


def test_a_pool_address_with_no_daemon_is_one_log_line_and_every_lookup_misses(
    model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    address = f"unix:{tmp_path}/no-such.sock"
    scheduler = connector(model_dir, address, KVConnectorRole.SCHEDULER)
    with caplog.at_level(logging.WARNING, logger="vllm.kvshare"):
        for i in range(3):
            assert scheduler.get_num_new_matched_tokens(Request(f"r{i}", prompt(i)), 0) == (
                0,
                False,
            )
    lines = [r.getMessage() for r in caplog.records if r.name == "vllm.kvshare"]
    assert len(lines) == 1, lines
    assert f"kvshare pool at {address}" in lines[0] and "No such file or directory" in lines[0]
    assert "recomputing without the pool" in lines[0]


def store(worker: KVShareConnector, tokens: list[int]) -> None:
    """What the worker does after the forward pass that computed `tokens`: store its chunks."""
    caches = {name: torch.randn(NUM_BLOCKS, 2, BLOCK, 128) for name in LAYERS}
    worker.register_kv_caches(caches)
    tracked = worker._track(Request("stored", tokens))
    blocks = list(range(len(tokens) // BLOCK))
    worker.bind_connector_metadata(
        KVShareMetadata(stores=[StoreSpec("stored", [0, 1], tracked.keys, blocks, tracked.seed)])
    )
    worker.wait_for_save()
    worker.clear_connector_metadata()
    assert worker.counters["stored"] == 2


def test_pages_of_another_layout_in_the_shared_pool_are_never_matched(model_dir: Path) -> None:
    pools = PoolFactory()
    try:
        address = pools.start(pools.config(size_bytes=16 * MIB)).address
        tokens = prompt(9)
        store(connector(model_dir, address, KVConnectorRole.WORKER), tokens)
        same = connector(model_dir, address, KVConnectorRole.SCHEDULER)
        assert same.get_num_new_matched_tokens(Request("same", tokens), 0)[0] == 2 * CHUNK
        # Another engine on the same pool whose KV pages hold other bytes (bf16 here; another
        # block layout or vLLM version likewise): its keys differ, so it never reads these.
        other = connector(model_dir, address, KVConnectorRole.SCHEDULER, torch.bfloat16)
        assert other.namespace != same.namespace
        assert other.get_num_new_matched_tokens(Request("other", tokens), 0) == (0, False)
        for scheduler in (same, other):
            scheduler.request_finished(Request("same", tokens), [])
            scheduler.request_finished(Request("other", tokens), [])
            scheduler.shutdown()
    finally:
        pools.close()
