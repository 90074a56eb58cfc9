"""A run's cost, predicted before it starts and measured after, per phase (docs/cost.md).

Both are ``CostReport``s of billable quantities (core/cost.py ``Usage``: Lambda GB-seconds,
invocations, Step Functions state transitions, S3 requests) priced by core/cost.py at the AWS
list prices the planner uses (planner/model/platforms.py, with their sources and date), per phase:

- ``forward``, ``backward``, ``sync``: the tasks of those phases and the states that run them (a
  phase's Map states and their items; ``backward`` includes the BackwardSync Parallel);
- ``evaluate``, ``checkpoint``: a job's evaluations and kept checkpoints, their Maps and tasks;
- ``orchestration``: the window's bookkeeping (the iteration gate, lambdas/gate.py, and its
  Choice, Advance, Init, Done, and the Due/Choice states asking for an evaluation or a
  checkpoint), the job state machine's states, and every retry of a state;
- ``client``: the S3 requests of the client itself — the launch's uploads and, measured, what this
  ``Run`` read while watching (listing and reading the task metrics).

Predicted (``predict``): the performance model's estimate of one iteration (planner/model/
perfmodel.py ``evaluate``, for any plan: the planner's or a manual one) times the iterations, plus
the per-window states and the gate, and each task's PUT of its metrics object; for a job that
evaluates or checkpoints, each pass (planner/model/passes.py, ``Job.predict_cost``) and the states
every iteration enters asking whether one is due. The model counts
the tasks' other S3 requests per iteration but not per phase: the summary reports S3 requests as
one figure, for the measured cost too. The launch's uploads are not predicted (a few dozen PUTs).

Measured (``measure``): every task's metrics (billed duration rounded up to the millisecond x its
memory, requests), the gate's own report of its work (its invocation's output in the window's
history, or for an Express window in its events logged to CloudWatch Logs), and the state
transitions counted in the execution histories: one per state entered, one per retry (a Task
scheduled again without being entered again).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

from stagecoach.core.cost import Prices, Usage, express_billed_s, gb_seconds, usage_by_phase, watcher_usage
from stagecoach.core.records import JobSpec, TaskMetrics, WatcherUsage
from stagecoach.planner import segments
from stagecoach.planner.emit import asl
from stagecoach.planner.limits import WATCH_GRACE_S
from stagecoach.planner.model.passes import PassEstimate
from stagecoach.planner.model.perfmodel import Estimate
from stagecoach.planner.model.platforms import Platform
from stagecoach.planner.plan import Plan

PHASES = ("forward", "backward", "sync", "evaluate", "checkpoint", "orchestration", "client")
OPTIONAL_PHASES = ("evaluate", "checkpoint")  # a job's evaluation on Lambda and kept checkpoints


@dataclass(frozen=True)
class CostReport:
    """What a run costs (``kind``: "predicted" or "measured"), per phase, in billable quantities."""

    kind: Literal["predicted", "measured"]
    iterations: int  # predicted: the run's; measured: the iterations done
    phases: Mapping[str, Usage]  # PHASES -> usage
    prices: Prices
    # S3 requests the prediction does not place in a phase (the performance model counts them per
    # iteration only); empty for a measured report
    unsplit: Usage = field(default_factory=Usage)

    @property
    def usd(self) -> float:
        return self.total.usd(self.prices)

    @property
    def total(self) -> Usage:
        out = self.unsplit
        for u in self.phases.values():
            out = out + u
        return out

    def phase_usd(self, s3: bool = True) -> dict[str, float]:
        """USD per phase; ``s3=False``: without S3 requests (compare with ``s3_usd``). Evaluation
        and checkpoints appear only for a job that has them."""
        return {
            p: (u if s3 else replace(u, puts=0, gets=0)).usd(self.prices)
            for p, u in self.phases.items()
            if p not in OPTIONAL_PHASES or u != Usage()
        }

    @property
    def s3_usd(self) -> float:
        t = self.total
        return Usage(puts=t.puts, gets=t.gets).usd(self.prices)

    def per_iteration_usd(self) -> float:
        return self.usd / self.iterations if self.iterations else 0.0

    def summary(self) -> str:
        """One line: the total, each phase without S3, then S3 requests (as the prediction has them)."""
        parts = ", ".join(f"{p} ${v:.4f}" for p, v in self.phase_usd(s3=False).items() if v > 0)
        return f"${self.usd:.4f} for {self.iterations} iterations ({parts}, S3 requests ${self.s3_usd:.4f})"

    def quantities(self) -> str:
        t = self.total
        return (
            f"Lambda {t.gb_s:,.1f} GB-s and {t.invocations:,} invocations, {t.transitions:,} state transitions, "
            f"{t.puts:,} PUT/LIST and {t.gets:,} GET requests"
            + (f", {t.express_requests:,} Express executions of {t.express_gb_s:,.1f} GB-s" if t.express_requests else "")
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "iterations": self.iterations,
            "usd": self.usd,
            "phase_usd": self.phase_usd(),
            "phases": {p: asdict(u) for p, u in self.phases.items()},
            "unsplit": asdict(self.unsplit),
            "total": asdict(self.total),
            "prices": asdict(self.prices),
        }


# -- predicted -------------------------------------------------------------------------------------
def gate_usage(plan: Plan, platform: Platform, capped: bool) -> Usage:
    """One iteration gate, as lambdas/gate.py works: a GET of the stop request; with a cost cap
    also the tally (GET, PUT) and the iteration's task metrics (GETs, 16 at a time). Its time: a
    storage round trip per sequential request."""
    tasks = len(_task_counts(plan))
    gets = 1 + (1 + tasks if capped else 0)
    puts = 1 if capped else 0
    rounds = 1 + (2 + math.ceil(tasks / 16) if capped else 0)
    return Usage(gb_s=gb_seconds(rounds * platform.storage_latency_s, plan.memory_mb[0]), invocations=1, puts=puts, gets=gets)


def watchers_predicted(plan: Plan, estimate: Estimate) -> Usage:
    """An iteration's phase watchers (lambdas/watcher.py), which the planner's estimate leaves out
    (a constant per phase but for stage 0's memory x the phase's time, not linear in the MILP's
    variables): per watched phase an invocation of the watcher function, at stage 0's memory, for the phase's time and
    WATCH_GRACE_S (its first look at a task is when the task usually has ended), its record's PUT,
    a look (GET) per task. Their states are in asl.phase_transitions."""
    n = asl.watched_phases(plan)
    spans = [estimate.forward_s, estimate.backward_sync_s][2 - n :] if n else []
    gb_s = sum(gb_seconds(span + WATCH_GRACE_S, plan.memory_mb[0]) for span in spans)
    return Usage(gb_s=gb_s, invocations=n, puts=n, gets=len(_task_counts(plan)) if n else 0)


def _task_counts(plan: Plan) -> list[tuple[str, int]]:
    """(phase, stage) of every task of one iteration."""
    out = [("forward", s) for s in range(plan.stages - 1) for _ in range(plan.replicas)]
    out += [("backward", s) for s in range(plan.stages) for _ in range(plan.replicas)]
    out += [("sync", s) for s in range(plan.stages) for _ in range(plan.sync_tasks(s))]
    return out


def pass_usage(plan: Plan, p: PassEstimate, passes: int = 1) -> Usage:
    """``passes`` evaluate or checkpoint passes (planner/model/passes.py) as billed: their tasks'
    seconds at their stage's memory, an invocation and a metrics PUT per task, their Maps' transitions."""
    gbs = sum(n * gb_seconds(t, plan.memory_mb[s]) for s, (t, n) in enumerate(zip(p.task_s, p.tasks)))
    return Usage(
        gb_s=gbs * passes,
        invocations=p.invocations * passes,
        transitions=p.transitions * passes,
        puts=round((p.puts + p.invocations) * passes),
        gets=round(p.gets * passes),
    )


def predict(
    plan: Plan,
    estimate: Estimate,
    iterations: int,
    platform: Platform,
    capped: bool = False,
    evals: Sequence[int] = (),
    saves: Sequence[int] = (),
    evaluate: PassEstimate | None = None,
    checkpoint: PassEstimate | None = None,
    windows: WindowRun | None = None,
) -> CostReport:
    """The whole run's predicted cost from the performance model's per-iteration ``estimate`` of
    ``plan``: the tasks' billed seconds per phase, the states, the gate, per window and per job.
    ``evals``/``saves``: the versions the job evaluates and checkpoints (Job.eval_versions,
    checkpoint_versions), each a pass priced by ``evaluate``/``checkpoint``; with either, every
    iteration also enters its Due and Choice states, and a window holds fewer iterations.
    ``windows``: how the windows run (default: STANDARD, of ``asl.window_length``); as EXPRESS no
    state of a window is a billed transition, each window is a request and its duration instead."""
    windows = windows or WindowRun(asl.STANDARD, asl.window_length(plan, evals=evals, saves=saves))
    billed = windows.workflow == asl.STANDARD  # Express windows' states are not billed per transition
    n = iterations
    phases = _task_phases(plan, estimate, n, billed)
    phases["orchestration"] = _orchestration(plan, estimate, n, platform, capped, windows, checks=bool(evals) + bool(saves))
    for name, versions, p in (("evaluate", evals, evaluate), ("checkpoint", saves, checkpoint)):
        if versions and p is None:
            raise ValueError(f"{name} versions given without the {name} pass's estimate (planner/model/passes.py)")
        if versions and p is not None:
            u = pass_usage(plan, p, len(versions))
            phases[name] = u if billed else replace(u, transitions=0)
    phases["client"] = Usage()
    phases = {p: phases[p] for p in PHASES if p in phases}  # in the measured report's order
    unsplit = Usage(puts=round(estimate.s3_puts * n), gets=round(estimate.s3_gets * n))
    return CostReport("predicted", iterations, phases, Prices.of(platform), unsplit=unsplit)


def _task_phases(plan: Plan, estimate: Estimate, n: int, billed: bool) -> dict[str, Usage]:
    """``n`` iterations' forward, backward and sync tasks and their states (``billed``: STANDARD
    windows); each task also PUTs its metrics object (lambdas/handler.py), which the model's
    requests leave out."""
    S, d = plan.stages, plan.replicas
    per_s = [m / 1024.0 for m in plan.memory_mb]
    gbs = {
        "forward": sum(d * estimate.stage_forward_s[s] * per_s[s] for s in range(S - 1)),
        "backward": sum(d * estimate.stage_backward_s[s] * per_s[s] for s in range(S)),
        "sync": sum(plan.sync_tasks(s) * estimate.stage_sync_s[s] * per_s[s] for s in range(S)),
    }
    inv = {"forward": (S - 1) * d, "backward": S * d, "sync": sum(plan.sync_tasks(s) for s in range(S))}
    tr = asl.phase_transitions(plan)
    return {
        p: Usage(gb_s=gbs[p] * n, invocations=inv[p] * n, transitions=tr[p] * n * billed, puts=inv[p] * n)
        for p in ("forward", "backward", "sync")
    }


@dataclass(frozen=True)
class SegmentCost:
    """One segment of a replica schedule as ``predict_schedule`` prices it: its ``iterations``
    from ``first``, its plan (Plan.plan_at: on the deployed functions' memory), the performance
    model's estimate of one of its iterations and, for a job that checkpoints, of its checkpoint pass."""

    first: int
    iterations: int
    plan: Plan
    estimate: Estimate
    checkpoint: PassEstimate | None = None


def predict_schedule(
    parts: Sequence[SegmentCost], iterations: int, platform: Platform, length: int, capped: bool = False, saves: Sequence[int] = ()
) -> CostReport:
    """The predicted cost of a replica schedule (docs/runtime.md "Dynamic workers"): each
    segment's iterations, checkpoints (a version v is kept after iteration v - 1) and per-iteration
    states as ``predict`` has an ordinary plan's, summed; then the run's STANDARD windows of
    ``length`` iterations, each a joined window (planner/emit/segments.py) with its Start and
    Enter states and a gate at its end (the segment of its last iteration's), a Segment, Switch and
    Go? per change inside a window (planner/segments.py), and the job's states. A change adds no
    Lambda time: the model charges no cold start to a cold iteration's cost (a job's first either)."""
    phases = {p: Usage() for p in ("forward", "backward", "sync", "orchestration", "checkpoint")}
    unsplit = Usage()
    for part in parts:
        n, est, seg = part.iterations, part.estimate, part.plan
        for p, u in _task_phases(seg, est, n, billed=True).items():
            phases[p] += u
        kept = [v for v in saves if part.first < v <= part.first + n]
        if kept and part.checkpoint is None:
            raise ValueError("checkpoint versions given without the checkpoint pass's estimate (planner/model/passes.py)")
        if kept and part.checkpoint is not None:
            phases["checkpoint"] += pass_usage(seg, part.checkpoint, len(kept))
        phases["orchestration"] += _iteration_orchestration(seg, est, n, platform, capped, bool(saves), billed=True)
        unsplit += Usage(puts=round(est.s3_puts * n), gets=round(est.s3_gets * n))
    ends = [min(start + length, iterations) for start in range(0, iterations, length)]
    for end in ends:  # each window's last gate, at the memory and tasks of its last iteration's segment
        phases["orchestration"] += gate_usage([p.plan for p in parts if p.first < end][-1], platform, capped)
    inside = sum(1 for p in parts[1:] if p.first % length)
    per_window = asl.TRANSITIONS_WINDOW_FIXED + segments.TRANSITIONS_SEGMENT_ENTRY + asl.TRANSITIONS_JOB_PER_WINDOW
    fixed = len(ends) * per_window + inside * segments.TRANSITIONS_SEGMENT_SWITCH + asl.TRANSITIONS_JOB_FIXED
    phases["orchestration"] += Usage(transitions=fixed)
    phases["client"] = Usage()
    phases = {p: phases[p] for p in PHASES if p in phases and (p != "checkpoint" or saves)}
    return CostReport("predicted", iterations, phases, Prices.of(platform), unsplit=unsplit)


@dataclass(frozen=True)
class WindowRun:
    """How a run's windows run: ``workflow`` STANDARD or EXPRESS (planner/emit/workflow.py), of
    ``length`` iterations; an Express window billed at ``memory_mb``."""

    workflow: str
    length: int
    memory_mb: int = 64


def _orchestration(plan: Plan, estimate: Estimate, n: int, platform: Platform, capped: bool, windows: WindowRun, checks: int) -> Usage:
    """The gates, the windows' bookkeeping states and the job's (STANDARD windows), or the
    windows' requests and duration and the job's states (EXPRESS)."""
    count = math.ceil(n / windows.length)
    standard = windows.workflow == asl.STANDARD
    usage = _iteration_orchestration(plan, estimate, n, platform, capped, checks, standard)
    gate = gate_usage(plan, platform, capped)
    usage = usage + Usage(gb_s=gate.gb_s * count, invocations=count, puts=gate.puts * count, gets=gate.gets * count)  # window ends
    if standard:
        transitions = count * (asl.TRANSITIONS_WINDOW_FIXED + asl.TRANSITIONS_JOB_PER_WINDOW)
        return usage + Usage(transitions=transitions + asl.TRANSITIONS_JOB_FIXED)
    full, last = divmod(n, windows.length)
    durations = [windows.length * estimate.time_s] * full + ([last * estimate.time_s] if last else [])
    billed_s = sum(express_billed_s(t) for t in durations)  # 100 ms steps
    return usage + Usage(
        transitions=count * asl.TRANSITIONS_JOB_PER_EXPRESS_WINDOW + asl.TRANSITIONS_JOB_FIXED,
        express_requests=count,
        express_gb_s=billed_s * windows.memory_mb / 1024.0,
    )


def _iteration_orchestration(plan: Plan, estimate: Estimate, n: int, platform: Platform, capped: bool, checks: int, billed: bool) -> Usage:
    """``n`` iterations' own orchestration: the gate before each, the phase watchers, and (``billed``:
    STANDARD windows) each iteration's bookkeeping states with its due checks (``checks``)."""
    gate, w = gate_usage(plan, platform, capped), watchers_predicted(plan, estimate)
    per_iteration = asl.phase_transitions(plan)["orchestration"] + asl.TRANSITIONS_DUE_CHECK * checks
    return Usage(
        gb_s=(gate.gb_s + w.gb_s) * n,
        invocations=(gate.invocations + w.invocations) * n,
        transitions=per_iteration * n * billed,
        puts=(gate.puts + w.puts) * n,
        gets=(gate.gets + w.gets) * n,
    )


# -- measured --------------------------------------------------------------------------------------
def state_phase(name: str) -> str:
    """The phase a state of the window state machine belongs to (planner/emit/asl.py names; a
    joined window's, planner/emit/segments.py, with their segment's suffix ``_s{j}``)."""
    name = re.sub(r"_s\d+$", "", name)
    for prefix, phase in (("Forward", "forward"), ("Backward", "backward"), ("Sync", "sync")):
        if name.startswith(prefix):  # BackwardSync, Backward{s}, Backward{s}Task, Forward{s}Group, ...
            return phase
    for prefix, phase in (("Evaluate", "evaluate"), ("Checkpoint", "checkpoint")):
        if name.startswith(prefix) and name not in (f"{prefix}Due", f"{prefix}Choice"):  # Due/Choice: bookkeeping
            return phase
    return "orchestration"


def _group_phase(event: Mapping[str, Any]) -> str | None:
    """The phase a group's child execution runs (planner/emit/groups.py: its input names it), from
    its ExecutionStarted event; None for any other execution."""
    try:
        given = json.loads(event.get("executionStartedEventDetails", {}).get("input") or "{}")
    except ValueError:
        return None
    phase = given.get("phase") if isinstance(given, dict) and "first" in given and "last" in given else None
    return phase if phase in PHASES else None


def history_usage(events: Iterable[Mapping[str, Any]]) -> dict[str, Usage]:
    """From execution histories (one after the other, each from its ExecutionStarted): state
    transitions per phase (one per state entered, one per retry of a Task; all of a group's child
    execution count to the phase it runs), and the iteration gates' own invocations and work."""
    out: dict[str, Usage] = {}
    entered_tasks = scheduled = 0
    group: str | None = None
    for ev in events:
        kind = ev.get("type", "")
        if kind == "ExecutionStarted":
            group = _group_phase(ev)
        elif kind.endswith("StateEntered"):
            phase = group or state_phase(ev.get("stateEnteredEventDetails", {}).get("name", ""))
            out[phase] = out.get(phase, Usage()) + Usage(transitions=1)
            entered_tasks += kind == "TaskStateEntered"
        elif kind == "TaskScheduled":
            scheduled += 1
        elif kind == "TaskSucceeded":
            details = ev.get("taskSucceededEventDetails", {})
            report = _gate_report(details.get("output"))
            if report is None and details.get("resource") == "startSyncExecution":
                report = express_usage(details.get("output"))
            if report is not None:
                out["orchestration"] = out.get("orchestration", Usage()) + report
    retries = max(0, scheduled - entered_tasks)
    if retries:
        out["orchestration"] = out.get("orchestration", Usage()) + Usage(transitions=retries)
    return out


def express_usage(output: str | None) -> Usage | None:
    """An Express window as billed, from the answer its startSyncExecution Task recorded in the
    job's history (planner/emit/asl.py RunExpressWindow): a request, and its BillingDetails' billed
    duration x billed memory. A start whose answer was lost is not counted (nothing says what ran)."""
    try:
        billing = json.loads(output or "").get("BillingDetails")
    except (ValueError, AttributeError):
        return None
    if not isinstance(billing, dict):
        return None
    seconds = float(billing.get("BilledDurationInMilliseconds", 0)) / 1000.0
    return Usage(express_requests=1, express_gb_s=seconds * float(billing.get("BilledMemoryUsedInMB", 0)) / 1024.0)


def express_gates(events: Iterable[Mapping[str, Any]]) -> Usage:
    """The iteration gates of one Express window execution, from its logged events (sdk/
    express_logs.py): each gate's own report of its work, as in a Standard window's history. Its
    states are no billed transitions (the window is billed per request and duration instead)."""
    out = Usage()
    for ev in events:
        if ev.get("type") == "TaskSucceeded":
            report = _gate_report(ev.get("taskSucceededEventDetails", {}).get("output"))
            out = out + (report or Usage())
    return out


def _gate_report(output: str | None) -> Usage | None:
    """The usage an iteration gate reports in its output (lambdas/gate.py), or None for any other task."""
    if not output:
        return None
    try:
        payload = json.loads(output).get("Payload")
    except (ValueError, AttributeError):
        return None
    if not isinstance(payload, dict) or payload.get("phase") != "gate" or "work" not in payload:
        return None
    w = payload["work"]
    return Usage(gb_s=gb_seconds(w["duration_s"], w["memory_mb"]), invocations=1, puts=int(w["puts"]), gets=int(w["gets"]))


def measure(
    spec: JobSpec,
    metrics: Sequence[TaskMetrics],
    histories: Iterable[Iterable[Mapping[str, Any]]],
    iterations_done: int,
    client_requests: Mapping[str, int] | None = None,
    prices: Prices | None = None,
    watchers: Iterable[WatcherUsage] = (),
    express: Iterable[Iterable[Mapping[str, Any]]] = (),
) -> CostReport:
    """The measured cost of a run so far: ``metrics`` of its tasks, the ``histories`` of its job
    and window executions, the logged events of its ``express`` window executions (their gates),
    and what the client did (the launch's requests from the spec, plus ``client_requests`` of the
    watching Run)."""
    phases: dict[str, Usage] = {p: Usage() for p in PHASES}
    for p, u in usage_by_phase(metrics).items():
        phases[p] = phases[p] + u
    for events in histories:
        for p, u in history_usage(events).items():
            phases[p] = phases[p] + u
    for events in express:
        phases["orchestration"] = phases["orchestration"] + express_gates(events)
    for w in watchers:  # orchestration: the phase watchers (lambdas/watcher.py), as each recorded itself
        phases["orchestration"] = phases["orchestration"] + watcher_usage(w)
    launch = spec.launch_requests or {}
    watch = client_requests or {}
    phases["client"] = Usage(
        puts=int(launch.get("puts", 0)) + int(watch.get("puts", 0)), gets=int(launch.get("gets", 0)) + int(watch.get("gets", 0))
    )
    if prices is None:
        if spec.prices is None:
            raise ValueError(f"job {spec.job} records no prices (launched before cost metering); pass prices=")
        prices = Prices(**spec.prices)
    return CostReport("measured", iterations_done, phases, prices)
