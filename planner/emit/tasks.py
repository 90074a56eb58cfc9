"""The Lambda tasks of a phase as ASL: one worker's Task, the inline Map that runs a phase's tasks
with its kill loop, and the Retry policies they share (the window's Maps and the groups' child
executions use the same builders, so a task retries alike wherever it runs)."""

from __future__ import annotations

from typing import Any

LAMBDA_RETRY = {
    "ErrorEquals": [
        "Lambda.ServiceException",
        "Lambda.AWSLambdaException",
        "Lambda.SdkClientException",
        "Lambda.TooManyRequestsException",
        "Lambda.ClientExecutionTimeoutException",
    ],
    "IntervalSeconds": 1,
    "MaxAttempts": 4,
    "BackoffRate": 2.0,
    "MaxDelaySeconds": 30,
    "JitterStrategy": "FULL",
}

# A worker that hung: the task is idempotent (same input, same bytes, same keys), so running it
# again is safe.
WORKER_RETRY = {
    "ErrorEquals": ["Sandbox.Timedout", "States.Timeout"],
    "IntervalSeconds": 1,
    "MaxAttempts": 3,
    "BackoffRate": 2.0,
    "MaxDelaySeconds": 10,
    "JitterStrategy": "FULL",
}

# A consumer that waited in vain until just before its Task's (learnt) timeout: usually its producer
# hung or was killed and is being run again, so waiting once more is what helps; a lost object is
# told apart (ObjectLost, lambdas/channel.py) and fails the window at once. A training task under a
# learnt timeout now waits once more at once, through its Map's re-run loop (``WAIT_AGAIN_AT_ONCE``):
# its producer's lateness is no load to back off from. No Task takes this Retry any more;
# planner/emit/groups.py's bound on a group's child still counts its attempts (a bound above the loop's).
WAIT_RETRY = {
    "ErrorEquals": ["ObjectWaitTimeout"],
    "IntervalSeconds": 1,
    "MaxAttempts": 2,
    "BackoffRate": 2.0,
    "JitterStrategy": "FULL",
}

# Errors under which AWS reports a worker killed for memory, and also other deaths: an
# out-of-memory kill has reached Step Functions as Runtime.OutOfMemory, as Runtime.ExitError
# ("signal: killed") and as Lambda.Unknown (which also covers timeouts). Only the remediation step
# can tell them apart (lambdas/remediate.py classify), so they are caught, not retried blindly...
KILLED_ERRORS = ["Runtime.OutOfMemory", "Runtime.ExitError", "Lambda.Unknown"]
# ...except the two ambiguous names, retried first: a crash is usually transient (the task is
# idempotent), while an out-of-memory kill reported under them fails each retry at the same point
# and is caught after the last (the price of AWS not naming it; docs/reliability.md). The gate
# retries them with backoff; a training task runs again at once (``KILL_RETRIES``, below).
AMBIGUOUS_KILLS = ["Runtime.ExitError", "Lambda.Unknown"]
KILLED_RETRY = {
    "ErrorEquals": AMBIGUOUS_KILLS,
    "IntervalSeconds": 1,
    "MaxAttempts": 5,
    "BackoffRate": 2.0,
    "MaxDelaySeconds": 8,
    "JitterStrategy": "FULL",
}

KILLED_ERROR = "Stagecoach.WorkerKilled"
# A killed training task runs again at once, up to this many times: its Catch loops back through a
# Choice and a Pass that counts (``worker_map``), where a Retry would first wait (IntervalSeconds is at
# least 1 s; with FULL jitter 0.5 s on average, then 1 s, 2 s...). A kill is no sign of load to
# back off from (throttling and service errors keep their backoff), and the new invocation's cold
# start is the wait. Five: a task killed at random with probability p fails for good with p^6
# (30%: 0.07%, where 3 retries left 0.8%: a window restart every ~8 iterations of the demo).
KILL_RETRIES = 5
# ...and so does a training task that timed out: a hung invocation is no load to back off from
# either, and a Retry's least wait (0.5 s on average) would add to every hang's timeout; and so
# does a consumer that waited in vain for a late producer (``ObjectWaitTimeout``, at the learnt
# timeout's end: a producer killed twice, or hung, is late by about that much), which waits again
# in the container it ran in (an error reply leaves it warm)
RERUN_AT_ONCE = [*AMBIGUOUS_KILLS, "States.Timeout", "Sandbox.Timedout"]
WAIT_AGAIN_AT_ONCE = ["ObjectWaitTimeout"]


def worker_task(
    phase: str | None, function: str | None, timeout: int | None, index_field: str, function_path: str = "$.fn"
) -> dict[str, Any]:
    """A worker's Task. ``timeout`` None: the iteration gate's learnt timeout, which the Map item
    carries (``timeout``, lambdas/timeouts.py) and the payload hands on so the worker's waits end
    just before it. ``phase`` None: the item names it (a group's child execution runs any phase).
    ``function`` None: the item's function, at ``function_path`` (a path, or an intrinsic of it)."""
    payload: dict[str, Any] = {
        **({"phase": phase} if phase is not None else {"phase.$": "$.phase"}),
        "job.$": "$.job",
        "bucket.$": "$.bucket",
        "t.$": "$.t",
        "window_start.$": "$.window_start",
        "attempt.$": "$.attempt",
        "stage.$": "$.stage",
        f"{index_field}.$": f"$.{index_field}",
    }
    params: dict[str, Any] = {"Payload": payload}
    if function is None:
        params["FunctionName.$"] = function_path
    else:
        params["FunctionName"] = function
    limit: dict[str, Any] = {"TimeoutSeconds": timeout}
    # a kill, a timeout, and under a learnt timeout a wait in vain: run again at once (``worker_map``'s loop)
    retry = [dict(LAMBDA_RETRY)]
    if timeout is None:
        payload["timeout.$"] = "$.timeout"
        limit = {"TimeoutSecondsPath": "$.timeout"}
    return {
        "Type": "Task",
        "Resource": "arn:aws:states:::lambda:invoke",
        "Parameters": params,
        **limit,
        "Retry": retry,
        "ResultPath": None,
        "End": True,
    }


def worker_map(
    name: str, items_path: str, selector: dict[str, Any], task: dict[str, Any], nxt: str | None, cold_path: str = "$.gate.timeouts.cold"
) -> dict[str, Any]:
    """A Map running a phase's tasks at once, each with its kill loop: a killed or timed-out task
    runs again at once (``KILL_RETRIES``), then fails the Map as ``KILLED_ERROR`` naming its stage.
    ``cold_path``: where the gate's extra time for a cold re-run is (lambdas/timeouts.py)."""
    item = {
        "job.$": "$.job",
        "bucket.$": "$.bucket",
        "t.$": "$.t",
        "window_start.$": "$.window_start",
        "attempt.$": "$.attempt",
        **selector,
    }
    # what the kill loop's Pass carries of an item's state (a Pass's Parameters replace it all)
    carried: dict[str, Any] = {(k if k.endswith(".$") else k + ".$"): "$." + k.removesuffix(".$") for k in item}
    if "timeout.$" in item:  # the gate's learnt timeout: a re-run, likely cold, gets ``cold`` more
        item["cold.$"] = cold_path
        # once: each re-run starts one cold container, not a colder one each time; adding ``cold``
        # at every pass let a task killed three times and then hung hold its Map for 10 s, not 4
        carried.pop("cold.$", None)
        carried.update({"cold": 0, "timeout.$": "States.MathAdd($.timeout, $.cold)"})
    state: dict[str, Any] = {
        "Type": "Map",
        "ItemsPath": items_path,
        "ItemSelector": {**item, "kills": 0},
        "MaxConcurrency": 0,  # every worker of a phase runs at once (they wait on each other)
        "ItemProcessor": {"ProcessorConfig": {"Mode": "INLINE"}, "StartAt": f"{name}Task", "States": _kill_loop(name, task, carried)},
        "ResultPath": None,
    }
    if nxt is None:
        state["End"] = True
    else:
        state["Next"] = nxt
    return state


def _rerun_errors(task: dict[str, Any]) -> list[str]:
    """What a task's loop runs again at once: kills and timeouts, and under a learnt timeout
    (``TimeoutSecondsPath``, which the worker's waits end just before) a wait in vain."""
    return [*RERUN_AT_ONCE, *(WAIT_AGAIN_AT_ONCE if "TimeoutSecondsPath" in task else [])]


def _kill_loop(name: str, task: dict[str, Any], carried: dict[str, Any]) -> dict[str, Any]:
    """A Map item's states: the task, and its kill loop (``carried``: what the loop's Pass keeps)."""
    return {
        f"{name}Task": {
            **task,
            "Catch": [
                {"ErrorEquals": _rerun_errors(task), "ResultPath": "$.caught", "Next": f"{name}Again?"},
                {"ErrorEquals": [e for e in KILLED_ERRORS if e not in AMBIGUOUS_KILLS], "ResultPath": "$.caught", "Next": f"{name}Killed"},
            ],
        },
        # a killed or timed-out task runs again at once (KILL_RETRIES), then counts as killed (the
        # remediation tells a timeout from a kill for memory by its name)
        f"{name}Again?": {
            "Type": "Choice",
            "Choices": [{"Variable": "$.kills", "NumericLessThan": KILL_RETRIES, "Next": f"{name}Again"}],
            "Default": f"{name}Killed",
        },
        f"{name}Again": {"Type": "Pass", "Parameters": {**carried, "kills.$": "States.MathAdd($.kills, 1)"}, "Next": f"{name}Task"},
        # name the stage in the failure, so the job state machine's remediation knows whose memory
        # to raise if the kill was for memory
        f"{name}Killed": {
            "Type": "Pass",
            "Parameters": {"stage.$": "$.stage", "error.$": "$.caught.Error", "cause.$": "$.caught.Cause"},
            "Next": f"{name}Failed",
        },
        f"{name}Failed": {"Type": "Fail", "Error": KILLED_ERROR, "CausePath": "States.JsonToString($)"},
    }
