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

import math
from typing import Any

from stagecoach.planner.emit.tasks import KILL_RETRIES, LAMBDA_RETRY, WAIT_RETRY, worker_map, worker_task
from stagecoach.planner.limits import GROUP_SIZE, INLINE_MAP_MAX_CONCURRENCY, LAMBDA_MAX_TIMEOUT_S, map_groups

# Errors of starting a child execution, which the group Task retries with backoff as Lambda's
# service errors (StartExecution is a token bucket: 300 per second refill in the large Regions,
# ../shared/facts.md). The optimized integration names a refused StartExecution
# "StepFunctions.<error code>Exception": a run on AWS recorded StateMachineDoesNotExist as
# "StepFunctions.StateMachineDoesNotExistException" (localstack/localstack,
# tests/aws/services/stepfunctions/v2/error_handling/test_task_service_sfn.snapshot.json, marked
# aws.validated; moto names them so too). Hence:
# - too many open executions (ExecutionLimitExceeded): "StepFunctions.ExecutionLimitExceededException",
#   and "StepFunctions.ExecutionLimitExceeded", the name the Step Functions guide retries
#   (https://docs.aws.amazon.com/step-functions/latest/dg/concepts-nested-workflows.html);
# - throttling, and any other error of the service: ThrottlingException is one of the API's common
#   errors, not an error of StartExecution's own (Step Functions API Reference, StartExecution, and
#   https://docs.aws.amazon.com/step-functions/latest/apireference/CommonErrors.html),
#   so it has no exception of its own in the SDK Step Functions calls with (the Cause's "(Service:
#   AWSStepFunctions; Status Code: ...; Error Code: ...; Request ID: ...; Proxy: null)" is the AWS
#   SDK for Java's message) and arrives as its base exception, "StepFunctions.AWSStepFunctionsException"
#   (as Lambda.AWSLambdaException does in the guide's "Handle transient Lambda service exceptions";
#   AWS's own solution retries startExecution.sync:2 on it: aws-solutions/
#   data-transfer-from-amazon-s3-glacier-vaults-to-amazon-s3, source/solution/infrastructure/workflows/
#   orchestrator.py). No "StepFunctions.ThrottlingException": no AWS source names one;
# - the call failing on its way (the SDK's client side): "StepFunctions.SdkClientException" (as
#   Lambda.SdkClientException).
# A child that ran and failed is States.TaskFailed (the Catch below), never retried: its tasks had
# their own retries.
GROUP_START_RETRY = {
    "ErrorEquals": [
        "StepFunctions.ExecutionLimitExceeded",
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


def _retry_bound(retry: dict[str, Any]) -> tuple[int, float]:
    """A Retrier's attempts after the first, and the longest it waits in all between them (FULL
    jitter only shortens the waits)."""
    attempts, interval, rate = int(retry["MaxAttempts"]), float(retry["IntervalSeconds"]), float(retry["BackoffRate"])
    cap = float(retry.get("MaxDelaySeconds", float("inf")))
    return attempts, sum(min(cap, interval * rate**k) for k in range(attempts))


# Slack per attempt of a group's task beyond its function's timeout: the invoke call, an Init phase
# (limited to 10 s; one retried on the invocation counts within the function's timeout: Lambda
# Developer Guide, https://docs.aws.amazon.com/lambda/latest/dg/lambda-runtime-environment.html)
# and Step Functions' scheduling of the attempt.
_ATTEMPT_SLACK_S = 60


# The longest a group's child can run: its tasks run at once, and each ends within its kill loop's
# 1 + KILL_RETRIES runs of its Task, each of at most 1 + WAIT_RETRY's + LAMBDA_RETRY's MaxAttempts
# attempts (planner/emit/tasks.py), each cut at its function's timeout, at most Lambda's 900 s
# whatever the Task's learnt TimeoutSecondsPath says, plus the Retriers' waits. The group Task
# takes this as its TimeoutSeconds, a constant: from the learnt timeout it would need products,
# which intrinsics lack, or one more state per group, which the history and cost models would have
# to count; and this bound holds whatever is learnt. A group thus never times out while its child
# can still end on its own, and the window sees its tasks' own errors (Stagecoach.WorkerKilled with
# its stage, ObjectLost) as without groups, where the inline Map has no timeout at all; the
# window's own timeout (the job's RunWindow, TimeoutSecondsPath) remains what bounds a window.
# TimeoutSeconds must be a positive integer and defaults to 99,999,999 (Step Functions Developer
# Guide, Task state: awsdocs/aws-step-functions-developer-guide,
# doc_source/amazon-states-language-task-state.md).
def _child_worst_case_s() -> int:
    """The bound above, in whole seconds."""
    (waits, wait_s), (services, service_s) = _retry_bound(WAIT_RETRY), _retry_bound(LAMBDA_RETRY)
    per_run = (1 + waits + services) * (LAMBDA_MAX_TIMEOUT_S + _ATTEMPT_SLACK_S) + math.ceil(wait_s + service_s)
    return (1 + KILL_RETRIES) * per_run


GROUP_TIMEOUT_S = _child_worst_case_s()
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
        # the child's tasks have their own timeouts and end it: this only outlasts their worst case
        "TimeoutSeconds": GROUP_TIMEOUT_S,
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
    """GroupFailed, GroupRethrow?, GroupRethrow, GroupLost: fail with the child's own error.

    A Fail state's ErrorPath and CausePath must each select a string, or be an intrinsic that
    returns one, among them States.JsonToString (Step Functions Developer Guide, "Fail workflow
    state", https://docs.aws.amazon.com/step-functions/latest/dg/state-fail.html). The guide does
    not say what an ErrorPath naming a ``States.*`` error does, and the States Language reserves
    them: "States MAY report errors with other names, which MUST NOT begin with the prefix
    'States.'" (https://states-language.net/spec.html, "Error representation"); moto fails such a
    Fail state's execution with States.Runtime. So only a child's own error of another name is
    rethrown; a ``States.*`` one (States.Runtime, States.Timeout, ...) or none at all (a child
    stopped, or timed out) ends as ``GROUP_LOST_ERROR``, the whole DescribeExecution in its Cause. The Choice tests IsPresent first: an And's later rules are not
    evaluated on a field that is absent (Developer Guide, "Choice workflow state",
    https://docs.aws.amazon.com/step-functions/latest/dg/state-choice.html)."""
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
                    # a Fail state's error must not be one of the States.* names ASL reserves (above)
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
    {0, r}, less one).

    It goes in a Task's Parameters (FunctionName.$), where intrinsics are allowed, nested up to 10
    in a field (this is 7); States.Array takes any values, States.Format's ``{}`` takes a string or
    a number ($.replica, an integer of the child's States.ArrayRange), States.ArrayUnique and
    States.ArrayLength an array, States.MathAdd integers, States.ArrayGetItem an array and an
    index (Step Functions Developer Guide, "Intrinsic functions for JSONPath states",
    https://docs.aws.amazon.com/step-functions/latest/dg/intrinsic-functions.html; moto evaluates
    it alike: tests/test_groups.py)."""
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
