"""Task timeouts learnt during the run: a hung task costs a few of its iterations' task times, not
the planner's worst case.

Step Functions has no heartbeat for a ``lambda:invoke`` Task (``SendTaskHeartbeat`` is for
activity workers and the callback and job-run patterns: Step Functions API Reference,
SendTaskHeartbeat; and a callback Task's heartbeat is not enforced while its synchronous Lambda
invocation runs: docs/reliability.md "Fault benchmark"), so a worker that never answers is noticed
only when its Task's timeout fires.
``TimeoutSecondsPath`` takes the timeout from the state's input, which must hold a positive integer
there (Amazon States Language, Task state; the CDK's ``Timeout.at`` says the same). The planner's
timeouts must hold a phase's predicted time with room to spare (``plan.timeouts_from``: twice the
prediction plus 10 s, at least 60 s); a hang then costs a minute. Once the job has run an
iteration, the gate (lambdas/gate.py) knows better: each task's metrics say how long it took.

Before each iteration the gate returns, per phase key (``"f"`` the Forward Map, ``"b{s}"`` stage
s's backward Map, ``"s{s}"`` its sync Map), the TimeoutSeconds the window's Tasks then take
(``TimeoutSecondsPath``, planner/emit/asl.py), and ``"cold"``, what a re-run adds to it::

    timeout = min(planned, max(MIN_S, ceil(FACTOR * median_low(slowest) + SLACK_S)))  # >= 3 x slowest
    cold    = ceil(longest cold task)

(``FACTOR_WARM`` and ``SLACK_WARM_S`` while the window attempt keeps state warm: below.) With
``FACTOR`` 3, ``SLACK_S`` a quarter second and ``MIN_S`` 2 s, the demo's Maps get 2-4 s.

A hung task costs its timeout, and Step Functions counts it in whole seconds (``TimeoutSeconds``,
at least 1): on tasks of a few tenths of a second the timeout is mostly its slack and rounding.
At least 1 s timed out fault-free tasks on a loaded 2-core machine (docs/reliability.md
"Timeouts"), under twice and under three times the slowest plus a quarter second: both were
reverted to at least 2 s, which no fault-free task has reached. A second of slack on top rounded
the demo's ~0.4 s tasks up to 3 s; a quarter second keeps them at the least, 2 s. A task timed out
only because it was slow runs again at once with ``cold`` more: a re-run, never a failure.

``slowest``: the slowest task of that key in each of the last ``SAMPLES`` sampled iterations (the
median keeps an iteration a fault slowed down, such as a consumer that waited for a re-run
producer, from raising the timeout); ``SLACK_S`` what the worker cannot see of an invocation (the
call, the sandbox). A task's first run finds its container warm (the window's tasks run on the
same functions every iteration); a task run again after a kill or a timeout usually starts a new
container, so the Map's re-run loop adds ``cold`` to its timeout once (asl ``{name}Again``):
the longest a cold task has worked, its Init included and its waits for other workers' objects
left out (``init_s + duration_s - wait_s`` of its metrics: a cold task also loads its job, model
and data; the waits are in ``slowest``, and a re-run consumer that waited for a hung producer must
not raise it), or ``COLD_DEFAULT_S`` before any cold task was seen. Before anything is learnt the
plan's timeouts hold, with ``cold`` 0. The planned timeout stays the ceiling of a first run. A task
that times out only because its timeout was short runs again, never lost: tasks are idempotent
(docs/reliability.md).

The gate samples iteration t-1's metrics (their keys are known from the plan: no LIST) at its first
``SAMPLES`` gates with one to sample and then every ``RESAMPLE_EVERY`` iterations, and keeps the
record in ``jobs/{job}/timeouts.json`` (records.LearntTimeouts) so a later window's gate, on any
container, starts from it.
"""

from __future__ import annotations

import math
import statistics
from concurrent.futures import ThreadPoolExecutor

from stagecoach.core import keys
from stagecoach.core.records import LearntTimeouts, TaskMetrics
from stagecoach.lambdas.channel import Channel
from stagecoach.planner.plan import Plan

FACTOR = 3.0
# a window attempt that keeps state warm (docs/runtime.md "State that stays warm"): a task of a
# worker that owns warm state and timed out only because it was slow runs again in another
# container, which does not hold that state, and the whole window restarts (WarmStateLost); so
# such an attempt's timeouts leave S3's and Lambda's tails far more room
FACTOR_WARM = 10.0
SLACK_WARM_S = 1.0
# a quarter second of slack and at least 2 s. At least 1 s timed out fault-free tasks on a loaded
# 2-core machine, twice (a ~0.3 s task at 1 s; the 40-replica group test's sync task ran again: 3
# transitions more than billed), so the floor stays 2 s; a second of slack on top of it rounded the
# demo's ~0.4 s tasks up to 3 s, where a quarter second gives 2 s (a hang's cost, benchmarks/faults.py)
SLACK_S = 0.25
COLD_DEFAULT_S = 10.0  # plan.timeouts_from's margin: a Lambda cold start with torch takes seconds
MIN_S = 2
SAMPLES = 5
RESAMPLE_EVERY = 5

_CACHE: dict[tuple[str, str], LearntTimeouts] = {}


def phase_key(phase: str, stage: int) -> str:
    """Which Map's timeout a task of ``phase`` on ``stage`` runs under."""
    return "f" if phase == "forward" else f"{phase[0]}{stage}"


def planned(plan: Plan) -> dict[str, int]:
    """The plan's own timeouts per phase key: the Forward Map runs under its slowest stage's."""
    out = {f"b{s}": plan.timeouts_s[s]["backward"] for s in range(plan.stages)}
    out.update({f"s{s}": plan.timeouts_s[s]["sync"] for s in range(plan.stages) if plan.sync_tasks(s) > 0})
    if plan.stages > 1:
        out["f"] = max(plan.timeouts_s[s]["forward"] for s in range(plan.stages - 1))
    return out


def timeouts(plan: Plan, learnt: LearntTimeouts | None, warm: bool = False) -> dict[str, int]:
    """The TimeoutSeconds per phase key for the next iteration, and ``cold`` (the formulas above;
    ``warm``: the window attempt keeps state warm, ``FACTOR_WARM``)."""
    out = planned(plan)
    if learnt is None:
        return {**out, "cold": 0}
    factor, slack = (FACTOR_WARM, SLACK_WARM_S) if warm else (FACTOR, SLACK_S)
    for k, ceiling in out.items():
        xs = learnt.samples.get(k)
        if xs:
            out[k] = min(ceiling, max(MIN_S, math.ceil(factor * statistics.median_low(xs) + slack)))
    return {**out, "cold": math.ceil(COLD_DEFAULT_S if learnt.cold_s is None else learnt.cold_s)}


def expected(learnt: LearntTimeouts | None) -> dict[str, float]:
    """Per phase key, the seconds its slowest task usually takes (the median the timeouts are
    built on), for the phase watcher (lambdas/watcher.py); empty before anything is learnt."""
    if learnt is None:
        return {}
    return {k: statistics.median_low(xs) for k, xs in learnt.samples.items() if xs}


def learnt_for(bucket: str, job: str) -> LearntTimeouts | None:
    """The record ``learn`` just kept for this job (the gate's container)."""
    return _CACHE.get((bucket, job))


def task_keys(job: str, plan: Plan, t: int) -> list[str]:
    """The metrics objects every task of iteration t writes (handler.py), from the plan alone."""
    out = [keys.metrics(job, t, "forward", s, r) for s in range(plan.stages - 1) for r in range(plan.replicas)]
    out += [keys.metrics(job, t, "backward", s, r) for s in range(plan.stages) for r in range(plan.replicas)]
    out += [keys.metrics(job, t, "sync", s, k) for s in range(plan.stages) for k in range(plan.sync_tasks(s))]
    return out


def sample(ch: Channel, job: str, plan: Plan, t: int, learnt: LearntTimeouts) -> LearntTimeouts:
    """``learnt`` with iteration t's tasks added (those whose metrics exist)."""
    with ThreadPoolExecutor(max_workers=16) as pool:
        bodies = [b for b in pool.map(ch.get_bytes, task_keys(job, plan, t)) if b is not None]
    slowest: dict[str, float] = {}
    cold = learnt.cold_s
    for body in bodies:
        m = TaskMetrics.model_validate_json(body)
        k = phase_key(m.phase, m.stage)
        slowest[k] = max(slowest.get(k, 0.0), m.duration_s)
        if m.init_s is not None:  # a cold task
            cold = max(cold or 0.0, m.init_s + m.duration_s - m.wait_s)
    samples = {k: list(v) for k, v in learnt.samples.items()}
    for k, v in slowest.items():
        samples[k] = (samples.get(k, []) + [v])[-SAMPLES:]
    return LearntTimeouts(samples=samples, cold_s=cold, through=t if bodies else learnt.through)


def _due(learnt: LearntTimeouts, u: int) -> bool:
    """Whether the gate samples iteration u (not sampled yet, and early or a resample's turn)."""
    if u < 0 or u <= learnt.through:
        return False
    taken = max((len(v) for v in learnt.samples.values()), default=0)
    return taken < SAMPLES or u - learnt.through >= RESAMPLE_EVERY


def _load(ch: Channel, job: str) -> LearntTimeouts:
    cached = _CACHE.get((ch.bucket, job))
    if cached is not None:
        return cached
    body = ch.get_bytes(keys.learnt_timeouts(job))
    return LearntTimeouts.model_validate_json(body) if body is not None else LearntTimeouts(samples={})


def learn(ch: Channel, job: str, plan: Plan, t: int, warm: bool = False) -> dict[str, int]:
    """Before iteration t: sample iteration t-1 if due, keep the record, return the timeouts
    (``warm``: for a window attempt that keeps state warm)."""
    learnt = _load(ch, job)
    if _due(learnt, t - 1):
        fresh = sample(ch, job, plan, t - 1, learnt)
        if fresh != learnt:
            ch.put_bytes(keys.learnt_timeouts(job), fresh.model_dump_json().encode())
        learnt = fresh
    _CACHE.clear()  # one job per container (its stage-0 function)
    _CACHE[(ch.bucket, job)] = learnt
    return timeouts(plan, learnt if learnt.samples else None, warm)
