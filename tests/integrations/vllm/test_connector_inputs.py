"""KVShareConnector objects on their own (no engine start): bad pool addresses, pools
shared with engines of another page layout, and a hybrid model's failed load reported per
request when block ids repeat across KV cache groups."""

from __future__ import annotations

import logging
import socket
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
)

from kvshare.integrations.vllm import KVShareConnector, KVShareMetadata, LoadSpec, StoreSpec
from kvshare.kvpool.client import PoolClient
from kvshare.kvpool.connector import state_key
from kvshare.kvpool.page import HEADER_BYTES
from kvshare.kvpool.protocol import (
    LENGTH,
    PROTOCOL_VERSION,
    decode_body,
    encode_frame,
    frame_length,
)
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
    model_dir: Path,
    pool: str,
    role: KVConnectorRole,
    dtype: torch.dtype = torch.float32,
    cache_config: KVCacheConfig | None = None,
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
    return KVShareConnector(config, role, cache_config or kv_cache_config(dtype))


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


class IncompatibleDaemon:
    """A unix socket that answers every frame like a pool daemon of another protocol
    version and page layout would answer a hello."""

    def __init__(self, path: Path) -> None:
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(str(path))
        self.server.listen()
        self.hellos = 0
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            with conn:
                header = conn.recv(LENGTH.size, socket.MSG_WAITALL)
                if len(header) < LENGTH.size:
                    continue
                request = decode_body(conn.recv(frame_length(header), socket.MSG_WAITALL))
                self.hellos += request.get("op") == "hello"
                hello = {
                    "id": request["id"],
                    "ok": True,
                    "version": PROTOCOL_VERSION + 1,
                    "header_bytes": HEADER_BYTES * 2,
                }
                conn.sendall(encode_frame(hello))

    def close(self) -> None:
        self.server.close()


def test_a_daemon_of_another_version_is_one_log_line_and_every_lookup_misses(
    model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    daemon = IncompatibleDaemon(tmp_path / "other.sock")
    address = f"unix:{tmp_path}/other.sock"
    try:
        scheduler = connector(model_dir, address, KVConnectorRole.SCHEDULER)
        with caplog.at_level(logging.WARNING, logger="vllm.kvshare"):
            for i in range(3):
                request = Request(f"r{i}", prompt(i))
                assert scheduler.get_num_new_matched_tokens(request, 0) == (0, False)
    finally:
        daemon.close()
    assert daemon.hellos >= 1  # the connector did reach it, and refused what it heard
    lines = [r.getMessage() for r in caplog.records if r.name == "vllm.kvshare"]
    assert len(lines) == 1, lines
    assert f"kvshare pool at {address}" in lines[0]
    assert "incompatible daemon hello" in lines[0] and "recomputing without the pool" in lines[0]


def store(worker: KVShareConnector, tokens: list[int]) -> None:
    """What the worker does after the forward pass that computed `tokens`: store its chunks."""
    caches = {name: torch.randn(NUM_BLOCKS, 2, BLOCK, 128) for name in LAYERS}
    worker.register_kv_caches(caches)
    tracked = worker._track(Request("stored", tokens))
    blocks = list(range(len(tokens) // BLOCK))
    worker.bind_connector_metadata(
        KVShareMetadata(stores=[StoreSpec("stored", [0, 1], tracked.keys, (blocks,), tracked.seed)])
    )
    worker.wait_for_save()
    worker.clear_connector_metadata()
    assert worker.counters["stored"] == 2


def test_pages_of_another_layout_in_the_shared_pool_are_never_matched(
    model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pools = PoolFactory()
    try:
        address = pools.start(pools.config(size_bytes=16 * MIB)).address
        tokens = prompt(9)
        store(connector(model_dir, address, KVConnectorRole.WORKER), tokens)
        same = connector(model_dir, address, KVConnectorRole.SCHEDULER)
        assert same.get_num_new_matched_tokens(Request("same", tokens), 0)[0] == 2 * CHUNK
        # Another engine on the same pool whose KV pages hold other bytes (bf16 here; another
        # block layout or vLLM version likewise): its keys differ, so it never reads these.
        with caplog.at_level(logging.INFO, logger="vllm.kvshare"):
            other = connector(model_dir, address, KVConnectorRole.SCHEDULER, torch.bfloat16)
        assert other.namespace != same.namespace
        # Its start line names its namespace, the one an operator compares across replicas.
        messages = [r.getMessage() for r in caplog.records]
        (started,) = [m for m in messages if "connector (scheduler)" in m]
        assert f"namespace {other.namespace.digest().hex()[:16]}" in started
        assert same.namespace.digest().hex()[:16] not in started
        assert other.get_num_new_matched_tokens(Request("other", tokens), 0) == (0, False)
        for scheduler in (same, other):
            scheduler.request_finished(Request("same", tokens), [])
            scheduler.request_finished(Request("other", tokens), [])
            scheduler.shutdown()
    finally:
        pools.close()


STATE_LAYER, ATTENTION_LAYER = "model.layers.0.linear_attn", "model.layers.1.self_attn.attn"
HYBRID_BLOCKS = 16
STATE_BYTES = 3 * 64 * 4 + 2 * 8 * 8 * 4


def hybrid_cache_config() -> KVCacheConfig:
    """Group 0: a Gated-DeltaNet-like state layer (align mode); group 1: full attention.
    Both draw block ids from one range, so an id names a block only within its group."""
    state = MambaSpec(
        block_size=BLOCK,
        shapes=((3, 64), (2, 8, 8)),
        dtypes=(torch.float32, torch.float32),
        mamba_cache_mode="align",
    )
    attention = FullAttentionSpec(
        block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.float32
    )
    return KVCacheConfig(
        num_blocks=HYBRID_BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec([STATE_LAYER], state),
            KVCacheGroupSpec([ATTENTION_LAYER], attention),
        ],
    )


def hybrid_caches() -> dict[str, torch.Tensor]:
    return {
        STATE_LAYER: torch.randint(-128, 127, (HYBRID_BLOCKS, STATE_BYTES), dtype=torch.int8),
        ATTENTION_LAYER: torch.randn(HYBRID_BLOCKS, 2, BLOCK, 128),
    }


def test_a_failed_hybrid_load_fails_only_its_request_though_block_ids_repeat_across_groups(
    model_dir: Path,
) -> None:
    pools = PoolFactory()
    try:
        address = pools.start(pools.config(size_bytes=16 * MIB)).address
        worker = connector(
            model_dir, address, KVConnectorRole.WORKER, cache_config=hybrid_cache_config()
        )
        source = hybrid_caches()
        worker.register_kv_caches(source)
        good, bad = (
            worker._track(Request("good", prompt(1))),
            worker._track(Request("bad", prompt(2))),
        )
        # Each prompt: chunks 0-1 (blocks 1-4 / 5-8) and the state after chunk 1 (block 3 / 4).
        worker.bind_connector_metadata(
            KVShareMetadata(
                stores=[
                    StoreSpec("good", [0, 1], good.keys, ([1, 2, 3, 4],), good.seed, 1, (3,)),
                    StoreSpec("bad", [0, 1], bad.keys, ([5, 6, 7, 8],), bad.seed, 1, (4,)),
                ]
            )
        )
        worker.wait_for_save()
        worker.clear_connector_metadata()
        assert worker.counters["stored"] == 6 and worker.counters["stored_states"] == 2
        client = PoolClient(address)
        result = client.lookup(bad.keys[:2], [(1, state_key(bad.keys[1]))])
        state_page = result.pages[-1]
        client.arena.as_tensor()[state_page.offset + HEADER_BYTES + 5] ^= 0x01
        client.release(result.lease)
        client.close()

        restored = hybrid_caches()
        worker.register_kv_caches(restored)
        # The good request's KV blocks 1-4 carry the same ids as the bad one's state block
        # (2) in the other group: a block-id report could not say which request failed.
        worker.bind_connector_metadata(
            KVShareMetadata(
                loads=[
                    LoadSpec("good", good.keys[:2], ([1, 2, 3, 4],), 0, (9,)),
                    LoadSpec("bad", bad.keys[:2], ([10, 11, 12, 13],), 0, (2,)),
                ]
            )
        )
        before = restored[STATE_LAYER][2].clone()
        worker.start_load_kv(None)
        results = worker.get_transfer_results(set())
        worker.clear_connector_metadata()
        assert results.finished_recving == {"good", "bad"}
        assert results.failed_recving == {"bad"}
        assert worker.get_block_ids_with_load_errors() == set()
        attention = ATTENTION_LAYER
        assert torch.equal(restored[attention][1:5], source[attention][1:5])
        assert torch.equal(restored[STATE_LAYER][9], source[STATE_LAYER][3])
        # Nothing of the failed load was written (its pages are verified before any copy).
        assert torch.equal(restored[STATE_LAYER][2], before)
        assert not torch.equal(restored[attention][10], source[attention][5])
        worker.shutdown()
    finally:
        pools.close()
