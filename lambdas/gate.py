"""The iteration gate: before each iteration the window asks whether the job may go on.

The window state machine invokes it (on the job's stage-0 function, which its role may already
invoke and whose role already reaches the job's objects, and only those) before every iteration t
and once more when the window has run its last one (planner/emit/asl.py ``Gate``). It answers
``{"stop": true}`` when the job should end at this boundary:

- a stop request exists (``jobs/{job}/stop/request.json``: ``Run.stop()``, ``stagecoach stop``);
- the job has a cost cap (``JobSpec.max_cost_usd``) and what it has used so far plus the next
  iteration's estimated cost would pass it: the gate then writes the stop request itself (reason
  ``max_cost``), so the job stops whoever is watching, or nobody (the client may be gone);
- the job stops on a non-finite loss (``JobSpec.stop_on_nonfinite_loss``) and the iteration just
  run had a loss that is NaN or infinite on some replica (its last stage's backward metrics, one
  GET per replica): the gate writes the stop request (reason ``nonfinite_loss``) likewise.

Stopping happens only between iterations: every task of iteration t-1 has finished, so version t
of the parameters, optimizer state and running statistics is complete, and nothing of iteration t
has started but, with FasDL's HAP overlapped (planner/emit/asl.py ``hap_overlap``), the
non-aggregators' gradients of t, computed on version t-1 and computed again by a resume. The
gate records ``jobs/{job}/stop/stopped.json`` (version t) for a later resume, and the window
ends in its ``Stopped`` state.

Timeouts: the gate also returns the TimeoutSeconds the iteration's Tasks run under, learnt from
the job's task metrics (lambdas/timeouts.py), so a hung task is noticed in seconds.

Metering (only for a job with a cap): the gate adds iteration t-1's task metrics (their keys are
known from the plan: no LIST) and the iteration's state transitions (by the emitter's count) to a
running tally (``jobs/{job}/cost/tally.json``), with its own invocation, and the window's and the
job's fixed transitions once per window. The tally misses what a failed window attempt used
before it failed and the retries of states; the client's measured cost (sdk/cost.py) counts
transitions from the execution histories instead. docs/cost.md.
"""

from __future__ import annotations

import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from typing import Any

from stagecoach.core import keys
from stagecoach.core.cost import Prices, Usage, express_gb_s, gb_seconds, task_usage
from stagecoach.core.decisions import decisions_key, with_decisions
from stagecoach.core.events import GateEvent
from stagecoach.core.records import CostTally, JobSpec, StopRecord, StopRequest, TaskMetrics
from stagecoach.lambdas import policy
from stagecoach.lambdas.channel import Channel
from stagecoach.lambdas.policy import covered
from stagecoach.lambdas.timeouts import expected, learn, learnt_for, task_keys
from stagecoach.planner.emit import asl
from stagecoach.planner.limits import WATCH_GRACE_S, map_transitions
from stagecoach.planner.plan import Plan

_SPECS: dict[tuple[str, str], JobSpec] = {}


def _spec(ch: Channel, job: str, t: int | None = None) -> JobSpec:
    """The job's spec, kept per container; read again when a replica policy's plan in it has not
    decided iteration ``t`` (the gate of another container may have since: lambdas/policy.py)."""
    key = (ch.bucket, job)
    if key in _SPECS and t is not None and _SPECS[key].plan.get("choices") and not covered(_SPECS[key].to_plan(), t):
        del _SPECS[key]
    if key not in _SPECS:
        body = ch.get_bytes(keys.job_spec(job))
        if body is None:
            raise FileNotFoundError(f"job {job!r} has no spec in s3://{ch.bucket}/{keys.job_spec(job)}")
        spec = JobSpec.model_validate_json(body)
        if spec.plan.get("choices"):  # a replica policy: its decisions so far (core/decisions.py)
            spec = with_decisions(spec, ch.get_bytes(decisions_key(job)))
        _SPECS.clear()
        _SPECS[key] = spec
    return _SPECS[key]


def job_plan(ch: Channel, job: str, t: int | None = None) -> Plan:
    """The job's plan, from its spec as the gate keeps it per container: the phase watcher
    (lambdas/watcher.py) needs no more of the job (its code is the tasks'), and a container of
    its own function keeps the spec from one watcher to the next. ``t``: the plan iteration t runs
    (dynamic workers: its segment's replicas)."""
    return _spec(ch, job, t).to_plan(t)


def iteration_usage(ch: Channel, job: str, plan: Plan, t: int, spec: JobSpec | None = None) -> Usage:
    """What iteration t's tasks used, from their metrics, plus its state transitions; with the
    job's ``spec``, also what the window ran after it before the next gate (``after_iteration``):
    the Due and Choice states asking for an evaluation or a checkpoint, and version t+1's
    Evaluate or Checkpoint pass if it ran one. Without those a job that evaluates ran on past its
    cap by more than an iteration's cost: two transitions an iteration went unmetered. An Express
    window's states are no billed transitions (its duration is: ``meter``)."""
    keys_, transitions = task_keys(job, plan, t), asl.transitions_per_iteration(plan)
    if spec is not None:
        more_keys, more_transitions = after_iteration(spec, plan, t + 1)
        keys_, transitions = keys_ + more_keys, transitions + more_transitions
    with ThreadPoolExecutor(max_workers=16) as pool:
        bodies = list(pool.map(ch.get_bytes, keys_))
    usage = Usage(transitions=0 if spec is not None and spec.express_memory_mb is not None else transitions)
    metrics = [TaskMetrics.model_validate_json(body) for body in bodies if body is not None]
    for m in metrics:
        usage = usage + task_usage(m)
    return usage + watchers_usage(plan, [m for m in metrics if m.t == t])


def watchers_usage(plan: Plan, metrics: list[TaskMetrics]) -> Usage:
    """Iteration t's phase watchers (lambdas/watcher.py) from its tasks' ``metrics``, without
    waiting for their own records (one may still be in its grace when this gate runs): each
    lasts its phase (first task's start to last task's end) and WATCH_GRACE_S at stage 0's
    memory, with an invocation, its record's PUT and a look per task. A watcher with nothing to
    watch ends at once: this errs high, as a cap's tally should."""
    n = asl.watched_phases(plan)
    if not n or not metrics:
        return Usage()
    memory = next((m.memory_mb for m in metrics if m.stage == 0), plan.memory_mb[0])
    gb_s = 0.0
    for phases in ((("forward",), ("backward", "sync")))[2 - n :]:
        ms = [m for m in metrics if m.phase in phases]
        if ms:
            gb_s += gb_seconds(max(m.end for m in ms) - min(m.start for m in ms) + WATCH_GRACE_S, memory)
    return Usage(gb_s=gb_s, invocations=n, puts=n, gets=len(task_keys("", plan, 0)))


def after_iteration(spec: JobSpec, plan: Plan, version: int) -> tuple[list[str], int]:
    """The metrics keys and state transitions of what the window runs between Advance (to
    ``version``) and the next Gate (planner/emit/asl.py ``_after_iteration_states``): each listed
    kind's Due and Choice states, every iteration; the Checkpoint Map (replica 0 of every stage,
    one Map) if ``version`` is kept; the Evaluate Parallel (a Map of every replica per stage) if it
    is evaluated. Their tasks' metrics are keyed by ``version`` (lambdas/handler.py)."""
    evals = spec.evaluation.versions if spec.evaluation is not None else []
    every = spec.checkpoint_every
    saves = bool(every)
    transitions = asl.TRANSITIONS_DUE_CHECK * (bool(evals) + saves)
    keys_: list[str] = []
    if every and version % every == 0 and version <= spec.iterations:
        keys_ += [keys.metrics(spec.job, version, "checkpoint", s, 0) for s in range(plan.stages)]
        transitions += map_transitions(plan.stages)
    if version in evals:
        keys_ += [keys.metrics(spec.job, version, "evaluate", s, r) for s in range(plan.stages) for r in range(plan.replicas)]
        transitions += 1 + plan.stages * map_transitions(plan.replicas)
    return keys_, transitions


def launch_usage(spec: JobSpec) -> Usage:
    req = spec.launch_requests or {}
    return Usage(puts=int(req.get("puts", 0)), gets=int(req.get("gets", 0)))


def _window_usage(spec: JobSpec) -> Usage:
    """What a window attempt costs once, beyond its iterations, counted at its first gate: as
    STANDARD its own fixed states and the job's per window; as EXPRESS the job's states per window
    and the execution's request (its duration is metered gate by gate, ``_express_duration``)."""
    if spec.express_memory_mb is None:
        return Usage(transitions=asl.TRANSITIONS_WINDOW_FIXED + asl.TRANSITIONS_JOB_PER_WINDOW)
    return Usage(transitions=asl.TRANSITIONS_JOB_PER_EXPRESS_WINDOW, express_requests=1)


def _express_duration(spec: JobSpec, tally: CostTally | None, window_first: bool, now: float) -> tuple[Usage, float, float]:
    """An Express window's duration so far, as billed (core/cost.py ``express_gb_s``: the whole
    execution in 100 ms steps), less what earlier gates of this attempt metered: the usage to add,
    and the attempt's start and metered GB-seconds for the tally. The start is the attempt's first
    gate's clock (the execution began a few ms before it: those stay unmetered)."""
    if spec.express_memory_mb is None:
        return Usage(), 0.0, 0.0
    started = now if window_first or tally is None else tally.window_started
    metered = 0.0 if window_first or tally is None else tally.window_gb_s
    total = express_gb_s(max(0.0, now - started), spec.express_memory_mb)
    return Usage(express_gb_s=total - metered), started, total


def _stored_usage(stored: dict[str, float]) -> Usage:
    """A tally's usage as stored (``asdict``; a tally written before Express windows lacks their fields)."""

    def count(name: str) -> int:
        return int(stored.get(name, 0))

    def amount(name: str) -> float:
        return float(stored.get(name, 0.0))

    return Usage(
        gb_s=amount("gb_s"),
        invocations=count("invocations"),
        transitions=count("transitions"),
        puts=count("puts"),
        gets=count("gets"),
        express_requests=count("express_requests"),
        express_gb_s=amount("express_gb_s"),
    )


def meter(ch: Channel, spec: JobSpec, ev: GateEvent, started: float, memory_mb: int) -> CostTally:
    """Add what the job used since the last gate to its tally, and store it."""
    plan = spec.to_plan()
    body = ch.get_bytes(keys.cost_tally(ev.job))
    tally = CostTally.model_validate_json(body) if body is not None else None
    gate_id = f"{ev.attempt}:{ev.t}"
    if tally is not None and tally.last_gate == gate_id:  # this gate, retried: counted already
        return tally
    if tally is not None:
        usage = _stored_usage(tally.usage)
    else:  # the first gate: the launch's requests and the job execution's fixed transitions
        usage = launch_usage(spec) + Usage(transitions=asl.TRANSITIONS_JOB_FIXED)
    through = tally.through if tally else 0
    window_first = ev.t <= (ev.window_start if ev.first is None else ev.first)  # the attempt's first gate
    if not window_first:
        metered = [ev.t - 1]  # just run by this window attempt (again, if the window restarted)
    else:
        # the previous window's last, unless its final gate counted it; for an attempt resuming a
        # failed one (lambdas/resumepoint.py), what that attempt ran after its last gate
        metered = list(range(through, ev.t))
        usage = usage + _window_usage(spec)
    for t in metered:
        usage = usage + iteration_usage(ch, ev.job, plan.plan_at(t), t, spec)
    now = time.time()
    duration, window_started, window_gb_s = _express_duration(spec, tally, window_first, now)
    # the gate itself: its invocation, its requests so far and the one PUT to come, its time so far
    st = ch.stats
    usage = usage + duration + Usage(gb_s=gb_seconds(now - started, memory_mb), invocations=1, puts=st.puts + 1, gets=st.gets)
    prices = Prices(**spec.prices) if spec.prices else None
    usd = usage.usd(prices) if prices else 0.0
    previous = tally.usd if tally is not None else 0.0
    tally = CostTally(
        through=max(through, ev.t),
        last_gate=gate_id,
        usage=asdict(usage),
        usd=usd,
        previous_usd=previous,
        window_started=window_started,
        window_gb_s=window_gb_s,
    )
    ch.put_bytes(keys.cost_tally(ev.job), tally.model_dump_json().encode())
    return tally


def nonfinite_loss(ch: Channel, job: str, plan: Plan, t: int) -> str | None:
    """What is not finite about iteration t's loss ("iteration 3's loss is nan on replica 1 of 2"),
    from its last stage's backward tasks' metrics (one per replica: handler.py); None if every
    replica's loss is finite."""
    last = plan.stages - 1
    with ThreadPoolExecutor(max_workers=16) as pool:
        bodies = list(pool.map(ch.get_bytes, [keys.metrics(job, t, "backward", last, r) for r in range(plan.replicas)]))
    bad = []
    for r, body in enumerate(bodies):
        loss = TaskMetrics.model_validate_json(body).loss if body is not None else None
        if loss is not None and not math.isfinite(loss):
            bad.append(f"{loss} on replica {r}")
    return f"iteration {t}'s loss is {', '.join(bad)} of {plan.replicas}" if bad else None


def _nonfinite_request(ch: Channel, spec: JobSpec, ev: GateEvent) -> StopRequest | None:
    """Under ``stop_on_nonfinite_loss``: the stop request, written, if the iteration this window
    attempt ran last (t - 1) had a loss that is not finite. A window's first gate checks nothing:
    the previous window's last gate checked its last iteration, and a resumed job goes on."""
    if not spec.stop_on_nonfinite_loss or not ev.window_start < ev.t < spec.iterations:
        return None
    detail = nonfinite_loss(ch, ev.job, spec.to_plan(ev.t - 1), ev.t - 1)
    if detail is None:
        return None
    request = StopRequest(reason="nonfinite_loss", time=time.time(), detail=detail)
    ch.put_bytes(keys.stop_request(ev.job), request.model_dump_json().encode())
    return request


def next_iteration_usd(tally: CostTally, ev: GateEvent) -> float:
    """What iteration ``ev.t`` will cost, by the one before it: this gate's increment when it
    metered exactly that one (the window's later gates), else the mean of the iterations so far
    (a window's first gate, whose increment also holds the window's fixed states; the mean holds
    the launch's share too, so it errs high: the job stops early rather than late). Before the
    first iteration nothing is known: 0 (the job stops there only if its launch passed the cap)."""
    first = ev.window_start if ev.first is None else ev.first
    if ev.t > first:
        return tally.usd - tally.previous_usd
    return tally.usd / tally.through if tally.through else 0.0


def _cap_request(ch: Channel, spec: JobSpec, ev: GateEvent, tally: CostTally) -> StopRequest | None:
    """The stop request (written) if running iteration ``ev.t`` would take the job past its cap:
    the tally so far plus the next iteration's estimated cost. Stopping before the iteration that
    would pass the cap, not after it, keeps the measured cost within the cap but for the estimate's
    error and what the tally cannot see (docs/cost.md): a user's cap is a limit, not a trigger."""
    assert spec.max_cost_usd is not None
    step = next_iteration_usd(tally, ev)
    if tally.usd + step <= spec.max_cost_usd:
        return None
    request = StopRequest(
        reason="max_cost",
        time=time.time(),
        detail=f"measured ${tally.usd:.6f} after {ev.t} iterations; the next (about ${step:.6f}) would pass the cap ${spec.max_cost_usd:.6f}",
    )
    ch.put_bytes(keys.stop_request(ev.job), request.model_dump_json().encode())
    return request


def gate(ev: GateEvent, ch: Channel, started: float, memory_mb: int) -> dict[str, Any]:
    """May the job run iteration ``ev.t``? ``{"stop": bool}`` for the window's Go? choice."""
    spec = _spec(ch, ev.job, ev.t if ev.t < ev.end else None)
    body = ch.get_bytes(keys.stop_request(ev.job))
    request = StopRequest.model_validate_json(body) if body is not None else _nonfinite_request(ch, spec, ev)
    out: dict[str, Any] = {"stop": False}
    if spec.max_cost_usd is not None:
        tally = meter(ch, spec, ev, started, memory_mb)
        out["usd"] = tally.usd
        if request is None and ev.t < spec.iterations:
            request = _cap_request(ch, spec, ev, tally)
    if request is not None and ev.t < ev.end:  # at the window's end the next window's first gate stops
        record = StopRecord(version=ev.t, reason=request.reason, time=time.time(), detail=request.detail, attempt=ev.attempt)
        ch.put_bytes(keys.stopped(ev.job), record.model_dump_json().encode())
        out["stop"] = True
    if spec.plan.get("choices"):  # a replica policy: the segment this iteration runs, decided at its window's first
        spec = _policy_segment(ch, spec, ev, out)
    # after the meter: the tally leaves out these few requests, the client's measured cost does not
    warm = _warm_attempt(ch, spec, ev)
    out["timeouts"] = learn(ch, ev.job, spec.to_plan(ev.t), ev.t, warm)
    # the phase watcher's expectations; none while state stays warm in containers, where a task run
    # again in another container would not find it (WarmStateLost restarts the window)
    out["expect"] = {} if warm else expected(learnt_for(ch.bucket, ev.job))
    return out


def _policy_segment(ch: Channel, spec: JobSpec, ev: GateEvent, out: dict[str, Any]) -> JobSpec:
    """Put the segment iteration ``ev.t`` runs in the gate's answer ``out`` (the policy window
    routes on it): decided if the spec does not cover it yet, at the window's first iteration
    (lambdas/policy.py ``decide``), not where none runs (the window's end, a stop); the spec as it
    now is, kept for this container."""
    if ev.t < ev.end and not out["stop"] and not covered(spec.to_plan(), ev.t):
        segment, spec = policy.decide(ch, spec, ev)
        _SPECS.clear()
        _SPECS[(ch.bucket, ev.job)] = spec
        out["segment"] = segment
        return spec
    plan = spec.to_plan()
    out["segment"] = policy.segment_of(plan, ev.t) if covered(plan, ev.t) else policy.last_segment(plan)
    return spec


_WARM: dict[str, bool] = {}


def _warm_attempt(ch: Channel, spec: JobSpec, ev: GateEvent) -> bool:
    """Whether this window attempt keeps state warm that only its containers hold, as its tasks
    decide it (JobContext.warm_attempt: no earlier attempt at the window failed; a stage that writes
    through has every version in S3 too, JobContext.writes_through); one LIST per container and attempt."""
    if not (spec.warm_state and spec.window_length is not None) or (spec.write_through and all(spec.write_through)):
        return False
    if ev.attempt not in _WARM:
        _WARM.clear()
        _WARM[ev.attempt] = not ch.any_under(keys.window_aborts(ev.job, ev.window_start))
    return _WARM[ev.attempt]
