#!/usr/bin/env bash
# One-command, idempotent environment set-up for hpcml.
#
# On a Debian-like machine (as root) it installs the system MPI and parallel HDF5,
# then builds mpi4py and h5py from source against them in .venv. On an HPC site,
# load the modules first and point MPICC / HDF5_DIR at them; apt is skipped when
# mpicc is already on PATH and HDF5_DIR is set.
#
#   Frontier:  module load PrgEnv-gnu cray-mpich cray-hdf5-parallel
#              MPICC=cc HDF5_DIR=$HDF5_ROOT HPCML_SKIP_APT=1 make setup
#
# Variables: VENV, PYTHON, MPICC, HDF5_DIR, HPCML_SKIP_APT=1, HPCML_TORCH_SPEC (pip
# arguments for torch), HPCML_VENV_ARGS (e.g. --system-site-packages to see a site torch),
# HPCML_BUILD_CFLAGS (the C flags of both source builds; default -Og -g0 for mpi4py, -O1 -g0 for h5py).
set -euo pipefail

VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${HPCML_TORCH_SPEC:-torch==2.13.0}
MPICC=${MPICC:-mpicc}
# After Python's -O3 -g, so these win. mpi4py is one C file on one core, the set-up's critical
# path: -Og builds it in ~29 s against ~100 s at -O1, its calls 0.1-0.3 us slower (docs/install.md).
MPI4PY_CFLAGS=${HPCML_BUILD_CFLAGS:--Og -g0}
H5PY_CFLAGS=${HPCML_BUILD_CFLAGS:--O1 -g0}  # -Og saves h5py nothing (its Cython step dominates)
APT_PACKAGES=(mpich libmpich-dev libhdf5-mpich-dev)

log() { printf '[setup %5ss] %s\n' "$SECONDS" "$*"; }
die() { printf 'setup: error: %s\n' "$*" >&2; exit 1; }

multiarch() {
    gcc -print-multiarch 2>/dev/null || dpkg-architecture -qDEB_HOST_MULTIARCH 2>/dev/null || echo "$(uname -m)-linux-gnu"
}

install_system_packages() {
    if [ "${HPCML_SKIP_APT:-0}" = 1 ]; then
        log "HPCML_SKIP_APT=1: using MPI and HDF5 from the environment (modules)"
        return
    fi
    if ! command -v dpkg >/dev/null 2>&1; then
        command -v "$MPICC" >/dev/null 2>&1 || die "no dpkg and no '$MPICC' on PATH: load your site's MPI module or set MPICC"
        log "not a Debian-like system: using MPI from PATH ($MPICC)"
        return
    fi
    local missing=()
    for p in "${APT_PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
    done
    if [ ${#missing[@]} -eq 0 ]; then
        log "system packages present: ${APT_PACKAGES[*]}"
        return
    fi
    [ "$(id -u)" = 0 ] || die "missing system packages ${missing[*]}: run 'sudo apt-get install ${missing[*]}' or 'sudo make setup'"
    log "apt-get install ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

# pip warns once per package about local index folders it cannot read; keep real errors.
quiet_pip() { "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }

# The dependencies the source builds do not need: pyproject's, less torch, mpi4py and h5py.
other_dependencies() {
    "$1" - <<'PY'
import re, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
reqs = project["dependencies"] + [r for extra in ("dev", "hf") for r in project["optional-dependencies"][extra]]
skip = {"torch", "mpi4py", "h5py"}
print("\n".join(sorted({r for r in reqs if re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0] not in skip})))
PY
}

# A cold set-up is mostly the two source builds: at Python's own flags (-O3 -g), ~200 s for
# mpi4py (one C file, one core) and ~240 s for h5py on one core of this machine. Three things
# cut it: both compile without debug info at low optimisation (mpi4py at -Og ~29 s, h5py at -O1
# ~52 s on 2 cores; their calls within 0.1-0.3 us and I/O as fast: docs/install.md), mpi4py's
# wheel is built in the background while torch and the pure-Python dependencies install, and
# h5py's extensions compile on every core (setuptools' build_ext --parallel, DIST_EXTRA_CONFIG).
main() {
    install_system_packages
    local hdf5_dir=${HDF5_DIR:-/usr/lib/$(multiarch)/hdf5/mpich}
    [ -d "$hdf5_dir" ] || die "HDF5_DIR=$hdf5_dir does not exist: set HDF5_DIR to your parallel HDF5 install (e.g. \$HDF5_ROOT)"
    command -v "$MPICC" >/dev/null 2>&1 || die "MPI compiler wrapper '$MPICC' not found on PATH"

    if [ ! -x "$VENV/bin/python" ]; then
        log "creating $VENV with $($PYTHON --version)"
        # shellcheck disable=SC2086  # HPCML_VENV_ARGS may hold several words
        "$PYTHON" -m venv ${HPCML_VENV_ARGS:-} "$VENV"
    fi
    local py="$VENV/bin/python"
    local pip=(quiet_pip "$py" -m pip install --disable-pip-version-check -q)
    work=$(mktemp -d)  # global: the EXIT trap runs after main has returned
    trap 'rm -rf "$work"' EXIT
    "${pip[@]}" numpy Cython pkgconfig "setuptools>=64" wheel

    local mpi4py_pid=
    if ! "$py" -c "import mpi4py" 2>/dev/null; then
        log "building mpi4py from source against $MPICC (beside the installs below)"
        MPICC="$MPICC" CFLAGS="$MPI4PY_CFLAGS" "$py" -m pip wheel --disable-pip-version-check -q --no-deps --no-binary=mpi4py \
            -w "$work" "mpi4py>=4.0,<5" >"$work/mpi4py.log" 2>&1 &
        mpi4py_pid=$!
    fi
    log "installing $TORCH_SPEC"
    local torch_args
    read -ra torch_args <<< "$TORCH_SPEC"  # may carry pip options, e.g. an --index-url
    "${pip[@]}" "${torch_args[@]}"
    log "installing parsl, pyzmq, test tools and the other dependencies"
    local others
    mapfile -t others < <(other_dependencies "$py")
    "${pip[@]}" "${others[@]}"
    if [ -n "$mpi4py_pid" ]; then
        wait "$mpi4py_pid" || { grep -v "is ignored: it is neither" "$work/mpi4py.log" >&2; die "building mpi4py failed (its log above)"; }
        "${pip[@]}" --no-deps "$work"/mpi4py-*.whl
        log "mpi4py built and installed"
    fi
    if ! "$py" -c "import h5py, sys; sys.exit(0 if h5py.get_config().mpi else 1)" 2>/dev/null; then
        log "building h5py from source against parallel HDF5 in $hdf5_dir ($(nproc) compile jobs)"
        "$py" -m pip uninstall -y -q h5py 2>/dev/null || true
        printf '[build_ext]\nparallel = %s\n' "$(nproc)" >"$work/build.cfg"
        CC="$MPICC" CFLAGS="$H5PY_CFLAGS" HDF5_MPI=ON HDF5_DIR="$hdf5_dir" DIST_EXTRA_CONFIG="$work/build.cfg" \
            "${pip[@]}" --no-binary=h5py --no-build-isolation "h5py>=3.11,<4"
    fi

    log "installing hpcml (editable)"
    "${pip[@]}" --no-build-isolation -e ".[dev,hf]"
    # byte-compiled once: an editable install leaves the sources uncompiled, and where
    # PYTHONDONTWRITEBYTECODE is set every `hpcml` command compiled ~30 modules again (~0.1 s each call)
    "$py" -m compileall -q hpcml >/dev/null || true
    log "done"
}

main "$@"
