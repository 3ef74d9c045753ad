# Two commands: `make setup` (idempotent) and `make test`. Everything installs into ./.venv and ./node_modules.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TYPED := protocol models toploc shardcast contracts environments trainer validator node discovery devnet
export OMP_WAIT_POLICY ?= PASSIVE

.PHONY: setup test test-slow lint contracts clean devnet

setup: $(VENV)/.installed node_modules/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned: the CPU build that lies on disk (an unpinned torch pulls a multi-GB CUDA build)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[cpu,dev]'
	touch $@

node_modules/.installed: package.json package-lock.json
	npm ci --no-audit --no-fund --loglevel=error
	touch $@

# The default tier in a random order (modules shuffled, and the tests inside each): a test that leans on
# another's leftovers fails here, not on someone else's machine. The header prints the seed; rerun an
# order with `.venv/bin/pytest --random-order-seed=N`, or keep file order with `-p no:random_order`.
test: setup
	$(PY) -m pytest --random-order

test-slow: setup
	$(PY) -m pytest -m "slow and not gpu"

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy $(TYPED)
	$(PY) -m contracts.build --check
	PYTHONPATH=. $(PY) docs/generate.py --check
	# Docker: no daemon here, so the images are checked statically (docker/README.md)
	$(VENV)/bin/hadolint docker/Dockerfile docker/Dockerfile.gpu
	$(PY) docker/compose_check.py

# The whole network on this machine (anvil, trainer + origin, relays, validators, CPU nodes); Ctrl-C stops it.
devnet: setup
	$(VENV)/bin/prime-devnet up $(ARGS)

# Recompile the Solidity sources into contracts/artifacts/ (committed; a test proves they reproduce).
contracts: setup
	$(PY) -m contracts.build

# Rewrite docs/reference/ from the code (config trees, reason codes, messages, ABI events, OpenAPI).
.PHONY: docs
docs: setup
	PYTHONPATH=. $(PY) docs/generate.py

clean:
	rm -rf $(VENV) node_modules .pytest_cache .mypy_cache
