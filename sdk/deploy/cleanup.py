"""Remove a job's functions, window state machine, role and objects; the same code on both backends.

Two callers: a launch that failed half-way removes what it created (:func:`rollback`), and
``stagecoach cleanup`` / ``Backend.cleanup`` removes a whole job (:func:`cleanup_job`). Both skip
what is already gone, so either can be repeated; other errors (AccessDenied) surface.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from botocore.exceptions import ClientError

from stagecoach.core import keys
from stagecoach.core.records import JobSpec
from stagecoach.deploy.chain import follow
from stagecoach.deploy.resources import (
    Clients,
    DeployError,
    StackResources,
    first_execution_arn,
    function_name,
    group_state_machine_name,
    job_id_from,
    read_json,
    state_machine_arn,
    window_state_machine_name,
)
from stagecoach.deploy.roles import delete_job_role
from stagecoach.planner.plan import per_worker_functions, stage_functions

Log = Callable[[str], None]


@dataclass
class Removed:
    """What a cleanup removed (or stopped)."""

    functions: list[str] = field(default_factory=list)
    state_machines: list[str] = field(default_factory=list)
    objects: list[str] = field(default_factory=list)
    stopped: list[str] = field(default_factory=list)
    roles: list[str] = field(default_factory=list)


def _quiet(_msg: str) -> None:
    return None


def delete_functions(c: Clients, names: list[str], log: Log = _quiet) -> list[str]:
    """Delete the named functions; returns those that existed."""
    out = []
    for name in names:
        try:
            c.lambda_.delete_function(FunctionName=name)
        except c.lambda_.exceptions.ResourceNotFoundException:
            continue
        except ClientError as e:
            # DeleteFunction requires the stack's tag (deployer policy), so a function that is gone
            # is denied rather than not found: it is gone if reading it says so
            if e.response.get("Error", {}).get("Code") != "AccessDeniedException" or _exists(c, name):
                raise
            continue
        out.append(name)
        log(f"deleted function {name}")
    return out


def _exists(c: Clients, name: str) -> bool:
    try:
        c.lambda_.get_function_configuration(FunctionName=name)
    except c.lambda_.exceptions.ResourceNotFoundException:
        return False
    return True


def delete_state_machines(c: Clients, arns: list[str], log: Log = _quiet) -> list[str]:
    """Delete the state machines; returns those that existed."""
    out = []
    for arn in arns:
        try:
            c.sfn.describe_state_machine(stateMachineArn=arn)
            c.sfn.delete_state_machine(stateMachineArn=arn)
        except c.sfn.exceptions.StateMachineDoesNotExist:
            continue
        out.append(arn)
        log(f"deleted state machine {arn}")
    return out


def delete_objects(res: StackResources, c: Clients, job_id: str, log: Log = _quiet) -> list[str]:
    """Delete every object under the job's prefix (1,000 per request); returns their keys."""
    listed = [
        o["Key"]
        for page in c.s3.get_paginator("list_objects_v2").paginate(Bucket=res.bucket, Prefix=keys.job_prefix(job_id))
        for o in page.get("Contents", [])
    ]
    for i in range(0, len(listed), 1000):
        c.s3.delete_objects(Bucket=res.bucket, Delete={"Objects": [{"Key": k} for k in listed[i : i + 1000]], "Quiet": True})
    log(f"deleted {len(listed)} objects under s3://{res.bucket}/{keys.job_prefix(job_id)}")
    return listed


def rollback(job_id: str, res: StackResources, c: Clients, functions: list[str], state_machines: list[str]) -> None:
    """Undo a launch that failed half-way: what it created, and its objects. Never raises: the
    launch's own error is the one to report."""
    for step in (
        lambda: delete_functions(c, functions),
        lambda: delete_state_machines(c, state_machines),
        lambda: delete_objects(res, c, job_id),
        lambda: delete_job_role(res, c, job_id),
    ):
        try:
            step()
        except ClientError:
            pass


def cleanup_job(
    res: StackResources, c: Clients, job_id: str, keep_results: bool = False, stop_running: bool = False, log: Log | None = None
) -> Removed:
    """Remove a job's functions, its window state machine and (unless ``keep_results``) its objects.

    A running job is refused unless ``stop_running``: deleting its functions would fail it
    half-way; with it, the job execution and its running window executions are stopped first. What
    is shared between jobs stays: datasets (data/), what past runs taught the job's next run
    (history/), and the stack's log group (its retention expires the job's log streams).
    """
    job_id = job_id_from(job_id)
    log = log or _quiet
    removed = Removed()
    spec = _spec(res, c, job_id)
    sm_arn = _window_state_machine(res, job_id, spec)
    # a plan with a phase of more than 40 workers also has a group machine (planner/emit/groups.py)
    group_arn = state_machine_arn(res, group_state_machine_name(res, job_id))
    _stop_job_execution(res, c, job_id, stop_running, removed, log)
    _stop_windows(c, sm_arn, removed)
    _stop_windows(c, group_arn, removed)
    removed.functions = delete_functions(c, _functions(res, c, job_id, spec), log)
    removed.state_machines = delete_state_machines(c, [sm_arn, group_arn], log)
    if delete_job_role(res, c, job_id):
        removed.roles.append(job_id)
        log(f"deleted the job's role {job_id}")
    if not keep_results:
        removed.objects = delete_objects(res, c, job_id, log)
    return removed


def _spec(res: StackResources, c: Clients, job_id: str) -> JobSpec | None:
    """The job's spec, or None where its launch failed before writing it."""
    try:
        return JobSpec.model_validate(read_json(c.s3, res.bucket, keys.job_spec(job_id)))
    except c.s3.exceptions.NoSuchKey:
        return None


def _window_state_machine(res: StackResources, job_id: str, spec: JobSpec | None) -> str:
    """The window state machine's ARN: the spec's, else the one its name rule gives."""
    if spec is not None and spec.window_state_machine:
        return spec.window_state_machine
    return state_machine_arn(res, window_state_machine_name(res, job_id))


def _stop_job_execution(res: StackResources, c: Clients, job_id: str, stop_running: bool, removed: Removed, log: Log) -> None:
    """Stop the job's latest execution (it continues as new ones) if it runs and we may; refuse if not."""
    execution = first_execution_arn(res, job_id)
    try:
        links, latest = follow(c.sfn, execution)
    except c.sfn.exceptions.ExecutionDoesNotExist:
        return
    execution = links[-1]
    if latest["status"] != "RUNNING":
        return
    if not stop_running:
        raise DeployError(f"job {job_id} is still running ({execution}); stop it first or pass --force")
    c.sfn.stop_execution(executionArn=execution, error="Stagecoach.Cleanup", cause="stopped by stagecoach cleanup")
    removed.stopped.append(execution)
    log(f"stopped {execution}")


def _stop_windows(c: Clients, sm_arn: str, removed: Removed) -> None:
    """A window (or group) execution outlives its stopped parent for a moment: stop it before its functions go."""
    try:
        for page in c.sfn.get_paginator("list_executions").paginate(stateMachineArn=sm_arn, statusFilter="RUNNING"):
            for e in page["executions"]:
                c.sfn.stop_execution(executionArn=e["executionArn"], error="Stagecoach.Cleanup", cause="stopped by stagecoach cleanup")
                removed.stopped.append(e["executionArn"])
    except (c.sfn.exceptions.StateMachineDoesNotExist, c.sfn.exceptions.StateMachineTypeNotSupported):
        pass  # gone, or an Express window: no ListExecutions, and nothing to stop (it ends with its caller's call)


def _functions(res: StackResources, c: Clients, job_id: str, spec: JobSpec | None) -> list[str]:
    """The job's functions: from its plan, or (the launch failed before job.json) by their name."""
    if spec is not None:
        plan = spec.to_plan()
        per_worker = per_worker_functions(plan, spec.warm_state)
        return [name for s in range(plan.stages) for name in stage_functions(plan, s, function_name(res, job_id, s), per_worker)]
    prefix = function_name(res, job_id, 0)[:-1]
    return [
        f["FunctionName"]
        for page in c.lambda_.get_paginator("list_functions").paginate()
        for f in page["Functions"]
        if f["FunctionName"].startswith(prefix)
    ]
