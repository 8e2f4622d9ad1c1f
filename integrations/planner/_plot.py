"""``RematPlan.plot``: the Pareto curve of bytes against recompute FLOPs."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .plan import RematPlan


def plot_pareto(plan: RematPlan, path: Path) -> Path:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError(
            "RematPlan.plot needs matplotlib: pip install 'torch-remat[plot]'"
        ) from e
    full = plan.no_remat_bytes
    points = plan.frontier()
    # A step curve: between two frontier points the cheaper plan's cost holds.
    xs, ys = [], []
    for p in points:
        if xs:
            xs.append(p.bytes / full)
            ys.append(ys[-1])
        xs.append(p.bytes / full)
        ys.append(p.cost[1] / 1e6)
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=100)
    ax.plot(xs, ys, "-o", markersize=3, label="planner (Pareto frontier)", color="tab:blue")
    markers = iter("sD^v<>")
    for name, (nbytes, flops, _) in plan.hand_policies().items():
        ax.plot(nbytes / full, flops / 1e6, next(markers, "x"), markersize=8, label=name)
    ax.axvline(plan.budget_bytes / full, color="grey", linestyle=":", label="this plan's budget")
    ax.plot(plan.predicted_bytes / full, plan.recompute_flops / 1e6, "*", markersize=13,
            color="tab:red", label="this plan")
    ax.set_xlabel("activation bytes after forward / no-remat bytes")
    ax.set_ylabel("recompute MFLOPs per step")
    ax.set_title(f"remat plans for {len(plan.blocks)} blocks ({full:,} B without remat)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
