"""Table rows and a Pareto plot (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from stagecoach.planner.model.syncmodel import SyncChoice
from stagecoach.planner.solve.sweep import PlannedConfig, PlanningResult

SYNC_SHORT = {
    "none": "-",
    "scatter_reduce": "SR",
    "pipelined_scatter_reduce": "PSR",
    "lambdaml_scatter_reduce": "LSR",
    "all_reduce": "AR",
    "k_reduce": "KR",
}
SYNC_LEGEND = "sync per stage: SR scatter-reduce, PSR pipelined scatter-reduce, LSR LambdaML's scatter-reduce, KRk k-reduce with K=k, AR all-reduce, - none (d = 1)"


def sync_short(c: SyncChoice) -> str:
    """A compact per-stage label of a sync choice (legend: SYNC_LEGEND)."""
    return f"KR{c.k}" if c.algo == "k_reduce" else SYNC_SHORT.get(c.algo, c.algo)


def _weights(a1: float, a2: float) -> str:
    """FuncPipe's weights as it writes them: (1, 2^19) rather than (1, 524288)."""
    if a1 == 1 and a2 >= 1 and float(a2).is_integer() and int(a2) & (int(a2) - 1) == 0:
        return f"(1,2^{int(a2).bit_length() - 1})"
    return f"({a1:g},{a2:g})"


def plan_row(c: PlannedConfig, samples_per_epoch: int | None = None, mark: str = "") -> dict[str, str | int]:
    """One table row: the plan's shape per stage, its predictions and how it was found."""
    e, cfg = c.estimate, c.config
    iters = -(-samples_per_epoch // cfg.global_batch) if samples_per_epoch else None
    a1, a2 = c.weights
    return {
        "": mark,
        "stages": cfg.stages,
        "layers/stage": "/".join(map(str, c.original_balance())),
        "tier MB/stage": "/".join(map(str, cfg.tiers_mb)),
        "d": cfg.replicas,
        "workers": cfg.stages * cfg.replicas,
        "micro-batches": f"{cfg.micro_batches}x{cfg.micro_batch}",
        "sync/stage": "/".join(sync_short(s) for s in cfg.sync),
        "s/iter": f"{e.time_s:.2f}",
        "$/iter": f"{e.cost:.5f}",
        "$/epoch": f"{e.cost * iters:.2f}" if iters else "-",
        "orch. $ share": f"{100 * e.orchestration_share:.1f}%",
        "weights": _weights(a1, a2),
        "found by": c.method,
    }


def format_table(rows: list[dict[str, str | int]]) -> str:
    """Left-aligned columns, a header and a rule."""
    if not rows:
        return "(no plans)"
    keys = list(rows[0])
    width = {k: max(len(str(k)), *(len(str(r[k])) for r in rows)) for k in keys}

    def line(r: Mapping[str, str | int]) -> str:
        return "  ".join(str(r[k]).ljust(width[k]) for k in keys).rstrip()

    return "\n".join([line({k: k for k in keys}), line({k: "-" * width[k] for k in keys})] + [line(r) for r in rows])


def result_table(res: PlanningResult, samples_per_epoch: int | None = None) -> str:
    """The Pareto plans, cheapest first; the recommended one marked with *."""
    return format_table([plan_row(c, samples_per_epoch, "*" if c is res.recommended else "") for c in res.pareto])


def pareto_png(res: PlanningResult, path: str | Path) -> Path:
    """Seconds vs USD per iteration: every weight's optimum, the Pareto front, the recommendation."""
    # matplotlib is the optional `plot` extra, heavy: imported on use
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.scatter([c.time_s for c in res.candidates], [c.cost for c in res.candidates], s=18, c="0.6", label="weights' optima")
    ax.plot([c.time_s for c in res.pareto], [c.cost for c in res.pareto], "o-", label="Pareto")
    r = res.recommended
    ax.scatter([r.time_s], [r.cost], s=140, marker="*", c="red", zorder=5, label="recommended")
    for c in res.pareto:
        ax.annotate(f"d={c.config.replicas} S={c.config.stages}", (c.time_s, c.cost), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_xscale("log")
    ax.set_xlabel("seconds / iteration")
    ax.set_ylabel("USD / iteration")
    ax.set_title(f"{res.profile.name}, global batch {res.global_batch}")
    ax.legend()
    fig.tight_layout()
    p = Path(path)
    fig.savefig(p, dpi=120)
    plt.close(fig)
    return p
