#!/usr/bin/env bash
# `make test`: every suite, each stage's time printed at the end (docs/testing.md keeps them).
# The Slurm suite runs beside the unit suite and then the 2-rank MPI suite -- niced, while the Slurm
# jobs mostly wait on the scheduler and a real walltime -- and the 4-rank MPI and workflow suites after
# them, one after another: on 2 cores the Slurm suite beside the 4-rank suite doubled the 4-rank
# suite (oversubscribed ranks) and stretched the Slurm suite past the time saved. The workflow
# suite runs as two halves side by side (scripts/workflow_tests.sh). Every stage
# runs even when one fails, so one CI run reports them all; any failure fails the run.
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
beside_log=$(mktemp)
beside_rc=$(mktemp)
trap 'rm -f "$beside_log" "$beside_rc"' EXIT
beside() {  # beside CMD...: start it in the background, its output kept apart until it ends
    ( t0=$SECONDS; "$@" >"$beside_log" 2>&1; echo "$? $((SECONDS - t0))" >"$beside_rc" ) &
    beside_pid=$!
}
joined() {  # joined NAME: wait for the background stage, print its output, note its time and status
    wait "$beside_pid"
    echo "=== make test: $1 (ran beside the stage above) ==="
    cat "$beside_log"
    read -r rc["$1"] took["$1"] <"$beside_rc" || { rc[$1]=1; took[$1]=0; }
}

beside bash scripts/slurm_tests.sh
# The unit suite at a lower priority (nice 5): the Slurm suite's jobs -- a real walltime, a lost
# node, campaigns with heartbeats -- take the cores when they need them, and the unit suite the
# cycles they leave while they wait on the scheduler (the stage 634 -> 526 s, docs/testing.md).
# The 2-rank MPI suite follows it, niced too, beside the Slurm suite's end (its campaigns): the
# two stages took 532 s together against ~552-587 s one after the other the same day.
stage unit bash -c "nice -n ${UNIT_NICE:-5} $PY -m pytest tests/unit -q || [ \$? -eq 5 ]"
stage mpi2 nice -n "${UNIT_NICE:-5}" bash scripts/mpi_tests.sh 2
joined slurm
stage mpi4 bash scripts/mpi_tests.sh 4
stage workflows bash scripts/workflow_tests.sh

status=0
echo "=== make test: stage, seconds, exit status ==="
for name in unit slurm mpi2 mpi4 workflows; do
    printf '%-10s %6s s  rc %s\n' "$name" "${took[$name]}" "${rc[$name]}"
    [ "${rc[$name]}" = 0 ] || status=1
done
printf '%-10s %6s s\n' total "$SECONDS"
exit "$status"
