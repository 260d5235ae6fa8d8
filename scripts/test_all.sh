#!/usr/bin/env bash
# `make test`: every suite, with the Slurm suite beside the unit and MPI suites. Slurm's tests
# spend most of their time waiting on the scheduler (a real 2-minute walltime, requeues, a
# lost node's timeout), so on 2 cores they cost little beside the CPU-bound suites; the
# workflow suite runs last, alone (its fault-tolerance cases time heartbeats and leases).
# Each stage's time is printed at the end (docs/testing.md keeps them); any failure fails the run.
set -uo pipefail
PY=${PY:-.venv/bin/python}
MPIEXEC=${MPIEXEC:-mpiexec}
MPI_TIMEOUT=${MPI_TIMEOUT:-2100}
export PY MPIEXEC MPI_TIMEOUT
log=$(mktemp -d)
trap 'rm -rf "$log"' EXIT
declare -A took rc
stage() {  # stage NAME CMD...: run it, note its time and status
    local name=$1 t0=$SECONDS; shift
    "$@"
    rc[$name]=$?
    took[$name]=$((SECONDS - t0))
}

t_slurm=$SECONDS
(bash scripts/slurm_tests.sh >"$log/slurm.out" 2>&1; echo $? >"$log/slurm.rc") &
slurm_pid=$!

stage unit bash -c "$PY -m pytest tests/unit -q || [ \$? -eq 5 ]"
stage mpi2 bash scripts/mpi_tests.sh 2
stage mpi4 bash scripts/mpi_tests.sh 4
wait "$slurm_pid"
rc[slurm]=$(cat "$log/slurm.rc" 2>/dev/null || echo 1)
took[slurm]=$((SECONDS - t_slurm))
echo "=== tests/slurm (ran beside the unit and MPI suites) ==="
cat "$log/slurm.out"
stage workflows bash -c "$PY -m pytest tests/workflows -q || [ \$? -eq 5 ]"

status=0
echo "=== make test: stage, seconds, exit status ==="
for name in unit mpi2 mpi4 slurm workflows; do
    printf '%-10s %6s s  rc %s\n' "$name" "${took[$name]}" "${rc[$name]}"
    [ "${rc[$name]}" = 0 ] || status=1
done
printf '%-10s %6s s\n' total "$SECONDS"
exit "$status"
