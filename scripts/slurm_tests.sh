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
# In this order: the tests bound by the clock (a real walltime, a node declared lost) first, when
# `make test` runs the unit suite beside this one; the campaigns, bound by CPU, after it has ended
# (they took 2-2.5x as long beside it: docs/testing.md). A new test file runs last.
ORDER=(test_walltime.py test_node_loss.py test_cluster.py test_campaign_slurm.py)
files=()
for f in "${ORDER[@]}"; do files+=("tests/slurm/$f"); done
for f in tests/slurm/test_*.py; do
    case " ${ORDER[*]} " in *" ${f##*/} "*) ;; *) files+=("$f") ;; esac
done
timeout --kill-after=30 1500 "$PY" -m pytest "${files[@]}" -q -p no:cacheprovider -o timeout="$TEST_TIMEOUT" "$@"
rc=$?
[ "$rc" -eq 5 ] && rc=0  # no test collected is not a failure of the cluster
if [ "$rc" -ne 0 ]; then
    echo "slurm_tests.sh: failed ($rc); the last lines of the daemons' logs:" >&2
    state=${HPCML_SLURM_DIR:-/tmp/hpcml-slurm}
    tail -n 15 "$state/ctld/slurmctld.log" "$state"/slurmd-n*.log >&2 2>/dev/null
fi
exit "$rc"
