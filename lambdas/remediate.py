"""The remediation step of the job state machine (DiSDeL's failure manager): out of memory -> one tier up.

Invoked on the stack's control function after a window failed because a stage's worker was killed.
AWS does not say reliably whether the kill was for memory: it has been reported as
``Runtime.OutOfMemory``, as ``Runtime.ExitError`` ("signal: killed") and as ``Lambda.Unknown``,
which also covers timeouts. :func:`classify` decides from the name, the message, and evidence the
stage left behind (a container whose memory came near its limit writes ``keys.memory_pressure``).
An out-of-memory kill raises the stage's function by one memory tier, recorded in the job's history
(``jobs/{job}/remediations/``) and for the job's next run (``history/{name}/memory.json``); any
other kill changes nothing. Either way the job state machine then restarts the window.

Reads only the job's spec, never its code: the control function runs no user code.
"""

from __future__ import annotations

import time
from typing import Any, Literal

import boto3

from stagecoach.core import keys
from stagecoach.core.events import RemediateEvent
from stagecoach.core.records import JobSpec, LearntMemory, MemoryPressure, Remediation, plan_shape
from stagecoach.errors import StagecoachError
from stagecoach.lambdas.channel import Channel
from stagecoach.planner.limits import LAMBDA_MAX_MB
from stagecoach.planner.plan import next_memory_tier, per_worker_functions, stage_functions

Kind = Literal["out_of_memory", "timeout", "crash"]

TIMEOUT_MESSAGE = "Task timed out after"
# A container past this share of its memory writes the pressure evidence (lambdas/handler.py).
PRESSURE_SHARE = 0.85


class MemoryExhausted(StagecoachError):
    """The stage already has Lambda's maximum memory: only a different plan can help."""


def classify(error: str, cause: str, memory_pressure: bool) -> Kind:
    """What killed a worker. A timeout is never taken for out-of-memory (its message says so in
    every shape AWS uses); Runtime.OutOfMemory always is; the ambiguous names count as
    out-of-memory only with evidence of memory pressure in that stage."""
    if error in ("Sandbox.Timedout", "States.Timeout") or TIMEOUT_MESSAGE in cause:
        return "timeout"
    if error == "Runtime.OutOfMemory":
        return "out_of_memory"
    if error in ("Runtime.ExitError", "Lambda.Unknown") and memory_pressure:
        return "out_of_memory"
    return "crash"


def remediate(ev: RemediateEvent, ch: Channel) -> dict[str, Any]:
    pressure = ch.get_bytes(keys.memory_pressure(ev.job, ev.stage))
    kind = classify(ev.error, ev.cause, pressure is not None)
    raised: dict[str, int] = {}
    if kind == "out_of_memory":
        raised = _raise_memory(ev, ch)
        _learn(ch, ev, raised["to_mb"])
        ch.delete([keys.memory_pressure(ev.job, ev.stage)])  # the new tier starts without pressure
    record = Remediation(
        time=time.time(),
        stage=ev.stage,
        function=ev.function,
        kind=kind,
        error=ev.error,
        cause=ev.cause[:500],
        evidence=MemoryPressure.model_validate_json(pressure) if pressure is not None else None,
        **raised,
    )
    ch.put_bytes(keys.remediation(ev.job, int(record.time * 1000), ev.stage), record.model_dump_json().encode())
    return record.model_dump()


def _raise_memory(ev: RemediateEvent, ch: Channel) -> dict[str, int]:
    lam = boto3.client("lambda")
    current = lam.get_function_configuration(FunctionName=ev.function)["MemorySize"]
    new = next_memory_tier(current)
    if new is None:
        raise MemoryExhausted(
            f"stage {ev.stage} ran out of memory at Lambda's maximum ({LAMBDA_MAX_MB} MB): "
            "use more stages (fewer layers per stage) or smaller micro-batches"
        )
    for name in _stage_functions(ev, ch):  # with a function per worker, every one of the stage's
        lam.update_function_configuration(FunctionName=name, MemorySize=new)
        # the waiter polls lambda:GetFunction until LastUpdateStatus is Successful
        lam.get_waiter("function_updated_v2").wait(FunctionName=name, WaiterConfig={"Delay": 1, "MaxAttempts": 60})
    return {"from_mb": current, "to_mb": new}


def _stage_functions(ev: RemediateEvent, ch: Channel) -> list[str]:
    """The functions the stage's tasks run on: ``ev.function`` (the stage's), and with warm state
    at d > 1 its replicas' and sync tasks' (planner/plan.py worker_function), from the job's spec."""
    spec = _spec(ch, ev)
    plan = spec.to_plan()
    return stage_functions(plan, ev.stage, ev.function, per_worker_functions(plan, spec.warm_state))


def _spec(ch: Channel, ev: RemediateEvent) -> JobSpec:
    body = ch.get_bytes(keys.job_spec(ev.job))
    if body is None:
        raise FileNotFoundError(f"job {ev.job!r} has no spec in s3://{ch.bucket}/{keys.job_spec(ev.job)}")
    return JobSpec.model_validate_json(body)


def _learn(ch: Channel, ev: RemediateEvent, new_mb: int) -> None:
    spec = _spec(ch, ev)
    plan = spec.to_plan()
    key = keys.learnt_memory(spec.name)
    old = ch.get_bytes(key)
    memory = LearntMemory.model_validate_json(old) if old else None
    learnt = dict(memory.memory_mb) if memory is not None and memory.fits(plan) else {}
    learnt[str(ev.stage)] = max(new_mb, learnt.get(str(ev.stage), 0))
    ch.put_bytes(key, LearntMemory(shape=plan_shape(plan), memory_mb=learnt).model_dump_json().encode())
