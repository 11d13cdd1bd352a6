# Two entry points on a fresh machine: `make demo` (install + run the main job) and
# `make test` (install test needs + run the whole suite). Both create .venv when missing.
VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin

.PHONY: demo test lint format install install-test clean

demo: install
	$(BIN)/kvshare demo

test: install-test lint
	$(BIN)/python -m pytest -q -ra

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
	rm -rf $(VENV) .pytest_cache .ruff_cache
