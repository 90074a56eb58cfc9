"""DiSDeL's timeout manager: task timeouts from a job's past runs.

After a run succeeds, the slowest warm task per stage and phase is recorded under
``history/{job name}/task_seconds.json`` in the stack's bucket. The next run of a job with the same
name (and the same stage count) sets each Task's TimeoutSeconds from those observations instead of
the plan's defaults: tight enough that a hung task is noticed quickly, loose enough for noise, and
refused outright if a phase could not fit Lambda's 15 minutes.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from stagecoach.planner.plan import PHASES, Plan, timeouts_from


def history_key(name: str) -> str:
    return f"history/{name}/task_seconds.json"


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
        "task_seconds": observed_task_seconds(run.metrics(), run.plan.stages),
        "job": run.job_id,
    }
    run._c.s3.put_object(Bucket=run.bucket, Key=history_key(run.job.name), Body=json.dumps(body).encode())


def refine(plan: Plan, name: str, s3: Any, bucket: str) -> Plan:
    """The plan with timeouts from the job's last successful run of the same shape, if there is one."""
    try:
        past = json.loads(s3.get_object(Bucket=bucket, Key=history_key(name))["Body"].read())
    except s3.exceptions.NoSuchKey:
        return plan
    same_shape = (past["balance"], past["replicas"], past["micro_batches"]) == (
        list(plan.balance), plan.replicas, plan.micro_batches)
    if not same_shape:
        return plan
    return replace(plan, timeouts_s=timeouts_from(past["task_seconds"]))
