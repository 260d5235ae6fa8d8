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
suite() {  # suite ARGS...: pytest on the cluster, bounded; 0 when nothing was collected
    timeout --kill-after=30 1500 "$PY" -m pytest -q -p no:cacheprovider -o timeout="$TEST_TIMEOUT" "$@"
    local rc=$?
    [ "$rc" -eq 5 ] && rc=0  # no test collected is not a failure of the cluster
    return "$rc"
}
if [ $# -gt 0 ]; then  # the tests asked for, one after another
    suite tests/slurm "$@"
    rc=$?
else
    # Two lanes side by side, each cancelling only its own jobs (tests/slurm/conftest.py): the
    # walltime test (a real 2-minute walltime, mostly waiting for Slurm's warning) beside the
    # others; then the lost node alone (it takes a node away from every job).
    lane_log=$(mktemp)
    HPCML_SLURM_ONLY=wall suite tests/slurm/test_walltime.py >"$lane_log" 2>&1 &
    lane=$!
    HPCML_SLURM_SPARE=wall suite tests/slurm --ignore=tests/slurm/test_walltime.py \
        --ignore=tests/slurm/test_node_loss.py
    rc=$?
    wait "$lane"
    lane_rc=$?
    echo "--- the walltime lane (ran beside):"
    cat "$lane_log"
    rm -f "$lane_log"
    suite tests/slurm/test_node_loss.py
    last_rc=$?
    for r in "$lane_rc" "$last_rc"; do [ "$rc" -eq 0 ] && rc=$r; done
fi
if [ "$rc" -ne 0 ]; then
    echo "slurm_tests.sh: failed ($rc); the last lines of the daemons' logs:" >&2
    state=${HPCML_SLURM_DIR:-/tmp/hpcml-slurm}
    tail -n 15 "$state/ctld/slurmctld.log" "$state"/slurmd-n*.log >&2 2>/dev/null
fi
exit "$rc"
