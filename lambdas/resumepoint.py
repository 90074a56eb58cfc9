"""The job state machine's ResumePoint step: where a failed window attempt's successor starts.

A window [start, end) whose attempt failed used to run again from ``start``, so under many faults a
long window lost every iteration it had done, each time. Its attempts after the first store every
version in S3 (lambdas/jobctx.py ``warm_attempt``), so the next attempt can start at the latest
version whose every object is stored (core/versions.py) instead: the work lost to a failure is at
most the iteration it struck. An evaluation or checkpoint due after an iteration belongs to it: a
version whose due records are missing is not a resume point (its iteration runs again, writing the
same bytes, then the evaluation).

Invoked on the stack's control function with the job id from the job execution's input; it only
lists the job's own objects (and reads its spec for the versions due), writes nothing, and runs no
user code. Versions are deterministic, so the resumed run is bit-identical to a fault-free one.
"""

from __future__ import annotations

from typing import Any

from stagecoach.core import keys, versions
from stagecoach.core.events import ResumeEvent
from stagecoach.core.records import JobSpec
from stagecoach.lambdas.channel import Channel


def _listed(ch: Channel, prefix: str) -> list[str]:
    out: list[str] = []
    for page in ch.s3.get_paginator("list_objects_v2").paginate(Bucket=ch.bucket, Prefix=prefix):
        ch.stats.count(puts=1)  # a LIST is billed at the PUT class's price (lambdas/channel.py any_under)
        out += [o["Key"] for o in page.get("Contents", [])]
    return out


def _counts(ch: Channel, job: str, kind: str) -> dict[int, int]:
    prefix = keys.state_prefix(job, kind)
    return versions.count_versions(_listed(ch, prefix), prefix)


def _unfinished(ch: Channel, job: str, spec: JobSpec, candidates: list[int]) -> set[int]:
    """The due versions among ``candidates`` whose evaluation (every replica's result) or
    checkpoint (every stage's part) is not stored."""
    plan = spec.to_plan()
    evaluated = spec.evaluation.versions if spec.evaluation is not None else []
    due = versions.due_versions(evaluated, spec.checkpoint_every, spec.iterations)
    missing: set[int] = set()
    for v in sorted(due & set(candidates)):
        wanted: set[str] = set()
        if v in evaluated:
            wanted |= {keys.eval_result(job, v, r) for r in range(plan.replicas)}
        if spec.checkpoint_every and v % spec.checkpoint_every == 0:
            wanted |= {keys.checkpoint(job, v, s) for s in range(plan.stages)}
        found = set(_listed(ch, f"jobs/{job}/eval/v{v}/")) | set(_listed(ch, f"{keys.checkpoints_prefix(job)}v{v}/"))
        if not wanted <= found:
            missing.add(v)
    return missing


def resume_point(ev: ResumeEvent, ch: Channel) -> dict[str, Any]:
    """``{"first": v}``: the iteration the window's next attempt starts at (core/versions.py)."""
    body = ch.get_bytes(keys.job_spec(ev.job))
    if body is None:
        raise FileNotFoundError(f"job {ev.job!r} has no spec in s3://{ch.bucket}/{keys.job_spec(ev.job)}")
    spec = JobSpec.model_validate_json(body)
    params, optim, buffers = (_counts(ch, ev.job, kind) for kind in ("params", "optim", "buffers"))
    complete = versions.complete_versions(params, optim, buffers, stateful=spec.optimizer_state)
    candidates = [v for v in complete if ev.start < v <= ev.end]
    unfinished = _unfinished(ch, ev.job, spec, candidates)
    return {"first": versions.resume_point(complete, ev.start, ev.end, unfinished)}
