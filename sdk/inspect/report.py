"""Inspect a run from its job execution ARN, on either backend: what `stagecoach inspect` prints.

Everything comes from the two places a run leaves traces: Step Functions (the job execution, its
window executions and their histories: status, where the run is, which tasks failed and why) and
the job's metrics objects in S3 (one per task: timings, bytes, loss; docs/runtime.md). Nothing
here needs the user's job file, so a run can be inspected from any machine with access to the
stack.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from stagecoach.backend import Backend
from stagecoach.core import keys
from stagecoach.core.records import CostTally, JobSpec, Remediation, StopRecord, TaskMetrics
from stagecoach.cost import CostReport
from stagecoach.deploy.resources import group_state_machine_of
from stagecoach.errors import StagecoachError
from stagecoach.evaluation import Evaluation
from stagecoach.inspect.events import FailedTask, failed_tasks
from stagecoach.inspect.express import express_windows, window_failures
from stagecoach.metrics import _losses, iteration_breakdown, phase_timings
from stagecoach.planner.plan import FUSED_SYNC
from stagecoach.run import Run, read_spec


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
    remediations: list[Remediation] = field(default_factory=list)  # killed workers: what was decided
    evaluations: list[Evaluation] = field(default_factory=list)  # the validation set's loss and metrics per version
    metrics: list[TaskMetrics] = field(default_factory=list, repr=False)
    cost: CostReport | None = None  # measured so far (None for a job launched before cost metering)
    stop: StopRecord | None = None  # where and why the job stopped, if it did
    max_cost_usd: float | None = None
    metered_usd: float | None = None  # the engine's running tally, what the cap is checked against
    latest_execution: str | None = None  # the job's latest execution, when it is not the one inspected

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("metrics")
        d["remediations"] = [r.model_dump() for r in self.remediations]
        d["cost"] = self.cost.to_dict() if self.cost else None
        d["stop"] = self.stop.model_dump() if self.stop else None
        return d


class InspectError(StagecoachError, RuntimeError):
    """The execution is not a Stagecoach job execution of this backend's stack."""


# ------------------------------------------------------------------------------------ reading
@dataclass(frozen=True)
class OpenedRun:
    """An existing job execution as read once: the Run, and what was read to build it."""

    run: Run
    description: dict[str, Any]  # DescribeExecution of the job execution
    spec: JobSpec  # the job's spec object
    execution_input: dict[str, Any]  # the job execution's input


def open_run(backend: Backend, execution_arn: str) -> Run:
    """A :class:`stagecoach.run.Run` for an existing job execution (no Job object needed)."""
    return read_run(backend, execution_arn).run


def read_run(backend: Backend, execution_arn: str) -> OpenedRun:
    """:func:`open_run`, keeping the execution's description, input and spec for the caller."""
    backend.check_arn(execution_arn)
    sfn = backend.clients.sfn
    try:
        d = sfn.describe_execution(executionArn=execution_arn)
    except sfn.exceptions.ExecutionDoesNotExist:
        raise InspectError(
            f"no execution {execution_arn} on the {backend.name} backend"
            + (
                " (was the run started on this project's local stack, or by a script whose own stack ended with it?)"
                if backend.name == "local"
                else ""
            )
        ) from None
    try:
        inp = json.loads(d.get("input") or "{}")
        job_id = inp["job"]
    except (ValueError, KeyError):
        raise InspectError(f"{execution_arn} is not a Stagecoach job execution (its input has no 'job')") from None
    if inp.get("bucket") and inp["bucket"] != backend.resources.bucket:
        raise InspectError(f"{execution_arn} belongs to bucket {inp['bucket']}, not this stack's {backend.resources.bucket}")
    try:
        spec = read_spec(backend.clients.s3, backend.resources.bucket, job_id)  # what Run.spec() reads
    except backend.clients.s3.exceptions.NoSuchKey:
        r = backend.resources
        raise InspectError(
            f"job {job_id} is {d['status']}, but its objects (s3://{r.bucket}/jobs/{job_id}/) are gone: was it cleaned "
            f"up (`stagecoach cleanup`)? Its Step Functions history stays for 90 days after it ended: "
            f"{r.console.format(region=r.region, arn=execution_arn, job=job_id)}"
        ) from None
    run = Run(backend, None, spec.to_plan(), job_id, execution_arn)
    return OpenedRun(run=run, description=d, spec=spec, execution_input=inp)


# ------------------------------------------------------------------------------------ inspect
def _remediations(backend: Backend, job_id: str) -> list[Remediation]:
    """What the remediation step decided about the job's killed workers (lambdas/remediate.py)."""
    s3, bucket = backend.clients.s3, backend.resources.bucket
    out = []
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=keys.remediations_prefix(job_id)):
        for o in page.get("Contents", []):
            try:
                out.append(Remediation.model_validate_json(s3.get_object(Bucket=bucket, Key=o["Key"])["Body"].read()))
            except s3.exceptions.NoSuchKey:
                continue
    return sorted(out, key=lambda r: r.time)


def inspect_execution(backend: Backend, execution_arn: str, max_failures: int = 50) -> Inspection:
    """Status, where the run is (window, iteration), phase timings, losses and failed tasks.

    Failed tasks come from the histories of the window executions that did not succeed, and of
    the latest one (a running window's retried tasks); a long run's succeeded windows are not read.
    """
    opened = read_run(backend, execution_arn)
    run, d, spec, inp = opened.run, opened.description, opened.spec, opened.execution_input
    metrics = run.metrics()
    done = run.iterations_done()
    length = int(inp.get("windowLength") or spec.window_length or 1)
    n_windows = -(-spec.iterations // length)
    # the job's status, as `list` and `train` show it: its latest execution's, even when the ARN
    # given is an earlier one (a stopped job's first execution, resumed since)
    status, d = run.job_state()
    execs = _window_executions(backend, spec.window_state_machine)
    if execs is None:  # Express windows: from the job's own history (inspect/express.py)
        job_events = run.history()
        execs = express_windows(job_events)
        failures = window_failures(execs, run.express_window_runs(job_events))[:max_failures]
    else:
        failures = _failures(run, execs + _failed_groups(backend, spec.window_state_machine), max_failures)
    window = _window(backend, execs, length)
    r = backend.resources
    if status == "SUCCEEDED":
        run.learn_if_newest()  # a run nobody waited on (train --no-wait): its next run's timeouts
    return Inspection(
        execution_arn=execution_arn,
        job_id=run.job_id,
        status=status,
        console_url=r.console.format(region=r.region, arn=execution_arn, job=run.job_id),
        started=str(d.get("startDate", "")),
        stopped=str(d["stopDate"]) if d.get("stopDate") else None,
        latest_execution=d["executionArn"] if d["executionArn"] != execution_arn else None,
        error=f"{d.get('error', '')}: {d.get('cause', '')[:500]}" if d.get("error") or d.get("cause") else None,
        plan=spec.plan,
        iterations=spec.iterations,
        iterations_done=done,
        windows=n_windows,
        window=window,
        phase_timings=phase_timings(metrics),
        losses=_losses(metrics, done),
        breakdown=iteration_breakdown(metrics, complete=done),
        failed_tasks=failures,
        remediations=_remediations(backend, run.job_id),
        evaluations=run.evaluations(),
        metrics=metrics,
        cost=run.cost() if spec.prices is not None else None,
        stop=run.stopped() if status == "STOPPED" else None,
        max_cost_usd=spec.max_cost_usd,
        metered_usd=_metered(backend, run.job_id) if spec.max_cost_usd is not None else None,
    )


def _window_executions(backend: Backend, window_state_machine: str | None) -> list[dict[str, Any]] | None:
    """The job's window executions, oldest first (none once it is cleaned up); None for Express
    windows, which ListExecutions does not list."""
    sfn = backend.clients.sfn
    execs: list[dict[str, Any]] = []
    if window_state_machine is None:
        return []
    try:
        for page in sfn.get_paginator("list_executions").paginate(stateMachineArn=window_state_machine):
            execs += page["executions"]
    except sfn.exceptions.StateMachineDoesNotExist:
        return []
    except sfn.exceptions.StateMachineTypeNotSupported:
        return None
    return sorted(execs, key=lambda e: e["startDate"])


def _failed_groups(backend: Backend, window_state_machine: str | None) -> list[dict[str, Any]]:
    """The group executions (a phase past 40 workers: planner/emit/groups.py) that failed, oldest
    first: their failed tasks are in their own histories, not the window's. A group whose tasks
    failed and ran again successfully is not read (a run has one per phase and iteration)."""
    if window_state_machine is None:
        return []
    sfn, execs = backend.clients.sfn, []
    group = group_state_machine_of(window_state_machine)
    try:
        for status in ("FAILED", "TIMED_OUT", "ABORTED"):
            for page in sfn.get_paginator("list_executions").paginate(stateMachineArn=group, statusFilter=status):
                execs += page["executions"]
    except sfn.exceptions.StateMachineDoesNotExist:  # a plan without groups
        return []
    return sorted(execs, key=lambda e: e["startDate"])


def _window(backend: Backend, execs: list[dict[str, Any]], length: int) -> dict[str, Any] | None:
    """Where the run is: the latest window execution's iterations, status and attempt."""
    if not execs:
        return None
    last = execs[-1]
    # an Express window's row carries what DescribeExecution would say (it cannot describe one)
    wd = last if "input" in last else backend.clients.sfn.describe_execution(executionArn=last["executionArn"])
    wi = json.loads(wd.get("input") or "{}")
    idx = int(wi["start"]) // length if isinstance(wi.get("start"), int) else None
    return {
        "index": idx,
        "start": wi.get("start"),
        "end": wi.get("end"),
        "status": wd["status"],
        "arn": last["executionArn"],
        "attempts": sum(1 for e in execs if e["name"].startswith(f"w{wi.get('start')}-")),
    }


def _failures(run: Run, execs: list[dict[str, Any]], max_failures: int) -> list[FailedTask]:
    """Failed tasks from the windows (and groups) that did not succeed and the latest window (its
    retried tasks); ``execs``: the windows, oldest first, then the failed groups."""
    to_read = [e for e in execs if e["status"] in ("FAILED", "TIMED_OUT", "ABORTED")]
    windows = [e for e in execs if not e.get("stateMachineArn", "").endswith("-group")]
    if windows and windows[-1] not in to_read:
        to_read.append(windows[-1])
    failures: list[FailedTask] = []
    for e in to_read:
        failures += failed_tasks(run.history(execution_arn=e["executionArn"]), e["executionArn"])
        if len(failures) >= max_failures:
            return failures[:max_failures]
    return failures


def _metered(backend: Backend, job_id: str) -> float | None:
    """The engine's running tally of a capped job (lambdas/gate.py), None before its first gate."""
    s3 = backend.clients.s3
    try:
        body = s3.get_object(Bucket=backend.resources.bucket, Key=keys.cost_tally(job_id))["Body"].read()
    except s3.exceptions.NoSuchKey:
        return None
    return CostTally.model_validate_json(body).usd


def _sync_label(p: dict[str, Any]) -> str:
    """The plan's gradient sync per stage: 'scatter_reduce (K=2)', or one entry per stage if they differ."""
    if int(p.get("replicas", 1)) == 1:
        return "none (1 replica)"
    n = len(p["balance"])
    sync = list(p.get("sync") or ["scatter_reduce"] * n)
    ks = list(p.get("aggregators") or [p["replicas"]] * n)
    labels = [s if s in FUSED_SYNC else f"{s} (K={k})" for s, k in zip(sync, ks)]  # fused: K = d
    return labels[0] if len(set(labels)) == 1 else ", ".join(f"s{i}: {lab}" for i, lab in enumerate(labels))


# why a job stopped (core/records.py StopReason), as the report says it
STOPPED_BY = {"requested": "on request", "max_cost": "cost cap", "nonfinite_loss": "non-finite loss"}


def _loss_lines(ls: list[float]) -> list[str]:
    """The loss curve in two lines: first, last and least loss, and every tenth iteration's. A NaN
    or infinite loss is shown as such, and the iterations that had one are counted."""
    finite = [v for v in ls if math.isfinite(v)]
    bad = [t for t, v in enumerate(ls) if not math.isfinite(v)]
    head = f"loss: first {ls[0]:.4f}, last {ls[-1]:.4f}"
    if not bad:
        head += f", min {min(ls):.4f}"
    else:
        head += f", min {min(finite):.4f} (finite)" if finite else ""
        head += f"; not finite in {len(bad)} of {len(ls)} iterations, first at iteration {bad[0]}"
    step = max(1, len(ls) // 10)
    return [head, "  " + " ".join(f"[{t}] {ls[t]:.4f}" for t in range(0, len(ls), step))]


def format_report(ins: Inspection) -> str:
    """The human-readable report `stagecoach inspect` prints: one section after another."""
    p = ins.plan
    lines = [
        f"job {ins.job_id}: {ins.status}",
        f"execution {ins.execution_arn}"
        + (f" (the job went on as {ins.latest_execution}, whose status this is)" if ins.latest_execution else ""),
        f"console   {ins.console_url}",
        f"started {ins.started}" + (f", stopped {ins.stopped}" if ins.stopped else ""),
        f"plan: {len(p['balance'])} stages (layers {list(p['balance'])}) x {p['replicas']} replicas, "
        f"{p['micro_batches']} micro-batches, memory {list(p['memory_mb'])} MB, sync {_sync_label(p)}",
        f"iteration {ins.iterations_done}/{ins.iterations} done",
    ]
    for section in (_window_lines, _end_lines, _cost_lines, _timing_lines, _breakdown_lines):
        lines += section(ins)
    if ins.losses:
        lines += _loss_lines(ins.losses)
    lines += [f"evaluation after {e.version} iterations ({e.samples} samples): {e.describe()}" for e in ins.evaluations]
    lines += _remediation_lines(ins) + _failure_lines(ins)
    return "\n".join(lines)


def _window_lines(ins: Inspection) -> list[str]:
    if not ins.window:
        return []
    w = ins.window
    return [
        f"window {('?' if w['index'] is None else w['index'] + 1)}/{ins.windows}: iterations [{w['start']}, {w['end']}) "
        f"{w['status']} (attempt {w['attempts']})"
    ]


def _end_lines(ins: Inspection) -> list[str]:
    """Why it stopped (at an iteration boundary, keeping its checkpoint), or its error."""
    if ins.stop:
        return [
            f"stopped before iteration {ins.stop.version} ({STOPPED_BY[ins.stop.reason]}"
            + (f": {ins.stop.detail}" if ins.stop.detail else "")
            + f"); checkpoint: version {ins.stop.version} of the parameters and optimizer state"
        ]
    return [f"error: {ins.error}"] if ins.error else []


def _cost_lines(ins: Inspection) -> list[str]:
    if not ins.cost:
        return []
    cap = ""
    if ins.max_cost_usd is not None:
        metered = f", the engine's meter ${ins.metered_usd:.4f}" if ins.metered_usd is not None else ""
        cap = f"; cap ${ins.max_cost_usd:.4f}{metered}"
    lines = [f"cost: measured {ins.cost.summary()}{cap}", f"  {ins.cost.quantities()}"]
    pred = (ins.plan.get("prediction") or {}).get("usd_per_iteration")
    if pred:
        lines.append(f"  the planner predicted ${pred:.6f} per iteration; measured ${ins.cost.per_iteration_usd():.6f}")
    return lines


def _timing_lines(ins: Inspection) -> list[str]:
    if not ins.phase_timings:
        return []
    lines = [
        "phase timings (mean per iteration after the first; task parts are means per task):",
        f"  {'phase':9} {'span s':>8} {'task s':>8} {'max s':>8} {'compute':>8} {'transfer':>9} {'wait':>8} {'tasks':>6}",
    ]
    for ph, v in ins.phase_timings.items():
        lines.append(
            f"  {ph:9} {v['span_s']:8.3f} {v['task_s']:8.3f} {v['max_task_s']:8.3f} {v['compute_s']:8.3f} "
            f"{v['transfer_s']:9.3f} {v['wait_s']:8.3f} {int(v['tasks']):6d}"
        )
    return lines


def _breakdown_lines(ins: Inspection) -> list[str]:
    if not ins.breakdown:
        return []
    b = ins.breakdown[1:] or ins.breakdown
    it = sum(x["iteration_s"] for x in b) / len(b)
    parts = {k: sum(x[k] for x in b) / len(b) for k in ("orchestration_s", "compute_s", "transfer_s", "wait_s")}
    return [
        f"time per iteration{' after the first' if len(ins.breakdown) > 1 else ''} {it:.3f} s: "
        + ", ".join(f"{k[:-2]} {v:.3f} s ({v / it:.0%})" if it > 0 else f"{k[:-2]} {v:.3f} s" for k, v in parts.items())
    ]


def _remediation_lines(ins: Inspection) -> list[str]:
    return [
        f"out of memory: stage {rm.stage} raised from {rm.from_mb} MB to {rm.to_mb} MB ({rm.function})"
        if rm.kind == "out_of_memory"
        else f"worker killed ({rm.kind}, {rm.error}): stage {rm.stage}, window restarted at the same memory"
        for rm in ins.remediations
    ]


def _failure_lines(ins: Inspection) -> list[str]:
    if not ins.failed_tasks:
        return ["failed tasks: none"]
    lines = [f"failed tasks ({len(ins.failed_tasks)}):"]
    for f in ins.failed_tasks:
        who = f"{f.phase} s{f.stage} #{f.index} t={f.t}" if f.phase else f.state
        cause = f.cause[len(f.error) + 2 :] if f.cause.startswith(f"{f.error}: ") else f.cause
        lines.append(f"  {who}: {f.error}: {cause[:300]}" + (" (retried, then succeeded)" if f.retried else ""))
    return lines
