# Two entry points on a fresh machine: `make demo` (install + run the main job) and
# `make test` (install test needs + run the whole suite). Both create .venv when missing.
VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin

.PHONY: demo test lint install install-test clean

demo: install
	$(BIN)/kvshare demo

test: install-test
	$(BIN)/python -m pytest -q -ra

lint: install-test
	$(BIN)/ruff check kvshare tests

install: $(VENV)/.installed

install-test: $(VENV)/.installed-test

$(VENV)/.installed: pyproject.toml scripts/install.sh
	PYTHON=$(PYTHON) VENV=$(VENV) sh scripts/install.sh
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(BIN)/pip install -q -e '.[test]'
	touch $@

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
