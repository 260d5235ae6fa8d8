#!/usr/bin/env bash
# `make test`: every suite, one after another, each stage's time printed at the end
# (docs/testing.md keeps them). Stages run in turn, not side by side: on 2 cores the Slurm
# suite beside the unit and MPI suites doubled the 4-rank MPI suite (oversubscribed ranks)
# and stretched the Slurm suite past the time saved. Every stage runs even when one fails, so
# one CI run reports them all; any failure fails the run.
set -uo pipefail
PY=${PY:-.venv/bin/python}
MPIEXEC=${MPIEXEC:-mpiexec}
MPI_TIMEOUT=${MPI_TIMEOUT:-2100}
export PY MPIEXEC MPI_TIMEOUT
declare -A took rc
stage() {  # stage NAME CMD...: run it, note its time and status
    local name=$1 t0=$SECONDS; shift
    echo "=== make test: $name ==="
    "$@"
    rc[$name]=$?
    took[$name]=$((SECONDS - t0))
}

stage unit bash -c "$PY -m pytest tests/unit -q || [ \$? -eq 5 ]"
stage mpi2 bash scripts/mpi_tests.sh 2
stage mpi4 bash scripts/mpi_tests.sh 4
stage workflows bash -c "$PY -m pytest tests/workflows -q || [ \$? -eq 5 ]"
stage slurm bash scripts/slurm_tests.sh

status=0
echo "=== make test: stage, seconds, exit status ==="
for name in unit mpi2 mpi4 workflows slurm; do
    printf '%-10s %6s s  rc %s\n' "$name" "${took[$name]}" "${rc[$name]}"
    [ "${rc[$name]}" = 0 ] || status=1
done
printf '%-10s %6s s\n' total "$SECONDS"
exit "$status"
