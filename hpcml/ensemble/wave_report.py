"""Where an adaptive campaign's sampler went: ``run_dir/waves.png``, for a person to look at.

Two scatter plots of the simulations' parameters (the first two of the bounds, on a log
axis where the sampler drew log-uniformly): coloured by wave, and by the loss the trainer
last reported for each (grey: none reported). With one parameter, the y axis is the wave.
"""

from __future__ import annotations

import math
from pathlib import Path

from hpcml.ensemble.sampling import SimStats
from hpcml.log import get_logger

logger = get_logger(__name__)


def write_wave_report(run_dir: str | Path, waves: list[dict], feedback: dict[str, SimStats],
                      log: frozenset[str] = frozenset()) -> Path | None:
    """``run_dir/waves.png`` from the wave record and the latest feedback; None when there is
    nothing to draw or matplotlib is missing (a report never fails a campaign)."""
    points = [(w["wave"], i, p) for w in waves for i, p in zip(w["ids"], w["params"])]
    if not points:
        return None
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover -- a dependency; the report is optional
        logger.warning("matplotlib is missing: no %s", Path(run_dir) / "waves.png")
        return None
    names = list(points[0][2])
    x_name = names[0]
    y_name = names[1] if len(names) > 1 else None
    xs = [p[x_name] for _, _, p in points]
    ys = [p[y_name] for _, _, p in points] if y_name else [w for w, _, _ in points]
    loss = [feedback[str(i)].loss if str(i) in feedback else math.nan for _, i, _ in points]
    fig, ax = plt.subplots(1, 2, figsize=(12, 5))
    sc = ax[0].scatter(xs, ys, c=[w for w, _, _ in points], cmap="viridis", s=28, edgecolors="k", linewidths=0.3)
    fig.colorbar(sc, ax=ax[0], label="wave")
    ax[0].set_title(f"{len(points)} simulations in {len(waves)} waves")
    known = [k for k, v in enumerate(loss) if math.isfinite(v)]
    unknown = [k for k, v in enumerate(loss) if not math.isfinite(v)]
    if unknown:
        ax[1].scatter([xs[k] for k in unknown], [ys[k] for k in unknown], c="lightgrey", s=28, label="no loss reported")
        ax[1].legend(loc="best", fontsize=8)
    if known:
        sc = ax[1].scatter([xs[k] for k in known], [ys[k] for k in known], c=[loss[k] for k in known], cmap="inferno",
                           s=28, edgecolors="k", linewidths=0.3)
        fig.colorbar(sc, ax=ax[1], label="training loss (latest)")
    ax[1].set_title("loss the trainer reported per simulation")
    for a in ax:
        a.set_xlabel(x_name)
        a.set_ylabel(y_name or "wave")
        if x_name in log:
            a.set_xscale("log")
        if y_name and y_name in log:
            a.set_yscale("log")
    fig.tight_layout()
    out = Path(run_dir) / "waves.png"
    fig.savefig(out, dpi=80)
    plt.close(fig)
    return out
