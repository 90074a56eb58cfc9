"""Inspect a run from its job execution ARN, on either backend: what `stagecoach inspect` prints.

Everything comes from the two places a run leaves traces: Step Functions (the job execution, its
window executions and their histories: status, where the run is, which tasks failed and why) and
the job's metrics objects in S3 (one per task: timings, bytes, loss; docs/runtime.md). Nothing
here needs the user's job file, so a run can be inspected from any machine with access to the
stack.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

from stagecoach.planner.plan import Plan

PHASES = ("forward", "backward", "sync")
_FAIL_EVENTS = {"TaskFailed", "TaskTimedOut", "LambdaFunctionFailed", "LambdaFunctionTimedOut", "TaskStartFailed",
                "TaskSubmitFailed", "LambdaFunctionStartFailed", "LambdaFunctionScheduleFailed"}


@dataclass
class FailedTask:
    """One failed task attempt (a retried attempt that later succeeded is reported as ``retried``)."""

    execution_arn: str
    state: str
    error: str
    cause: str
    phase: str | None = None
    stage: int | None = None
    index: int | None = None
    t: int | None = None
    function: str | None = None
    timestamp: str = ""
    retried: bool = False


@dataclass
class Inspection:
    execution_arn: str
    job_id: str
    status: str
    console_url: str
    started: str
    stopped: str | None
    error: str | None
    plan: dict[str, Any]
    iterations: int
    iterations_done: int
    windows: int
    window: dict[str, Any] | None  # the latest window execution: index, start, end, status, arn
    phase_timings: dict[str, dict[str, float]]
    losses: list[float]
    breakdown: list[dict[str, float]]
    failed_tasks: list[FailedTask] = field(default_factory=list)
    metrics: list[dict[str, Any]] = field(default_factory=list, repr=False)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("metrics")
        return d


class InspectError(RuntimeError):
    """The execution is not a Stagecoach job execution of this backend's stack."""


# ------------------------------------------------------------------------------------ reading
def open_run(backend: Any, execution_arn: str) -> Any:
    """A :class:`stagecoach.run.Run` for an existing job execution (no Job object needed)."""
    from stagecoach.run import Run

    if hasattr(backend, "check_arn"):
        backend.check_arn(execution_arn)
    sfn = backend.clients.sfn
    try:
        d = sfn.describe_execution(executionArn=execution_arn)
    except sfn.exceptions.ExecutionDoesNotExist:
        raise InspectError(f"no execution {execution_arn} on the {backend.name} backend"
                           + (" (is `stagecoach local start` running, and was the run started while it was?)" if backend.name == "local" else "")) from None
    try:
        inp = json.loads(d.get("input") or "{}")
        job_id = inp["job"]
    except (ValueError, KeyError):
        raise InspectError(f"{execution_arn} is not a Stagecoach job execution (its input has no 'job')") from None
    if inp.get("bucket") and inp["bucket"] != backend.resources.bucket:
        raise InspectError(f"{execution_arn} belongs to bucket {inp['bucket']}, not this stack's {backend.resources.bucket}")
    run = Run(backend, None, None, job_id, execution_arn)
    spec = run.spec()
    run.plan = Plan.from_dict(spec["plan"])
    run._spec_cache = spec  # type: ignore[attr-defined]
    run._execution_input = inp  # type: ignore[attr-defined]
    run._description = d  # type: ignore[attr-defined]
    return run


def _payload(params: str | None) -> dict[str, Any]:
    try:
        p = json.loads(params or "{}")
    except ValueError:
        return {}
    payload = p.get("Payload", {})
    if isinstance(payload, str):
        try:
            payload = json.loads(payload)
        except ValueError:
            payload = {}
    return {"function": p.get("FunctionName"), **(payload if isinstance(payload, dict) else {})}


def _cause_text(cause: str) -> str:
    """A Lambda error's cause is JSON (errorType, errorMessage, stackTrace); keep the message."""
    try:
        c = json.loads(cause)
    except (ValueError, TypeError):
        return cause or ""
    if isinstance(c, dict) and "errorMessage" in c:
        return f"{c.get('errorType', '')}: {c['errorMessage']}".strip(": ")
    return cause


def failed_tasks(events: list[dict[str, Any]], execution_arn: str) -> list[FailedTask]:
    """Failed task attempts in one execution's history, traced back to their state and worker.

    A failure event points (previousEventId) at its TaskStarted, which points at TaskScheduled
    (the Lambda parameters: function and payload with phase, stage, replica/shard, t) — the
    state's name is on the TaskStateEntered before that.
    """
    by_id = {e["id"]: e for e in events}
    out: list[FailedTask] = []
    succeeded_payloads: list[tuple[Any, ...]] = []
    for e in events:
        if e["type"] in ("TaskSucceeded", "LambdaFunctionSucceeded"):
            sched = _walk_to(by_id, e, {"TaskScheduled", "LambdaFunctionScheduled"})
            if sched is not None:
                succeeded_payloads.append(_worker_key(_payload(_sched_params(sched))))
    for e in events:
        if e["type"] not in _FAIL_EVENTS:
            continue
        det = next((v for k, v in e.items() if k.endswith("EventDetails") and isinstance(v, dict)), {})
        sched = _walk_to(by_id, e, {"TaskScheduled", "LambdaFunctionScheduled"})
        entered = _walk_to(by_id, e, {"TaskStateEntered"})
        p = _payload(_sched_params(sched)) if sched else {}
        index = p.get("replica", p.get("shard"))
        ft = FailedTask(
            execution_arn=execution_arn,
            state=(entered or {}).get("stateEnteredEventDetails", {}).get("name", "?"),
            error=str(det.get("error", e["type"])),
            cause=_cause_text(str(det.get("cause", "")))[:1000],
            phase=p.get("phase"),
            stage=p.get("stage"),
            index=index,
            t=p.get("t"),
            function=p.get("function"),
            timestamp=str(e.get("timestamp", "")),
        )
        ft.retried = bool(p) and _worker_key(p) in succeeded_payloads
        out.append(ft)
    return out


def _sched_params(ev: dict[str, Any]) -> str | None:
    det = ev.get("taskScheduledEventDetails") or ev.get("lambdaFunctionScheduledEventDetails") or {}
    return det.get("parameters") or det.get("input")


def _worker_key(p: dict[str, Any]) -> tuple[Any, ...]:
    return (p.get("phase"), p.get("stage"), p.get("replica", p.get("shard")), p.get("t"))


def _walk_to(by_id: dict[int, dict[str, Any]], ev: dict[str, Any], types: set[str], limit: int = 20) -> dict[str, Any] | None:
    cur: dict[str, Any] | None = ev
    for _ in range(limit):
        if cur is None:
            return None
        prev = cur.get("previousEventId")
        cur = by_id.get(prev) if prev else None
        if cur is not None and cur["type"] in types:
            return cur
    return None


# ------------------------------------------------------------------------------------ metrics
def _by_iteration(metrics: Iterable[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    out: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for m in metrics:
        out[int(m["t"])].append(m)
    return out


def _span(ms: list[dict[str, Any]]) -> float:
    return max(m["end"] for m in ms) - min(m["start"] for m in ms) if ms else 0.0


def phase_timings(metrics: list[dict[str, Any]], skip_first: int = 1) -> dict[str, dict[str, float]]:
    """Per phase: mean span per iteration (first start to last end), mean task duration and its
    compute / transfer / wait parts, and the slowest task. The first ``skip_first`` iterations
    (cold starts) are left out when later ones exist."""
    by_it = _by_iteration(metrics)
    its = [t for t in sorted(by_it) if t >= skip_first] or sorted(by_it)
    out: dict[str, dict[str, float]] = {}
    for phase in PHASES:
        spans, tasks = [], []
        for t in its:
            pm = [m for m in by_it[t] if m["phase"] == phase]
            if pm:
                spans.append(_span(pm))
                tasks += pm
        if not tasks:
            continue
        n = len(tasks)
        out[phase] = {
            "span_s": sum(spans) / len(spans),
            "task_s": sum(m["duration_s"] for m in tasks) / n,
            "max_task_s": max(m["duration_s"] for m in tasks),
            "compute_s": sum(m["compute_s"] for m in tasks) / n,
            "transfer_s": sum(m["upload_s"] + m["download_s"] for m in tasks) / n,
            "wait_s": sum(m["wait_s"] for m in tasks) / n,
            "tasks": float(n),
            "cold": float(sum(1 for m in tasks if m.get("cold"))),
        }
    return out


def iteration_breakdown(metrics: list[dict[str, Any]], complete: int | None = None) -> list[dict[str, float]]:
    """Per iteration: wall time and its split into orchestration, compute, transfer and waiting.

    Wall time runs from the iteration's first task start to the next iteration's (so it includes
    the state transitions between phases); the phases' spans are time in tasks, split by the
    tasks' own compute / upload+download / wait shares; the rest is orchestration (Step Functions
    transitions and Lambda invocation latency). The same accounting as Run.time_breakdown, per
    iteration rather than averaged.
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
        wall = min(m["start"] for m in by_it[t + 1]) - min(m["start"] for m in ms)
        spans = sum(_span([m for m in ms if m["phase"] == p]) for p in PHASES)
        dur = sum(m["duration_s"] for m in ms) or 1.0
        comp = sum(m["compute_s"] for m in ms)
        xfer = sum(m["upload_s"] + m["download_s"] for m in ms)
        wait = sum(m["wait_s"] for m in ms)
        out.append({
            "t": float(t),
            "iteration_s": wall,
            "orchestration_s": max(0.0, wall - spans),
            "compute_s": spans * comp / dur,
            "transfer_s": spans * xfer / dur,
            "wait_s": spans * wait / dur,
        })
    return out


def _losses(metrics: list[dict[str, Any]], complete: int) -> list[float]:
    by_it = _by_iteration(metrics)
    out = []
    for t in range(complete):
        ls = [m["loss"] for m in by_it.get(t, []) if "loss" in m]
        out.append(sum(ls) / len(ls) if ls else float("nan"))
    return out


# ------------------------------------------------------------------------------------ inspect
def inspect_execution(backend: Any, execution_arn: str, max_failures: int = 50) -> Inspection:
    """Status, where the run is (window, iteration), phase timings, losses and failed tasks."""
    run = open_run(backend, execution_arn)
    d = run._description
    spec = run._spec_cache
    inp = run._execution_input
    metrics = run.metrics()
    done = run.iterations_done()
    windows = inp.get("windows", [])
    sfn = backend.clients.sfn
    window = None
    failures: list[FailedTask] = []
    try:
        execs = []
        for page in sfn.get_paginator("list_executions").paginate(stateMachineArn=spec["window_state_machine"]):
            execs += page["executions"]
    except sfn.exceptions.StateMachineDoesNotExist:
        execs = []  # cleaned up
    execs.sort(key=lambda e: e["startDate"])
    if execs:
        last = execs[-1]
        wd = sfn.describe_execution(executionArn=last["executionArn"])
        wi = json.loads(wd.get("input") or "{}")
        idx = next((i for i, w in enumerate(windows) if w.get("start") == wi.get("start")), None)
        window = {"index": idx, "start": wi.get("start"), "end": wi.get("end"), "status": wd["status"],
                  "arn": last["executionArn"], "attempts": sum(1 for e in execs if e["name"].startswith(f"w{wi.get('start')}-"))}
    for e in execs:
        if e["status"] in ("FAILED", "TIMED_OUT", "ABORTED") or d["status"] != "SUCCEEDED":
            for ft in failed_tasks(run.history(execution_arn=e["executionArn"]), e["executionArn"]):
                failures.append(ft)
                if len(failures) >= max_failures:
                    break
    r = backend.resources
    return Inspection(
        execution_arn=execution_arn,
        job_id=run.job_id,
        status=d["status"],
        console_url=r.console.format(region=r.region, arn=execution_arn),
        started=str(d.get("startDate", "")),
        stopped=str(d["stopDate"]) if d.get("stopDate") else None,
        error=f"{d.get('error', '')}: {d.get('cause', '')[:500]}" if d.get("error") or d.get("cause") else None,
        plan=spec["plan"],
        iterations=int(spec.get("iterations", windows[-1]["end"] if windows else 0)),
        iterations_done=done,
        windows=len(windows),
        window=window,
        phase_timings=phase_timings(metrics),
        losses=_losses(metrics, done),
        breakdown=iteration_breakdown(metrics, complete=done),
        failed_tasks=failures,
        metrics=metrics,
    )


def format_report(ins: Inspection) -> str:
    """The human-readable report `stagecoach inspect` prints."""
    p = ins.plan
    lines = [
        f"job {ins.job_id}: {ins.status}",
        f"execution {ins.execution_arn}",
        f"console   {ins.console_url}",
        f"started {ins.started}" + (f", stopped {ins.stopped}" if ins.stopped else ""),
        f"plan: {len(p['balance'])} stages (layers {list(p['balance'])}) x {p['replicas']} replicas, "
        f"{p['micro_batches']} micro-batches, memory {list(p['memory_mb'])} MB",
        f"iteration {ins.iterations_done}/{ins.iterations} done",
    ]
    if ins.window:
        w = ins.window
        lines.append(f"window {('?' if w['index'] is None else w['index'] + 1)}/{ins.windows}: iterations [{w['start']}, {w['end']}) "
                     f"{w['status']} (attempt {w['attempts']})")
    if ins.error:
        lines.append(f"error: {ins.error}")
    if ins.phase_timings:
        lines.append("phase timings (mean per iteration after the first; task parts are means per task):")
        lines.append(f"  {'phase':9} {'span s':>8} {'task s':>8} {'max s':>8} {'compute':>8} {'transfer':>9} {'wait':>8} {'tasks':>6}")
        for ph, v in ins.phase_timings.items():
            lines.append(f"  {ph:9} {v['span_s']:8.3f} {v['task_s']:8.3f} {v['max_task_s']:8.3f} {v['compute_s']:8.3f} "
                         f"{v['transfer_s']:9.3f} {v['wait_s']:8.3f} {int(v['tasks']):6d}")
    if ins.breakdown:
        b = ins.breakdown[1:] or ins.breakdown
        it = sum(x["iteration_s"] for x in b) / len(b)
        parts = {k: sum(x[k] for x in b) / len(b) for k in ("orchestration_s", "compute_s", "transfer_s", "wait_s")}
        lines.append(f"time per iteration {it:.3f} s: " + ", ".join(
            f"{k[:-2]} {v:.3f} s ({v / it:.0%})" if it > 0 else f"{k[:-2]} {v:.3f} s" for k, v in parts.items()))
    if ins.losses:
        ls = ins.losses
        step = max(1, len(ls) // 10)
        lines.append(f"loss: first {ls[0]:.4f}, last {ls[-1]:.4f}, min {min(ls):.4f}")
        lines.append("  " + " ".join(f"[{t}] {ls[t]:.4f}" for t in range(0, len(ls), step)))
    if ins.failed_tasks:
        lines.append(f"failed tasks ({len(ins.failed_tasks)}):")
        for f in ins.failed_tasks:
            who = f"{f.phase} s{f.stage} #{f.index} t={f.t}" if f.phase else f.state
            lines.append(f"  {who}: {f.error}: {f.cause[:300]}" + (" (retried, then succeeded)" if f.retried else ""))
    else:
        lines.append("failed tasks: none")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ plots
_COLOURS = {"forward": "#4c72b0", "backward": "#dd8452", "sync": "#55a868"}


def plot_gantt(metrics: list[dict[str, Any]], path: str, iterations: tuple[int, int] | None = None) -> str:
    """Tasks as bars on a row per (stage, worker), coloured by phase; the waiting part hatched.

    By default the last (up to) 5 iterations, where containers are warm; ``iterations`` = [a, b).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if not metrics:
        raise ValueError("no task metrics yet: nothing to plot")
    ts = sorted({int(m["t"]) for m in metrics})
    a, b = iterations if iterations else (max(ts[0], ts[-1] - 4), ts[-1] + 1)
    ms = [m for m in metrics if a <= m["t"] < b]
    t0 = min(m["start"] for m in ms)
    rows = sorted({(m["stage"], m["phase"] == "sync", m["index"]) for m in ms})
    ypos = {r: i for i, r in enumerate(rows)}
    fig, ax = plt.subplots(figsize=(12, 0.45 * len(rows) + 1.8))
    for m in ms:
        y = ypos[(m["stage"], m["phase"] == "sync", m["index"])]
        ax.broken_barh([(m["start"] - t0, m["duration_s"])], (y - 0.4, 0.8), facecolors=_COLOURS[m["phase"]], edgecolor="black", linewidth=0.3)
        if m.get("wait_s", 0) > 0:
            ax.broken_barh([(m["end"] - t0 - m["wait_s"], m["wait_s"])], (y - 0.4, 0.8), facecolors="none", hatch="///", edgecolor="white", linewidth=0)
    for t in range(a, b):
        starts = [m["start"] for m in ms if m["t"] == t]
        if starts:
            ax.axvline(min(starts) - t0, color="grey", linestyle=":", linewidth=0.8)
            ax.text(min(starts) - t0, len(rows) - 0.4, f"t={t}", fontsize=7, color="grey")
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"stage {s} {'shard' if sync else 'replica'} {i}" for s, sync, i in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.set_title(f"tasks per stage, iterations {a}-{b - 1} (hatched: waiting for other workers' objects)")
    ax.legend(handles=[Patch(color=c, label=p) for p, c in _COLOURS.items()], loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_breakdown(breakdown: list[dict[str, float]], path: str) -> str:
    """Stacked bars per iteration: orchestration, compute, S3 transfer, waiting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not breakdown:
        raise ValueError("fewer than two iterations finished: no time breakdown yet")
    ts = [int(x["t"]) for x in breakdown]
    fig, ax = plt.subplots(figsize=(max(6.0, min(16.0, 0.12 * len(ts) + 4)), 4))
    bottom = [0.0] * len(ts)
    for key, colour in (("compute_s", "#4c72b0"), ("transfer_s", "#dd8452"), ("wait_s", "#c44e52"), ("orchestration_s", "#8c8c8c")):
        vals = [x[key] for x in breakdown]
        ax.bar(ts, vals, bottom=bottom, color=colour, label=key[:-2], width=0.9)
        bottom = [u + v for u, v in zip(bottom, vals)]
    ax.set_xlabel("iteration")
    ax.set_ylabel("seconds")
    ax.set_title("time per iteration")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_loss(losses: list[float], path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(len(losses)), losses)
    ax.set_xlabel("iteration")
    ax.set_ylabel("loss (global-batch mean)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_plots(ins: Inspection, directory: str) -> list[str]:
    """gantt.png, breakdown.png and loss.png for the run, as far as it has got."""
    os.makedirs(directory, exist_ok=True)
    out = []
    if ins.metrics:
        out.append(plot_gantt(ins.metrics, os.path.join(directory, f"{ins.job_id}-gantt.png")))
    if ins.breakdown:
        out.append(plot_breakdown(ins.breakdown, os.path.join(directory, f"{ins.job_id}-breakdown.png")))
    if ins.losses:
        out.append(plot_loss(ins.losses, os.path.join(directory, f"{ins.job_id}-loss.png")))
    return out
