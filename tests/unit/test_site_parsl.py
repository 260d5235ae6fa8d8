"""site_configs/*: each Site's Parsl Config under the pinned Parsl (pilot and one allocation),
the block script Parsl would submit, executors and launch lines, bad arguments.

Configs are only constructed (no scheduler is contacted); the block script is what the
provider's own public template renders. One test runs the local config for real: two MPI
simulations through Parsl. (The outer job scripts of `hpcml job`: test_jobscript.py.)
"""

from __future__ import annotations

import shlex
import sys
import time
from pathlib import Path

import parsl
import pytest
from parsl.app.app import bash_app
from parsl.executors import HighThroughputExecutor, MPIExecutor, ThreadPoolExecutor
from parsl.executors.high_throughput.mpi_prefix_composer import compose_all
from parsl.launchers import SimpleLauncher

from hpcml.ensemble import site
from hpcml.ensemble.block_preview import WORKER_COMMAND_PLACEHOLDER, render_batch_script
from hpcml.errors import ConfigError
from tests.unit.test_sites import SITES

BATCH_SITES = [s for s in SITES if s != "local"]
ACTIVATE = f"source {shlex.quote(sys.prefix)}/bin/activate" if sys.prefix != sys.base_prefix \
    else f"export PATH={shlex.quote(sys.prefix)}/bin:$PATH"


def _config(name: str, tmp_path: Path, **kwargs):
    args = {"run_dir": str(tmp_path / "run"), "nodes": 2, "walltime": "01:00:00", "account": "proj42",
            "worker_init": "echo user-init", **kwargs}
    return site.load_site(name).parsl_config(**args)


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


# ----------------------------------------------------------------------------- batch scripts

EXPECTED_SCRIPT = {
    "frontier": ["#SBATCH --nodes=2", "#SBATCH --time=60", "#SBATCH --ntasks-per-node=1",
                 "#SBATCH --exclusive", "#SBATCH --account=proj42", "#SBATCH --partition=batch",
                 "module load PrgEnv-gnu/8.7.0 cpe/26.03 cray-mpich cray-hdf5-parallel cray-python rocm/7.1.1",
                 "module load rccl-net-plugin craype-accel-amd-gfx90a",
                 "export NCCL_SOCKET_IFNAME=hsn0,hsn1,hsn2,hsn3", "export MIOPEN_USER_DB_PATH=/tmp/hpcml-miopen",
                 "export HPCML_SOCKET_IFNAME=hsn0"],
    "perlmutter": ["#SBATCH --nodes=2", "#SBATCH --time=60", "#SBATCH --exclusive", "#SBATCH --account=proj42",
                   "#SBATCH --qos=regular", "#SBATCH --constraint=gpu", "#SBATCH --gpus-per-node=4",
                   "module load PrgEnv-gnu cray-mpich cray-hdf5-parallel python",
                   "module load nccl-plugin || echo 'hpcml-job: module load nccl-plugin failed, a line not on the "
                   "facility pages: module avail nccl; without a plugin module NCCL falls back to TCP sockets between "
                   "nodes' >&2",
                   "export HPCML_GPU_MAP=3,2,1,0"],
    "summit": ["#BSUB -W 60", "#BSUB -P proj42", "#BSUB -q batch", "#BSUB -nnodes 2",
               "module load gcc spectrum-mpi hdf5 python", "export HPCML_SOCKET_IFNAME=ib0"],
    "polaris": ["#PBS -l walltime=01:00:00", "#PBS -l select=2:ncpus=64:system=polaris",
                "#PBS -l filesystems=home:eagle", "#PBS -l place=scatter", "module use /soft/modulefiles",
                "module load PrgEnv-gnu cray-hdf5-parallel conda", "export NCCL_NET='AWS Libfabric'",
                "export NCCL_NET_GDR_LEVEL=PHB", "export FI_MR_CACHE_MONITOR=userfaultfd",
                "export HPCML_GPU_MAP=3,2,1,0", "export TMPDIR=/tmp"],
    "aurora": ["#PBS -l walltime=01:00:00", "#PBS -l select=2:ncpus=208", "#PBS -l filesystems=home:flare",
               "#PBS -l place=scatter", "module load frameworks",
               "export CCL_PROCESS_LAUNCHER=pmix", "export CCL_ATL_TRANSPORT=mpi", "export CCL_KVS_MODE=mpi",
               "export FI_MR_CACHE_MONITOR=userfaultfd", "export ZE_FLAT_DEVICE_HIERARCHY=FLAT",
               "export TMPDIR=/tmp"],
    "slurm-local": ["#SBATCH --nodes=2", "#SBATCH --time=60", "#SBATCH --exclusive", "#SBATCH --partition=debug",
                    "#SBATCH --account=proj42"],
}
EXPECTED_SUBMIT = {
    "frontier": "sbatch submit_scripts/parsl.sims.block",
    "perlmutter": "sbatch submit_scripts/parsl.sims.block",
    "summit": "bsub submit_scripts/parsl.sims.block.submit",
    "polaris": "qsub -q debug -A proj42 submit_scripts/parsl.sims.block",
    "aurora": "qsub -q debug -A proj42 submit_scripts/parsl.sims.block",
    "slurm-local": "sbatch submit_scripts/parsl.sims.block",
}


@pytest.mark.parametrize("name", BATCH_SITES)
def test_batch_script_has_the_expected_lines(name, tmp_path):
    script = render_batch_script(_config(name, tmp_path))
    lines = _lines(script.text)
    assert lines[0] == "#!/bin/bash"
    for expected in EXPECTED_SCRIPT[name]:
        assert expected in lines, f"{name}: {expected!r} missing from\n{script.text}"
    # the site's lines, then this Python environment, then the user's own, then the worker pool
    activate, user = lines.index(ACTIVATE), lines.index("echo user-init")
    assert lines.index(EXPECTED_SCRIPT[name][-1]) < activate < user < len(lines) - 1 or name == "slurm-local"
    assert lines[-1] == WORKER_COMMAND_PLACEHOLDER  # SimpleLauncher: one pool, not wrapped
    assert "--cpus-per-task" not in script.text and "--bind-to" not in script.text
    assert script.submit_command == EXPECTED_SUBMIT[name]


def test_batch_script_queue_override(tmp_path):
    frontier = render_batch_script(_config("frontier", tmp_path, queue="extended")).text
    assert "#SBATCH --partition=extended" in _lines(frontier)
    summit = render_batch_script(_config("summit", tmp_path, queue="killable")).text
    assert "#BSUB -q killable" in _lines(summit)
    polaris = render_batch_script(_config("polaris", tmp_path, queue="preemptable"))
    assert polaris.submit_command.startswith("qsub -q preemptable -A proj42 ")


def test_batch_script_without_account(tmp_path, monkeypatch):
    """An account is optional where the site says so (Perlmutter: the default project), taken
    from $HPCML_ACCOUNT when not given, and refused before Parsl submits anything where required."""
    monkeypatch.delenv("HPCML_ACCOUNT", raising=False)
    perlmutter = render_batch_script(_config("perlmutter", tmp_path, account=None))
    assert "--account" not in perlmutter.text
    for name in ("aurora", "polaris", "frontier", "summit"):
        with pytest.raises(ConfigError, match=f"site {name} requires an account: pass --account PROJECT or set "
                                              "HPCML_ACCOUNT"):
            _config(name, tmp_path, account=None, nodes=1)
    monkeypatch.setenv("HPCML_ACCOUNT", "envproj")
    aurora = render_batch_script(_config("aurora", tmp_path, account=None, nodes=1))
    assert aurora.submit_command == "qsub -q debug -A envproj submit_scripts/parsl.sims.block"


@pytest.mark.parametrize("name, nodes, walltime, queue", [
    ("polaris", 1, "01:00:00", "debug"), ("polaris", 2, "01:00:00", "debug"), ("polaris", 3, "01:00:00",
                                                                                "debug-scaling"),
    ("polaris", 2, "02:00:00", "capacity"), ("polaris", 11, "03:00:00", "prod"), ("aurora", 2, "01:00:00", "debug"),
    ("aurora", 3, "01:00:00", "debug-scaling"), ("aurora", 300, "12:00:00", "prod"),
    ("perlmutter", 100, "01:00:00", "regular"), ("perlmutter", 2, "00:30:00", "regular"), ("summit", 7, "01:00:00",
                                                                                         "batch"),
    ("frontier", 3, "01:00:00", "batch"), ("frontier", 3, "04:00:00", "extended"), ("slurm-local", 2, "01:00:00",
                                                                                     "debug"),
])
def test_block_queue_by_nodes_and_walltime(name, nodes, walltime, queue, tmp_path):
    provider = _config(name, tmp_path, nodes=nodes, walltime=walltime).executors[0].provider
    chosen = {"frontier": "partition", "slurm-local": "partition", "perlmutter": "qos"}.get(name, "queue")
    assert getattr(provider, chosen) == queue


def test_local_config_has_no_batch_script(tmp_path):
    with pytest.raises(ConfigError, match="submits no batch script"):
        render_batch_script(_config("local", tmp_path))


# ----------------------------------------------------------------------------- executors

MPI_LAUNCHER = {"frontier": "srun", "perlmutter": "srun", "polaris": "mpiexec", "aurora": "mpiexec",
                "slurm-local": "srun"}


@pytest.mark.parametrize("name", sorted(MPI_LAUNCHER))
def test_mpi_sites_use_mpiexecutor(name, tmp_path):
    config = _config(name, tmp_path, nodes=2 if name == "slurm-local" else 4, max_concurrent_sims=3, retries=5)
    (executor,) = config.executors
    assert isinstance(executor, MPIExecutor) and executor.label == "sims"
    assert executor.mpi_launcher == MPI_LAUNCHER[name] and executor.enable_mpi_mode
    assert executor.max_workers_per_block == (2 if name == "slurm-local" else 3)  # whole nodes per simulation
    assert isinstance(executor.provider.launcher, SimpleLauncher)
    assert executor.provider.nodes_per_block == (2 if name == "slurm-local" else 4)
    assert (executor.provider.init_blocks, executor.provider.min_blocks, executor.provider.max_blocks) == (1, 1, 1)
    assert executor.drain_period == 3600 - 360 and executor.encrypted
    assert config.strategy_period == 0.5  # the first block's workers are seen quickly
    assert getattr(executor.provider, "cores_per_node", None) is None  # Parsl #3006
    assert (config.retries, config.usage_tracking) == (5, 0)
    assert config.run_dir == str(tmp_path / "run" / "parsl")


def test_summit_uses_htex_with_jsrun_in_the_task(tmp_path):
    (executor,) = _config("summit", tmp_path, nodes=1, max_concurrent_sims=6).executors
    assert type(executor) is HighThroughputExecutor and not executor.enable_mpi_mode
    assert executor.label == "sims" and executor.max_workers_per_node == 6
    assert isinstance(executor.provider.launcher, SimpleLauncher)


def test_local_config_runs_threads(tmp_path):
    config = _config("local", tmp_path, max_concurrent_sims=3, retries=1)
    (executor,) = config.executors
    assert isinstance(executor, ThreadPoolExecutor) and executor.label == "sims"
    assert executor.max_threads == 3
    assert (config.retries, config.usage_tracking, config.strategy) == (1, 0, "none")
    assert config.run_dir == str(tmp_path / "run" / "parsl")


@pytest.mark.parametrize("nodes, sim_ranks, wanted, at_once", [
    (4, 2, 4, 4), (4, 56, 4, 4), (4, 57, 4, 2), (4, 112, 1, 1), (2, 2, 4, 2), (8, 2, 3, 3),
])
def test_frontier_sims_at_once_whole_nodes(nodes, sim_ranks, wanted, at_once, tmp_path):
    config = _config("frontier", tmp_path, nodes=nodes, sim_ranks=sim_ranks, max_concurrent_sims=wanted)
    assert config.executors[0].max_workers_per_block == at_once


def test_summit_packs_sims_on_cores(tmp_path):
    config = _config("summit", tmp_path, nodes=1, sim_ranks=10, max_concurrent_sims=8)
    assert config.executors[0].max_workers_per_node == 4  # 42 cores // 10 ranks


def test_a_simulation_larger_than_the_block_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match=r"sim_ranks=57 does not fit in nodes=1 of frontier \(56 cores each\)"):
        _config("frontier", tmp_path, nodes=1, sim_ranks=57)
    with pytest.raises(ConfigError, match="sim_ranks=43 does not fit in nodes=1 of summit"):
        _config("summit", tmp_path, nodes=1, sim_ranks=43)


# ----------------------------------------------------------------------------- simulations

@pytest.mark.parametrize("name, ranks, spec, prefix", [
    ("frontier", 2, {"num_nodes": 1, "num_ranks": 2, "ranks_per_node": 2},
     "srun --ntasks 2 --ntasks-per-node 2 --nodelist n1 --nodes 1 "),
    ("frontier", 112, {"num_nodes": 2, "num_ranks": 112, "ranks_per_node": 56},
     "srun --ntasks 112 --ntasks-per-node 56 --nodelist n1,n2 --nodes 2 "),
    ("perlmutter", 65, {"num_nodes": 2, "num_ranks": 65, "ranks_per_node": 33},
     "srun --ntasks 65 --ntasks-per-node 33 --nodelist n1,n2 --nodes 2 "),
    ("polaris", 33, {"num_nodes": 2, "num_ranks": 33, "ranks_per_node": 17},
     "mpiexec -n 33 -ppn 17 -hosts n1,n2 "),
    ("aurora", 8, {"num_nodes": 1, "num_ranks": 8, "ranks_per_node": 8}, "mpiexec -n 8 -ppn 8 -hosts n1 "),
])
def test_mpi_sites_sim_launch_is_parsls_prefix(name, ranks, spec, prefix, tmp_path):
    s = site.load_site(name)
    # simulations run without the collective library's variables, and on Frontier without the
    # RCCL plugin's rendezvous setting (issue 41)
    unset = [f"-u {v.name}" for v in s.environment if v.training_only]
    unset += ["-u FI_CXI_RDZV_PROTO"] if name == "frontier" else []
    assert s.sim_prefix(ranks) == " ".join(["env", *unset, "$PARSL_MPI_PREFIX"])
    assert s.sim_resource_spec(ranks) == spec
    executor = _config(name, tmp_path, nodes=2).executors[0]
    executor.validate_resource_spec(dict(spec))  # the keys MPIExecutor accepts
    hosts = ["n1", "n2"][:spec["num_nodes"]]
    assert compose_all(executor.mpi_launcher, spec, hosts)["PARSL_MPI_PREFIX"] == prefix


def test_summit_and_local_sim_launch():
    summit, local = site.load_site("summit"), site.load_site("local")
    assert summit.sim_prefix(4) == "jsrun -n4 -a1 -c1" and summit.sim_resource_spec(4) == {}
    assert local.sim_prefix(2) == "mpiexec -n 2" and local.sim_resource_spec(2) == {}


@pytest.mark.parametrize("name", SITES)
def test_sim_launch_rejects_zero_ranks(name):
    s = site.load_site(name)
    for function in (s.sim_prefix, s.sim_resource_spec):
        with pytest.raises(ConfigError, match="ranks=0 must be an integer >= 1"):
            function(0)


# ----------------------------------------------------------------------------- training launch

TRAIN = {
    "local": "mpiexec -n 4 python x.py",
    "frontier": "srun -N2 -n16 -c7 --gpus-per-task=1 --gpu-bind=closest --network=disable_rdzv_get python x.py",
    "summit": "jsrun -n12 -r6 -a1 -g1 -c7 -b packed:7 python x.py",
    "polaris": "mpiexec -n 8 --ppn 4 --depth=8 --cpu-bind depth python x.py",
    "perlmutter": "srun -C gpu -N2 -n8 -c32 --cpu-bind=cores --gpus-per-node=4 --gpu-bind=none python x.py",
    "aurora": "mpiexec -n 24 --ppn 12 --cpu-bind "
              "list:1-8:9-16:17-24:25-32:33-40:41-48:53-60:61-68:69-76:77-84:85-92:93-100 python x.py",
    "slurm-local": "srun -N2 -n4 --ntasks-per-node=2 --mpi=pmi2 python x.py",
}


@pytest.mark.parametrize("name", SITES)
def test_train_line_exact(name):
    s = site.load_site(name)
    assert s.train_line(["python", "x.py"], nodes=2) == TRAIN[name]
    quoted = s.train_line(["python", "x.py", "--tag", "a b", "$HOME"])
    assert quoted.endswith(" python x.py --tag 'a b' '$HOME'")
    with pytest.raises(ConfigError, match="nodes=0 must be an integer >= 1"):
        s.train_line(["python"], nodes=0)
    with pytest.raises(ConfigError, match=r"argv=\[\] must be a non-empty list of strings"):
        s.train_line([])
    with pytest.raises(ConfigError, match="argv='python x.py'"):
        s.train_line("python x.py")


@pytest.mark.parametrize("name, ranks, hosts, line", [
    ("frontier", 4, ["nid1"], "srun --nodelist=nid1 -N1 -n4 -c7 --gpus-per-task=1 --gpu-bind=closest "
                              "--network=disable_rdzv_get t.py"),
    ("polaris", 2, ["x1", "x2"], "mpiexec --hosts x1,x2 -n 2 --ppn 1 --depth=8 --cpu-bind depth t.py"),
    ("slurm-local", 3, ["n1", "n2"], "srun --nodelist=n1,n2 -N2 -n3 --ntasks-per-node=2 --mpi=pmi2 t.py"),
    ("summit", 6, ["h1"], "jsrun -n6 -r6 -a1 -g1 -c7 -b packed:7 t.py"),
])
def test_train_line_honours_ranks_and_pins_hosts(name, ranks, hosts, line):
    """TrainingJob.ranks on a batch site, and one-allocation mode's training nodes."""
    nodes = len(hosts)
    assert site.load_site(name).train_line(["t.py"], nodes=nodes, ranks=ranks, hosts=hosts) == line


def test_train_line_rejects_more_ranks_than_devices():
    with pytest.raises(ConfigError, match=r"ranks=9 > 8 devices on nodes=1 of frontier \(8 per node\)"):
        site.load_site("frontier").train_line(["t.py"], ranks=9)
    with pytest.raises(ConfigError, match="ranks=1 < nodes=2"):
        site.load_site("polaris").train_line(["t.py"], nodes=2, ranks=1)


# ----------------------------------------------------------------------------- one allocation

@pytest.mark.parametrize("name, launcher", [("frontier", "srun"), ("polaris", "mpiexec"), ("slurm-local", "srun")])
def test_one_allocation_config_starts_workers_here_on_the_simulation_nodes(name, launcher, tmp_path):
    """Inside the user's job: no block is submitted; the workers' environment narrows the
    job's node list to the simulations' nodes, which is where MPIExecutor places tasks."""
    from parsl.providers import LocalProvider

    config = _config(name, tmp_path, nodes=1, sim_nodes=("n2", "n3"), max_concurrent_sims=8)
    (executor,) = config.executors
    assert isinstance(executor, MPIExecutor) and executor.mpi_launcher == launcher
    assert isinstance(executor.provider, LocalProvider) and executor.max_workers_per_block == 2
    assert executor.address == "127.0.0.1"
    init = executor.provider.worker_init
    if site.load_site(name).scheduler == "slurm":
        assert "export SLURM_NODELIST=n2,n3 SLURM_JOB_NODELIST=n2,n3" in init.splitlines()
    else:
        nodefile = tmp_path / "run" / "sim_nodes"
        assert f"export PBS_NODEFILE={nodefile}" in init.splitlines() and nodefile.read_text() == "n2\nn3\n"


# ----------------------------------------------------------------------------- bad arguments

@pytest.mark.parametrize("name", SITES)
@pytest.mark.parametrize("kwargs, words", [
    ({"nodes": 0}, "nodes=0 must be an integer >= 1"),
    ({"nodes": True}, "nodes=True must be an integer >= 1"),
    ({"max_concurrent_sims": 0}, "max_concurrent_sims=0 must be an integer >= 1"),
    ({"sim_ranks": -2}, "sim_ranks=-2 must be an integer >= 1"),
    ({"retries": -1}, "retries=-1 must be an integer >= 0"),
    ({"walltime": "1h"}, "walltime='1h' must be HH:MM:SS"),
    ({"walltime": "01:60:00"}, "walltime='01:60:00' must be HH:MM:SS"),
    ({"walltime": 3600}, "walltime=3600 must be HH:MM:SS"),
    ({"walltime": "00:00:30"}, "walltime='00:00:30' is under one minute"),
    ({"account": "my proj"}, "account='my proj' must be a non-empty word or None"),
    ({"queue": ""}, "queue='' must be a non-empty word or None"),
    ({"run_dir": ""}, "run_dir='' must be a non-empty path"),
    ({"sim_nodes": ["n1", "bad host"]}, "sim_nodes=['bad host'] must be host names"),
])
def test_bad_arguments_are_one_line_config_errors(name, kwargs, words, tmp_path):
    with pytest.raises(ConfigError) as info:
        _config(name, tmp_path, **kwargs)
    assert words in str(info.value) and "\n" not in str(info.value)
    assert isinstance(info.value, ValueError)


def test_drain_period_leaves_the_end_of_the_walltime_free():
    assert site.drain_period("01:00:00") == 3600 - 360
    assert site.drain_period("12:00:00") == 12 * 3600 - 600
    assert site.drain_period("00:05:00") == 300 - 60
    assert site.drain_period("00:01:30") == 45


# ----------------------------------------------------------------------------- the local site, for real

def test_local_config_runs_two_mpi_simulations(tmp_path):
    """Two bash_apps each run a 2-rank mpiexec through the local config; both print the world size."""
    local = site.load_site("local")
    parsl.load(local.parsl_config(run_dir=str(tmp_path / "run"), max_concurrent_sims=2, retries=0))
    try:
        @bash_app(executors=[site.SIMS_LABEL])
        def stamp(path: str):
            return f"date +%s.%N > {path}"

        @bash_app(executors=[site.SIMS_LABEL])
        def simulation(launch: str, stdout: str, stderr: str, parsl_resource_specification: dict):
            # one write per rank: print() writes "2" and "\n" apart, which mpiexec may interleave
            code = "import sys; from mpi4py import MPI; sys.stdout.write(f'{MPI.COMM_WORLD.size}\\n')"
            return f"{launch} {shlex.quote(sys.executable)} -c {shlex.quote(code)}"

        submitted = time.time()
        stamp(str(tmp_path / "stamp")).result(timeout=30)
        started = float((tmp_path / "stamp").read_text())
        assert started - submitted < 1.0, f"first task started {started - submitted:.3f} s after submission"

        outputs = [tmp_path / f"sim{i}.out" for i in range(2)]
        futures = [simulation(local.sim_prefix(2), stdout=str(out), stderr=str(out.with_suffix(".err")),
                              parsl_resource_specification=local.sim_resource_spec(2)) for out in outputs]
        assert [f.result(timeout=60) for f in futures] == [0, 0]
        assert [out.read_text().split() for out in outputs] == [["2", "2"], ["2", "2"]]
    finally:
        parsl.dfk().cleanup()
        parsl.clear()


def test_local_training_takes_a_rank_count():
    """On one machine the trainer's size is a rank count; the Campaign passes TrainingJob.ranks."""
    local = site.load_site("local")
    assert local.train_line(["python", "t.py"], ranks=4) == "mpiexec -n 4 python t.py"
    assert local.train_line(["python", "t.py"], nodes=2) == "mpiexec -n 4 python t.py"
    with pytest.raises(ValueError, match="ranks"):
        local.train_line(["python"], ranks=0)
