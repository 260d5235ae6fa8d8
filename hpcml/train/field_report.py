"""A one-page report of a field-surrogate run, for a person to look at: ``report.png``."""

from __future__ import annotations

import json
from pathlib import Path

from hpcml.stream.buffer import Sample
from hpcml.train.fields import FieldTrainer


def write_report(run_dir: str | Path, trainer: FieldTrainer, vals: list[Sample], summary: dict) -> None:
    """``run_dir/report.png``: the loss curve, the buffer occupancy (``buffer_len`` in the
    metrics), and the last held-out sample's field: true, predicted, error."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    run_dir = Path(run_dir)
    hist = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    s = max(vals, key=lambda v: v.t)
    pred = trainer.predict(s.params[None], np.array([s.t]))[0]
    fig, ax = plt.subplots(1, 5, figsize=(22, 4))
    ax[0].semilogy([h["step"] for h in hist], [h["loss"] for h in hist])
    ax[0].set(title=f"training loss ({summary.get('gradient_steps')} steps)", xlabel="step", ylabel="MSE (normalised)")
    ax[1].plot([h["step"] for h in hist if "buffer_len" in h], [h["buffer_len"] for h in hist if "buffer_len" in h])
    ax[1].set(title="buffer occupancy (rank 0)", xlabel="step", ylabel="samples")
    vmin, vmax = float(s.fields[0].min()), float(s.fields[0].max())
    for a, img, title in ((ax[2], s.fields[0], "true (held-out sim)"), (ax[3], pred, "predicted"),
                          (ax[4], pred - s.fields[0], "error")):
        im = a.imshow(img.T, origin="lower", cmap="inferno" if a is not ax[4] else "coolwarm",
                      **({"vmin": vmin, "vmax": vmax} if a is not ax[4] else {}))
        a.set_title(title)
        fig.colorbar(im, ax=a)
    fig.suptitle(f"heat surrogate, {summary.get('train_ranks')} trainer ranks: val rel. L2 {summary['val_rel_l2']:.3f}")
    fig.tight_layout()
    fig.savefig(run_dir / "report.png", dpi=80)
    plt.close(fig)
