"""The remediation step of the job state machine (DiSDeL's failure manager): out of memory -> one tier up.

Invoked after a window failed because a stage ran out of memory: raise that stage's function by one
memory tier, record it in the job's history (``jobs/{job}/remediations/``) and for the job's next
run (``history/{name}/memory.json``), then the job state machine restarts the window.
"""

from __future__ import annotations

import json
import time
from typing import Any

import boto3

from stagecoach.lambdas.channel import Channel
from stagecoach.lambdas.events import RemediateEvent
from stagecoach.lambdas.jobctx import job_context
from stagecoach.planner.plan import LAMBDA_MAX_MB, next_memory_tier


class MemoryExhausted(Exception):
    """The stage already has Lambda's maximum memory: only a different plan can help."""


def remediate(ev: RemediateEvent, ch: Channel) -> dict[str, Any]:
    lam = boto3.client("lambda")
    current = lam.get_function_configuration(FunctionName=ev.function)["MemorySize"]
    new = next_memory_tier(current)
    if new is None:
        raise MemoryExhausted(
            f"stage {ev.stage} ran out of memory at Lambda's maximum ({LAMBDA_MAX_MB} MB): "
            "use more stages (fewer layers per stage) or smaller micro-batches"
        )
    lam.update_function_configuration(FunctionName=ev.function, MemorySize=new)
    lam.get_waiter("function_updated_v2").wait(FunctionName=ev.function, WaiterConfig={"Delay": 1, "MaxAttempts": 60})
    record = {"time": time.time(), "stage": ev.stage, "function": ev.function, "from_mb": current, "to_mb": new, "error": ev.error[:500]}
    ch.put_bytes(f"jobs/{ev.job}/remediations/{int(record['time'] * 1000)}-s{ev.stage}.json", json.dumps(record).encode())
    ctx = job_context(ch, ev.job)
    plan = ctx.plan
    key = f"history/{ctx.spec['name']}/memory.json"
    body = ch.get_bytes(key)
    memory = json.loads(body) if body else {}
    if memory.get("shape") != [list(plan.balance), plan.replicas, plan.micro_batches]:
        memory = {"shape": [list(plan.balance), plan.replicas, plan.micro_batches], "memory_mb": {}}
    memory["memory_mb"][str(ev.stage)] = max(new, memory["memory_mb"].get(str(ev.stage), 0))
    ch.put_bytes(key, json.dumps(memory).encode())
    return record
