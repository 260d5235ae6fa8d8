# hpcml: `make demo` and `make test` set up .venv first when needed (see scripts/setup.sh).
SHELL   := /bin/bash
VENV    ?= .venv
PY      := $(VENV)/bin/python
MPIEXEC ?= mpiexec
READY   := $(VENV)/.hpcml-ready
# A hung job must never eat CI's 90 minutes: every MPI launch runs under a hard limit.
MPI_TIMEOUT ?= 900
MPIRUN  := timeout --kill-after=30 $(MPI_TIMEOUT) $(MPIEXEC)

.PHONY: setup verify demo test test-unit test-mpi test-workflows clean

setup: $(READY)

$(READY): pyproject.toml scripts/setup.sh scripts/verify_env.py
	bash scripts/setup.sh
	$(PY) scripts/verify_env.py --mpiexec "$(MPIEXEC)"
	@touch $@

verify: setup
	$(PY) scripts/verify_env.py --mpiexec "$(MPIEXEC)"

demo: setup
	$(MPIRUN) -n 4 $(VENV)/bin/hpcml grid --tp 2 --check

test: setup
	$(MAKE) --no-print-directory test-unit test-mpi test-workflows

test-unit: setup
	$(PY) -m pytest tests/unit -q || [ $$? -eq 5 ]

# Many tests per launch: each launch pays MPI start-up and a torch import per rank.
test-mpi: setup
	$(MPIRUN) -n 2 $(PY) tests/mpi_pytest.py tests/mpi -q
	$(MPIRUN) -n 4 $(PY) tests/mpi_pytest.py tests/mpi -q

test-workflows: setup
	$(PY) -m pytest tests/workflows -q || [ $$? -eq 5 ]

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache runs
