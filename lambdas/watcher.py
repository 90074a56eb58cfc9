"""The phase watcher: a hung task costs a fraction of a second past its expected end, not its Task's
whole timeout.

Step Functions notices a worker that never answers only when its Task's ``TimeoutSeconds`` fires,
in whole seconds and at least 2 s here (lambdas/timeouts.py), where the demo's tasks take ~0.4 s;
a callback Task's heartbeat is not enforced while its Lambda invocation runs (docs/reliability.md
"Fault benchmark"). So the window runs each phase beside a watcher (planner/emit/asl.py
``_watched``): a Parallel whose one branch is the phase and whose other is this task, on the job's
watcher function (plan.watcher_function). The watcher knows what the gate learnt (``expect``: per phase key, the seconds its
slowest task usually takes) and which tasks the phase runs (the plan). It first looks at a task's
metrics object (written as the task ends; keys from the plan, no LIST) when the task usually has
ended, then polls it every POLL_S until the task is done or due::

    due = LATE_FACTOR x expected + LATE_SLACK_S

counted from the phase's start (a sync task: from when its stage's backward tasks were all done,
as its Map starts then). A task due without metrics of this attempt is run again at once, beside its
Map's own invocation, with the payload its Map item gave it (tasks are idempotent: the same input
writes the same bytes under the same keys, as a timed-out task's re-run already does beside the
invocation it replaced). When every task of the phase has its metrics and the watcher ran one
again, it fails with ``PhaseDone``: the Parallel fails, which stops the Map still waiting on the
hung invocation, and the window catches ``PhaseDone`` and goes on. If it ran none again it waits
WATCH_GRACE_S (planner/limits.py) and then fails the same way, which in a fault-free phase comes
after the phase's own end (its branch ends in a Fail state of the same name, which ends the
Parallel and abandons the watcher's Task), so a fault-free iteration's transitions do not depend
on which branch ends first. Whatever way it ends, it writes what it used (records.WatcherUsage).

A kill is not the watcher's: its Task fails at once and the Map's loop runs it again, usually well
before the task is due (a cold re-run adds a few tenths of a second, within LATE_FACTOR). Nothing is
watched while state stays warm only in the attempt's containers (the gate sends no expectations
then): another container would not hold it.
"""

from __future__ import annotations

import json
import math
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

from stagecoach.core import keys
from stagecoach.core.events import WatchEvent
from stagecoach.core.records import TaskMetrics, WatcherUsage
from stagecoach.errors import StagecoachError
from stagecoach.lambdas.channel import ABORT_CHECK_S, Channel
from stagecoach.lambdas.timeouts import phase_key
from stagecoach.planner.limits import WATCH_GRACE_S
from stagecoach.planner.plan import Plan, worker_function

LATE_FACTOR = 2.0
LATE_SLACK_S = 0.3
POLL_S = 0.05
MIN_OWN_S = 0.05  # the least of a task's own time once its inputs are there
GRACE_S = WATCH_GRACE_S  # planner/limits.py says why

Invoke = Callable[[str, dict[str, Any]], None]


class PhaseDone(StagecoachError):
    """Every task of the phase is done, one of them through the watcher: end the phase's Parallel."""


@dataclass(frozen=True)
class Watched:
    """One task of the phase: what its Map item runs, and when it is late."""

    phase: str
    stage: int
    index: int  # the replica, or the sync task's shard
    look_s: float  # seconds after the phase's start: when it usually has ended (its first look)
    due_s: float  # ... and when it is late (a sync task: once its stage's backward is done, ``_synced``)
    own_s: float = 0.0  # its expected seconds once its inputs are there (``_after_inputs``)

    @property
    def ident(self) -> tuple[str, int, int]:
        return (self.phase, self.stage, self.index)

    def key(self, ev: WatchEvent) -> str:
        return keys.metrics(ev.job, ev.t, self.phase, self.stage, self.index)

    def payload(self, ev: WatchEvent) -> dict[str, Any]:
        """The event its Map item hands its Task (planner/emit/tasks.py ``worker_task``), with the
        re-run's cold allowance on its timeout as the Map's own re-run gets it."""
        field = "shard" if self.phase == "sync" else "replica"
        timeout = ev.timeouts[phase_key(self.phase, self.stage)] + ev.timeouts.get("cold", 0)
        return {
            "phase": self.phase,
            "job": ev.job,
            "bucket": ev.bucket,
            "t": ev.t,
            "window_start": ev.window_start,
            "attempt": ev.attempt,
            "stage": self.stage,
            field: self.index,
            "timeout": timeout,
        }


def _due(expected_s: float) -> float:
    return LATE_FACTOR * expected_s + LATE_SLACK_S


def watched(plan: Plan, ev: WatchEvent) -> list[Watched]:
    """The phase's tasks the gate has expectations for (none before it learnt any)."""
    e, d = ev.expect, plan.replicas
    if ev.watch == "forward":
        if "f" not in e:
            return []
        return [Watched("forward", s, r, e["f"], _due(e["f"])) for s in range(plan.stages - 1) for r in range(d)]
    out: list[Watched] = []
    for s in range(plan.stages):
        b = e.get(f"b{s}")
        if b is None:
            continue
        after = e.get(f"b{s + 1}")  # a backward task waits for the next stage's gradients
        own = b if after is None else max(b - after, MIN_OWN_S)
        out += [Watched("backward", s, r, b, _due(b), own) for r in range(d)]
        y = e.get(f"s{s}")
        if y is not None:
            out += [Watched("sync", s, k, b + y, math.inf, y) for k in range(plan.sync_tasks(s))]
    return out


def _after_inputs(pending: list[Watched], finished: set[Watched], rerun: set[int], plan: Plan, now: float) -> list[Watched]:
    """A task is due from when what it waits for was seen done, not only from the phase's start:
    a backward task from the next stage's backward tasks (its gradients; its own part of the
    expected time is the difference of the two), a sync task from its stage's (its Map starts
    then; never before). A stage whose backward task the watcher ran again (``rerun``) has a
    backward Map still waiting on the hung invocation, so its sync Map never starts: its sync
    tasks are due at once."""
    done = Counter(w.stage for w in finished if w.phase == "backward")

    def ready(w: Watched) -> bool:
        waits_on = w.stage + 1 if w.phase == "backward" else w.stage
        return w.phase != "forward" and waits_on < plan.stages and done[waits_on] == plan.replicas

    def due(w: Watched) -> float:
        return now if w.phase == "sync" and w.stage in rerun else now + _due(w.own_s)

    return [replace(w, look_s=min(w.look_s, now + w.own_s), due_s=min(w.due_s, due(w))) if ready(w) else w for w in pending]


def _done(ch: Channel, ev: WatchEvent, w: Watched) -> bool:
    """Whether the task ended in this window attempt (its metrics say which attempt wrote them)."""
    body = ch.get_bytes(w.key(ev))
    return body is not None and TaskMetrics.model_validate_json(body).attempt == ev.attempt


def _aborted(ch: Channel, ev: WatchEvent) -> bool:
    """Whether the window attempt failed (its Abort state wrote the marker): its Map already failed
    with the task that did not answer, so running a task again helps nothing, and the window's
    waiting tasks must stop on the marker, not on an input a re-run wrote (lambdas/channel.py).
    Step Functions does not stop a Lambda invocation when its Parallel fails: the watcher must."""
    return bool(ev.attempt) and ch.get_bytes(keys.window_abort(ev.job, ev.attempt)) is not None


def watch_and_record(ev: WatchEvent, ch: Channel, plan: Plan, invoke: Invoke, memory_mb: int) -> dict[str, Any]:
    """``watch``, then what it used written as its last act (records.WatcherUsage), also when it
    ends the phase with PhaseDone: its Task's output rarely reaches the history (docs/cost.md)."""
    started, again = time.monotonic(), [0]
    try:
        return watch(ev, ch, plan, invoke, counter=again)
    finally:
        usage = WatcherUsage(
            t=ev.t,
            watch=ev.watch,
            attempt=ev.attempt,
            duration_s=time.monotonic() - started,
            memory_mb=memory_mb,
            puts=ch.stats.puts + 1,
            gets=ch.stats.gets,
            again=again[0],
        )
        ch.put_bytes(keys.watcher_usage(ev.job, ev.t, ev.watch, ev.attempt), usage.model_dump_json().encode())


def watch(
    ev: WatchEvent,
    ch: Channel,
    plan: Plan,
    invoke: Invoke,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    counter: list[int] | None = None,
) -> dict[str, Any]:
    """Watch the phase until every task is done (or the longest of its timeouts has passed, when
    the Maps' own timeouts have taken over, or the window attempt failed: ``_aborted``); raise
    PhaseDone if a task had to be run again.
    ``counter`` (a one-item list) counts the re-runs as they start."""
    counter = counter if counter is not None else [0]
    pending = watched(plan, ev)
    if not pending:
        return {"again": 0}
    start = clock()
    give_up = start + max(ev.timeouts.get(phase_key(w.phase, w.stage), 0) for w in pending) + ev.timeouts.get("cold", 0)
    again: dict[tuple[str, int, int], Future[None]] = {}  # by Watched.ident: its times may be tightened since
    finished: set[Watched] = set()
    # not a context manager: its exit would wait for a re-run that hung in turn
    pool = ThreadPoolExecutor(max_workers=8)
    next_abort_look = ABORT_CHECK_S
    while pending and clock() < give_up:
        now = clock() - start
        # a first look when a task usually has ended, so a fault-free phase's watcher ends with it
        # (and is billed for about as long), then a poll until it is done or due
        looked = [w for w in pending if now >= w.look_s]
        done = {w for w in looked if _done(ch, ev, w)}
        finished |= done
        rerun = {stage for (phase, stage, _) in again if phase == "backward"}
        pending = _after_inputs([w for w in pending if w not in done], finished, rerun, plan, now)
        late = [w for w in looked if w not in done and now >= w.due_s and w.ident not in again]
        if late or now >= next_abort_look:
            next_abort_look = now + ABORT_CHECK_S
            if _aborted(ch, ev):
                pool.shutdown(wait=False)
                return {"again": len(again), "aborted": True}
        for w in late:
            again[w.ident] = pool.submit(invoke, plan_function(ev, w, finished), w.payload(ev))
            counter[0] += 1
        if pending:  # poll what was looked at; else sleep until the next look
            sleep(POLL_S if any(w in pending for w in looked) else max(0.0, min(w.look_s for w in pending) - now))
    pool.shutdown(wait=False)
    if pending:
        return {"again": len(again)}
    if again:
        raise PhaseDone(f"iteration {ev.t}: {len(again)} task(s) ran again beside their Map: {sorted(again)}")
    # every task's work is done; a Map still open after GRACE_S waits on an invocation that wrote
    # its metrics and then died or hung (a kill can land after the last PUT), or on its re-run
    sleep(GRACE_S)
    raise PhaseDone(f"iteration {ev.t}: every task is done, the phase's Map is still waiting")


def plan_function(ev: WatchEvent, w: Watched, done: set[Watched] | None = None) -> str:
    """Where to run the task again: with a function per worker, on the function of a worker of the
    same stage and kind whose task is done (its container is warm and idle, where the late task's
    own is busy with the hung invocation; any function of a stage runs any of its tasks), else on
    the task's own; with a function per stage, on it (Lambda picks an idle container)."""
    fn = ev.functions[w.stage]
    if not ev.per_worker:
        return fn
    kind = "k" if w.phase == "sync" else "r"
    idle = sorted(o.index for o in done or set() if o.stage == w.stage and o.phase == w.phase and o.index != w.index)
    return worker_function(fn, kind, idle[0] if idle else w.index)


def lambda_invoke(client: Any) -> Invoke:
    """Run a task again synchronously (its result is in S3; an error only means it did not help)."""

    def run(function: str, payload: dict[str, Any]) -> None:
        client.invoke(FunctionName=function, Payload=json.dumps(payload).encode())

    return run
