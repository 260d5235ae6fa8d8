"""What an online training run did, summed over its trainer ranks: exactly-once accounting
and the reasons it is not ``ok`` (no silent success).

Counts cover the whole campaign, not one job: a rank's ``seen`` keys and what each of its
simulations should have given come back from the checkpoint, so a run resumed after a
requeue or a relaunch still knows what the first job ingested. Per simulation:

- expected: what it streamed (its Producer's count, from the driver's done record or its
  ranks' end markers) -- or, read from files, the samples in its file;
- ingested: the samples of it that entered a buffer, each (simulation, step) once;
- missing = expected - ingested: sent, never trained on -- the run fails and names them;
- duplicates: samples received again (a retried simulation) and dropped;
- untrained: ingested, never in a batch (the step budget ended first): a note, not a failure.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

BENIGN_DROPS = frozenset({"stale_attempt"})
"""Drops that lose nothing: a retried simulation's older attempt, superseded by the new one.
Any other dropped message fails the run (its data never reached training)."""
_LISTED = 8


def accounting(per_rank: list[dict]) -> dict[str, Any]:
    """Every rank's ``{"expected", "ingested"}`` (per simulation) summed into the run's counts."""
    expected: dict[int, int | None] = {}
    ingested: Counter[int] = Counter()
    for acc in per_rank:
        for sim, n in acc.get("expected", {}).items():
            expected[int(sim)] = n
        ingested.update({int(s): n for s, n in acc.get("ingested", {}).items()})
    silent = sorted({int(s) for acc in per_rank for s in acc.get("silent", [])})
    known = {s: n for s, n in expected.items() if n is not None}
    missing = {s: n - ingested[s] for s, n in sorted(known.items()) if ingested[s] < n}
    return {"samples_expected": sum(known.values()), "samples_missing": sum(missing.values()),
            "missing_by_sim": {str(s): n for s, n in missing.items()},
            "sims_count_unknown": sorted(s for s, n in expected.items() if n is None),
            "sims_expected": len(expected), "sims_silent": silent}


def summarize(stats: list[dict], *, steps: int, batch: int, world: int, final_loss: float | None) -> dict[str, Any]:
    """The run's summary from every rank's gathered stats (``train_online``'s)."""
    busy = sum(s["since_first_batch_s"] for s in stats)
    evicted_unused = sum(s.get("buffer", {}).get("evicted_unused", 0) for s in stats)
    unused = sum(s["unused"] for s in stats)
    return {"samples_ingested": sum(s["samples"] for s in stats),
            **accounting([s["accounting"] for s in stats]),
            "duplicate_samples": sum(s.get("duplicates", 0) for s in stats),
            "dropped_messages": dict(sum((Counter(s.get("dropped", {})) for s in stats), Counter())),
            "intake_mb_s": sum(s.get("intake_mb_s", 0.0) for s in stats),
            "bytes_ingested": sum(s.get("bytes", 0) for s in stats),
            "samples_unused": unused, "samples_untrained": unused + evicted_unused,
            "samples_drained": sum(s.get("drained", 0) for s in stats),
            "samples_trained": steps * batch * world, "gradient_steps": steps, "final_loss": final_loss,
            "trainer_idle_fraction": sum(s["starved_s"] for s in stats) / busy if busy else 0.0,
            "agreement_fraction": sum(s["agree_s"] for s in stats) / busy if busy else 0.0,
            "train_s": max(s["train_s"] for s in stats),
            "buffer": {"per_rank": [s.get("buffer", {}) for s in stats]}, "train_ranks": world}


def _sims(by_sim: dict[str, int], expected: dict) -> str:
    items = list(by_sim.items())
    text = ", ".join(f"simulation {s}: {n}" + (f" of {expected[s]}" if s in expected else "") for s, n in
                     items[:_LISTED])
    return text + (f", and {len(items) - _LISTED} more" if len(items) > _LISTED else "")


def problems(summary: dict, stats: list[dict], steps: int, *, batch: int = 1, budget: int | None = None,
             policy: str = "fifo") -> tuple[list[str], list[str]]:
    """(problems that fail the run, notes that do not). ``batch``: samples a rank takes a step;
    ``budget``: the steps asked for; ``policy``: the training buffer's."""
    out: list[str] = []
    short = {r: s["samples"] for r, s in enumerate(stats) if 0 < s["samples"] < batch}
    if steps == 0 and short:
        r, n = min(short.items(), key=lambda kv: kv[1])
        out.append(f"the trainer took 0 gradient steps: trainer rank {r} received {n} sample(s) before its stream "
                   f"ended, fewer than the batch of {batch} a rank takes a step -- lower the batch "
                   f"(TrainingJob(batch=) or the trainer's config) to at most {n}, or run more simulations")
    elif steps == 0:
        out.append("the trainer took 0 gradient steps")
    died = [f"trainer rank {r}: {s['error']}" for r, s in enumerate(stats) if s.get("error")]
    if died:
        out.append(f"the sample source died ({'; '.join(died)}): data sent after that was lost")
    for r, s in enumerate(stats):
        if s["samples"]:
            continue
        expected = s["accounting"].get("expected", {})
        if s["accounting"].get("silent") and not expected:
            continue  # said once below, naming them
        if expected and not any(expected.values()):
            out.append(f"trainer rank {r} received no sample: the {len(expected)} completed simulation(s) routed to "
                       f"it ({sorted(int(k) for k in expected)[:_LISTED]}) streamed none: each ended having sent 0 "
                       f"samples (no output step reached, or run without its stream, e.g. without --stream)")
        else:
            out.append(f"trainer rank {r} received no sample")
    dropped = {k: n for k, n in summary["dropped_messages"].items() if k not in BENIGN_DROPS}
    if dropped:
        why = ", ".join(f"{n} {reason}" for reason, n in sorted(dropped.items()))
        out.append(f"{sum(dropped.values())} message(s) were dropped ({why}): see the trainer's log")
    if summary.get("sims_silent"):
        out.append(f"simulation(s) {summary['sims_silent'][:_LISTED]} completed without streaming (no "
                   f"hpcml.stream.Producer of theirs was closed: run without their stream option?): their samples "
                   f"never reached training")
    if summary["samples_missing"]:
        exp = {str(k): v for s in stats for k, v in s["accounting"].get("expected", {}).items()}
        out.append(f"{summary['samples_missing']} of {summary['samples_expected']} samples of completed simulations "
                   f"never reached training ({_sims(summary['missing_by_sim'], exp)} missing): a trainer that "
                   f"died lost what it received after its last checkpoint; resume the campaign to run those "
                   f"simulations again")
    notes = []
    if summary["samples_untrained"] and steps:
        drained = summary.get("samples_drained", 0)
        notes.append(f"{summary['samples_untrained']} of {summary['samples_ingested']} ingested samples were never "
                     f"in a batch (the step budget, {steps} steps, ended before they were used)"
                     + (f"; {drained} of them were taken out of the buffer after the last step to keep the "
                        f"simulations flowing, and are not in the checkpoint" if drained else
                        ": they are in the checkpoint; raise the steps and resume to train on them"))
    if budget is not None and 0 < steps < budget:
        world = len(stats)
        notes.append(f"training ended at step {steps} of the {budget} asked for: the stream ended and the {policy} "
                     f"buffer had no batch more ({summary['samples_ingested']} samples, {batch} a rank a step on "
                     f"{world} rank(s){', each used once' if policy != 'reservoir' else ''}) -- run more simulations, "
                     f"ask for fewer steps, or a reservoir buffer, which reuses samples")
    if summary["sims_count_unknown"]:
        notes.append(f"how many samples simulation(s) {summary['sims_count_unknown'][:_LISTED]} sent is not known "
                     f"(no count from the driver, no end markers): their losses cannot be counted")
    return out, notes


def earlier_final_loss(path: str | None, *, campaign: str | None, step: int) -> float | None:
    """The final loss an earlier job of this campaign wrote at ``step`` (its summary file, whatever
    the driver's run), for a job resumed at that step that took none (a finished campaign resumed):
    its summary keeps the loss rather than null. None for another campaign's file, another step's,
    or one that cannot be read."""
    from hpcml import safeio
    from hpcml.errors import ConfigError
    from hpcml.numeric import is_real

    if not path:
        return None
    try:
        old = safeio.read_json(path, 1 << 20)
    except (ConfigError, OSError):
        return None
    if not isinstance(old, dict) or (old.get("campaign"), old.get("gradient_steps")) != (campaign, step):
        return None
    loss = old.get("final_loss")
    return float(loss) if is_real(loss) else None
