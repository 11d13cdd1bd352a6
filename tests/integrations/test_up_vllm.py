"""`kvshare up --engine vllm`: replicas are `vllm serve` with kvshare's connector on the pool."""

from __future__ import annotations

import json

import pytest

from kvshare.serve.launcher import Cluster, UpConfig


def test_vllm_replicas_serve_the_model_with_the_connector_on_the_clusters_pool() -> None:
    config = UpConfig.from_args(
        [
            "--engine",
            "vllm",
            "--model",
            "/m/smol-hf",
            "--vllm-bin",
            "/venv/bin/vllm",
            "--vllm-args",
            "--max-model-len 4096",
            "--port",
            "0",
        ]
    )
    cluster = Cluster(config)
    argv = cluster._replica_argv(1)
    port = cluster.replica_urls[1].rsplit(":", 1)[1]
    assert argv[:7] == [
        "/venv/bin/vllm",
        "serve",
        "/m/smol-hf",
        "--host",
        "127.0.0.1",
        "--port",
        port,
    ]
    transfer = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert transfer["kv_connector_module_path"] == "kvshare.integrations.vllm"
    assert transfer["kv_load_failure_policy"] == "recompute"
    assert transfer["kv_connector_extra_config"] == {
        "kv_pool": cluster.pool_address,
        "chunk_tokens": config.chunk_tokens,
    }
    assert argv[-2:] == ["--max-model-len", "4096"]
    assert cluster._replica_env()["VLLM_HOST_IP"] == "127.0.0.1"
    # vLLM serves POST /reset_prefix_cache only in dev mode; the router resets through it
    # and does the pool calls at the cluster's daemon.
    assert cluster._replica_env()["VLLM_SERVER_DEV_MODE"] == "1"
    router = cluster._router_argv()
    assert router[router.index("--engine") + 1] == "vllm"
    assert router[router.index("--kv-pool") + 1] == cluster.pool_address
    assert config.ready_timeout == 900.0  # a vLLM start takes minutes on a busy CPU host


def test_a_python_of_vllms_venv_runs_the_server_module() -> None:
    config = UpConfig.from_args(
        ["--engine", "vllm", "--model", "/m", "--vllm-bin", "/venv/bin/python3", "--port", "0"]
    )
    argv = Cluster(config)._replica_argv(0)
    assert argv[:5] == [
        "/venv/bin/python3",
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        "/m",
    ]


def test_vllm_replicas_without_the_pool_get_no_connector() -> None:
    config = UpConfig.from_args(
        ["--engine", "vllm", "--model", "/m", "--no-kv-pool", "--port", "0"]
    )
    assert "--kv-transfer-config" not in Cluster(config)._replica_argv(0)


def test_an_unknown_engine_is_refused() -> None:
    with pytest.raises(ValueError, match="engine must be kvshare or vllm"):
        UpConfig(engine="sglang")


def test_the_clusters_api_key_guards_the_vllm_replicas_through_their_environment() -> None:
    config = UpConfig.from_args(
        ["--engine", "vllm", "--model", "/m", "--api-key", "s3cret-key", "--port", "0"]
    )
    cluster = Cluster(config)
    assert cluster._replica_env()["VLLM_API_KEY"] == "s3cret-key"
    assert not any("s3cret-key" in arg for arg in cluster._replica_argv(0))
    unkeyed = Cluster(UpConfig.from_args(["--engine", "vllm", "--model", "/m", "--port", "0"]))
    assert "VLLM_API_KEY" not in unkeyed._replica_env()
