"""What a job's past runs teach its next one (DiSDeL's timeout and failure managers).

Timeouts: after a run succeeds, the slowest warm task per stage and phase is recorded under
``history/{job name}/task_seconds.json`` in the stack's bucket. The next run of a job with the same
name (and the same stages, replicas, micro-batches and sync algorithms) sets each Task's TimeoutSeconds from those observations instead of
the plan's defaults: tight enough that a hung task is noticed quickly, loose enough for noise, and
refused outright if a phase could not fit Lambda's 15 minutes.

Memory: when a stage runs out of memory, the job state machine's remediation step raises that
stage's function by one tier and records it under ``history/{job name}/memory.json``; the next run
of the same shape starts each stage at no less than the memory that worked.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from stagecoach.lambdas import keys
from stagecoach.planner.plan import PHASES, Plan, timeouts_from


def history_key(name: str) -> str:
    return keys.learnt_task_seconds(name)


def memory_key(name: str) -> str:
    return keys.learnt_memory(name)


def _shape(plan: Plan) -> list:
    return [list(plan.balance), plan.replicas, plan.micro_batches]


def observed_task_seconds(metrics: list[dict[str, Any]], stages: int) -> list[dict[str, float]]:
    """Slowest warm task per stage and phase (cold starts excluded: they are not the steady state)."""
    out = [{p: 0.0 for p in PHASES} for _ in range(stages)]
    for m in metrics:
        if not m.get("cold"):
            row = out[m["stage"]]
            row[m["phase"]] = max(row[m["phase"]], float(m["duration_s"]))
    return out


def record(run: Any) -> None:
    """Remember this run's task durations for the next run of the same job."""
    body = {
        "stages": run.plan.stages,
        "balance": list(run.plan.balance),
        "replicas": run.plan.replicas,
        "micro_batches": run.plan.micro_batches,
        "sync": list(run.plan.sync),
        "aggregators": list(run.plan.aggregators),
        "task_seconds": observed_task_seconds(run.metrics(), run.plan.stages),
        "job": run.job_id,
    }
    run._c.s3.put_object(Bucket=run.bucket, Key=history_key(run.job.name), Body=json.dumps(body).encode())


def _read(s3: Any, bucket: str, key: str) -> Any:
    try:
        return json.loads(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
    except (s3.exceptions.NoSuchKey, s3.exceptions.NoSuchBucket):
        return None  # no history yet (a missing bucket is reported by the deployment's preflight)


def refine(plan: Plan, name: str, s3: Any, bucket: str) -> Plan:
    """The plan with timeouts and memory learnt from the job's past runs of the same shape."""
    past = _read(s3, bucket, history_key(name))
    # task times depend on the sync algorithm too (a fused sync lengthens backward)
    same_sync = past and past.get("sync") == list(plan.sync) and past.get("aggregators") == list(plan.aggregators)
    if same_sync and [past["balance"], past["replicas"], past["micro_batches"]] == _shape(plan):
        plan = replace(plan, timeouts_s=timeouts_from(past["task_seconds"]))
    memory = _read(s3, bucket, memory_key(name))
    if memory and memory.get("shape") == _shape(plan):
        learnt = {int(s): mb for s, mb in memory["memory_mb"].items()}
        plan = replace(plan, memory_mb=tuple(max(mb, learnt.get(s, 0)) for s, mb in enumerate(plan.memory_mb)))
    return plan
