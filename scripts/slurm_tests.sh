#!/usr/bin/env bash
# The Slurm test suite, for `make test-slurm`: start the two-node cluster on this host, run
# tests/slurm against it, stop it -- whatever fails. Every job the tests submit is cancelled
# by the stop; pytest-timeout cuts a hung test.
set -uo pipefail
PY=${PY:-.venv/bin/python}
TEST_TIMEOUT=${TEST_TIMEOUT:-600}  # the walltime test takes ~110 s quiet, ~3x that under load
trap 'bash scripts/slurm_cluster.sh stop' EXIT
bash scripts/slurm_cluster.sh start || exit 1
eval "$(bash scripts/slurm_cluster.sh env)"
timeout --kill-after=30 1500 "$PY" -m pytest tests/slurm -q -p no:cacheprovider -o timeout="$TEST_TIMEOUT" "$@"
rc=$?
[ "$rc" -eq 5 ] && rc=0  # no test collected is not a failure of the cluster
if [ "$rc" -ne 0 ]; then
    echo "slurm_tests.sh: failed ($rc); the last lines of the daemons' logs:" >&2
    state=${HPCML_SLURM_DIR:-/tmp/hpcml-slurm}
    tail -n 15 "$state/ctld/slurmctld.log" "$state"/slurmd-n*.log >&2 2>/dev/null
fi
exit "$rc"
