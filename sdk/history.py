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

from collections.abc import Iterable
from dataclasses import replace
from typing import TYPE_CHECKING, TypeVar

from pydantic import BaseModel, ValidationError

from stagecoach.core import keys
from stagecoach.core.records import LearntMemory, LearntTaskSeconds, TaskMetrics
from stagecoach.planner.plan import PHASES, Plan, timeouts_from

if TYPE_CHECKING:  # deploy is this module's sibling layer (pyproject [tool.importlinter]): the name only
    from stagecoach.deploy.resources import BotoClient

R = TypeVar("R", bound=BaseModel)


def history_key(name: str) -> str:
    return keys.learnt_task_seconds(name)


def memory_key(name: str) -> str:
    return keys.learnt_memory(name)


def observed_task_seconds(metrics: Iterable[TaskMetrics], stages: int) -> list[dict[str, float]]:
    """Slowest warm task per stage and phase (cold starts excluded: they are not the steady state)."""
    out = [{p: 0.0 for p in PHASES} for _ in range(stages)]
    for m in metrics:
        if not m.cold and m.phase in PHASES:  # an evaluate task runs under its function's timeout
            row = out[m.stage]
            row[m.phase] = max(row[m.phase], m.duration_s)
    return out


def record(s3: BotoClient, bucket: str, name: str, job_id: str, plan: Plan, metrics: Iterable[TaskMetrics]) -> None:
    """Remember a successful run's task durations for the next run of the same job."""
    body = LearntTaskSeconds(
        stages=plan.stages,
        balance=list(plan.balance),
        replicas=plan.replicas,
        micro_batches=plan.micro_batches,
        sync=list(plan.sync),
        aggregators=list(plan.aggregators),
        task_seconds=observed_task_seconds(metrics, plan.stages),
        job=job_id,
    )
    s3.put_object(Bucket=bucket, Key=history_key(name), Body=body.model_dump_json().encode())


def recorded_job(s3: BotoClient, bucket: str, name: str) -> str | None:
    """The job whose task durations the name's record holds (``record``), None if there is none."""
    past = _read(s3, bucket, history_key(name), LearntTaskSeconds)
    return past.job if past is not None else None


def _read(s3: BotoClient, bucket: str, key: str, record_type: type[R]) -> R | None:
    """The record, or None when there is none yet (a missing bucket is reported by the
    deployment's preflight) or it is not one this version wrote (then it is simply not used)."""
    try:
        body = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
    except (s3.exceptions.NoSuchKey, s3.exceptions.NoSuchBucket):
        return None
    try:
        return record_type.model_validate_json(body)
    except ValidationError:
        return None


def refine(plan: Plan, name: str, s3: BotoClient, bucket: str) -> Plan:
    """The plan with timeouts and memory learnt from the job's past runs of the same shape."""
    past = _read(s3, bucket, history_key(name), LearntTaskSeconds)
    if past is not None and past.fits(plan):
        plan = replace(plan, timeouts_s=timeouts_from(past.task_seconds))
    memory = _read(s3, bucket, memory_key(name), LearntMemory)
    if memory is not None and memory.fits(plan):
        learnt = {int(s): mb for s, mb in memory.memory_mb.items()}
        plan = replace(plan, memory_mb=tuple(max(mb, learnt.get(s, 0)) for s, mb in enumerate(plan.memory_mb)))
    return plan
