"""hpcml.train.fault.KillAtStep: the reliability tests' crash, checked without dying (the
crash itself runs in tests/workflows/test_heat_surrogate.py: a trainer killed twice)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from hpcml.errors import ConfigError
from hpcml.train.fault import KillAtStep


def test_it_dies_by_sigkill_at_its_step_and_counts_the_crash(tmp_path):
    code = ("import sys; from pathlib import Path; from hpcml.train.fault import KillAtStep; "
            f"k = KillAtStep(step=3, marker=Path({str(tmp_path / 'm')!r}), times=2)\n"
            "for s in range(1, 6): k({'step': s}); print('after', s, flush=True)")
    first = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert first.returncode == -9 and first.stdout.splitlines()[-1] == "[train] reliability test: killing trainer " \
        "rank 0 after step 3 (crash 1 of 2)" and "after 2" in first.stdout and "after 3" not in first.stdout
    assert (tmp_path / "m").read_text() == "1"
    (tmp_path / "m").write_text("2")  # two launches crashed: the third lives (in this process)
    k = KillAtStep(step=3, marker=tmp_path / "m", times=2)
    for s in range(1, 6):
        k({"step": s})
    assert (tmp_path / "m").read_text() == "2"


def test_other_steps_and_ranks_pass_and_bad_input_is_one_line(tmp_path):
    KillAtStep(step=3, rank=1, marker=tmp_path / "m")({"step": 3})  # rank 0 here: not the one that dies
    for bad, msg in (({"step": 0}, "step=0: expected an integer >= 1"), ({"step": True}, "step=True"),
                     ({"step": 2, "times": 0}, "times=0")):
        with pytest.raises(ConfigError, match=msg):
            KillAtStep(marker=tmp_path / "m", **bad)
    (tmp_path / "junk").write_text("x" * 10)
    with pytest.raises(ConfigError, match=r"junk holds 'xxxxxxxxxx': expected a count of crashes"):
        KillAtStep(step=2, marker=tmp_path / "junk")
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(ValueError, match="fifo"):  # a FIFO is refused at once, never opened for reading
        KillAtStep(step=2, marker=tmp_path / "fifo")
