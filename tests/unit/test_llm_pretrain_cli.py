"""workflows/llm_pretrain.py answers ``--help`` and a mistyped flag before it imports torch: on a
job of many ranks each would pay ~3 CPU-s of imports for a one-line usage error."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "workflows" / "llm_pretrain.py")
#: The script run as ``__main__`` with torch made unimportable: any import of it raises.
NO_TORCH = ("import runpy, sys; sys.modules['torch'] = None; sys.argv = ['llm_pretrain.py', *sys.argv[1:]]; "
            f"runpy.run_path({SCRIPT!r}, run_name='__main__')")


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", NO_TORCH, *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=60)


def test_a_mistyped_flag_and_help_answer_without_importing_torch():
    bad = _run("--steps", "x")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.strip().splitlines()[-1] == "llm_pretrain.py: error: argument --steps: invalid int value: 'x'"
    unknown = _run("--tp", "2", "--fsdpp")
    assert unknown.returncode == 2 and unknown.stderr.strip().endswith("unrecognized arguments: --fsdpp")
    usage = _run("--help")
    assert usage.returncode == 0 and "--reduce-dtype" in usage.stdout and usage.stderr == ""
    ran = _run("--steps", "1")  # past the arguments the trainer needs torch: the block holds
    assert ran.returncode != 0 and "torch" in ran.stderr
