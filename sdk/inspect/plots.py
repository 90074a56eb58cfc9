"""The run as pictures: a Gantt chart of its tasks, the time breakdown per iteration, the loss."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from stagecoach.core.records import TaskMetrics
from stagecoach.inspect.events import FailedTask
from stagecoach.inspect.report import InspectError, Inspection

if TYPE_CHECKING:
    from matplotlib.axes import Axes

# ------------------------------------------------------------------------------------ plots
_COLOURS = {"forward": "#4c72b0", "backward": "#dd8452", "sync": "#55a868"}


_PARTS = (
    ("compute_s", "compute", "#4c72b0"),
    ("transfer_s", "S3 transfer", "#dd8452"),
    ("wait_s", "waiting for other workers", "#c44e52"),
    ("orchestration_s", "orchestration (no task running)", "#8c8c8c"),
)


def _pyplot() -> Any:  # matplotlib.pyplot, loaded on use: a module, which no annotation names
    try:
        # matplotlib is the optional `plot` extra, heavy: imported on use
        import matplotlib
    except ImportError:
        raise InspectError("--plot needs matplotlib: pip install 'stagecoach[plot]'") from None
    matplotlib.use("Agg")
    # matplotlib is the optional `plot` extra, heavy: imported on use
    import matplotlib.pyplot as plt

    return plt


def gantt_rows(metrics: list[TaskMetrics]) -> list[tuple[int, bool, int]]:
    """The Gantt chart's rows, top to bottom: per stage, its replicas (forward and backward tasks
    share a row), then its sync tasks, as (stage, is_sync, index). Taken from the tasks that ran,
    so a stage has as many sync rows as its aggregators (K), and none for a fused sync."""
    return sorted({(int(m.stage), m.phase == "sync", int(m.index)) for m in metrics})


def plot_gantt(
    metrics: list[TaskMetrics], path: str, iterations: tuple[int, int] | None = None, failures: list[FailedTask] | None = None
) -> str:
    """Tasks as bars on a row per (stage, worker), coloured by phase; the waiting part hatched;
    failed task attempts (``failures``, from the histories) as red crosses where they failed.

    Rows: each stage's replicas (forward, backward) and then its sync tasks (as many as the stage's
    aggregators, whatever the sync algorithm; none for a fused sync). By default the last (up to) 5
    iterations; ``iterations`` = [a, b). The waiting share is drawn at the end of its task (the
    metrics give its length, not when it happened).
    """
    plt = _pyplot()
    a, b, ms = _gantt_window(metrics, iterations)
    t0 = min(m.start for m in ms)
    rows = gantt_rows(ms)
    ypos = {r: i for i, r in enumerate(rows)}
    fig, ax = plt.subplots(figsize=(12, 0.42 * len(rows) + 2.2))
    _draw_tasks(ax, ms, t0, ypos)
    crosses = _failure_crosses(failures or [], t0, ypos, a, b)
    if crosses:
        ax.scatter(
            [x for x, _ in crosses],
            [y for _, y in crosses],
            marker="X",
            s=60,
            color="#d62728",
            zorder=5,
            edgecolors="white",
            linewidths=0.6,
        )
    _draw_boundaries(ax, rows, ms, t0, a, b)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"stage {s} {'sync' if sync else 'replica'} {i}" for s, sync, i in rows], fontsize=8)
    ax.set_ylim(len(rows) - 0.5, -1.0)
    ax.set_xlabel("seconds")
    ax.set_title(f"tasks per stage, iterations {a}-{b - 1} (hatched: waiting for other workers' objects)", fontsize=10)
    _gantt_legend(ax, len(rows), failed=bool(crosses))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _gantt_window(metrics: list[TaskMetrics], iterations: tuple[int, int] | None) -> tuple[int, int, list[TaskMetrics]]:
    """The iterations [a, b) to draw (by default the last up to 5) and their tasks; an empty
    window is an error the caller reports, not an empty picture."""
    if not metrics:
        raise ValueError("no task metrics yet: nothing to plot")
    ts = sorted({int(m.t) for m in metrics})
    a, b = iterations if iterations else (max(ts[0], ts[-1] - 4), ts[-1] + 1)
    ms = [m for m in metrics if a <= m.t < b]
    if not ms:
        raise ValueError(f"no task metrics in iterations [{a}, {b})")
    return a, b, ms


def _draw_tasks(ax: Axes, ms: list[TaskMetrics], t0: float, ypos: dict[tuple[int, bool, int], int]) -> None:
    """A bar per task on its row, and its waiting share hatched at its end (the metrics give how
    long it waited, not when)."""
    for m in ms:
        y = ypos[(int(m.stage), m.phase == "sync", int(m.index))]
        ax.broken_barh(
            [(m.start - t0, m.duration_s)],
            (y - 0.4, 0.8),
            facecolors=_COLOURS.get(m.phase, "#999999"),
            edgecolor="black",
            linewidth=0.3,
        )
        if m.wait_s > 0:
            ax.broken_barh(
                [(m.end - t0 - m.wait_s, m.wait_s)], (y - 0.4, 0.8), facecolors="none", hatch="///", edgecolor="white", linewidth=0
            )


def _failure_crosses(
    failures: list[FailedTask], t0: float, ypos: dict[tuple[int, bool, int], int], a: int, b: int
) -> list[tuple[float, int]]:
    """(seconds, row) of each failed attempt in the window that can be placed: a failure whose
    history lacks its time, iteration or worker, or whose worker has no row here, is left out."""
    return [
        (f.time - t0, ypos[(f.stage, f.phase == "sync", f.index)])
        for f in failures
        if f.time is not None
        and f.t is not None
        and f.stage is not None
        and f.index is not None
        and a <= f.t < b
        and (f.stage, f.phase == "sync", f.index) in ypos
    ]


def _draw_boundaries(ax: Axes, rows: list[tuple[int, bool, int]], ms: list[TaskMetrics], t0: float, a: int, b: int) -> None:
    """A line between stages, and a dotted line where each iteration's first task started,
    labelled with the iteration (and "cold" if a task of it started a container)."""
    for i in range(1, len(rows)):
        if rows[i][0] != rows[i - 1][0]:
            ax.axhline(i - 0.5, color="black", linewidth=0.6)
    for t in range(a, b):
        starts = [m.start for m in ms if m.t == t]
        if starts:
            ax.axvline(min(starts) - t0, color="grey", linestyle=":", linewidth=0.8)
            cold = any(m.cold for m in ms if m.t == t)
            ax.text(min(starts) - t0, -0.75, f"t={t}" + (" (cold)" if cold else ""), fontsize=7, color="dimgrey")


def _gantt_legend(ax: Axes, n_rows: int, failed: bool) -> None:
    """The phases' colours, the hatch, and the failure cross if any was drawn; below the chart,
    further down when there are few rows (the axis label would overlap it)."""
    # matplotlib is the optional `plot` extra, heavy to import: imported on use (after _pyplot's check)
    from matplotlib.artist import Artist
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles: list[Artist] = [Patch(color=c, label=p) for p, c in _COLOURS.items()]
    handles.append(Patch(facecolor="#dd8452", hatch="///", edgecolor="white", label="waiting"))
    if failed:
        handles.append(Line2D([], [], marker="X", color="#d62728", linestyle="none", markersize=8, label="failed attempt"))
    ax.legend(
        handles=handles,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.12 if n_rows > 6 else -0.2),
        ncol=len(handles),
        fontsize=8,
        frameon=False,
    )


def plot_breakdown(breakdown: list[dict[str, float]], path: str) -> str:
    """Stacked bars per iteration: compute, S3 transfer, waiting, orchestration (they add up to it)."""
    plt = _pyplot()  # first: without matplotlib, its error says how to install it
    # matplotlib is the optional `plot` extra, heavy: imported on use
    from matplotlib.ticker import MaxNLocator

    if not breakdown:
        raise ValueError("fewer than two iterations finished: no time breakdown yet")
    ts = [int(x["t"]) for x in breakdown]
    fig, ax = plt.subplots(figsize=(max(8.0, min(18.0, 0.12 * len(ts) + 6)), 4))
    bottom = [0.0] * len(ts)
    for key, label, colour in _PARTS:
        vals = [x[key] for x in breakdown]
        ax.bar(ts, vals, bottom=bottom, color=colour, label=label, width=0.8)
        bottom = [u + v for u, v in zip(bottom, vals)]
    for x, top in zip(breakdown, bottom):
        if x.get("cold"):
            ax.annotate("cold", (x["t"], top), textcoords="offset points", xytext=(0, 2), ha="center", fontsize=7, color="dimgrey")
    warm = breakdown[1:] or breakdown
    mean = sum(x["iteration_s"] for x in warm) / len(warm)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("iteration")
    ax.set_ylabel("seconds")
    ax.set_title(f"time per iteration (mean {mean:.2f} s{' after the first' if len(breakdown) > 1 else ''})", fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_loss(losses: list[float], path: str) -> str:
    """The loss curve: the global-batch mean loss per iteration."""
    plt = _pyplot()  # first: without matplotlib, its error says how to install it
    # matplotlib is the optional `plot` extra, heavy: imported on use
    from matplotlib.ticker import MaxNLocator

    if not losses:
        raise ValueError("no finished iteration yet: no loss to plot")
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(len(losses)), losses, marker="o" if len(losses) <= 30 else None, markersize=3)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("iteration")
    ax.set_ylabel("loss (global-batch mean)")
    ax.set_title(f"loss: {losses[0]:.4f} -> {losses[-1]:.4f}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_plots(ins: Inspection, directory: str) -> list[str]:
    """<job>-gantt.png, <job>-breakdown.png and <job>-loss.png for the run, as far as it has got."""
    os.makedirs(directory, exist_ok=True)
    out = []
    if ins.metrics:
        out.append(plot_gantt(ins.metrics, os.path.join(directory, f"{ins.job_id}-gantt.png"), failures=ins.failed_tasks))
    if ins.breakdown:
        out.append(plot_breakdown(ins.breakdown, os.path.join(directory, f"{ins.job_id}-breakdown.png")))
    if ins.losses:
        out.append(plot_loss(ins.losses, os.path.join(directory, f"{ins.job_id}-loss.png")))
    return out
