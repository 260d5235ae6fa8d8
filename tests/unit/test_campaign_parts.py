"""Issue 44: the pieces a campaign run is made of, each tested alone -- when it stops and how
long its trainer then has to save (``StopPolicy``), and when an adaptive campaign's next wave
is due (``Waves.due``). The trainer's supervision (``TrainerWatch``) runs real training jobs
in tests/workflows (a trainer killed, relaunched, out of restarts, stopped by the walltime)."""

from __future__ import annotations

import pytest

from hpcml import stop
from hpcml.ensemble.sampling import Halton
from hpcml.ensemble.spec import SimSpec
from hpcml.ensemble.stopping import LAST_SECONDS_S, SAVE_MARGIN_S, SAVE_WINDOW_S, StopPolicy
from hpcml.ensemble.waves import Waves

BOUNDS = {"k": (0.1, 10.0), "q": (-1.0, 1.0)}


def test_the_campaign_stops_near_its_walltime_on_a_warning_or_for_the_first_reason_noted():
    now = [1000.0]
    p = StopPolicy(1000.0 + 300, signals=False, clock=lambda: now[0])
    assert not p.stopping() and p.reason is None
    assert p.save_window() == 300 - LAST_SECONDS_S  # the trainer saves until just before the walltime
    now[0] = 1000.0 + 300 - SAVE_MARGIN_S + 1  # no warning came, and the walltime is near
    assert p.stopping() and p.reason == f"walltime: {SAVE_MARGIN_S:.0f} s left and no warning came"
    p.note("trainer saved and stopped (exit 75)")
    assert p.reason == f"walltime: {SAVE_MARGIN_S:.0f} s left and no warning came"  # the first reason is kept

    q = StopPolicy(None, signals=False)
    assert not q.stopping() and q.save_window() == SAVE_WINDOW_S  # no walltime: a fixed save window
    q.note("trainer saved and stopped (exit 75)")
    assert q.stopping() and q.reason == "trainer saved and stopped (exit 75)"

    stop.request("SIGUSR1")
    try:
        assert not StopPolicy(None, signals=False).stopping()  # a driver that did not install the handlers
        heard = StopPolicy(None, signals=True)
        assert heard.stopping() and heard.reason == "SIGUSR1"
    finally:
        stop.clear()


def test_the_next_wave_is_due_when_enough_of_the_last_has_ended_nothing_runs_or_a_trainer_rank_idles(tmp_path):
    w = Waves(lambda i, p: SimSpec(sim_id=i, params=p, argv=["true"]), Halton(BOUNDS, seed=0), budget=8, size=4,
              trigger=0.5)
    w.open(tmp_path)
    asked = []
    idle = lambda: asked.append(1) or False  # noqa: E731 -- counts how often it was asked
    assert w.last_ids() == [] and w.due(0, running=True, idle=idle)  # none proposed yet
    w.propose(None)
    assert w.last_ids() == [0, 1, 2, 3]
    assert not w.due(1, running=True, idle=idle) and asked == [1]  # 1 of 4 ended, below the trigger
    assert w.due(2, running=True, idle=idle) and asked == [1]  # half ended: due, idle() not asked
    assert w.due(0, running=False, idle=idle)  # nothing runs
    assert w.due(0, running=True, idle=lambda: True)  # a trainer rank has no simulation to learn from
    with pytest.raises(TypeError):
        w.due(0, True)  # keywords: which flag is which is never a guess
