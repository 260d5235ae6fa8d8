"""A one-page report of a field-surrogate run, for a person to look at: ``report.png``."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from hpcml import safeio
from hpcml.stream.buffer import Sample


def write_report(run_dir: str | Path, sample: Sample, pred: np.ndarray, summary: dict) -> None:
    """``run_dir/report.png``: the loss curve, the buffer occupancy (``buffer_len`` in the
    metrics), and one held-out sample's field -- true, predicted, error: curves for a 1-D
    field, images for 2-D, the middle slice along the last axis for 3-D."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    hist = []
    for line in safeio.iter_lines(run_dir / "metrics.jsonl", 1 << 20):
        try:
            rec = safeio.parse_json(line, "metrics.jsonl", max_depth=8) if line.strip() else None
        except ValueError:
            continue  # a torn or foreign line: the plot goes on without it
        if isinstance(rec, dict):
            hist.append(rec)
    true = sample.fields[0]
    if true.ndim == 3:
        true, pred = true[..., true.shape[-1] // 2], pred[..., pred.shape[-1] // 2]
    fig, ax = plt.subplots(1, 5 if true.ndim == 2 else 4, figsize=(22, 4))
    ax[0].semilogy([h["step"] for h in hist], [h["loss"] for h in hist])
    ax[0].set(title=f"training loss ({summary.get('gradient_steps')} steps)", xlabel="step", ylabel="loss (normalised)")
    ax[1].plot([h["step"] for h in hist if "buffer_len" in h], [h["buffer_len"] for h in hist if "buffer_len" in h])
    ax[1].set(title="buffer occupancy (rank 0)", xlabel="step", ylabel="samples")
    if true.ndim == 1:
        ax[2].plot(true, label="true (held-out sim)")
        ax[2].plot(pred, "--", label="predicted")
        ax[2].legend()
        ax[3].plot(pred - true)
        ax[2].set_title(f"simulation {sample.sim} at t={sample.t:.3g}")
        ax[3].set_title("error")
    else:
        vmin, vmax = float(true.min()), float(true.max())
        for a, img, title in ((ax[2], true, "true (held-out sim)"), (ax[3], pred, "predicted"),
                              (ax[4], pred - true, "error")):
            im = a.imshow(img.T, origin="lower", cmap="inferno" if a is not ax[4] else "coolwarm",
                          **({"vmin": vmin, "vmax": vmax} if a is not ax[4] else {}))
            a.set_title(title)
            fig.colorbar(im, ax=a)
    fig.suptitle(f"field surrogate, {summary.get('train_ranks')} trainer ranks: held-out rel. L2 "
                 f"{summary.get('val_rel_l2', float('nan')):.3f}")
    fig.tight_layout()
    fig.savefig(run_dir / "report.png", dpi=80)
    plt.close(fig)
