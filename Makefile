# k3lab: the README's two commands.
#   make book   executes every notebook on the CPU defaults -> build/notebooks, build/html, a table
#   make test   sync check, then one pytest process over tests/ and every notebook (nbval)
# Both are self-contained on a fresh machine: they create .venv when missing, install k3lab and
# build the token shards first. .ci/run runs `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# torch goes in first and pinned: an unbounded torch>=2.11 resolves to a ~3 GB CUDA build.
TORCH_PIN := torch==2.13.0
TORCH_STAMP := $(VENV)/.k3lab-torch
VENV_STAMP := $(VENV)/.k3lab-installed
SHARDS_STAMP := data/shards/manifest.json
DATA_INPUTS := $(wildcard data/corpus.tar.xz data/tokenizer.json data/manifest.json k3lab/data.py)
SANITIZE := .ci/nbval-sanitize.cfg
PYTEST_ARGS ?=

.DEFAULT_GOAL := help
.PHONY: help book test venv sysdeps data

help:
	@echo "make book   execute the book (CPU defaults): build/notebooks, build/html, a table"
	@echo "make test   check .py/.ipynb sync, pytest tests/ and nbval over book/ in one process"
	@echo "make venv | sysdeps | data   the prerequisites both commands build when missing"
	@echo "  sysdeps, as root: apt-get installs QEMU for chapter 07; K3LAB_SKIP_SYSDEPS=1 skips it"

$(TORCH_STAMP):
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install $(TORCH_PIN)
	touch $@

# Reinstalled whenever the packaging changes.
$(VENV_STAMP): pyproject.toml setup.py $(TORCH_STAMP)
	$(PY) -m pip install -e '.[dev]'
	touch $@

venv: $(VENV_STAMP)

# System packages for the AgentEnv chapter (QEMU): as root with apt-get, installs the missing ones
# system-wide; K3LAB_SKIP_SYSDEPS=1 skips it. A no-op until k3lab/agentenv/sysdeps.py exists.
sysdeps: $(VENV_STAMP)
	@if [ -f k3lab/agentenv/sysdeps.py ]; then $(PY) -m k3lab.agentenv.sysdeps; fi

# The shard manifest is written last, after both shards and the check against data/manifest.json.
$(SHARDS_STAMP): $(DATA_INPUTS) | $(VENV_STAMP)
	$(PY) -m k3lab.data build

data: $(SHARDS_STAMP)

book: sysdeps $(SHARDS_STAMP)
	$(PY) -m k3lab.book run

# pytest's exit code 5 (nothing collected) fails this target like any other nonzero code.
test: sysdeps $(SHARDS_STAMP)
	$(PY) -m k3lab.book check-sync
	$(PY) -m pytest -p no:cacheprovider tests/ --nbval --nbval-current-env \
		--nbval-sanitize-with $(SANITIZE) book/ $(PYTEST_ARGS)
