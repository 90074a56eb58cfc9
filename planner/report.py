"""Table rows and a Pareto plot (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .api import PlannedConfig, PlanningResult


def plan_row(c: PlannedConfig, samples_per_epoch: int | None = None, mark: str = "") -> dict[str, Any]:
    e, cfg = c.estimate, c.config
    iters = -(-samples_per_epoch // cfg.global_batch) if samples_per_epoch else None
    return {
        "": mark,
        "stages": cfg.stages,
        "layers/stage": "/".join(map(str, c.original_balance())),
        "tier MB/stage": "/".join(map(str, cfg.tiers_mb)),
        "d": cfg.replicas,
        "micro-batches": f"{cfg.micro_batches}x{cfg.micro_batch}",
        "sync": ",".join(sorted({s.label() for s in cfg.sync})),
        "s/iter": f"{e.time_s:.2f}",
        "$/iter": f"{e.cost:.5f}",
        "$/epoch": f"{e.cost * iters:.2f}" if iters else "-",
        "orch. $ share": f"{100 * e.orchestration_share:.1f}%",
        "found by": c.method,
    }


def format_table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "(no plans)"
    keys = list(rows[0])
    width = {k: max(len(str(k)), *(len(str(r[k])) for r in rows)) for k in keys}
    line = lambda r: "  ".join(str(r[k]).ljust(width[k]) for k in keys)
    return "\n".join([line({k: k for k in keys}), line({k: "-" * width[k] for k in keys})] + [line(r) for r in rows])


def result_table(res: PlanningResult, samples_per_epoch: int | None = None) -> str:
    return format_table([plan_row(c, samples_per_epoch, "*" if c is res.recommended else "") for c in res.pareto])


def pareto_png(res: PlanningResult, path: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.scatter([c.time_s for c in res.candidates], [c.cost for c in res.candidates], s=12, c="0.7", label="candidates")
    ax.plot([c.time_s for c in res.pareto], [c.cost for c in res.pareto], "o-", label="Pareto")
    r = res.recommended
    ax.scatter([r.time_s], [r.cost], s=120, marker="*", c="red", zorder=5, label="recommended")
    ax.set_xlabel("seconds / iteration")
    ax.set_ylabel("USD / iteration")
    ax.set_title(f"{res.profile.name}, global batch {res.global_batch}")
    ax.legend()
    fig.tight_layout()
    p = Path(path)
    fig.savefig(p, dpi=120)
    plt.close(fig)
    return p
