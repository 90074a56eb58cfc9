"""Phases past 40 workers: a Map of more tasks than an inline Map runs at once runs them in groups.

AWS runs at most 40 iterations of an inline Map at once (planner/limits.py), and every worker of a
phase must run at once (they wait on each other's objects). So a phase Map of more than
``GROUP_SIZE`` tasks becomes a Map over groups of at most ``GROUP_SIZE``: each group is a child
execution of the job's group state machine (``group_definition``), started and awaited with
``states:startExecution.sync:2``, whose own inline Map runs the group's tasks with the window's
Retry and kill loop (planner/emit/tasks.py). AWS's sample for thousands of parallel tasks does the
same (aws-samples/aws-stepfunctions-examples, sam/app-decompose-for-parallelism).

What keeps the states small: the window holds only the groups' bounds (at most
``INLINE_MAP_MAX_CONCURRENCY`` of them per Map, constants of the definition), and the child
generates its tasks' indices with ``States.ArrayRange`` and, with one function per worker, their
functions' names with ``States.Format``; the tasks' outputs are discarded, so no state's input or
output grows with the number of workers.

A failed group reaches its parent as ``States.TaskFailed`` whose Cause is the child's
DescribeExecution JSON (Step Functions' casing: ``Error``, ``Cause``): ``GroupFailed`` reads it and
fails the group's Map iteration with the worker's own error and cause, so the window's Catch
(``Redo?`` on a lost object, the abort otherwise) and the job's remediation see what they see
without groups.
"""

from __future__ import annotations

from typing import Any

from stagecoach.planner.emit.tasks import worker_map, worker_task
from stagecoach.planner.limits import GROUP_SIZE, INLINE_MAP_MAX_CONCURRENCY, map_groups

# Errors of starting a child execution (the optimized integration names a service error
# "StepFunctions.<exception>"): StartExecution is throttled by a token bucket (300 per second
# refill in the large Regions: ../shared/facts.md), so back off as for Lambda's service errors.
GROUP_START_RETRY = {
    "ErrorEquals": [
        "StepFunctions.ThrottlingException",
        "StepFunctions.ExecutionLimitExceededException",
        "StepFunctions.AWSStepFunctionsException",
        "StepFunctions.SdkClientException",
    ],
    "IntervalSeconds": 1,
    "MaxAttempts": 4,
    "BackoffRate": 2.0,
    "MaxDelaySeconds": 30,
    "JitterStrategy": "FULL",
}
# The error a group whose child failed without an error of its own (it timed out or was stopped)
# or with one of the States.* errors a Fail state may not raise ends with: the window fails and
# restarts, as after any other failure.
GROUP_LOST_ERROR = "Stagecoach.GroupLost"
# A group's fields, which the window hands its child (the child's tasks need no more).
_GROUP_FIELDS = ("job", "bucket", "t", "window_start", "attempt", "timeout", "cold")


def group_bounds(tasks: int) -> list[dict[str, int]]:
    """The groups of a Map of ``tasks``: their first and last index, at most GROUP_SIZE apart."""
    n = map_groups(tasks)
    if n > INLINE_MAP_MAX_CONCURRENCY:
        raise ValueError(f"{tasks} tasks need {n} groups of {GROUP_SIZE}, more than a Map runs at once ({INLINE_MAP_MAX_CONCURRENCY})")
    return [{"first": g * GROUP_SIZE, "last": min(tasks, (g + 1) * GROUP_SIZE) - 1} for g in range(n)]


def grouped_map(
    name: str, stage: int, phase: str, function: str, items_path: str, timeout: str | int, nxt: str | None, group_arn: str
) -> dict[str, Any]:
    """A phase's Map over groups (``items_path`` holds ``group_bounds``): each item starts the
    group's child execution and waits for it. ``timeout``: the tasks' TimeoutSeconds, the path of
    the gate's learnt one or a fixed number. ``function``: the stage's function."""
    selector: dict[str, Any] = {
        "job.$": "$.job",
        "bucket.$": "$.bucket",
        "t.$": "$.t",
        "window_start.$": "$.window_start",
        "attempt.$": "$.attempt",
        # the gate's learnt timeout and a cold re-run's extra (training phases), or a fixed
        # timeout (evaluation, after the iteration: its state carries no gate output)
        **({"timeout.$": timeout, "cold.$": "$.gate.timeouts.cold"} if isinstance(timeout, str) else {"timeout": timeout, "cold": 0}),
        "first.$": "$$.Map.Item.Value.first",
        "last.$": "$$.Map.Item.Value.last",
    }
    child_input: dict[str, Any] = {f"{k}.$": f"$.{k}" for k in (*_GROUP_FIELDS, "first", "last")}
    child_input.update({"stage": stage, "phase": phase, "fn": function, "AWS_STEP_FUNCTIONS_STARTED_BY_EXECUTION_ID.$": "$$.Execution.Id"})
    start = {
        "Type": "Task",
        "Resource": "arn:aws:states:::states:startExecution.sync:2",
        "Parameters": {"StateMachineArn": group_arn, "Input": child_input},
        # the child's tasks have their own timeouts; a group ends when they do
        "TimeoutSeconds": 900 * 4,
        "Retry": [dict(GROUP_START_RETRY)],
        "Catch": [{"ErrorEquals": ["States.TaskFailed"], "ResultPath": "$.caught", "Next": f"{name}GroupFailed"}],
        "ResultPath": None,
        "End": True,
    }
    state: dict[str, Any] = {
        "Type": "Map",
        "ItemsPath": items_path,
        "ItemSelector": selector,
        "MaxConcurrency": 0,
        "ItemProcessor": {
            "ProcessorConfig": {"Mode": "INLINE"},
            "StartAt": f"{name}Group",
            "States": {f"{name}Group": start, **_rethrow_states(name)},
        },
        "ResultPath": None,
    }
    state.update({"End": True} if nxt is None else {"Next": nxt})
    return state


def _rethrow_states(name: str) -> dict[str, Any]:
    """GroupFailed, GroupRethrow?, GroupRethrow, GroupLost: fail with the child's own error."""
    return {
        f"{name}GroupFailed": {
            "Type": "Pass",
            "Parameters": {"child.$": "States.StringToJson($.caught.Cause)"},
            "Next": f"{name}GroupRethrow?",
        },
        f"{name}GroupRethrow?": {
            "Type": "Choice",
            "Choices": [
                {
                    # a Fail state's error must not be one of the States.* names ASL reserves
                    "And": [
                        {"Variable": "$.child.Error", "IsPresent": True},
                        {"Variable": "$.child.Cause", "IsPresent": True},
                        {"Not": {"Variable": "$.child.Error", "StringMatches": "States.*"}},
                    ],
                    "Next": f"{name}GroupRethrow",
                }
            ],
            "Default": f"{name}GroupLost",
        },
        f"{name}GroupRethrow": {"Type": "Fail", "ErrorPath": "$.child.Error", "CausePath": "$.child.Cause"},
        f"{name}GroupLost": {"Type": "Fail", "Error": GROUP_LOST_ERROR, "CausePath": "States.JsonToString($.child)"},
    }


def _replica_function(per_worker: bool) -> str:
    """A replica's function: the stage's, or with one per worker plan.worker_function's rule —
    the stage's own for replica 0, "{stage}-r{r}" for the others — as an intrinsic: the index of
    the right one of the two names is 0 for replica 0 and 1 otherwise (the length of the set
    {0, r}, less one)."""
    if not per_worker:
        return "$.fn"
    named = "States.Array($.fn, States.Format('{}-r{}', $.fn, $.replica))"
    return f"States.ArrayGetItem({named}, States.MathAdd(States.ArrayLength(States.ArrayUnique(States.Array(0, $.replica))), -1))"


def _shard_function(per_worker: bool) -> str:
    """A sync task's function: the stage's, or "{stage}-k{k}" (plan.worker_function)."""
    return "States.Format('{}-k{}', $.fn, $.shard)" if per_worker else "$.fn"


def group_definition(per_worker: bool) -> dict[str, Any]:
    """The job's group state machine: run one group's tasks of one phase at once (the phase and
    the stage's function come with the input), each with the window's Retry and kill loop."""
    common = {"stage.$": "$.stage", "phase.$": "$.phase", "fn.$": "$.fn", "timeout.$": "$.timeout"}

    def tasks(index: str, fn: str) -> dict[str, Any]:  # state names are unique in a whole definition
        task = worker_task(None, None, None, index, function_path=fn)
        return worker_map(index.capitalize(), "$.items", {**common, f"{index}.$": "$$.Map.Item.Value"}, task, None, cold_path="$.cold")

    return {
        "Comment": "Stagecoach group: one group of at most 40 of a phase's tasks, a child execution of the window",
        "StartAt": "Items",
        "States": {
            "Items": {
                "Type": "Pass",
                "Parameters": {
                    **{f"{k}.$": f"$.{k}" for k in (*_GROUP_FIELDS, "stage", "phase", "fn")},
                    "items.$": "States.ArrayRange($.first, $.last, 1)",
                },
                "Next": "Kind?",
            },
            "Kind?": {
                "Type": "Choice",
                "Choices": [{"Variable": "$.phase", "StringEquals": "sync", "Next": "Shards"}],
                "Default": "Replicas",
            },
            "Replicas": tasks("replica", _replica_function(per_worker)),
            "Shards": tasks("shard", _shard_function(per_worker)),
        },
    }
