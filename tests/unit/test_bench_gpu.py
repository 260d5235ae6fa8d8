"""benchmarks/gpu.py (issue 23, GPU readiness): one line and exit 69 without a GPU; its CPU
smoke run goes through every section's code path; a failing section is named, not hidden."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu.py"
CLEAN_ENV = {k: v for k, v in os.environ.items()
             if not k.startswith(("PMI_", "PMIX_", "MPI_LOCAL", "SLURM_", "OMPI_", "HYDRA_"))}
HAS_GPU = torch.cuda.is_available() or (hasattr(torch, "xpu") and torch.xpu.is_available())
SMOKE_RANKS = 2 if shutil.which("mpiexec") else 1


def load_driver():
    spec = importlib.util.spec_from_file_location("hpcml_bench_gpu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=CLEAN_ENV,
                          cwd=ROOT, timeout=timeout)


def numbers(obj):
    """Every int or float in a JSON value (bools excluded)."""
    if isinstance(obj, dict):
        for v in obj.values():
            yield from numbers(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from numbers(v)
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
        yield obj


@pytest.mark.skipif(HAS_GPU, reason="a GPU is present: the benchmark runs instead of refusing")
def test_without_a_gpu_it_fails_at_once_in_one_line():
    out = run("--json", timeout=60)
    assert out.returncode == 69
    assert out.stdout == ""
    assert out.stderr == ("benchmarks/gpu.py: no GPU: torch.cuda.is_available() is False "
                          "(CUDA/ROCm/XPU device needed)\n")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    where = tmp_path_factory.mktemp("gpu-smoke")
    out = run("--cpu-smoke", "--json", "--smoke-ranks", str(SMOKE_RANKS), "--dir", str(where), "--timeout", "150")
    assert out.returncode == 0, out.stderr[-4000:]
    assert list(where.iterdir()) == []  # checkpoints, disk test and rendezvous files removed
    return json.loads(out.stdout)


def test_smoke_says_it_is_no_measurement(smoke):
    assert smoke["smoke"] is True and smoke["spec"]["smoke"] is True
    assert "not measurements" in smoke["note"]
    assert smoke["failed"] == []
    assert set(smoke["sections"]) == {"mfu", "fsdp", "tp2", "moe", "bringup", "ckpt", "field"}
    assert all(math.isfinite(x) for x in numbers(smoke))


@pytest.mark.parametrize("section, keys", [
    ("mfu", ["tokens_per_s", "tflops_per_device", "eager_tokens_per_s", "hpcml_vs_eager", "gemm_tflops"]),
    ("fsdp", ["tokens_per_s", "tokens_per_s_per_device", "scaling_efficiency"]),
    ("tp2", ["tokens_per_s", "tokens_per_s_per_device", "scaling_efficiency"]),
    ("moe", ["dense_tokens_per_s", "grouped_tokens_per_s", "loop_tokens_per_s", "grouped_vs_dense",
             "grouped_load_max_over_mean"]),
    ("ckpt", ["state_bytes", "disk_write_gbps", "d2h_pageable_gbps", "sync_save_s", "async_block_second_s",
              "async_total_gbps", "dcp_async_block_s", "async_block_vs_sync", "async_total_vs_disk"]),
])
def test_smoke_section_has_positive_figures(smoke, section, keys):
    sec = smoke["sections"][section]
    if section in ("fsdp", "tp2") and SMOKE_RANKS == 1:
        assert sec == {"status": "skipped", "reason": "needs >= 2 ranks (--smoke-ranks), 1 visible"}
        return
    assert sec["status"] == "ok", sec
    for key in keys:
        assert sec[key] > 0, (key, sec[key])


def test_smoke_two_part_sections(smoke):
    up, field = smoke["sections"]["bringup"], smoke["sections"]["field"]
    assert up["status"] == "ok" and field["status"] == "ok"
    for part in (up["hpcml"], up["torch"]):
        assert part["ranks"] == SMOKE_RANKS and part["allreduce_correct"] is True
        assert part["bringup_s"] > 0 and part["first_allreduce_s"] > 0
    assert up["hpcml_over_torch_bringup"] > 0
    assert field["gpu"]["samples_per_s"] > 0 and field["cpu"]["samples_per_s"] > 0 and field["gpu_over_cpu"] > 0
    assert field["gpu"]["final_loss"] == pytest.approx(field["cpu"]["final_loss"], rel=1e-4)  # same steps


def test_a_failing_section_is_named_and_the_rest_still_runs():
    out = run("--cpu-smoke", "--json", "--sections", "mfu", "moe", "--model-size", "no-such-model", timeout=120)
    assert out.returncode == 1
    assert out.stderr.splitlines()[-1] == "benchmarks/gpu.py: failed sections: mfu (errors in the JSON)"
    res = json.loads(out.stdout)
    assert res["failed"] == ["mfu"]
    assert res["sections"]["mfu"]["status"] == "error"
    assert "unknown transformer preset 'no-such-model'" in res["sections"]["mfu"]["error"]
    assert res["sections"]["moe"]["status"] == "ok"


def test_one_gpu_skips_the_multi_gpu_sections_with_the_reason():
    gpu = load_driver()
    launches = {w: (ranks, skip) for _, w, ranks, _, skip in gpu.plan(list(gpu.SECTIONS), 1, smoke=False)}
    assert launches["fsdp"] == (1, "needs >= 2 GPUs, 1 visible")
    assert launches["tp2"] == (1, "needs >= 2 GPUs, 1 visible")
    assert launches["mfu"] == (1, None) and launches["bringup_hpcml"] == (1, None)
    three = {w: skip for _, w, _, _, skip in gpu.plan(["fsdp", "tp2"], 3, smoke=False)}
    assert three == {"fsdp": None, "tp2": "needs an even number of GPUs, 3 visible"}
    four = {w: ranks for _, w, ranks, _, _ in gpu.plan(list(gpu.SECTIONS), 4, smoke=False)}
    assert four["fsdp"] == four["tp2"] == four["bringup_torch"] == 4 and four["ckpt"] == 1


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H100 80GB HBM3", 989.4), ("NVIDIA H100 PCIe", 756.5), ("NVIDIA H200", 989.4),
    ("NVIDIA GH200 480GB", 989.4), ("NVIDIA A100-SXM4-40GB", 312.0), ("AMD Instinct MI250X", 191.5),
    ("AMD Instinct MI250X/MI250", None), ("Intel(R) Data Center GPU Max 1550", 367.0),
    ("NVIDIA GeForce RTX 4090", None), ("Tesla V100-SXM2-16GB", None),
])
def test_peak_table_never_guesses(name, peak):
    load_driver()  # puts benchmarks/ on sys.path
    from gpu_common import peak_tflops

    got, source = peak_tflops(name)
    assert got == peak
    assert source  # a datasheet, or what to pass instead
