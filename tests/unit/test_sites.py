"""site_configs/*: finding every typed Site, its validation and its hardware facts. What a
Site builds for Parsl (configs, block scripts, launch lines) is tested in test_site_parsl.py."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from hpcml.ensemble import site
from hpcml.ensemble.site import Queue, Site, SiteHardware, Source
from hpcml.errors import ConfigError

SITES = ["aurora", "frontier", "local", "perlmutter", "polaris", "slurm-local", "summit"]


# ----------------------------------------------------------------------------- finding sites

def test_list_sites_names_every_module():
    assert site.list_sites() == SITES


def test_load_site_returns_the_typed_site():
    frontier = site.load_site("frontier")
    assert isinstance(frontier, Site) and frontier.name == "frontier" and frontier.scheduler == "slurm"
    assert site.load_site("slurm_local") is site.load_site("slurm-local")  # '-' and '_' alike
    assert site.load_site(frontier) is frontier


def test_unknown_site_is_one_line_naming_it_and_the_known_ones():
    with pytest.raises(ConfigError) as info:
        site.load_site("nope")
    message = str(info.value)
    assert "'nope'" in message and "\n" not in message
    assert message.endswith("known sites are aurora, frontier, local, perlmutter, polaris, slurm-local, summit")


@pytest.mark.parametrize("name", SITES)
def test_every_site_is_one_literal_value(name):
    """A site module holds one Site; nothing else is read from it (no getattr contract)."""
    s = site.load_site(name)
    assert isinstance(s.hardware, SiteHardware) and s.name == name
    assert s.train_ranks_per_node == (s.hardware.gpus_per_node or 2)
    source = Path(sys.modules[f"site_configs.{name.replace('-', '_')}"].__file__).read_text()
    assert "parsl.channels" not in source  # removed from Parsl; OLCF's old example still imports it
    assert "_write_submit_script" not in source


@pytest.mark.parametrize("overrides, words", [
    ({"train_launch": "srun -n{tasks}"}, "uses ['tasks']"),
    ({"mpi_launcher": "aprun"}, "mpi_launcher='aprun' must be one of srun, mpiexec"),
    ({"sim_launch": "mpiexec -n {ranks}"}, "sim_launch='[env ...] $PARSL_MPI_PREFIX' goes with an mpi_launcher"),
    ({"train_ranks_per_node": 3}, "train_ranks_per_node=3 must equal gpus_per_node=8"),
    ({"queues": (Queue(name="q", max_walltime="01:00:00", source=Source(url="https://x.org/q", read="2026-01-01")),)},
     "queues ['q'] must be of kind partition or qos on slurm"),
    ({"environment": ({"NCCL_NET": "x"},)}, "environment must be a tuple of EnvVar"),
    ({"modules": ("module load x",)}, "modules must be a tuple of Fact"),
])
def test_site_validation_names_the_value(overrides, words):
    fields = {k: getattr(site.load_site("frontier"), k) for k in Site.__dataclass_fields__}
    Site(**fields)  # the site as it is passes
    with pytest.raises(ConfigError, match=re.escape(words)):
        Site(**{**fields, **overrides})


def test_sites_load_from_anywhere_without_torch_or_mpi4py(tmp_path):
    """From a directory where ``site_configs`` is not importable (a script in workflows/):
    found next to hpcml; loading every site imports neither torch nor mpi4py."""
    code = ("import sys; from hpcml.ensemble import site\n"
            "for name in site.list_sites(): site.load_site(name)\n"
            "print(len(site.list_sites()), sorted(m for m in ('torch', 'mpi4py') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=tmp_path, timeout=60)
    assert out.stdout.strip() == f"{len(SITES)} []"
    parsl_free = ("import sys; from hpcml.ensemble import site\n"
                  "[site.load_site(n) for n in site.list_sites()]; print('parsl.executors' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", parsl_free], capture_output=True, text=True, check=True, cwd=tmp_path)
    assert out.stdout.strip() == "False"  # `hpcml job` on a login node stays quick


# ----------------------------------------------------------------------------- hardware facts

HARDWARE = {  # name: (gpus_per_node, scheduler, bf16 TFLOP/s per device, injection GB/s, usable cores)
    "frontier": (8, "slurm", 191.5, 100.0, 56),
    "summit": (6, "lsf", 15.7, 25.0, 42),
    "polaris": (4, "pbs", 312.0, 50.0, 32),
    "perlmutter": (4, "slurm", 312.0, 100.0, 64),
    "aurora": (12, "pbs", 367.0, 200.0, 102),
}


@pytest.mark.parametrize("name", sorted(HARDWARE))
def test_hardware_facts(name):
    hw = site.load_site(name).hardware
    gpus, scheduler, bf16, injection, cores = HARDWARE[name]
    assert (hw.name, hw.gpus_per_node, hw.scheduler) == (name, gpus, scheduler)
    assert (hw.peak_tflops_bf16_per_gpu, hw.node_injection_gbps, hw.cpu_cores_per_node) == (bf16, injection, cores)
    assert hw.peak_tflops_bf16_per_gpu >= hw.peak_tflops_fp32_per_gpu > 0
    assert 16 <= hw.gpu_memory_gb <= 64 and 256 <= hw.memory_gb_per_node <= 1024
    assert hw.peak_tflops_bf16_per_node == pytest.approx(gpus * bf16)
    assert "GB/s" in hw.intra_node_link


def test_slurm_local_facts_match_the_test_cluster():
    """What scripts/slurm_cluster.sh configures: CPUs=4 per node (config_overrides), no GPU."""
    hw = site.load_site("slurm-local").hardware
    assert (hw.gpus_per_node, hw.cpu_cores_per_node, hw.scheduler) == (0, 4, "slurm")
    script = (Path(__file__).resolve().parents[2] / "scripts" / "slurm_cluster.sh").read_text()
    assert "CPUS=${HPCML_SLURM_CPUS:-4}" in script


def test_local_hardware_is_this_machine():
    import os

    hw = site.load_site("local").hardware
    assert (hw.gpus_per_node, hw.scheduler, hw.gpu_model) == (0, "local", "none")
    assert hw.cpu_cores_per_node == (os.cpu_count() or 1)
    assert hw.memory_gb_per_node > 0 and hw.peak_tflops_bf16_per_node == 0


def _hardware(**overrides) -> SiteHardware:
    fields = {"name": "x", "gpus_per_node": 4, "gpu_model": "g", "cpu_cores_per_node": 32,
              "memory_gb_per_node": 256.0, "gpu_memory_gb": 40.0, "peak_tflops_bf16_per_gpu": 312.0,
              "peak_tflops_fp32_per_gpu": 19.5, "node_injection_gbps": 50.0, "intra_node_link": "l",
              "scheduler": "pbs"}
    return SiteHardware(**{**fields, **overrides})


@pytest.mark.parametrize("overrides, words", [
    ({"gpus_per_node": -1}, "gpus_per_node=-1"),
    ({"cpu_cores_per_node": 0}, "cpu_cores_per_node=0"),
    ({"memory_gb_per_node": 0.0}, "memory_gb_per_node=0.0"),
    ({"scheduler": "sge"}, "'sge'"),
    ({"gpu_memory_gb": 0.0}, "gpu_memory_gb=0.0 must be > 0 with gpus_per_node=4"),
    ({"gpus_per_node": 0}, "gpu_memory_gb=40.0 must be 0 with gpus_per_node=0"),
    ({"name": "my site"}, "'my site'"),
    ({"name": "Frontier"}, "'Frontier'"),
])
def test_hardware_validation_names_the_number(overrides, words):
    with pytest.raises(ConfigError, match=re.escape(words)):
        _hardware(**overrides)
    with pytest.raises(TypeError):
        SiteHardware("x")  # keyword-only
