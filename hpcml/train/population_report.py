"""The picture of a population-based training run: every member's validation loss and
learning rate over the rounds, with the copies marked, from the PBT history
(:class:`hpcml.train.pbt.PBTConfig` ``history``, JSON lines).

    python -m hpcml.train.population_report run/pbt.jsonl run/pbt.png
"""

from __future__ import annotations

import sys
from pathlib import Path

from hpcml import safeio
from hpcml.errors import ConfigError

#: A round's line holds a few numbers per member: 64 KiB is thousands of members.
MAX_LINE = 64 << 10


def read_history(path: str | Path) -> list[dict]:
    """The rounds of a PBT history, in order; ConfigError (naming the file and line) for a
    line that is not a round, a torn last line (a crash while appending) passed over."""
    rounds = []
    for i, raw in enumerate(safeio.iter_lines(path, MAX_LINE), 1):
        if not raw.endswith(b"\n"):
            break
        try:
            r = safeio.parse_json(raw, f"{path} line {i}")
        except safeio.FileRefused as e:
            raise ConfigError(str(e)) from None
        if not (isinstance(r, dict) and isinstance(r.get("round"), int) and isinstance(r.get("members"), list)
                and all(isinstance(m, dict) and isinstance(m.get("member"), int) for m in r["members"])):
            raise ConfigError(f"{path} line {i}: expected a PBT round (round, step, members), got {raw[:80]!r}")
        rounds.append(r)
    return rounds


def plot(history: str | Path, out: str | Path) -> Path:
    """Two panels over the rounds: each member's loss (a copy marked where a member took
    another's model) and learning rate (log scale). Returns ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rounds = read_history(history)
    if not rounds:
        raise ConfigError(f"{history}: no PBT round recorded: nothing to plot")
    members = sorted({m["member"] for r in rounds for m in r["members"]})
    fig, (ax_loss, ax_lr) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    for k in members:
        rows = [(r["round"], m) for r in rounds for m in r["members"] if m["member"] == k]
        x = [rd for rd, _ in rows]
        line, = ax_loss.plot(x, [m.get("score") for _, m in rows], marker="o", ms=3, label=f"member {k}")
        copied = [(rd, m.get("score")) for rd, m in rows if m.get("copied") is not None]
        if copied:
            ax_loss.scatter(*zip(*copied), marker="x", s=40, color=line.get_color())
        ax_lr.plot(x, [m.get("lr") for _, m in rows], marker="o", ms=3, color=line.get_color())
    ax_loss.set_ylabel("validation loss (x: copied a better member)")
    ax_lr.set_ylabel("learning rate after the round")
    ax_lr.set_yscale("log")
    ax_lr.set_xlabel("round")
    ax_loss.legend(fontsize=7, ncol=4)
    fig.suptitle(f"population-based training: {len(members)} members, {len(rounds)} rounds")
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m hpcml.train.population_report HISTORY.jsonl OUT.png")
    print(plot(sys.argv[1], sys.argv[2]))
