#!/usr/bin/env bash
# The MPI test suite at N ranks, for `make test-mpi`: every test on every rank of one launch.
# A failing test aborts the job (tests/mpi/conftest.py). A hang is cut by pytest-timeout per
# test, on every rank, which prints each rank's stacks; the launch is then retried once, with
# the stacks left in the log for a diagnosis: a rare hang must not cost CI its whole run.
set -uo pipefail
n=$1; shift
PY=${PY:-.venv/bin/python}
MPIEXEC=${MPIEXEC:-mpiexec}
MPI_TIMEOUT=${MPI_TIMEOUT:-900}
TEST_TIMEOUT=${TEST_TIMEOUT:-180}
err=$(mktemp)
trap 'rm -f "$err"' EXIT
for attempt in 1 2; do
    timeout --kill-after=30 "$MPI_TIMEOUT" $MPIEXEC -n "$n" "$PY" tests/mpi_pytest.py tests/mpi -q \
        -o timeout="$TEST_TIMEOUT" "$@" 2>"$err"
    rc=$?
    cat "$err" >&2
    [ "$rc" -eq 0 ] && exit 0
    if [ "$attempt" -eq 1 ] && { grep -q "Timeout (" "$err" || [ "$rc" -eq 124 ]; }; then
        echo "mpi_tests.sh: a test hung at $n ranks (stacks above); retrying the launch once" >&2
        continue
    fi
    exit "$rc"
done
