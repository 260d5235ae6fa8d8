"""Issue 39: a user's mistake ends the campaign at its first occurrence, with its cause named.

The simulation is one the project does not ship: a 1-D shallow-water height field on 2 MPI
ranks, written here as a newcomer would (``Producer.from_campaign`` and ``send``), streaming
into the Burgers trainer of ``own_sim/`` (field ``u`` on 64 points). Four mistakes: the field
sent under another name (``h``), a block of the wrong shape, a simulation that blows up
(an infinity at step 5, which once reached training and made every weight NaN), and ranks whose
blocks overlap (a halo point sent as a rank's own: each sample dropped as ``incomplete_cover``
until the campaign ended, 52 s, then "resume the campaign", which failed the same way). Before, the first cost 82 s
and ended in "resume the campaign", the second three attempts per simulation and a relaunched
trainer. Now the producer learns what the trainer takes at its handshake and refuses at the
first ``send``; the error is final: one attempt, no retry (``retries=2``), no relaunch, and the
campaign's error names the simulation and the values.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("parsl")

from hpcml.ensemble import Campaign, SimSpec, TrainingJob  # noqa: E402
from hpcml.errors import ConfigError  # noqa: E402
from hpcml.stream import new_secret  # noqa: E402

TRAIN = str(Path(__file__).resolve().parent / "own_sim" / "train_burgers.py")

SHALLOW = '''
import argparse, json
import numpy as np
from mpi4py import MPI
from hpcml.stream import Producer

p = argparse.ArgumentParser()
p.add_argument("--sim-id", type=int, required=True)
p.add_argument("--params-json", required=True)
p.add_argument("--mistake", choices=("field", "shape", "blowup", "overlap"), required=True)
args = p.parse_args()
comm = MPI.COMM_WORLD
nx = 64
lo, hi = comm.rank * nx // comm.size, (comm.rank + 1) * nx // comm.size
if args.mistake == "overlap" and comm.rank == 1:
    lo -= 1  # a halo point of rank 0's sent as its own
h = 1.0 + 0.1 * np.sin(2 * np.pi * np.arange(lo, hi) / nx)
out = Producer.from_campaign(comm=comm, params=json.loads(args.params_json), global_shape=(nx,), offset=(lo,),
                             local_shape=(hi - lo,), sim_id=args.sim_id)
for step in range(20):
    h = h + 0.01 * np.roll(h, 1) - 0.01 * h
    if args.mistake == "field":
        out.send(step, 0.1 * step, {"h": h})  # the trainer trains on "u"
    elif args.mistake == "blowup":
        if step == 5:
            h[0] = np.inf  # an unstable step: one point overflows
        out.send(step, 0.1 * step, {"u": h})
    elif args.mistake == "shape":
        out.send(step, 0.1 * step, {"u": np.append(h, 0.0)})  # one point too many
    else:
        out.send(step, 0.1 * step, {"u": h})
out.close()
'''


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mistake, cause", [
    ("field", "fields ['h'] sent, the trainer takes ['u'] (trainer rank 0 at tcp://"),
    ("shape", "field 'u' has shape (33,), expected the subdomain (32,)"),
    ("blowup", "field 'u' at step 5 holds 0 NaN and 1 infinite values of 32 (the first at (0,) of this rank's "
               "subdomain): the simulation diverged"),
    ("overlap", "rank 0's block at offset (0,) of local_shape (32,) and rank 1's at (31,) of (33,) overlap: each "
                "point of global_shape (64,) must come from one rank"),
])
def test_a_deterministic_mistake_ends_the_campaign_at_once_with_its_cause(tmp_path, mistake, cause):
    sim = tmp_path / "shallow1d.py"
    sim.write_text(SHALLOW)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    new_secret(run_dir / "stream.key")
    env = {"HPCML_STREAM_ENDPOINTS_FILE": str(run_dir / "endpoints.json"),
           "HPCML_STREAM_SECRET_FILE": str(run_dir / "stream.key")}
    sims = [SimSpec(sim_id=i, params={"nu": 0.02, "amp": 0.7}, ranks=2,
                    argv=[sys.executable, str(sim), "--mistake", mistake]) for i in range(4)]
    training = TrainingJob(argv=[sys.executable, TRAIN, "--nx", "64", "--t-max", "2.0", "--steps", "50"],
                           ranks=1, max_restarts=2)
    campaign = Campaign(run_dir=run_dir, site="local", max_concurrent=2, retries=2, env=env, progress=False)
    t0 = time.monotonic()
    with pytest.raises(ConfigError) as e:
        campaign.run(sims, training=training, ready_file=run_dir / "endpoints.json", ready_timeout_s=120,
                     train_timeout_s=120)
    wall = time.monotonic() - t0
    text = str(e.value)
    assert text.startswith("simulation ") and ("failed on a deterministic error, not retried (a retry, or a resume "
                                               "before its cause is fixed, would fail the same way): simulation "
                                               ) in text, text
    assert cause in text, text
    assert "resume=True" not in text
    prov = [json.loads(x) for x in (run_dir / "provenance.jsonl").read_text().splitlines()]
    failed = [r for r in prov if r["status"] == "failed"]
    assert failed and all(r["attempt"] == 0 for r in prov), prov  # no retry of anything
    record = json.loads((run_dir / "campaign.json").read_text())
    assert record["training"]["restarts"] == 0, record["training"]  # the trainer was not relaunched
    # and stopped by the campaign: its returncode (0, MPICH's launcher's after SIGTERM) is not the trainer's own
    assert record["training"].get("stopped_by") == "campaign", record["training"]
    print(f"\n{mistake}: ended in {wall:.1f} s: {text}")
