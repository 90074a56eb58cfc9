"""What the task metrics say about a run: per iteration, per phase, the loss, where time went.

Pure functions over the records each task writes (jobs/{job}/metrics/, docs/runtime.md), shared by
``Run`` (progress bar, ``time_breakdown``) and ``stagecoach inspect``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

from stagecoach.core.records import TaskMetrics
from stagecoach.planner.plan import PHASES


# ------------------------------------------------------------------------------------ metrics
def _by_iteration(metrics: Iterable[TaskMetrics]) -> dict[int, list[TaskMetrics]]:
    """The training tasks by iteration (an evaluate task of version t runs before iteration t and
    is not part of it)."""
    out: dict[int, list[TaskMetrics]] = defaultdict(list)
    for m in metrics:
        if m.phase in ("forward", "backward", "sync"):  # not evaluate or checkpoint tasks
            out[int(m.t)].append(m)
    return out


def _span(ms: list[TaskMetrics]) -> float:
    return max(m.end for m in ms) - min(m.start for m in ms) if ms else 0.0


def _busy(ms: list[TaskMetrics]) -> float:
    """Seconds during which at least one of the tasks ran (the union of their intervals).

    Not the sum of the phases' spans: in BackwardSync the stages run in parallel branches, so one
    stage's sync overlaps another's backward."""
    total, end = 0.0, float("-inf")
    for a, b in sorted((m.start, m.end) for m in ms):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def phase_timings(metrics: list[TaskMetrics], skip_first: int = 1) -> dict[str, dict[str, float]]:
    """Per phase: mean span per iteration (first start to last end), mean task duration and its
    compute / transfer / wait parts, and the slowest task. The first ``skip_first`` iterations
    (cold starts) are left out when later ones exist."""
    by_it = _by_iteration(metrics)
    its = [t for t in sorted(by_it) if t >= skip_first] or sorted(by_it)
    out: dict[str, dict[str, float]] = {}
    for phase in PHASES:
        spans, tasks = [], []
        for t in its:
            pm = [m for m in by_it[t] if m.phase == phase]
            if pm:
                spans.append(_span(pm))
                tasks += pm
        if not tasks:
            continue
        n = len(tasks)
        out[phase] = {
            "span_s": sum(spans) / len(spans),
            "task_s": sum(m.duration_s for m in tasks) / n,
            "max_task_s": max(m.duration_s for m in tasks),
            "compute_s": sum(m.compute_s for m in tasks) / n,
            "transfer_s": sum(m.transfer_s for m in tasks) / n,
            "wait_s": sum(m.wait_s for m in tasks) / n,
            "tasks": float(n),
            "cold": float(sum(1 for m in tasks if m.cold)),
        }
    return out


def iteration_breakdown(metrics: list[TaskMetrics], complete: int | None = None) -> list[dict[str, float]]:
    """Per iteration: wall time and its split into orchestration, compute, transfer and waiting.

    Wall time runs from the iteration's first task start to the next iteration's (so it includes
    the state transitions between phases). The time during which some task of the iteration ran
    (the union of the task intervals: parallel stages are not counted twice) is split by the tasks'
    own compute / transfer / wait shares; the rest, when no task ran, is orchestration (Step
    Functions transitions and Lambda invocation latency). The shares are of the tasks' accounted
    seconds (compute + transfer + wait), so the four parts always add up to the wall time, also when
    a worker's metrics count overlapping uploads and downloads twice. ``cold``: tasks that started a
    new execution environment (their compute includes its start-up).
    """
    by_it = _by_iteration(metrics)
    ts = sorted(by_it)
    if complete is not None:
        ts = [t for t in ts if t < complete]
    out = []
    for t in ts:
        if t + 1 not in by_it:
            continue
        ms = by_it[t]
        wall = min(m.start for m in by_it[t + 1]) - min(m.start for m in ms)
        busy = min(_busy(ms), wall)
        comp = sum(m.compute_s for m in ms)
        xfer = sum(m.transfer_s for m in ms)
        wait = sum(m.wait_s for m in ms)
        parts = comp + xfer + wait
        if parts <= 0:  # nothing accounted: call it compute
            comp, parts = 1.0, 1.0
        out.append(
            {
                "t": float(t),
                "iteration_s": wall,
                "orchestration_s": wall - busy,
                "compute_s": busy * comp / parts,
                "transfer_s": busy * xfer / parts,
                "wait_s": busy * wait / parts,
                "cold": float(sum(1 for m in ms if m.cold)),
            }
        )
    return out


def mean_loss(ms: Iterable[TaskMetrics]) -> float | None:
    """An iteration's loss, the global-batch mean: the mean of its replicas' losses (the last
    stage's backward tasks), or None if none has reported one. NaN if any replica's is NaN (or
    two are infinite with opposite signs), infinite if one is: never the mean of the finite ones."""
    ls = [m.loss for m in ms if m.loss is not None]
    return sum(ls) / len(ls) if ls else None


def _losses(metrics: list[TaskMetrics], complete: int) -> list[float]:
    """The loss of each of the first ``complete`` iterations (``mean_loss``; NaN where none is known)."""
    by_it = _by_iteration(metrics)
    out = []
    for t in range(complete):
        loss = mean_loss(by_it.get(t, []))
        out.append(float("nan") if loss is None else loss)
    return out
