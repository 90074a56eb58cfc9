"""Table rows and a Pareto plot (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from stagecoach.planner.model.syncmodel import SyncChoice
from stagecoach.planner.solve.pareto import DELTA_THRESHOLD, MODEL_TIME_ACCURACY
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
# Every column of plan_row, explained once, in its order (tests/test_plan_report.py checks that
# each column has an entry, so a new column cannot go unexplained).
COLUMN_LEGEND: dict[str, str] = {
    "": f"recommended: by FuncPipe's rule the fastest plan whose speed-up over the cheapest is worth >= {DELTA_THRESHOLD} of "
    f"its extra cost, counting only speed-ups beyond the performance model's accuracy ({MODEL_TIME_ACCURACY:.0%}); then the "
    f"cheapest plan within {MODEL_TIME_ACCURACY:.0%} of its time",
    "stages": "pipeline stages S",
    "layers/stage": "children of your nn.Sequential per stage",
    "tier MB/stage": "Lambda memory per stage, MB",
    "d": "replicas of every stage (data parallelism)",
    "workers": "stages x d: the Lambda invocations a phase runs at once",
    "micro-batches": "micro-batches per replica x samples per micro-batch (8x8: 8 micro-batches of 8)",
    "sync/stage": "gradient sync per stage (below)",
    "s/iter": "predicted seconds per iteration",
    "$/iter": "predicted USD per iteration",
    "$/epoch": "USD per --samples-per-epoch samples",
    "orch. $ share": "of the cost, orchestration (Step Functions transitions, Lambda and S3 requests) rather than compute",
    "weights": "(a1,a2) of the objective a1 x nano-USD + a2 x seconds whose proven optimum the plan is: FuncPipe's "
    "(1,0) cheapest ... (1,2^22) fastest",
    "found by": "milp = proven optimal for its weights; milp(time_limit) = best found within --time-limit",
}


def table_legend() -> str:
    """What every column of the table means, one line each, then the sync abbreviations."""
    width = max(len(k) for k in COLUMN_LEGEND)
    lines = [f"{(k or '*').ljust(width)}  {v}" for k, v in COLUMN_LEGEND.items()]
    return "\n".join(lines + [SYNC_LEGEND])


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


def point_label(c: PlannedConfig) -> str:
    """What sets a Pareto plan apart, in words: stages, replicas, each stage's memory tier and the
    micro-batches, then its predictions. Two plans that differ only in a tier differ here too."""
    cfg = c.config
    stages = f"{cfg.stages} stage{'s' if cfg.stages > 1 else ''}"
    replicas = f"{cfg.replicas} replica{'s' if cfg.replicas > 1 else ''}"
    tiers = "/".join(map(str, cfg.tiers_mb))
    batches = f"{cfg.micro_batches} micro-batch{'es' if cfg.micro_batches > 1 else ''} of {cfg.micro_batch}"
    return f"{stages} x {replicas}, {tiers} MB, {batches}: {c.time_s:#.3g} s, ${c.cost:#.4g}"


def axis_limits(values: list[float], rel: float = 0.1) -> tuple[float, float, bool]:
    """An axis range for ``values`` and whether it is logarithmic. Linear unless they span more
    than a factor 4; a linear range covers at least +-``rel`` of their middle, so that a $2e-8
    difference between two plans of $1.6e-4 is drawn as the nothing it is, not across the whole
    axis (matplotlib's autoscale fits the data, however close)."""
    lo, hi = min(values), max(values)
    if lo > 0 and hi / lo > 4:
        return lo / 1.4, hi * 1.4, True
    mid = (lo + hi) / 2
    half = max(0.6 * (hi - lo), rel * abs(mid), 1e-12)
    return max(0.0, mid - half) if lo >= 0 else mid - half, mid + half, False


def _style_axis(ax: Any, which: str, values: list[float]) -> None:
    """Plain tick labels (no offset, no x1e-4 exponent), at most about five of them, so none overlap."""
    from matplotlib import ticker  # the optional `plot` extra, as in pareto_figure

    lo, hi, log = axis_limits(values)
    axis = ax.xaxis if which == "x" else ax.yaxis
    if log:
        (ax.set_xscale if which == "x" else ax.set_yscale)("log")
        axis.set_major_locator(ticker.LogLocator(subs=(1.0, 2.0, 5.0), numticks=6))
        axis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        axis.set_minor_formatter(ticker.NullFormatter())
    else:
        axis.set_major_locator(ticker.MaxNLocator(nbins=5, steps=[1, 2, 2.5, 5, 10], min_n_ticks=3))
        fmt = ticker.ScalarFormatter(useOffset=False)
        fmt.set_scientific(False)
        axis.set_major_formatter(fmt)
    (ax.set_xlim if which == "x" else ax.set_ylim)(lo, hi)


def pareto_figure(res: PlanningResult) -> Any:
    """Seconds vs USD per iteration: every weight's optimum, the Pareto front numbered, each
    number explained below the plot (stages, replicas, tiers; label text beside close points
    would overlap), the recommendation starred."""
    # matplotlib is the optional `plot` extra, heavy: imported on use
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.scatter([c.time_s for c in res.candidates], [c.cost for c in res.candidates], s=18, c="0.6", zorder=2)
    ax.plot([c.time_s for c in res.pareto], [c.cost for c in res.pareto], "o-", zorder=3)
    r = res.recommended
    ax.scatter([r.time_s], [r.cost], s=160, marker="*", c="red", zorder=4)
    box = {"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none", "alpha": 0.8}  # legible over the line
    fan = [(6, 6), (6, -14), (-14, 6), (-14, -14), (0, 10), (0, -18), (10, -4), (-18, -4)]  # coinciding points
    front = {(c.time_s, c.cost) for c in res.pareto}
    others = any((c.time_s, c.cost) not in front for c in res.candidates)
    handles = [Line2D([], [], marker="o", c="0.6", ls="", label="another weight's optimum, not on the front")] if others else []
    for i, c in enumerate(res.pareto, 1):
        ax.annotate(str(i), (c.time_s, c.cost), textcoords="offset points", xytext=fan[(i - 1) % len(fan)], fontsize=8, zorder=5, bbox=box)
        rec = ", recommended (red star)" if c is r else ""
        handles.append(Line2D([], [], marker=f"${i}$", c="C0", ls="", label=point_label(c) + rec))
    values = res.candidates + res.pareto
    _style_axis(ax, "x", [c.time_s for c in values])
    _style_axis(ax, "y", [c.cost for c in values])
    ax.grid(True, alpha=0.3)
    ax.set_xlabel("seconds / iteration")
    ax.set_ylabel("USD / iteration")
    ax.set_title(f"{res.profile.name}, global batch {res.global_batch}: Pareto plans")
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(0.0, -0.14), fontsize=8, frameon=False)
    return fig


def pareto_png(res: PlanningResult, path: str | Path) -> Path:
    """The Pareto plot (pareto_figure) written as a PNG."""
    import matplotlib.pyplot as plt  # the optional `plot` extra, as in pareto_figure

    fig = pareto_figure(res)
    p = Path(path)
    fig.savefig(p, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return p
