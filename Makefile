# hpcml: `make demo` and `make test` set up .venv first when needed (see scripts/setup.sh).
SHELL   := /bin/bash
VENV    ?= .venv
PY      := $(VENV)/bin/python
MPIEXEC ?= mpiexec
READY   := $(VENV)/.hpcml-ready
# A hung job must never eat CI's 90 minutes: every MPI launch runs under a hard limit.
MPI_TIMEOUT ?= 2100

.PHONY: setup verify demo test test-unit test-mpi test-workflows test-slurm slurm-start slurm-stop bench-gpu clean

setup: $(READY)

$(READY): pyproject.toml scripts/setup.sh scripts/verify_env.py
	bash scripts/setup.sh
	$(PY) scripts/verify_env.py --mpiexec "$(MPIEXEC)"
	@touch $@

verify: setup
	$(PY) scripts/verify_env.py --mpiexec "$(MPIEXEC)"

# The main job: 16 heat simulations (2 MPI ranks each, Parsl) streaming into a 2-rank
# data-parallel surrogate trainer; summary.json and report.png land in runs/demo. A run
# directory holds one campaign, so an earlier demo is kept aside as runs/demo.<time>.
demo: setup
	@if [ -e runs/demo ]; then old=runs/demo.$$(date +%Y%m%d-%H%M%S); mv runs/demo $$old; echo "earlier demo kept in $$old"; fi
	timeout --kill-after=30 600 $(PY) workflows/heat_surrogate.py --site local --sims 16 --mode online --run-dir runs/demo

# Every suite (Slurm beside unit, then the rest in turn); each stage's time is printed at the end
# (scripts/test_all.sh, docs/testing.md).
test: setup
	PY=$(PY) MPIEXEC="$(MPIEXEC)" MPI_TIMEOUT=$(MPI_TIMEOUT) bash scripts/test_all.sh

test-unit: setup
	$(PY) -m pytest tests/unit -q || [ $$? -eq 5 ]

# Many tests per launch: each launch pays MPI start-up and a torch import per rank.
# scripts/mpi_tests.sh prints every rank's stacks if a test hangs, and retries that launch once.
test-mpi: setup
	PY=$(PY) MPIEXEC="$(MPIEXEC)" MPI_TIMEOUT=$(MPI_TIMEOUT) bash scripts/mpi_tests.sh 2
	PY=$(PY) MPIEXEC="$(MPIEXEC)" MPI_TIMEOUT=$(MPI_TIMEOUT) bash scripts/mpi_tests.sh 4

test-workflows: setup
	PY=$(PY) bash scripts/workflow_tests.sh

# A real two-node Slurm cluster on this host (scripts/slurm_cluster.sh): started, tested, stopped.
test-slurm: setup
	PY=$(PY) bash scripts/slurm_tests.sh

slurm-start:
	bash scripts/slurm_cluster.sh start

slurm-stop:
	bash scripts/slurm_cluster.sh stop

# GPU readiness (issue 23): every figure only a GPU gives, as one JSON object on stdout. The
# script launches its own workers: one-rank sections as plain python, the multi-GPU ones as
# $(MPIEXEC) -n <visible GPUs>. Without a GPU it fails at once in one line (exit 69).
bench-gpu: setup
	MPIEXEC="$(MPIEXEC)" $(PY) benchmarks/gpu.py --json

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache runs
