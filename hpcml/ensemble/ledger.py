"""The campaign's books: what each simulation streamed, the end-of-campaign record the
trainer reads, what a resumed campaign need not run again, and the trainer's own count.

Everything here is read from the run directory, so it covers every job of the campaign,
not only this one: a simulation's streamed count is its successful attempt's Producer
record (``attempt_K.stream.json``, kept in its provenance line as ``streamed``), and the
trainer's accounting (``train_summary.json``) is over its checkpointed state.
"""

from __future__ import annotations

import time
from collections.abc import Container, Iterable
from pathlib import Path

from hpcml import safeio
from hpcml.contract import MAX_RECORD_BYTES, Contract, DoneRecord
from hpcml.ensemble import attempts, provenance
from hpcml.errors import ConfigError
from hpcml.idset import IdSet
from hpcml.log import get_logger

logger = get_logger(__name__)


def streamed(run_dir: Path, sim_ids: Iterable[int], done: dict[int, dict] | None = None) -> dict[int, int | None]:
    """What each completed simulation streamed (its successful attempt's Producer count;
    None: it completed without a Producer); ``done``: :func:`provenance.completed_sims`, when
    the caller has read it already."""
    sim_ids = list(sim_ids)
    if done is None:
        done = provenance.completed_sims(run_dir) if sim_ids else {}
    out: dict[int, int | None] = {}
    for sim in sim_ids:
        rec = done.get(sim)
        if rec is not None:
            n = rec.get("streamed")
            if n is None and rec.get("attempt") is not None:  # recorded before the stream record was read
                n = attempts.stream_record(attempts.sim_dir(run_dir, sim), rec["attempt"])
            out[sim] = n
    return out


def streamed_anything(s, wait_s: float = 5.0) -> bool:
    """Whether the completed simulation ``s`` (a pool's Sim) closed a Producer: a bundled
    member's record says so; a launched one's attempt left its stream record (waited for a
    little: a shared file system shows another node's new file late)."""
    if s.spec.entry is not None:
        return any(r.get("streamed") is not None for r in s.recorded.values() if r.get("status") == "ok")
    deadline = time.monotonic() + wait_s
    while attempts.stream_record(s.dir, s.first + s.claimed - 1) is None:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.25)
    return True


def done_record(contract: Contract, completed: Iterable[int], failed: Iterable[int],
                streaming: Container[int]) -> DoneRecord:
    """The end of this run's campaign: ``streaming`` simulations (of those completed) carry
    their streamed counts; one that closed no Producer is ``silent``; the others are not waited for.
    The ids are kept as :class:`~hpcml.idset.IdSet` runs (10^5 of them are a few runs)."""
    completed, failed = IdSet(completed), IdSet(failed)
    counts = streamed(Path(contract.run_dir), [s for s in completed if s in streaming])
    return DoneRecord(completed=completed, failed=failed,
                      streamed={s: n for s, n in counts.items() if n is not None},
                      silent=sorted(s for s, n in counts.items() if n is None), campaign=contract.campaign,
                      run=contract.run)


def kept(run_dir: Path, completed: set[int], streaming: set[int], done: dict[int, dict] | None = None) -> set[int]:
    """Of the simulations that completed in earlier runs, those whose results survive: every
    sample of a streaming one in the trainer's latest checkpoint (one that finished after the
    last save runs again), and the non-streaming ones (their files were written whole)."""
    keep = completed - streaming
    need = {s: n for s, n in streamed(run_dir, completed & streaming, done).items() if n is not None}
    if need:  # one trainer's latest checkpoint, or the step every member of a population holds
        from hpcml.train.online_state import simulations_kept

        keep |= simulations_kept(run_dir / "checkpoints", need)
    keep |= {s for s in completed & streaming if need.get(s, 1) == 0}  # streamed nothing: nothing to lose
    return keep


def trainer_summary(contract: Contract) -> dict | None:
    """The training job's summary if it is this run's (its campaign and run say so), else None."""
    try:
        rec = safeio.read_json(contract.summary_file, MAX_RECORD_BYTES)
    except ConfigError as e:
        logger.warning("ignoring the training job's summary: %s", e)
        return None
    if rec is None or contract.stale(rec) is not None:
        return None
    return rec


def samples(summary: dict | None) -> dict | None:
    """The accounting a CampaignResult carries, from the trainer's summary."""
    if not summary or "samples_ingested" not in summary:
        return None
    return {"expected": summary.get("samples_expected"), "ingested": summary["samples_ingested"],
            "missing": summary.get("samples_missing", 0), "missing_by_sim": summary.get("missing_by_sim", {}),
            "duplicates": summary.get("duplicate_samples", 0), "untrained": summary.get("samples_untrained", 0),
            "dropped": summary.get("dropped_messages", {})}


def missing_line(s: dict) -> str:
    by = ", ".join(f"simulation {k}: {v}" for k, v in list(s.get("missing_by_sim", {}).items())[:8])
    return (f"{s['missing']} of {s['expected']} samples of completed simulations never reached training ({by}): "
            f"resume the campaign (resume=True) to run those simulations again")
