"""Continue a job from its last complete checkpoint, and find the stack's jobs.

A job's functions, window state machine, code, data and spec stay in the stack until
`stagecoach cleanup`, and its parameters (and optimizer state, and running statistics) are
stored at least at every window's first version and after its last (docs/runtime.md "Checkpoints,
cleanup, idempotence"). So a job that stopped, failed, or finished can go on: a new execution of
the job state machine, named ``{job}-r{n}``, starts at the latest version whose every object is
there, and runs to the job's iterations — or to a new total, which is written into the job's spec
(and its window's lists of evaluations and checkpoints) before anything starts. The versions are
deterministic (data order, dropout, schedules are functions of the seed and the iteration), so the
continued run ends bit-identical to one that never stopped.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from stagecoach.core import keys, versions
from stagecoach.core.records import EvalSpec, JobSpec
from stagecoach.deploy.resources import (
    Clients,
    DeployError,
    StackResources,
    function_name,
    job_of_execution,
    object_exists,
    parse_execution_name,
)
from stagecoach.planner.emit.job_input import JobInput

RUNNING = {"RUNNING"}


def _objects_per_version(c: Clients, bucket: str, job: str, kind: str) -> dict[int, int]:
    """How many objects of ``kind`` ("params", "optim", "buffers": core/keys.py) each version has."""
    prefix = keys.state_prefix(job, kind)
    found: list[str] = []
    for page in c.s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        found += [o["Key"] for o in page.get("Contents", [])]
    return versions.count_versions(found, prefix)


def last_checkpoint(c: Clients, bucket: str, job: str) -> int:
    """The latest version whose parameters (every chunk of every shard of every stage), optimizer
    state (for a stateful optimizer) and running statistics (where the model has them) are stored
    (core/versions.py). Not counted from version 0, which is gone once a later window started: the
    workers keep each window's first version, and with one iteration per window the second
    window's is version 1 (lambdas/collectives.py forget_old_version)."""
    params, optim, buffers = (_objects_per_version(c, bucket, job, kind) for kind in ("params", "optim", "buffers"))
    if not params:
        raise DeployError(f"job {job} has no stored parameters (s3://{bucket}/jobs/{job}/params/): was it cleaned up?")
    spec = JobSpec.model_validate_json(c.s3.get_object(Bucket=bucket, Key=keys.job_spec(job))["Body"].read())
    stateful = spec.optimizer_state
    return versions.complete_versions(params, optim, buffers, stateful)[-1]


@dataclass(frozen=True)
class JobStatus:
    """One job of the stack, as `stagecoach list` shows it."""

    job: str
    name: str
    status: str  # the latest execution's: RUNNING, SUCCEEDED, FAILED, ABORTED, STOPPED...
    started: str
    iterations: int
    execution_arn: str


def _executions(c: Clients, res: StackResources) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for page in c.sfn.get_paginator("list_executions").paginate(stateMachineArn=res.job_state_machine_arn):
        out += page["executions"]
    return out


def job_executions(c: Clients, res: StackResources, job: str) -> list[dict[str, Any]]:
    """The job's executions (every link and resumption), oldest first."""
    mine = [e for e in _executions(c, res) if job_of_execution(e["name"]) == job]
    return sorted(mine, key=lambda e: e["startDate"])


def list_jobs(c: Clients, res: StackResources) -> list[JobStatus]:
    """The stack's jobs, newest first, each with its latest execution's status."""
    by_job: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for e in _executions(c, res):
        by_job[job_of_execution(e["name"])].append(e)
    out = []
    for job, execs in by_job.items():
        latest = max(execs, key=lambda e: e["startDate"])
        first = min(execs, key=lambda e: e["startDate"])
        try:
            spec = JobSpec.model_validate_json(c.s3.get_object(Bucket=res.bucket, Key=keys.job_spec(job))["Body"].read())
            name, iterations = spec.name, spec.iterations
        except c.s3.exceptions.NoSuchKey:
            name, iterations = "(cleaned up)", 0
        status = latest["status"]
        if status == "FAILED" and object_exists(c.s3, res.bucket, keys.stopped(job)):
            status = "STOPPED"  # the gate ended it at an iteration boundary (lambdas/gate.py)
        out.append(JobStatus(job, name, status, str(first["startDate"]), iterations, latest["executionArn"]))
    return sorted(out, key=lambda j: j.started, reverse=True)


def resume_job(
    c: Clients, res: StackResources, job: str, iterations: int | None = None, max_cost_usd: float | None = None
) -> tuple[str, int, int]:
    """Start the job again from its last complete checkpoint; returns (execution ARN, the version
    it starts from, its iterations). A stopped job's stop request and record are removed first
    (lambdas/gate.py would stop it again at once); ``max_cost_usd``: a new cost cap (the engine's
    tally of what the job has cost so far goes on)."""
    running = [e for e in job_executions(c, res, job) if e["status"] in RUNNING]
    if running:
        raise DeployError(f"job {job} is still running ({running[-1]['executionArn']}): stop it first (`stagecoach stop {job}`)")
    try:
        spec = JobSpec.model_validate_json(c.s3.get_object(Bucket=res.bucket, Key=keys.job_spec(job))["Body"].read())
    except c.s3.exceptions.NoSuchKey:
        raise DeployError(f"job {job} has no spec in s3://{res.bucket}/jobs/{job}/: it was cleaned up (or never ran here)") from None
    window, length = spec.window_state_machine, spec.window_length
    if window is None or length is None:
        raise DeployError(f"job {job} is a profiling job: it has no iterations to resume")
    start = last_checkpoint(c, res.bucket, job)
    total = spec.iterations if iterations is None else iterations
    if total <= start:
        raise DeployError(f"job {job} has its parameters after {start} iterations already: give --iterations above {start} to train on")
    if total != spec.iterations:
        spec = _extend(c, res, spec, total)
    if max_cost_usd is not None:
        spec = spec.model_copy(update={"max_cost_usd": max_cost_usd})
        c.s3.put_object(Bucket=res.bucket, Key=keys.job_spec(job), Body=spec.model_dump_json(indent=2).encode())
    c.s3.delete_objects(Bucket=res.bucket, Delete={"Objects": [{"Key": keys.stop_request(job)}, {"Key": keys.stopped(job)}], "Quiet": True})
    execs = job_executions(c, res, job)
    if not execs:
        raise DeployError(f"job {job} has no executions on {res.job_state_machine_arn}: it ran on another stack (or over 90 days ago)")
    first = json.loads(c.sfn.describe_execution(executionArn=execs[0]["executionArn"]).get("input") or "{}")
    n, link = _resumption_links(execs)
    job_input = JobInput(
        job=job,
        bucket=res.bucket,
        windowStateMachineArn=window,
        iterations=total,
        windowLength=length,
        windowTimeout=int(first["windowTimeout"]),
        windowType=first.get("windowType", "STANDARD"),  # as the job's window state machine was created
        windowsPerExecution=int(first["windowsPerExecution"]),
        functionPrefix=function_name(res, job, 0)[:-1],
        controlFunction=res.control_function,
        link=link,
        start=start,
    )
    arn = c.sfn.start_execution(stateMachineArn=res.job_state_machine_arn, name=f"{job}-r{n}", input=job_input.model_dump_json())[
        "executionArn"
    ]
    return arn, start, total


def _resumption_links(execs: list[dict[str, Any]]) -> tuple[int, int]:
    """For a new resumption of the job with these executions: its number n (``{job}-r{n}``), and
    its place in the chain (JobInput.link): after the job's latest continuation, so that its own
    continuations are named ``{job}-c{link + 1}``, ... and never repeat an earlier execution's name
    (Step Functions refuses a name used in the last 90 days with ExecutionAlreadyExists:
    https://docs.aws.amazon.com/step-functions/latest/apireference/API_StartExecution.html)."""
    names = [name for e in execs if (name := parse_execution_name(e["name"])) is not None]
    n = 1 + sum(1 for name in names if name.kind == "r")
    return n, max((name.n for name in names if name.kind == "c"), default=0)


def _extend(c: Clients, res: StackResources, spec: JobSpec, total: int) -> JobSpec:
    """A new total of iterations: in the spec the workers read, and in the window's lists of
    versions to evaluate (every ``eval_every`` and the last) and to keep (every ``checkpoint_every``)."""
    evaluation = spec.evaluation
    if evaluation is not None:
        every = evaluation.every or total
        versions = sorted({v for v in evaluation.versions if v <= total} | set(range(every, total + 1, every)) | {total})
        evaluation = EvalSpec(dataset=evaluation.dataset, versions=versions, metrics=evaluation.metrics, every=evaluation.every)
    new = spec.model_copy(update={"iterations": total, "evaluation": evaluation})
    sm = spec.window_state_machine
    assert sm is not None
    definition = json.loads(c.sfn.describe_state_machine(stateMachineArn=sm)["definition"])
    init = definition["States"]["Init"]["Parameters"]
    if evaluation is not None and "evals" in init:
        init["evals"] = evaluation.versions
    if spec.checkpoint_every and "saves" in init:
        init["saves"] = list(range(spec.checkpoint_every, total + 1, spec.checkpoint_every))
    c.sfn.update_state_machine(stateMachineArn=sm, definition=json.dumps(definition))
    c.s3.put_object(Bucket=res.bucket, Key=keys.job_spec(spec.job), Body=new.model_dump_json(indent=2).encode())
    return new
