"""Emit the Step Functions state machines of a plan, as plain ASL dicts (JSONPath).

The window state machine runs iterations [start, end) of one job; each iteration is three phases
as states (docs/runtime.md "States"):

    Gate (Task) -> Go? (Choice) -> Forward (Map over every worker but the last stage's)
                -> BackwardSync (Parallel, a branch per stage: Map(backward) -> Map(sync))
                -> Advance (Pass: t + 1) -> Gate

The Gate, before each iteration, asks the job's stage-0 function whether the job may go on
(lambdas/gate.py: a stop request, or a cost cap passed); if not, the window ends in ``Stopped``
at that iteration boundary, with the parameters of the version reached complete (docs/cost.md).

The job state machine (statemachines/job.asl.json, deployed by SAM) runs the windows one after the
other with states:startExecution.sync:2, so no single execution nears the 25,000-event history
limit; the emitter sizes the windows for that (``window_length``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

from stagecoach.planner.emit.groups import group_bounds, grouped_map
from stagecoach.planner.emit.segments import joined_windows, policy_windows
from stagecoach.planner.emit.tasks import KILLED_ERROR, KILLED_RETRY, LAMBDA_RETRY, WORKER_RETRY, worker_map, worker_task
from stagecoach.planner.hap import HAP_SYNC
from stagecoach.planner.limits import EXPRESS_MAX_DURATION_S, GROUP_SIZE, HISTORY_MAX_EVENTS, map_groups, map_transitions
from stagecoach.planner.plan import Plan, plan_watchable, watcher_function, worker_function
from stagecoach.planner.segments import check_segments, choice_plan

HISTORY_LIMIT = HISTORY_MAX_EVENTS
# Share of the history a window may plan to use; the rest absorbs retries (each retry of a Task
# adds TaskScheduled, TaskStarted and TaskFailed) and the window's fixed events.
HISTORY_BUDGET = 0.8

# A failed phase's Catch: write the abort marker, then fail the window with the phase's own error.
ABORT_CATCH = {"ErrorEquals": ["States.ALL"], "ResultPath": "$.caught", "Next": "Abort"}

# A lost activation or input gradient (ObjectLost, lambdas/channel.py: its producer finished in
# this attempt, the object is not in S3) is recovered inside the window: Redo? and Redo run the
# iteration's phases again (Forward, BackwardSync; the Gate's learnt timeouts kept), and its
# producer writes the object again, with the same bytes. The redo is a new attempt name
# (``{execution}-r{n}``), so its consumers do not take the first run's metrics for their
# producers' (and the first run's abort marker, never written, would stop none of them). Every
# version t is still in S3 when iteration t runs again: a stage that stores every version
# (JobSpec.write_through, or without warm state) reloads it; a warm stage whose container moved
# on to t+1 fails with WarmStateLost, and the window restarts as before. At most REDO_LIMIT per
# window execution, and only where they cost at most a twentieth of its history (``redo_limit``).
# The Catch sees the task's own error name: a failed Map iteration fails its Map, and a failed
# branch fails its Parallel, with that error, which the state's Catch matches (Step Functions
# Developer Guide, "Parallel workflow state" and "Map state", error handling); the Abort path's
# Failed state already reads the same name from $.caught.Error.
REDO_ERRORS = ["ObjectLost"]
REDO_LIMIT = 3
REDO_SHARE = 20  # a window of n iterations redoes at most n // REDO_SHARE of them

# Events one state adds to the history (the same on AWS and moto's interpreter).
EV_TASK = 5  # TaskStateEntered, TaskScheduled, TaskStarted, TaskSucceeded, TaskStateExited
EV_MAP_ITEM = 2  # MapIterationStarted, MapIterationSucceeded
EV_MAP = 4  # MapStateEntered, MapStateStarted, MapStateSucceeded, MapStateExited
EV_PARALLEL = 4  # ParallelStateEntered, ParallelStateStarted, ParallelStateSucceeded, ParallelStateExited
# a phase beside its watcher (``_watched``): the outer Parallel's four (it ends Failed with
# PhaseDone, then Exited, on moto), the phase's Fail state, and the watcher's Task (five when it
# ends before the phase, as when it has no expectations; on AWS an abandoned Task records
# TaskStateAborted in place of its last two): an upper bound
EV_WATCHED_PHASE = EV_PARALLEL + 1 + EV_TASK
EV_PASS = 2  # PassStateEntered, PassStateExited (Choice: ChoiceStateEntered/Exited, likewise)
EV_WINDOW_FIXED = 1 + EV_PASS + EV_TASK + EV_PASS + EV_PASS + 1  # started, Init, last Gate and Go?, Done, succeeded

# The error a window and the job end with when the job stops at an iteration boundary (a stop
# request or the cost cap): distinct from every failure, so the job's status can say "stopped".
STOPPED_ERROR = "Stagecoach.Stopped"
GATE_TIMEOUT_S = 60

# The window's workflow type (JobInput.windowType; the job's ``workflow``, docs/runtime.md "Express
# windows"): a STANDARD window is billed per state transition, an EXPRESS one per request and
# duration, runs at most EXPRESS_MAX_DURATION_S, has no history API and no .sync integration inside
STANDARD: Final = "STANDARD"
EXPRESS: Final = "EXPRESS"
# The job's startSyncExecution Task waits for the Express window: its five minutes, and slack
EXPRESS_TASK_TIMEOUT_S = EXPRESS_MAX_DURATION_S + 60

# State transitions (what Step Functions Standard bills: one per state entered, and one per
# retry): the window's per-iteration bookkeeping (Gate, Go?, Advance) and its fixed states (Init,
# the last Gate and Go?, Done); the job's per window (Next?, Bounds, Clamp, Full/LastWindow,
# WindowType?, RunWindow or RunExpressWindow and ExpressEnded?, Advance) and fixed (the last Next?, Done). planner/model/perfmodel.py mirrors the first.
TRANSITIONS_ITERATION_BOOKKEEPING = 3
TRANSITIONS_WINDOW_FIXED = 4
TRANSITIONS_JOB_PER_WINDOW = 7  # ... WindowType?, RunWindow, Advance
TRANSITIONS_JOB_PER_EXPRESS_WINDOW = 8  # ... WindowType?, RunExpressWindow, ExpressEnded?, Advance
TRANSITIONS_JOB_FIXED = 2
# a phase beside its watcher (``_watched``): the outer Parallel takes the phase's name, and the phase's
# own Parallel ("<name>Phase") and its Fail ("<name>Ended") are entered too; the watcher's Task
# ("Watch<name>") counts to the orchestration. Its Catch states are entered only when it ended the
# phase (a fault) or failed.
TRANSITIONS_WATCHED_PHASE = 2
TRANSITIONS_WATCHER = 1
# a job that evaluates (or checkpoints) asks after every iteration whether this version is due:
# the EvaluateDue Pass and EvaluateChoice Choice (CheckpointDue, CheckpointChoice), due or not
TRANSITIONS_DUE_CHECK = 2


# a group's start Task (states:startExecution.sync:2): TaskStateEntered, TaskScheduled, TaskStarted,
# TaskSubmitted, TaskSucceeded, TaskStateExited (../shared/facts.md; the child's events are its own)
EV_GROUP_TASK = 6


def _map_events(items: int) -> int:
    """A phase Map's events in the window's history: per task, or per group (its child's tasks
    add their events to the child's own history)."""
    g = map_groups(items)
    return EV_MAP + (g * (EV_MAP_ITEM + EV_GROUP_TASK) if g else items * (EV_MAP_ITEM + EV_TASK))


# FasDL's HAP overlapped (``hap_overlap``): the two Choices of its BackwardSync, Lead? and Ahead?
TRANSITIONS_HAP_CHOICES = 2


def hap_overlap(plan: Plan) -> bool:
    """Whether ``plan``'s window runs FasDL's HAP overlapped (``_hap_backward_sync``): the
    non-aggregators' backward tasks of iteration t+1 beside iteration t's aggregators' backward
    and sync Maps. A one-stage HAP plan of a fixed d whose Maps run inline (at most GROUP_SIZE
    replicas); any other HAP window runs its iterations one after the other, as before."""
    return (
        plan.stages == 1
        and plan.replicas > 1
        and plan.sync[0] == HAP_SYNC
        and not plan.segments
        and not plan.choices
        and not map_groups(plan.replicas)
    )


def watched_phases(plan: Plan) -> int:
    """How many of an iteration's phases run beside a watcher (``_watched``): Forward (S > 1) and
    BackwardSync, when the plan is ``watchable``."""
    return (1 + (plan.stages > 1)) if watchable(plan) else 0


def phase_transitions(plan: Plan) -> dict[str, int]:
    """Per phase, the state transitions of one fault-free iteration: Forward (a Parallel of a Map
    per stage but the last), BackwardSync (the Parallel and each stage's backward Map), the sync
    Maps, and the bookkeeping (Gate, Go?, Advance); each Map's as limits.map_transitions. A watched
    phase (``_watched``) adds its inner Parallel and its Fail to the phase, and the watcher's Task
    to the orchestration."""
    s, d = plan.stages, plan.replicas
    w = TRANSITIONS_WATCHED_PHASE if watchable(plan) else 0
    if hap_overlap(plan):  # a steady iteration: the aggregators' Map, the next non-aggregators', Lead? and Ahead?
        k = plan.aggregators[0]
        return {
            "forward": 0,
            "backward": 1 + map_transitions(k) + map_transitions(d - k),
            "sync": map_transitions(plan.sync_tasks(0)),
            "orchestration": TRANSITIONS_ITERATION_BOOKKEEPING + TRANSITIONS_HAP_CHOICES,
        }
    return {
        "forward": (1 + (s - 1) * map_transitions(d) + w) if s > 1 else 0,
        "backward": 1 + s * map_transitions(d) + w,
        "sync": sum(map_transitions(plan.sync_tasks(st)) for st in range(s) if plan.sync_tasks(st)),
        "orchestration": TRANSITIONS_ITERATION_BOOKKEEPING + TRANSITIONS_WATCHER * watched_phases(plan),
    }


def transitions_per_iteration(plan: Plan) -> int:
    """State transitions of one fault-free iteration (``phase_transitions``, the states
    ``events_per_iteration`` counts the events of)."""
    return sum(phase_transitions(plan).values())


def events_per_iteration(plan: Plan, evals: Sequence[int] = (), saves: Sequence[int] = ()) -> int:
    """History events one fault-free iteration adds to a window execution (with ``evals`` and
    ``saves``: the checks, and an Evaluate and a Checkpoint in every iteration, as a bound)."""
    s, d = plan.stages, plan.replicas
    n = EV_TASK + EV_PASS  # Gate (Task), Go? (Choice)
    if evals:
        n += 2 * EV_PASS + EV_PARALLEL + s * _map_events(d)  # EvaluateDue (Pass), EvaluateChoice, Evaluate
    if saves:
        n += 2 * EV_PASS + _map_events(s)  # CheckpointDue, CheckpointChoice, Checkpoint
    if s > 1:
        n += EV_PARALLEL + (s - 1) * _map_events(d)  # Forward
    if hap_overlap(plan):  # a bound: the attempt's first iteration's Maps of all d and of the next d - K, Lead? and Ahead?
        n += EV_PARALLEL + 2 * EV_PASS + _map_events(d) + _map_events(d - plan.aggregators[0])
    else:
        n += EV_PARALLEL + s * _map_events(d)  # backward Maps
    n += EV_WATCHED_PHASE * watched_phases(plan)
    n += sum(_map_events(plan.sync_tasks(st)) for st in range(s) if plan.sync_tasks(st))  # sync Maps
    n += EV_PASS  # Next
    return n


def _usable_events(limit: int) -> int:
    return int(limit * HISTORY_BUDGET) - EV_WINDOW_FIXED


def redo_limit(plan: Plan, limit: int = HISTORY_LIMIT, evals: Sequence[int] = (), saves: Sequence[int] = ()) -> int:
    """How many iterations a window execution may run again after a lost object (``REDO_LIMIT``,
    at most one per ``REDO_SHARE`` iterations the window could hold without them)."""
    return min(REDO_LIMIT, _usable_events(limit) // events_per_iteration(plan, evals, saves) // REDO_SHARE)


def window_length(plan: Plan, limit: int = HISTORY_LIMIT, evals: Sequence[int] = (), saves: Sequence[int] = ()) -> int:
    """Iterations per window execution so its history stays well under ``limit`` events, its
    redos (``redo_limit``: an iteration's events and Redo? and Redo each) included."""
    per = events_per_iteration(plan, evals, saves)
    usable = _usable_events(limit) - redo_limit(plan, limit, evals, saves) * (per + 2 * EV_PASS)
    n = usable // per
    if n < 1:
        raise ValueError(
            f"one iteration of this plan needs {per} history events, more than a window can hold ({usable}): use fewer stages or replicas"
        )
    return n


# A worker's function by (stage, kind, index): kind "r" a replica, "k" a sync shard (plan.worker_function).
FunctionOf = Callable[[int, str, int], str]


def _function_of(functions: Sequence[str], per_worker: bool) -> FunctionOf:
    """Whose function runs a worker's task: its stage's, or with ``per_worker`` one of its own,
    which the worker's Map item then names."""

    def fn(s: int, kind: str, i: int) -> str:
        return worker_function(functions[s], kind, i) if per_worker else functions[s]

    return fn


def _item_lists(plan: Plan, fn: FunctionOf, per_worker: bool) -> dict[str, Any]:
    """The Maps' items, computed once in Init so the iterations' states only point at them: the
    replicas (``ranks``; with ``per_worker`` per stage, each naming its function, ``bw``) and each
    stage's sync shards, for a Map of at most GROUP_SIZE tasks; for a larger one only its groups'
    bounds (``groups``: ``r`` the replicas, ``k{s}`` stage s's shards; planner/emit/groups.py)."""
    s_count, d = plan.stages, plan.replicas
    lists: dict[str, Any] = {}
    groups: dict[str, Any] = {}
    if map_groups(d):
        groups["r"] = group_bounds(d)
    else:
        lists["ranks"] = list(range(d))
        if per_worker:
            lists["bw"] = {f"s{st}": [{"replica": r, "fn": fn(st, "r", r)} for r in range(d)] for st in range(s_count)}
    shards: dict[str, Any] = {}
    for st in range(s_count):
        k = plan.sync_tasks(st)
        if map_groups(k):
            groups[f"k{st}"] = group_bounds(k)
        else:
            shards[f"s{st}"] = [{"shard": i, "fn": fn(st, "k", i)} for i in range(k)] if per_worker else list(range(k))
    lists["shards"] = shards
    if groups:
        lists["groups"] = groups
    if hap_overlap(plan):  # the aggregators' and the non-aggregators' Maps (``_hap_backward_sync``)
        k = plan.aggregators[0]
        item: Callable[[int], Any] = (lambda r: {"replica": r, "fn": fn(0, "r", r)}) if per_worker else (lambda r: r)
        lists["hap"] = {"a": [item(r) for r in range(k)], "n": [item(r) for r in range(k, d)]}
    return lists


def _init_state(plan: Plan, fn: FunctionOf, per_worker: bool, evals: Sequence[int], saves: Sequence[int]) -> dict[str, Any]:
    """Init: the window's position, and every Map's items (``_item_lists``)."""
    s_count = plan.stages
    return {
        "Type": "Pass",
        "Parameters": {
            "job.$": "$.job",
            "bucket.$": "$.bucket",
            "t.$": "$.first",
            "end.$": "$.end",
            "window_start.$": "$.start",
            # the first iteration this attempt runs: the window's start, or where a failed attempt
            # left it complete (the job state machine's ResumePoint, lambdas/resumepoint.py)
            "first.$": "$.first",
            # this attempt's execution name: the key of its abort marker (restarts get their own)
            "attempt.$": "$$.Execution.Name",
            "redo": 0,  # iterations run again after a lost object (Redo)
            **_item_lists(plan, fn, per_worker),
            **_hap_position(plan),
            **({"evals": sorted(set(evals))} if evals else {}),
            **(
                {"saves": sorted(set(saves)), "sv": [{"stage": st, "replica": 0, "fn": fn(st, "r", 0)} for st in range(s_count)]}
                if saves
                else {}
            ),
        },
        "Next": "Gate",
    }


def _hap_position(plan: Plan) -> dict[str, Any]:
    """An overlapped HAP window's position (``_hap_backward_sync``), set in Init: ``lead``, whether
    this iteration's non-aggregators have still to compute its gradient (the attempt's first
    iteration, and a redo), and ``ahead``, the iteration after t, whose non-aggregators' gradient
    the iteration computes if it is before the window's end."""
    return {"lead": True, "ahead.$": "States.MathAdd($.first, 1)"} if hap_overlap(plan) else {}


def _gate_states(plan: Plan, gate_function: str) -> dict[str, Any]:
    """Gate, Go? and Stopped: before each iteration, and once more at the window's end (metering
    its last iteration), stage 0's function says whether the job may go on."""
    return {
        "Gate": {
            "Type": "Task",
            "Resource": "arn:aws:states:::lambda:invoke",
            "Parameters": {
                "FunctionName": gate_function,
                "Payload": {
                    "phase": "gate",
                    "job.$": "$.job",
                    "bucket.$": "$.bucket",
                    "t.$": "$.t",
                    "end.$": "$.end",
                    "window_start.$": "$.window_start",
                    "first.$": "$.first",
                    "attempt.$": "$.attempt",
                },
            },
            "TimeoutSeconds": GATE_TIMEOUT_S,
            "Retry": [dict(LAMBDA_RETRY), dict(WORKER_RETRY), dict(KILLED_RETRY)],
            "ResultSelector": {"stop.$": "$.Payload.stop", "timeouts.$": "$.Payload.timeouts", "expect.$": "$.Payload.expect"},
            "ResultPath": "$.gate",
            # no task of the window is running: fail without the abort marker
            "Catch": [{"ErrorEquals": ["States.ALL"], "ResultPath": "$.caught", "Next": "Failed"}],
            "Next": "Go?",
        },
        "Go?": {
            "Type": "Choice",
            "Choices": [
                {"Variable": "$.t", "NumericGreaterThanEqualsPath": "$.end", "Next": "Done"},
                {"Variable": "$.gate.stop", "BooleanEquals": True, "Next": "Stopped"},
            ],
            "Default": "Forward" if plan.stages > 1 else "BackwardSync",
        },
        # the job stops at this iteration boundary: version t is complete (the gate recorded it)
        "Stopped": {
            "Type": "Fail",
            "Error": STOPPED_ERROR,
            "CausePath": "States.Format('stopped before iteration {}', $.t)",
        },
    }


@dataclass(frozen=True)
class _Maps:
    """Builds a stage's phase Maps: inline up to GROUP_SIZE tasks, else over groups of child
    executions of ``group_arn`` (planner/emit/groups.py)."""

    plan: Plan
    functions: Sequence[str]
    per_worker: bool
    group_arn: str | None

    def _arn(self) -> str:
        if self.group_arn is None:
            raise ValueError(f"a phase of more than {GROUP_SIZE} tasks runs in groups: pass the group state machine's ARN")
        return self.group_arn

    def replicas(self, name: str, s: int, phase: str, timeout: str | int, nxt: str | None) -> dict[str, Any]:
        """Stage ``s``'s replicas running ``phase``; ``timeout``: the gate's learnt one (a path) or fixed."""
        if map_groups(self.plan.replicas):
            return grouped_map(name, s, phase, self.functions[s], "$.groups.r", timeout, nxt, self._arn())
        fn: str | None = None
        if self.per_worker:  # each item names its function
            items, sel = f"$.bw.s{s}", {"stage": s, "replica.$": "$$.Map.Item.Value.replica", "fn.$": "$$.Map.Item.Value.fn"}
        else:
            items, sel, fn = "$.ranks", {"stage": s, "replica.$": "$$.Map.Item.Value"}, self.functions[s]
        return worker_map(name, items, _timed(sel, timeout), worker_task(phase, fn, _fixed(timeout), "replica"), nxt)

    def hap_replicas(self, name: str, items: str, t_path: str, nxt: str | None) -> dict[str, Any]:
        """An overlapped HAP window's backward tasks of the replicas at ``items`` (``$.hap.a``, the
        aggregators; ``$.hap.n``, the non-aggregators), of the iteration at ``t_path``, under the
        gate's learnt timeout for the backward phase."""
        fn: str | None = None
        if self.per_worker:
            sel = {"stage": 0, "replica.$": "$$.Map.Item.Value.replica", "fn.$": "$$.Map.Item.Value.fn"}
        else:
            sel, fn = {"stage": 0, "replica.$": "$$.Map.Item.Value"}, self.functions[0]
        sel = _timed({**sel, "t.$": t_path}, "$.gate.timeouts.b0")
        return worker_map(name, items, sel, worker_task("backward", fn, None, "replica"), nxt)

    def shards(self, name: str, s: int, nxt: str | None) -> dict[str, Any]:
        """Stage ``s``'s sync tasks, under the gate's learnt timeout for them."""
        timeout = f"$.gate.timeouts.s{s}"
        if map_groups(self.plan.sync_tasks(s)):
            return grouped_map(name, s, "sync", self.functions[s], f"$.groups.k{s}", timeout, nxt, self._arn())
        fn: str | None = None
        if self.per_worker:
            sel = {"stage": s, "shard.$": "$$.Map.Item.Value.shard", "fn.$": "$$.Map.Item.Value.fn"}
        else:
            sel, fn = {"stage": s, "shard.$": "$$.Map.Item.Value"}, self.functions[s]
        return worker_map(name, f"$.shards.s{s}", _timed(sel, timeout), worker_task("sync", fn, None, "shard"), nxt)

    def per_stage(self, name: str, stages: int, phase: str, timeout: str | int) -> dict[str, Any]:
        """A Parallel of one replicas Map per stage of the first ``stages`` (each stage's workers
        in a Map of their own, so a phase reaches past one inline Map's 40 at once)."""
        branches = [
            {"StartAt": f"{name}{s}", "States": {f"{name}{s}": self.replicas(f"{name}{s}", s, phase, timeout, None)}} for s in range(stages)
        ]
        return {"Type": "Parallel", "Branches": branches, "ResultPath": None}


def _timed(selector: dict[str, Any], timeout: str | int) -> dict[str, Any]:
    """A Map item with the gate's learnt timeout (a path), which its Task takes through TimeoutSecondsPath."""
    return {**selector, "timeout.$": timeout} if isinstance(timeout, str) else selector


def _fixed(timeout: str | int) -> int | None:
    return timeout if isinstance(timeout, int) else None


def _forward_state(maps: _Maps, redos: int) -> dict[str, Any]:
    """Forward: a Parallel of one Map per stage but the last (whose forward runs in its backward
    task), under the gate's learnt timeout for the forward phase."""
    state = maps.per_stage("Forward", maps.plan.stages - 1, "forward", "$.gate.timeouts.f")
    state.update({"Catch": _phase_catch(redos), "Next": "BackwardSync"})
    return state


def _phase_catch(redos: int) -> list[dict[str, Any]]:
    """Forward's and BackwardSync's Catch: a lost object to Redo? (if the window may redo), all else to Abort."""
    lost = [{"ErrorEquals": list(REDO_ERRORS), "ResultPath": "$.caught", "Next": "Redo?"}] if redos else []
    return [*lost, dict(ABORT_CATCH)]


def _redo_states(plan: Plan, carry: dict[str, Any], redos: int) -> dict[str, Any]:
    """Redo? and Redo: iteration t's phases again, under a new attempt name (``REDO_ERRORS``)."""
    if not redos:
        return {}
    return {
        "Redo?": {
            "Type": "Choice",
            "Choices": [{"Variable": "$.redo", "NumericLessThan": redos, "Next": "Redo"}],
            "Default": "Abort",
        },
        "Redo": {
            "Type": "Pass",
            "Parameters": {
                **_without_lead(carry),
                "t.$": "$.t",
                "gate.$": "$.gate",
                "attempt.$": "States.Format('{}-r{}', $$.Execution.Name, $.redo)",
                "redo.$": "States.MathAdd($.redo, 1)",
                # a redo runs every replica's backward task of t again (``_hap_backward_sync``)
                **({"lead": True} if hap_overlap(plan) else {}),
            },
            "Next": "Forward" if plan.stages > 1 else "BackwardSync",
        },
    }


# lambdas/watcher.py PhaseDone (a Lambda error's name is its exception's class name): every task of
# the phase is done, one through the watcher; the phase's own branch ends in a Fail of this name too
PHASE_DONE = "PhaseDone"


def watchable(plan: Plan) -> bool:
    """Whether a window of ``plan`` runs its phases beside a watcher (limits.watchable). Not an
    overlapped HAP window (``hap_overlap``): its BackwardSync runs tasks of two iterations, and the
    watcher knows one iteration's (it would end the phase once iteration t's were done, with the
    next iteration's non-aggregators still running)."""
    return plan_watchable(plan) and not hap_overlap(plan)


def _watcher(name: str, watch: str, functions: Sequence[str], per_worker: bool, timeout_s: int) -> dict[str, Any]:
    """The watcher's branch: its Task on the job's watcher function (plan.watcher_function); it
    fails with PhaseDone when it ended the phase, and quietly on any other error (the phase's own
    timeouts then hold)."""
    payload = {
        "phase": "watch",
        "watch": watch,
        **{f"{k}.$": f"$.{k}" for k in ("job", "bucket", "t", "window_start", "attempt")},
        "functions": list(functions),
        "per_worker": per_worker,
        "timeouts.$": "$.gate.timeouts",
        "expect.$": "$.gate.expect",
    }
    task = {
        "Type": "Task",
        "Resource": "arn:aws:states:::lambda:invoke",
        "Parameters": {"FunctionName": watcher_function(functions[0]), "Payload": payload},
        "TimeoutSeconds": timeout_s,
        "ResultPath": None,
        "Catch": [
            {"ErrorEquals": [PHASE_DONE], "ResultPath": "$.caught", "Next": f"Watch{name}Ended"},
            {"ErrorEquals": ["States.ALL"], "ResultPath": "$.caught", "Next": f"Watch{name}Quiet"},
        ],
        "End": True,
    }
    states = {f"Watch{name}": task, f"Watch{name}Ended": {"Type": "Fail", "Error": PHASE_DONE}, f"Watch{name}Quiet": {"Type": "Succeed"}}
    return {"StartAt": f"Watch{name}", "States": states}


def _watched(name: str, phase: dict[str, Any], watch: str, functions: Sequence[str], per_worker: bool, timeout_s: int) -> dict[str, Any]:
    """``phase`` (a Parallel named ``name``, with its Catch and Next) beside its watcher
    (lambdas/watcher.py): a Parallel of the phase, which ends in a Fail named PHASE_DONE, and the
    watcher, which ends the Parallel early the same way; the window catches PHASE_DONE and goes on,
    and every other error as the phase alone would have raised it."""
    catch, nxt = phase.pop("Catch"), phase.pop("Next")
    own = {
        "StartAt": f"{name}Phase",
        "States": {f"{name}Phase": {**phase, "Next": f"{name}Ended"}, f"{name}Ended": {"Type": "Fail", "Error": PHASE_DONE}},
    }
    return {
        "Type": "Parallel",
        "Branches": [own, _watcher(name, watch, functions, per_worker, timeout_s)],
        "ResultPath": None,
        # the phase's end: its input goes on unchanged (no error to keep)
        "Catch": [{"ErrorEquals": [PHASE_DONE], "ResultPath": None, "Next": nxt}, *catch],
        "Next": nxt,  # never taken: the phase's branch always ends in its Fail
    }


def phase_parallel(states: dict[str, Any], name: str) -> dict[str, Any]:
    """A window's phase Parallel ("Forward", "BackwardSync") among its ``states``, inside its
    watcher's Parallel when it has one (``_watched``)."""
    state: dict[str, Any] = states[name]
    own: dict[str, Any] | None = state["Branches"][0]["States"].get(f"{name}Phase") if state.get("Branches") else None
    return own if own is not None and own.get("Type") == "Parallel" else state


def _watch_timeout_s(plan: Plan) -> int:
    """The watcher Task's bound: it gives up by the phase's longest timeout and a cold allowance."""
    return max(max(p.values()) for p in plan.timeouts_s) + 60


def _stage_branch(maps: _Maps, s: int) -> dict[str, Any]:
    """Stage ``s``'s branch of BackwardSync: its backward Map, then its sync Map if it has one, so
    a stage syncs as soon as its own backward pass is done, whatever the other stages do."""
    has_sync = maps.plan.sync_tasks(s) > 0  # d = 1 and the fused syncs (pipelined, LambdaML's) have no sync Map
    # the gate's learnt timeouts (lambdas/timeouts.py), one per Map
    states = {f"Backward{s}": maps.replicas(f"Backward{s}", s, "backward", f"$.gate.timeouts.b{s}", f"Sync{s}" if has_sync else None)}
    if has_sync:
        states[f"Sync{s}"] = maps.shards(f"Sync{s}", s, None)
    return {"StartAt": f"Backward{s}", "States": states}


def _backward_sync(maps: _Maps, redos: int) -> dict[str, Any]:
    """BackwardSync: a Parallel of a branch per stage (``_stage_branch``)."""
    branches = [_stage_branch(maps, s) for s in range(maps.plan.stages)]
    return {"Type": "Parallel", "Branches": branches, "ResultPath": None, "Catch": _phase_catch(redos), "Next": "Advance"}


def _hap_backward_sync(maps: _Maps, redos: int) -> dict[str, Any]:
    """BackwardSync of an overlapped HAP window (``hap_overlap``; docs/runtime.md "FasDL's HAP"):
    a non-aggregator's gradient of iteration t+1 is computed on version t (staleness 1), which
    exists when iteration t starts, so it runs beside iteration t's aggregation. Two branches:

    - Lead? -> the aggregators' backward tasks of t (all d replicas' in the attempt's first
      iteration or a redo, ``lead``: no earlier iteration of this attempt computed the
      non-aggregators' gradient of t) -> the sync Map of t, which reduces all d gradients of t;
    - Ahead? -> the non-aggregators' backward tasks of t+1 (``ahead``), unless t+1 is the window's
      end (the next window's first iteration computes them).

    The sync Map of t ends before iteration t+1 starts (the Parallel waits for both branches), so
    version t+1 is complete when the non-aggregators of t+2 read it, and the gradient of t+1 is in
    S3 before the sync Map of t+1 starts. The gate still runs between iterations: a stop after t
    leaves the non-aggregators' gradient of t+1 computed, which a resume computes again (the same
    bytes under the same keys)."""
    timeout = "$.gate.timeouts.b0"
    lead = {
        "Lead?": {
            "Type": "Choice",
            "Choices": [{"Variable": "$.lead", "BooleanEquals": True, "Next": "Backward0"}],
            "Default": "Backward0Aggregators",
        },
        "Backward0": maps.replicas("Backward0", 0, "backward", timeout, "Sync0"),
        "Backward0Aggregators": maps.hap_replicas("Backward0Aggregators", "$.hap.a", "$.t", "Sync0"),
        "Sync0": maps.shards("Sync0", 0, None),
    }
    ahead = {
        "Ahead?": {
            "Type": "Choice",
            "Choices": [{"Variable": "$.ahead", "NumericLessThanPath": "$.end", "Next": "Backward0Ahead"}],
            "Default": "NoneAhead",
        },
        "Backward0Ahead": maps.hap_replicas("Backward0Ahead", "$.hap.n", "$.ahead", None),
        "NoneAhead": {"Type": "Succeed"},
    }
    return {
        "Type": "Parallel",
        "Branches": [{"StartAt": "Lead?", "States": lead}, {"StartAt": "Ahead?", "States": ahead}],
        "ResultPath": None,
        "Catch": _phase_catch(redos),
        "Next": "Advance",
    }


def _abort_states(abort_key_format: str) -> dict[str, Any]:
    """Abort and Failed. A failed phase leaves its other tasks running (Step Functions cannot stop
    a Lambda invocation), waiting for objects the failed one will never write: the abort marker
    tells them to stop (lambdas/channel.py checks it while waiting), then the window fails with
    the phase's error."""
    return {
        "Abort": {
            "Type": "Task",
            "Resource": "arn:aws:states:::aws-sdk:s3:putObject",
            "Parameters": {"Bucket.$": "$.bucket", "Key.$": f"States.Format('{abort_key_format}', $.job, $.attempt)", "Body": "{}"},
            "TimeoutSeconds": 30,
            "Retry": [{"ErrorEquals": ["States.ALL"], "IntervalSeconds": 1, "MaxAttempts": 2, "JitterStrategy": "FULL"}],
            "Catch": [{"ErrorEquals": ["States.ALL"], "ResultPath": "$.abortFailed", "Next": "Failed"}],
            "ResultPath": None,
            "Next": "Failed",
        },
        "Failed": {"Type": "Fail", "ErrorPath": "$.caught.Error", "CausePath": "$.caught.Cause"},
    }


def _carry(lists: Sequence[str], evals: Sequence[int], saves: Sequence[int], hap: bool = False) -> dict[str, Any]:
    """What a Pass between iterations keeps of the state: everything Init set but ``t``, which
    the Pass sets itself (a Pass's Parameters replace the whole state); ``lists``: the item
    lists' names (``_item_lists``)."""
    carry = {
        "job.$": "$.job",
        "bucket.$": "$.bucket",
        "end.$": "$.end",
        "window_start.$": "$.window_start",
        "first.$": "$.first",
        "attempt.$": "$.attempt",
        "redo.$": "$.redo",
        **{f"{k}.$": f"$.{k}" for k in lists},
    }
    if evals:
        carry.update({"evals.$": "$.evals"})
    if saves:
        carry.update({"saves.$": "$.saves", "sv.$": "$.sv"})
    if hap:  # an overlapped HAP window's position (``_hap_position``)
        carry.update({"lead.$": "$.lead", "ahead.$": "$.ahead"})
    return carry


def _after_iteration_states(maps: _Maps, carry: dict[str, Any], evals: Sequence[int], saves: Sequence[int]) -> dict[str, Any]:
    """Advance (t + 1), then, after the iteration that reaches a listed version, keep a checkpoint
    (a Map of replica 0 of every stage), then evaluate (every worker: a Map per stage); then back
    to the Gate. Both run under the functions' own timeout (a task walks its whole share)."""
    plan = maps.plan
    long_timeout = max(plan.function_timeout_s(s) for s in range(plan.stages))
    chain = [name for name, versions in (("Checkpoint", saves), ("Evaluate", evals)) if versions]
    states: dict[str, Any] = {
        "Advance": {
            "Type": "Pass",
            "Parameters": {**_without_lead(carry), "t.$": "States.MathAdd($.t, 1)", **_hap_advance(plan)},
            "Next": f"{chain[0]}Due" if chain else "Gate",
        }
    }
    for i, name in enumerate(chain):
        nxt = f"{chain[i + 1]}Due" if i + 1 < len(chain) else "Gate"
        states.update(_due_states(name, "$.saves" if name == "Checkpoint" else "$.evals", carry, nxt))
        if name == "Checkpoint":
            sel = {"stage.$": "$$.Map.Item.Value.stage", "replica.$": "$$.Map.Item.Value.replica", "fn.$": "$$.Map.Item.Value.fn"}
            states[name] = worker_map(name, "$.sv", sel, worker_task("checkpoint", None, long_timeout, "replica"), nxt)
        else:
            states[name] = {**maps.per_stage(name, plan.stages, "evaluate", long_timeout), "Next": nxt}
        states[name]["Catch"] = [dict(ABORT_CATCH)]
    return states


def _without_lead(carry: dict[str, Any]) -> dict[str, Any]:
    """``carry`` for a Pass that sets ``lead`` itself (a field and its path may not both be given)."""
    return {k: v for k, v in carry.items() if k != "lead.$"}


def _hap_advance(plan: Plan) -> dict[str, Any]:
    """An overlapped HAP window's position after iteration t (``_hap_position``): the next
    iteration's non-aggregators are done, and the one after it is ahead."""
    return {"lead": False, "ahead.$": "States.MathAdd($.t, 2)"} if hap_overlap(plan) else {}


def _due_states(name: str, versions: str, carry: dict[str, Any], nxt: str) -> dict[str, Any]:
    """{name}Due and {name}Choice: whether version t is listed in ``versions`` (a Pass computes
    States.ArrayContains, a Choice branches on it: ASL has no modulo); if not, on to ``nxt``."""
    return {
        f"{name}Due": {
            "Type": "Pass",
            "Parameters": {**carry, "t.$": "$.t", "due.$": f"States.ArrayContains({versions}, $.t)"},
            "Next": f"{name}Choice",
        },
        f"{name}Choice": {
            "Type": "Choice",
            "Choices": [{"Variable": "$.due", "BooleanEquals": True, "Next": name}],
            "Default": nxt,
        },
    }


def _segmented_window(
    plan: Plan,
    functions: Sequence[str],
    per_worker: bool,
    evals: Sequence[int],
    saves: Sequence[int],
    abort_key_format: str,
    group_arn: str | None,
) -> dict[str, Any]:
    """The window of a plan with segments: each segment's window as a fixed plan's, joined into one
    (planner/emit/segments.py) that runs an iteration on its segment's replicas."""
    check_segments(plan)
    parts = [
        (
            first,
            window_definition(
                plan.plan_at(first), functions, per_worker, evals, saves, abort_key_format=abort_key_format, group_arn=group_arn
            ),
        )
        for first, _ in plan.segments
    ]
    schedule = ", ".join(f"{seg.replicas} from {first}" for first, seg in plan.segments)
    return joined_windows(parts, f"Stagecoach window: {plan.stages} stages, replicas {schedule}")


def _policy_window(
    plan: Plan,
    functions: Sequence[str],
    per_worker: bool,
    evals: Sequence[int],
    saves: Sequence[int],
    abort_key_format: str,
    group_arn: str | None,
) -> dict[str, Any]:
    """The window of a replica policy's plan: each choice's window as a fixed plan's, joined into
    one (planner/emit/segments.py) that runs a window on the segment its gate chose."""
    graphs = [
        (
            d,
            window_definition(
                choice_plan(plan, d), functions, per_worker, evals, saves, abort_key_format=abort_key_format, group_arn=group_arn
            ),
        )
        for d in plan.choices
    ]
    return policy_windows(graphs, f"Stagecoach window: {plan.stages} stages, replicas chosen from {list(plan.choices)} by a policy")


def window_definition(
    plan: Plan,
    functions: Sequence[str],
    per_worker: bool = False,
    evals: Sequence[int] = (),
    saves: Sequence[int] = (),
    *,
    abort_key_format: str,
    group_arn: str | None = None,
) -> dict[str, Any]:
    """The window state machine of ``plan``; ``functions[s]`` is stage s's Lambda function name or
    ARN. ``per_worker`` (plan.per_worker_functions): every replica and sync task of a stage runs on
    a function of its own (plan.worker_function), named in its Map item as Forward's are.
    ``evals``: the versions (iterations done) after which to evaluate on the validation set: an
    Evaluate Map of every (stage, replica) runs after the iteration that reaches one, each on its
    replica's function (lambdas/evaluation.py), decided in the state machine with States.ArrayContains.
    ``saves``: likewise, the versions of which a Checkpoint Map (replica 0 of every stage) keeps
    a loadable state_dict (lambdas/checkpoint.py). ``abort_key_format``: the abort marker's key as
    a States.Format template of (job, attempt), core/keys.py ``WINDOW_ABORT``, which the workers read
    (the planner imports nothing above it, so the caller hands the rule in). ``group_arn``: the
    job's group state machine (``groups.group_definition``), which a phase of more than GROUP_SIZE
    tasks runs its groups on."""
    if len(functions) != plan.stages:
        raise ValueError(f"need one function per stage ({plan.stages}), got {len(functions)}")
    if plan.choices:  # a replica policy: each choice's graph, joined, routed by the gate (planner/emit/segments.py)
        return _policy_window(plan, functions, per_worker, evals, saves, abort_key_format, group_arn)
    if plan.segments:  # dynamic workers: each segment's graph, joined (planner/emit/segments.py)
        return _segmented_window(plan, functions, per_worker, evals, saves, abort_key_format, group_arn)
    s_count, d = plan.stages, plan.replicas
    redos = redo_limit(plan, evals=evals, saves=saves)
    maps = _Maps(plan, functions, per_worker, group_arn)
    fn = _function_of(functions, per_worker)
    carry = _carry(list(_item_lists(plan, fn, per_worker)), evals, saves, hap_overlap(plan))
    states: dict[str, Any] = {"Init": _init_state(plan, fn, per_worker, evals, saves), **_gate_states(plan, functions[0])}
    if s_count > 1:
        states["Forward"] = _forward_state(maps, redos)
    states["BackwardSync"] = _hap_backward_sync(maps, redos) if hap_overlap(plan) else _backward_sync(maps, redos)
    if watchable(plan):
        for name, watch in (("Forward", "forward"), ("BackwardSync", "backward")):
            if name in states:
                states[name] = _watched(name, states[name], watch, functions, per_worker, _watch_timeout_s(plan))
    states.update(_abort_states(abort_key_format))
    states.update(_redo_states(plan, carry, redos))
    states.update(_after_iteration_states(maps, carry, evals, saves))
    states["Done"] = {"Type": "Succeed"}
    return {
        "Comment": f"Stagecoach window: {s_count} stages x {d} replicas, {plan.micro_batches} micro-batches, "
        f"sync {', '.join(sorted(set(plan.sync))) if d > 1 else 'none'}",
        "StartAt": "Init",
        "States": states,
    }


# Events the job state machine adds to its own history (counted on moto's recorded histories by
# tests/test_asl.py): a window that succeeds first time, and each restart of a failed window.
# Next?/Clamp/WindowType? Choices, Bounds/Full-or-Last/Advance Passes, and the .sync:2 Task (6 events);
# an Express window: the startSyncExecution Task and ExpressEnded? (7) instead
EV_JOB_WINDOW = 3 * EV_PASS + 3 * EV_PASS + 6
EV_JOB_EXPRESS_WINDOW = 3 * EV_PASS + 3 * EV_PASS + EV_TASK + EV_PASS
# the Catch path's states, the remediation, the resume point (Task, Progress?, Progressed), the Task again
EV_JOB_RESTART = 4 * EV_PASS + EV_PASS + EV_PASS + 6 + EV_TASK + EV_TASK + 2 * EV_PASS + EV_PASS + 1  # + WindowType?, the Express run's 7th
# A window's restarts in all (however far each attempt got): bounds a job execution's history
WINDOW_RESTARTS = 12
# started, the last Next?, NextLink, ContinueAsNew, Continued, succeeded (the last link: Done instead, fewer)
EV_JOB_FIXED = 1 + EV_PASS + EV_PASS + EV_TASK + EV_PASS + 1


def windows_per_execution(limit: int = HISTORY_LIMIT) -> int:
    """Windows one job execution runs before it continues as a new execution: enough that even if
    every window restarted ``WINDOW_RESTARTS`` times, the execution's history stays within the budget."""
    worst = max(EV_JOB_WINDOW, EV_JOB_EXPRESS_WINDOW) + WINDOW_RESTARTS * EV_JOB_RESTART
    return max(1, (int(limit * HISTORY_BUDGET) - EV_JOB_FIXED) // worst)


def _job_carry() -> dict[str, Any]:
    """What every Pass of the job keeps of its state: the execution's input (JobInput), with
    ``start`` and ``windowsHere`` as they advance (a Pass's Parameters replace the whole state)."""
    return {
        "job.$": "$.job",
        "bucket.$": "$.bucket",
        "windowStateMachineArn.$": "$.windowStateMachineArn",
        "iterations.$": "$.iterations",
        "windowLength.$": "$.windowLength",
        "windowTimeout.$": "$.windowTimeout",
        "windowType.$": "$.windowType",
        "windowsPerExecution.$": "$.windowsPerExecution",
        "functionPrefix.$": "$.functionPrefix",
        "controlFunction.$": "$.controlFunction",
        "link.$": "$.link",
        "start.$": "$.start",
        "windowsHere.$": "$.windowsHere",
    }


def _job_window_loop(carry: dict[str, Any], window: dict[str, Any]) -> dict[str, Any]:
    """Next? .. Advance: the loop over the windows, each [start, min(start + windowLength,
    iterations)), run as a child execution that the job waits for (startExecution.sync:2)."""
    return {
        "Next?": {
            "Type": "Choice",
            "Choices": [
                {"Variable": "$.start", "NumericGreaterThanEqualsPath": "$.iterations", "Next": "Done"},
                {"Variable": "$.windowsHere", "NumericGreaterThanEqualsPath": "$.windowsPerExecution", "Next": "NextLink"},
            ],
            "Default": "Bounds",
        },
        "Bounds": {
            "Type": "Pass",
            "Parameters": {**carry, "end.$": "States.MathAdd($.start, $.windowLength)", "first.$": "$.start", "attempt": 1, "restarts": 0},
            "Next": "Clamp",
        },
        "Clamp": {
            "Type": "Choice",
            "Choices": [{"Variable": "$.end", "NumericGreaterThanPath": "$.iterations", "Next": "LastWindow"}],
            "Default": "FullWindow",
        },
        "LastWindow": {"Type": "Pass", "Parameters": {**window, "end.$": "$.iterations"}, "Next": "WindowType?"},
        "FullWindow": {"Type": "Pass", "Parameters": window, "Next": "WindowType?"},
        **_run_window_states(window),
        "Advance": {
            "Type": "Pass",
            "Parameters": {**carry, "start.$": "$.end", "windowsHere.$": "States.MathAdd($.windowsHere, 1)"},
            "Next": "Next?",
        },
    }


def _window_start_parameters() -> dict[str, Any]:
    """StateMachineArn, Name and Input of a window execution, however it is started."""
    return {
        "StateMachineArn.$": "$.windowStateMachineArn",
        # unique per attempt: a restarted window is a new execution
        "Name.$": "States.Format('w{}-{}', $.start, States.UUID())",
        "Input": {
            "job.$": "$.job",
            "bucket.$": "$.bucket",
            "start.$": "$.start",
            "end.$": "$.end",
            "first.$": "$.first",
            "AWS_STEP_FUNCTIONS_STARTED_BY_EXECUTION_ID.$": "$$.Execution.Id",
        },
    }


def _run_window_states(window: dict[str, Any]) -> dict[str, Any]:
    """WindowType? .. ExpressFailed: run the window as the job's ``windowType`` says. A STANDARD
    window is a child execution the job waits for with startExecution.sync:2; an EXPRESS one runs
    synchronously through the aws-sdk integration startSyncExecution (AWS: "For nested Express
    Workflows, arn:aws:states:::states:startExecution.sync isn't currently supported. Use
    arn:aws:states:::aws-sdk:sfn:startSyncExecution instead", docs/runtime.md), whose call succeeds
    whatever the window's end: its result's Status says (SUCCEEDED, FAILED, TIMED_OUT) and, for a
    failure, its Error and Cause, which ExpressFailed hands to Killed? as a failed Standard
    window's DescribeExecution is. A start that fails (a synchronous Express execution is
    at-most-once: it may be lost) is caught as any other failure: the window restarts."""
    return {
        "WindowType?": {
            "Type": "Choice",
            "Choices": [{"Variable": "$.windowType", "StringEquals": EXPRESS, "Next": "RunExpressWindow"}],
            "Default": "RunWindow",
        },
        "RunWindow": {
            "Type": "Task",
            "Resource": "arn:aws:states:::states:startExecution.sync:2",
            "Parameters": _window_start_parameters(),
            "TimeoutSecondsPath": "$.windowTimeout",
            "Catch": [{"ErrorEquals": ["States.ALL"], "ResultPath": "$.failure", "Next": "HowDidItFail"}],
            "ResultPath": None,
            "Next": "Advance",
        },
        "RunExpressWindow": {
            "Type": "Task",
            "Resource": "arn:aws:states:::aws-sdk:sfn:startSyncExecution",
            "Parameters": _window_start_parameters(),
            "TimeoutSeconds": EXPRESS_TASK_TIMEOUT_S,
            "Catch": [{"ErrorEquals": ["States.ALL"], "ResultPath": "$.failure", "Next": "HowDidItFail"}],
            "ResultPath": "$.run",
            "Next": "ExpressEnded?",
        },
        "ExpressEnded?": {
            "Type": "Choice",
            "Choices": [{"Variable": "$.run.Status", "StringEquals": "SUCCEEDED", "Next": "Advance"}],
            "Default": "ExpressFailed",
        },
        "ExpressFailed": {"Type": "Pass", "Parameters": {**window, "child.$": "$.run"}, "Next": "Killed?"},
    }


def _job_failure_reading(window: dict[str, Any]) -> dict[str, Any]:
    """HowDidItFail .. ReadStage: tell a killed worker (on to the remediation) and a stop (the job
    ends Stopped) from any other failure (restarted as it is). A failed child execution's Cause is
    its DescribeExecution output as JSON, in Step Functions' casing (Error, Cause, ExecutionArn, ...)."""
    return {
        "HowDidItFail": {
            "Type": "Choice",
            "Choices": [{"Variable": "$.failure.Error", "StringEquals": "States.TaskFailed", "Next": "ReadFailure"}],
            "Default": "ResumePoint",
        },
        "ReadFailure": {
            "Type": "Pass",
            "Parameters": {**window, "child.$": "States.StringToJson($.failure.Cause)"},
            "Next": "Killed?",
        },
        "Killed?": {
            "Type": "Choice",
            "Choices": [
                {
                    "And": [
                        {"Variable": "$.child.Error", "IsPresent": True},
                        {"Variable": "$.child.Error", "StringEquals": KILLED_ERROR},
                    ],
                    "Next": "ReadStage",
                },
                # the window stopped at an iteration boundary (a stop request, the cost cap): not
                # a failure to retry; the job ends with the same error, which Run reads as STOPPED
                {
                    "And": [
                        {"Variable": "$.child.Error", "IsPresent": True},
                        {"Variable": "$.child.Error", "StringEquals": STOPPED_ERROR},
                    ],
                    "Next": "Stopped",
                },
            ],
            "Default": "ResumePoint",
        },
        "Stopped": {"Type": "Fail", "Error": STOPPED_ERROR, "CausePath": "$.child.Cause"},
        "ReadStage": {
            "Type": "Pass",
            "Parameters": {**window, "killed.$": "States.StringToJson($.child.Cause)"},
            "Next": "Remediate",
        },
    }


def _remediate_state() -> dict[str, Any]:
    """Remediate: DiSDeL's failure manager, on the stack's control function (not on the killed
    stage's own, which may be the one short of memory): if the kill was for memory, the stage's
    function goes one memory tier up before the window's next attempt."""
    return {
        "Type": "Task",
        "Resource": "arn:aws:states:::lambda:invoke",
        "Parameters": {
            "FunctionName.$": "$.controlFunction",
            "Payload": {
                "phase": "remediate",
                "job.$": "$.job",
                "bucket.$": "$.bucket",
                "function.$": "States.Format('{}{}', $.functionPrefix, $.killed.stage)",
                "stage.$": "$.killed.stage",
                "error.$": "$.killed.error",
                "cause.$": "$.killed.cause",
            },
        },
        "TimeoutSeconds": 120,
        "Retry": [dict(LAMBDA_RETRY)],
        "Catch": [{"ErrorEquals": ["States.ALL"], "ResultPath": "$.remediation", "Next": "WindowFailed"}],
        "ResultPath": None,
        "Next": "ResumePoint",
    }


def _resume_states(window: dict[str, Any]) -> dict[str, Any]:
    """ResumePoint .. Progressed: where the window's next attempt starts (lambdas/resumepoint.py:
    its latest complete version, on the stack's control function); an attempt that got further
    than the one before it resets the count of attempts without progress. If the step itself
    fails, the next attempt starts where the last one did."""
    return {
        "ResumePoint": {
            "Type": "Task",
            "Resource": "arn:aws:states:::lambda:invoke",
            "Parameters": {
                "FunctionName.$": "$.controlFunction",
                "Payload": {"phase": "resume", "job.$": "$.job", "bucket.$": "$.bucket", "start.$": "$.start", "end.$": "$.end"},
            },
            "TimeoutSeconds": 60,
            "Retry": [dict(LAMBDA_RETRY)],
            "ResultSelector": {"first.$": "$.Payload.first"},
            "ResultPath": "$.resumed",
            "Catch": [{"ErrorEquals": ["States.ALL"], "ResultPath": "$.resumeFailed", "Next": "CanRestart"}],
            "Next": "Progress?",
        },
        "Progress?": {
            "Type": "Choice",
            "Choices": [{"Variable": "$.resumed.first", "NumericGreaterThanPath": "$.first", "Next": "Progressed"}],
            "Default": "CanRestart",
        },
        "Progressed": {
            "Type": "Pass",
            "Parameters": {
                **{k: v for k, v in window.items() if k not in ("first.$", "attempt.$")},
                "first.$": "$.resumed.first",
                "attempt": 0,
            },
            "Next": "CanRestart",
        },
    }


def _job_restart(window: dict[str, Any], window_attempts: int, backoff_s: int) -> dict[str, Any]:
    """CanRestart .. WindowFailed: run the window again after ``backoff_s``, until
    ``window_attempts`` attempts in a row got no further (``attempt``) or the window restarted
    ``WINDOW_RESTARTS`` times in all (``restarts``, which bounds the job execution's history), then
    fail the job."""
    return {
        "CanRestart": {
            "Type": "Choice",
            "Choices": [
                {
                    "And": [
                        {"Variable": "$.attempt", "NumericLessThan": window_attempts},
                        {"Variable": "$.restarts", "NumericLessThan": WINDOW_RESTARTS},
                    ],
                    "Next": "Backoff",
                }
            ],
            "Default": "WindowFailed",
        },
        "Backoff": {"Type": "Wait", "Seconds": backoff_s, "Next": "NextAttempt"},
        "NextAttempt": {
            "Type": "Pass",
            "Parameters": {**window, "attempt.$": "States.MathAdd($.attempt, 1)", "restarts.$": "States.MathAdd($.restarts, 1)"},
            "Next": "WindowType?",
        },
        "WindowFailed": {
            "Type": "Fail",
            "Error": "Stagecoach.WindowFailed",
            "Cause": "a window failed on every attempt; its last error is in the job's history",
        },
    }


def _job_continuation(carry: dict[str, Any]) -> dict[str, Any]:
    """NextLink .. Continued: continue as a new execution, with the same input from the next
    window, named {job}-c{link}, and end this one."""
    return {
        "NextLink": {
            "Type": "Pass",
            "Parameters": {
                **{k: v for k, v in carry.items() if k != "windowsHere.$"},
                "link.$": "States.MathAdd($.link, 1)",
                "windowsHere": 0,
            },
            "Next": "ContinueAsNew",
        },
        "ContinueAsNew": {
            "Type": "Task",
            "Resource": "arn:aws:states:::states:startExecution",
            "Parameters": {
                "StateMachineArn.$": "$$.StateMachine.Id",
                "Name.$": "States.Format('{}-c{}', $.job, $.link)",
                "Input": carry,
            },
            "TimeoutSeconds": 60,
            "Retry": [
                {"ErrorEquals": ["States.ALL"], "IntervalSeconds": 2, "MaxAttempts": 5, "BackoffRate": 2.0, "JitterStrategy": "FULL"}
            ],
            "ResultSelector": {"continuedAs.$": "$.ExecutionArn"},
            "ResultPath": "$.next",
            "Next": "Continued",
        },
        "Continued": {"Type": "Pass", "Parameters": {"continuedAs.$": "$.next.continuedAs"}, "End": True},
    }


def job_definition(window_attempts: int = 4, backoff_s: int = 2) -> dict[str, Any]:
    """The job state machine: run the job's windows one after the other with startExecution.sync:2,
    restarting a failed window, and continue as a new execution before its own history fills.

    The windows are computed by the state machine itself from (start, iterations, windowLength),
    so the execution's input has the same small size for any number of iterations (JobInput), and
    after ``windowsPerExecution`` windows the execution starts its successor (named
    ``{job}-c{link}``) with the next start and ends; ``Run`` follows the chain. A restarted window
    starts from its latest complete version (the ResumePoint step, lambdas/resumepoint.py; at worst
    its first, which the workers keep until the window has finished); its tasks are idempotent, so
    what a failed attempt left behind is rewritten with the same bytes. The restart is an explicit Catch -> Choice -> Wait
    loop rather than a Retry, so every attempt is a visible state in the job's history (and a place
    where the remediation step acts before the next attempt).
    """
    carry = _job_carry()
    window = {**carry, "end.$": "$.end", "first.$": "$.first", "attempt.$": "$.attempt", "restarts.$": "$.restarts"}
    return {
        "Comment": "Stagecoach job: runs the job's windows one after the other, continuing as a new execution",
        "StartAt": "Next?",
        "States": {
            **_job_window_loop(carry, window),
            **_job_failure_reading(window),
            "Remediate": _remediate_state(),
            **_resume_states(window),
            **_job_restart(window, window_attempts, backoff_s),
            **_job_continuation(carry),
            "Done": {"Type": "Pass", "Parameters": {"done.$": "$.start"}, "End": True},
        },
    }
