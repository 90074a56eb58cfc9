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

from stagecoach.lambdas import keys
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
    time: float | None = None  # the failure's epoch seconds (for the Gantt chart)


@dataclass
class Inspection:
    """Everything `stagecoach inspect` reports about one job execution (``to_dict`` for --json)."""

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
    remediations: list[dict[str, Any]] = field(default_factory=list)  # out-of-memory: stage raised a tier
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
    try:
        spec = run.spec()
    except backend.clients.s3.exceptions.NoSuchKey:
        r = backend.resources
        raise InspectError(
            f"job {job_id} is {d['status']}, but its objects (s3://{r.bucket}/jobs/{job_id}/) are gone: was it cleaned "
            f"up (`stagecoach cleanup`)? Its Step Functions history stays for 90 days after it ended: "
            f"{r.console.format(region=r.region, arn=execution_arn)}"
        ) from None
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
            time=e["timestamp"].timestamp() if hasattr(e.get("timestamp"), "timestamp") else None,
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
def _transfer(m: dict[str, Any]) -> float:
    """Seconds the task had an S3 transfer in flight: ``transfer_s`` (the union of concurrent
    uploads and downloads) where the worker records it, else upload + download (sequential)."""
    if "transfer_s" in m:
        return float(m["transfer_s"])
    return float(m.get("upload_s", 0.0)) + float(m.get("download_s", 0.0))


def _by_iteration(metrics: Iterable[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    out: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for m in metrics:
        out[int(m["t"])].append(m)
    return out


def _span(ms: list[dict[str, Any]]) -> float:
    return max(m["end"] for m in ms) - min(m["start"] for m in ms) if ms else 0.0


def _busy(ms: list[dict[str, Any]]) -> float:
    """Seconds during which at least one of the tasks ran (the union of their intervals).

    Not the sum of the phases' spans: in BackwardSync the stages run in parallel branches, so one
    stage's sync overlaps another's backward."""
    total, end = 0.0, float("-inf")
    for a, b in sorted((float(m["start"]), float(m["end"])) for m in ms):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


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
            "transfer_s": sum(_transfer(m) for m in tasks) / n,
            "wait_s": sum(m["wait_s"] for m in tasks) / n,
            "tasks": float(n),
            "cold": float(sum(1 for m in tasks if m.get("cold"))),
        }
    return out


def iteration_breakdown(metrics: list[dict[str, Any]], complete: int | None = None) -> list[dict[str, float]]:
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
        wall = min(m["start"] for m in by_it[t + 1]) - min(m["start"] for m in ms)
        busy = min(_busy(ms), wall)
        comp = sum(float(m["compute_s"]) for m in ms)
        xfer = sum(_transfer(m) for m in ms)
        wait = sum(float(m["wait_s"]) for m in ms)
        parts = comp + xfer + wait
        if parts <= 0:  # nothing accounted: call it compute
            comp, parts = 1.0, 1.0
        out.append({
            "t": float(t),
            "iteration_s": wall,
            "orchestration_s": wall - busy,
            "compute_s": busy * comp / parts,
            "transfer_s": busy * xfer / parts,
            "wait_s": busy * wait / parts,
            "cold": float(sum(1 for m in ms if m.get("cold"))),
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
def _remediations(backend: Any, job_id: str) -> list[dict[str, Any]]:
    """The job's out-of-memory remediations (jobs/{job}/remediations/, lambdas/remediate.py)."""
    s3, bucket = backend.clients.s3, backend.resources.bucket
    out = []
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"{keys.job_prefix(job_id)}remediations/"):
        for o in page.get("Contents", []):
            try:
                out.append(json.loads(s3.get_object(Bucket=bucket, Key=o["Key"])["Body"].read()))
            except (ValueError, s3.exceptions.NoSuchKey):
                continue
    return sorted(out, key=lambda r: r.get("time", 0))


def inspect_execution(backend: Any, execution_arn: str, max_failures: int = 50) -> Inspection:
    """Status, where the run is (window, iteration), phase timings, losses and failed tasks.

    Failed tasks come from the histories of the window executions that did not succeed, and of
    the latest one (a running window's retried tasks); a long run's succeeded windows are not read.
    """
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
    to_read = [e for e in execs if e["status"] in ("FAILED", "TIMED_OUT", "ABORTED")]
    if execs and execs[-1] not in to_read:
        to_read.append(execs[-1])
    for e in to_read:
        failures += failed_tasks(run.history(execution_arn=e["executionArn"]), e["executionArn"])
        if len(failures) >= max_failures:
            failures = failures[:max_failures]
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
        remediations=_remediations(backend, run.job_id),
        metrics=metrics,
    )


def _sync_label(p: dict[str, Any]) -> str:
    """The plan's gradient sync per stage: 'scatter_reduce (K=2)', or one entry per stage if they differ."""
    if int(p.get("replicas", 1)) == 1:
        return "none (1 replica)"
    n = len(p["balance"])
    sync = list(p.get("sync") or ["scatter_reduce"] * n)
    ks = list(p.get("aggregators") or [p["replicas"]] * n)
    labels = [s if s == "pipelined_scatter_reduce" else f"{s} (K={k})" for s, k in zip(sync, ks)]
    return labels[0] if len(set(labels)) == 1 else ", ".join(f"s{i}: {lab}" for i, lab in enumerate(labels))


def format_report(ins: Inspection) -> str:
    """The human-readable report `stagecoach inspect` prints."""
    p = ins.plan
    lines = [
        f"job {ins.job_id}: {ins.status}",
        f"execution {ins.execution_arn}",
        f"console   {ins.console_url}",
        f"started {ins.started}" + (f", stopped {ins.stopped}" if ins.stopped else ""),
        f"plan: {len(p['balance'])} stages (layers {list(p['balance'])}) x {p['replicas']} replicas, "
        f"{p['micro_batches']} micro-batches, memory {list(p['memory_mb'])} MB, sync {_sync_label(p)}",
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
        lines.append(f"time per iteration{' after the first' if len(ins.breakdown) > 1 else ''} {it:.3f} s: " + ", ".join(
            f"{k[:-2]} {v:.3f} s ({v / it:.0%})" if it > 0 else f"{k[:-2]} {v:.3f} s" for k, v in parts.items()))
    if ins.losses:
        ls = ins.losses
        step = max(1, len(ls) // 10)
        lines.append(f"loss: first {ls[0]:.4f}, last {ls[-1]:.4f}, min {min(ls):.4f}")
        lines.append("  " + " ".join(f"[{t}] {ls[t]:.4f}" for t in range(0, len(ls), step)))
    for rm in ins.remediations:
        lines.append(f"out of memory: stage {rm.get('stage')} raised from {rm.get('from_mb')} MB to {rm.get('to_mb')} MB "
                     f"({rm.get('function')})")
    if ins.failed_tasks:
        lines.append(f"failed tasks ({len(ins.failed_tasks)}):")
        for f in ins.failed_tasks:
            who = f"{f.phase} s{f.stage} #{f.index} t={f.t}" if f.phase else f.state
            cause = f.cause[len(f.error) + 2:] if f.cause.startswith(f"{f.error}: ") else f.cause
            lines.append(f"  {who}: {f.error}: {cause[:300]}" + (" (retried, then succeeded)" if f.retried else ""))
    else:
        lines.append("failed tasks: none")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ plots
_COLOURS = {"forward": "#4c72b0", "backward": "#dd8452", "sync": "#55a868"}
_PARTS = (("compute_s", "compute", "#4c72b0"), ("transfer_s", "S3 transfer", "#dd8452"),
          ("wait_s", "waiting for other workers", "#c44e52"), ("orchestration_s", "orchestration (no task running)", "#8c8c8c"))


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise InspectError("--plot needs matplotlib: pip install 'stagecoach[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def gantt_rows(metrics: list[dict[str, Any]]) -> list[tuple[int, bool, int]]:
    """The Gantt chart's rows, top to bottom: per stage, its replicas (forward and backward tasks
    share a row), then its sync tasks, as (stage, is_sync, index). Taken from the tasks that ran,
    so a stage has as many sync rows as its aggregators (K), and none for a fused sync."""
    return sorted({(int(m["stage"]), m["phase"] == "sync", int(m["index"])) for m in metrics})


def plot_gantt(metrics: list[dict[str, Any]], path: str, iterations: tuple[int, int] | None = None,
               failures: list[FailedTask] | None = None) -> str:
    """Tasks as bars on a row per (stage, worker), coloured by phase; the waiting part hatched;
    failed task attempts (``failures``, from the histories) as red crosses where they failed.

    Rows: each stage's replicas (forward, backward) and then its sync tasks (as many as the stage's
    aggregators, whatever the sync algorithm; none for a fused sync). By default the last (up to) 5
    iterations; ``iterations`` = [a, b). The waiting share is drawn at the end of its task (the
    metrics give its length, not when it happened).
    """
    from matplotlib.patches import Patch

    plt = _pyplot()
    if not metrics:
        raise ValueError("no task metrics yet: nothing to plot")
    ts = sorted({int(m["t"]) for m in metrics})
    a, b = iterations if iterations else (max(ts[0], ts[-1] - 4), ts[-1] + 1)
    ms = [m for m in metrics if a <= m["t"] < b]
    if not ms:
        raise ValueError(f"no task metrics in iterations [{a}, {b})")
    t0 = min(m["start"] for m in ms)
    rows = gantt_rows(ms)
    ypos = {r: i for i, r in enumerate(rows)}
    fig, ax = plt.subplots(figsize=(12, 0.42 * len(rows) + 2.2))
    for m in ms:
        y = ypos[(int(m["stage"]), m["phase"] == "sync", int(m["index"]))]
        ax.broken_barh([(m["start"] - t0, m["duration_s"])], (y - 0.4, 0.8), facecolors=_COLOURS.get(m["phase"], "#999999"),
                       edgecolor="black", linewidth=0.3)
        if m.get("wait_s", 0) > 0:
            ax.broken_barh([(m["end"] - t0 - m["wait_s"], m["wait_s"])], (y - 0.4, 0.8), facecolors="none", hatch="///",
                           edgecolor="white", linewidth=0)
    crosses = [(f.time - t0, ypos[(f.stage, f.phase == "sync", f.index)]) for f in failures or []
               if f.time is not None and f.t is not None and a <= f.t < b and (f.stage, f.phase == "sync", f.index) in ypos]
    if crosses:
        ax.scatter([x for x, _ in crosses], [y for _, y in crosses], marker="X", s=60, color="#d62728", zorder=5,
                   edgecolors="white", linewidths=0.6)
    for i in range(1, len(rows)):  # a line between stages
        if rows[i][0] != rows[i - 1][0]:
            ax.axhline(i - 0.5, color="black", linewidth=0.6)
    for t in range(a, b):
        starts = [m["start"] for m in ms if m["t"] == t]
        if starts:
            ax.axvline(min(starts) - t0, color="grey", linestyle=":", linewidth=0.8)
            cold = any(m.get("cold") for m in ms if m["t"] == t)
            ax.text(min(starts) - t0, -0.75, f"t={t}" + (" (cold)" if cold else ""), fontsize=7, color="dimgrey")
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"stage {s} {'sync' if sync else 'replica'} {i}" for s, sync, i in rows], fontsize=8)
    ax.set_ylim(len(rows) - 0.5, -1.0)
    ax.set_xlabel("seconds")
    ax.set_title(f"tasks per stage, iterations {a}-{b - 1} (hatched: waiting for other workers' objects)", fontsize=10)
    from matplotlib.lines import Line2D

    handles = [Patch(color=c, label=p) for p, c in _COLOURS.items()] + [Patch(facecolor="#dd8452", hatch="///", edgecolor="white", label="waiting")]
    if crosses:
        handles.append(Line2D([], [], marker="X", color="#d62728", linestyle="none", markersize=8, label="failed attempt"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.12 if len(rows) > 6 else -0.2), ncol=len(handles),
              fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_breakdown(breakdown: list[dict[str, float]], path: str) -> str:
    """Stacked bars per iteration: compute, S3 transfer, waiting, orchestration (they add up to it)."""
    from matplotlib.ticker import MaxNLocator

    plt = _pyplot()
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
    from matplotlib.ticker import MaxNLocator

    plt = _pyplot()
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
