"""Create a job's functions and window state machine, and start its job execution.

The same boto3 calls for the local stack and for AWS (the AWS backend passes clients that make the
creations idempotent). If anything fails, whatever was created is removed.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from stagecoach.core import keys
from stagecoach.core.cost import Prices
from stagecoach.deploy.cleanup import rollback
from stagecoach.deploy.requests import RequestCounter
from stagecoach.deploy.resources import (
    HANDLER,
    Clients,
    DeployError,
    StackResources,
    function_name,
    group_state_machine_name,
    new_job_id,
    state_machine_arn,
    window_log_group_arn,
    window_state_machine_name,
)
from stagecoach.deploy.roles import JOB_TAG, STACK_TAG, create_function_when_role_ready, create_job_role
from stagecoach.deploy.upload import upload_job
from stagecoach.planner.emit import asl, groups, workflow
from stagecoach.planner.emit.asl_check import check_definition
from stagecoach.planner.emit.job_input import JobInput
from stagecoach.planner.limits import concurrency_needed
from stagecoach.planner.model.platforms import aws_platform
from stagecoach.planner.plan import Plan, per_worker_functions, stage_functions, watcher_function

if TYPE_CHECKING:
    from stagecoach.job import Job


def window_timeout_s(plan: Plan, length: int, evaluates: bool = False) -> int:
    """A window must finish within its iterations' worst case (every phase and the iteration gate
    at its timeout, and an evaluation and a checkpoint after each if the job has them: their
    function's timeout) plus slack."""
    per_iter = max(t["forward"] for t in plan.timeouts_s) + max(t["backward"] + t["sync"] for t in plan.timeouts_s) + asl.GATE_TIMEOUT_S
    if evaluates:  # an evaluation and a checkpoint after every iteration, as a bound
        per_iter += 2 * max(plan.function_timeout_s(s) for s in range(plan.stages))
    return min(365 * 24 * 3600, (length + 1) * per_iter + 300)


def check_concurrency(plan: Plan, available: int | None, where: str) -> None:
    """Refuse a plan the account cannot run: every worker of a phase must run at once (they wait
    for each other), and while a failed window's tasks wind down its restart starts new ones, so
    twice the plan's peak, plus the remediation step, must fit in the account's unreserved
    concurrency. ``available`` None: unknown (not checked)."""
    if available is None:
        return
    peak = plan.peak_invocations()
    need = concurrency_needed(peak)
    if need > available:
        raise DeployError(
            f"this plan runs up to {peak} Lambda invocations at once, and a restarted window briefly doubles that "
            f"({need} with the remediation step), but {where} allows {available} concurrent executions: "
            "request a higher 'Concurrent executions' quota (Service Quotas > AWS Lambda), or plan fewer replicas or stages"
        )


def preflight(res: StackResources, c: Clients) -> None:
    """Check the stack's bucket and job state machine exist before creating anything.

    A denied check is not a missing stack: it is reported as such, naming the action to grant.
    """
    try:
        c.s3.head_bucket(Bucket=res.bucket)
    except DeployError:
        raise  # the AWS backend's AccessDenied already names the action and the policy statement
    except c.s3.exceptions.ClientError as e:
        code = e.response.get("Error", {}).get("Code", "")
        if code in ("403", "AccessDenied", "Forbidden"):
            raise DeployError(
                f"access to bucket {res.bucket!r} was denied (s3:ListBucket on arn:aws:s3:::{res.bucket}): "
                "grant your identity the deployer policy (docs/deployer-policy.json, statement ListJobObjects)"
            ) from None
        raise DeployError(
            f"bucket {res.bucket!r} is not usable ({code or e}): deploy the stack first (sam deploy), "
            "or point the backend at the stack that owns the bucket"
        ) from None
    try:
        c.sfn.describe_state_machine(stateMachineArn=res.job_state_machine_arn)
    except DeployError:
        raise
    except c.sfn.exceptions.ClientError as e:
        code = e.response["Error"].get("Code", "")
        if code in ("AccessDeniedException", "AccessDenied"):
            raise DeployError(
                f"states:DescribeStateMachine on {res.job_state_machine_arn} was denied: grant your identity the "
                "deployer policy (docs/deployer-policy.json, statement StateMachines)"
            ) from None
        raise DeployError(
            f"job state machine {res.job_state_machine_arn} is missing ({code}): deploy the stack first (sam deploy)"
        ) from None


def create_stage_function(res: StackResources, c: Clients, name: str, job_id: str, memory_mb: int, timeout_s: int, role_arn: str) -> None:
    """One Lambda function of the worker image (a stage's, a profiling tier's, or the stack's own
    control function). Tagged with its stack, which the roles' tag conditions require, and its job."""
    create_function_when_role_ready(
        c,
        dict(
            FunctionName=name,
            Role=role_arn,
            PackageType="Image",
            Code={"ImageUri": res.image_uri},
            ImageConfig={"Command": [HANDLER]},
            MemorySize=memory_mb,
            Timeout=timeout_s,
            Architectures=[res.architecture],
            Environment={"Variables": {"STAGECOACH_BUCKET": res.bucket, "POWERTOOLS_SERVICE_NAME": "stagecoach-worker"}},
            Tags={STACK_TAG: res.prefix, JOB_TAG: job_id},
        ),
    )


def reserved_concurrency(plan: Plan, stage: int, per_worker: bool = False, watcher: bool = False) -> int:
    """What ``reserve_concurrency`` reserves for each of a stage's functions: its most tasks at once
    (the replicas, or the sync Map's K; 1 with a function per worker), twice, for the tasks of a
    failed window winding down while its restart runs; the phase watcher's function (``watcher``,
    plan.watcher_function) one watcher at a time, twice likewise."""
    return 2 * (1 if per_worker or watcher else max(plan.replicas, plan.sync_tasks(stage)))


def _window_definition(job: Job, plan: Plan, functions: list[str], per_worker: bool, group_arn: str | None) -> dict[str, Any]:
    """The job's window state machine."""
    return asl.window_definition(
        plan,
        functions,
        per_worker,
        evals=job.eval_versions(),
        saves=job.checkpoint_versions(),
        abort_key_format=keys.WINDOW_ABORT,
        group_arn=group_arn,
    )


def _checked(what: str, definition: dict[str, Any]) -> dict[str, Any]:
    """``definition`` once its graph passes the structural check (planner/emit/asl_check.py): a
    broken definition is refused before anything is created, rather than by Step Functions
    half-way through the launch."""
    problems = check_definition(definition)
    if problems:
        raise DeployError(f"the emitted {what} state machine is malformed (a bug in planner/emit/): " + "; ".join(problems))
    return definition


def _create_state_machine(
    res: StackResources, c: Clients, job_id: str, name: str, definition: dict[str, Any], kind: str = asl.STANDARD
) -> str:
    """Create one of the job's state machines (its window, its group), tagged with the stack and the
    job; ``kind``: STANDARD, or EXPRESS for a window (planner/emit/workflow.py)."""
    # an Express window keeps no history in Step Functions: it logs every event with its data to
    # the stack's log group, which the console shows an Express execution from (docs/runtime.md)
    logging = {
        "level": "ALL",
        "includeExecutionData": True,
        "destinations": [{"cloudWatchLogsLogGroup": {"logGroupArn": window_log_group_arn(res)}}],
    }
    arn: str = c.sfn.create_state_machine(
        name=name,
        definition=json.dumps(definition),
        roleArn=res.states_role_arn,
        type=kind,
        tags=[{"key": STACK_TAG, "value": res.prefix}, {"key": JOB_TAG, "value": job_id}],
        **({"loggingConfiguration": logging} if kind == asl.EXPRESS else {}),
    )["stateMachineArn"]
    return arn


def deploy_and_start(
    job: Job, plan: Plan, res: StackResources, c: Clients, reserve_concurrency: bool = False, max_cost_usd: float | None = None
) -> tuple[str, str]:
    """Create the job's resources and start it; returns (job id, job execution ARN). The caller
    has checked the stack (:func:`preflight`). ``max_cost_usd``: the job's cost cap, which its
    iteration gate enforces (lambdas/gate.py)."""
    job_id = new_job_id(job.name)
    per_worker = per_worker_functions(plan, job.warm_state)  # warm state with d > 1: one per worker
    functions = [function_name(res, job_id, s) for s in range(plan.stages)]
    group = _checked("group", groups.group_definition(per_worker)) if workflow.needs_groups(plan) else None
    # the window's definition names the group machine's ARN, which its name gives before it exists
    group_arn = state_machine_arn(res, group_state_machine_name(res, job_id)) if group else None
    definition = _checked("window", _window_definition(job, plan, functions, per_worker, group_arn))
    # the windows' type and length (planner/emit/workflow.py); refuses Express windows that cannot run
    choice = job.window_choice(plan, aws_platform("x86_64" if res.architecture == "x86_64" else "arm64"))
    created_functions: list[str] = []
    created_sm: list[str] = []
    try:
        role = create_job_role(res, c, job_id)  # the job's own: its objects only (deploy/roles.py)
        # The state machines and the job's objects first, the functions last: IAM propagates the
        # new role meanwhile (Lambda refuses a role it cannot assume yet, deploy/roles.py).
        if group is not None:
            created_sm.append(_create_state_machine(res, c, job_id, group_state_machine_name(res, job_id), group))
        window = _create_state_machine(res, c, job_id, window_state_machine_name(res, job_id), definition, choice.workflow)
        created_sm.append(window)
        length = choice.window_length
        with RequestCounter(c.s3) as launched:
            spec = upload_job(job, plan, res, c, job_id, length, window)
        for s in range(plan.stages):
            for name in stage_functions(plan, s, functions[s], per_worker):
                create_stage_function(res, c, name, job_id, plan.memory_mb[s], plan.function_timeout_s(s), role)
                created_functions.append(name)
                if reserve_concurrency:
                    c.lambda_.put_function_concurrency(
                        FunctionName=name,
                        ReservedConcurrentExecutions=reserved_concurrency(plan, s, per_worker, name == watcher_function(functions[0])),
                    )
        # the job is metered at the prices of its functions' architecture, as of now
        prices = Prices.of(aws_platform("x86_64" if res.architecture == "x86_64" else "arm64"))
        requests = {"puts": launched.puts + 1, "gets": launched.gets}  # + the spec's own PUT
        express_mb = choice.memory_mb if choice.workflow == asl.EXPRESS else None  # what the gate's cap prices
        spec = spec.model_copy(
            update={"max_cost_usd": max_cost_usd, "prices": asdict(prices), "launch_requests": requests, "express_memory_mb": express_mb}
        )
        c.s3.put_object(Bucket=res.bucket, Key=keys.job_spec(job_id), Body=spec.model_dump_json(indent=2).encode())
        job_input = JobInput(
            job=job_id,
            bucket=res.bucket,
            windowStateMachineArn=window,
            iterations=job.iterations,
            windowLength=length,
            windowTimeout=window_timeout_s(plan, length, evaluates=bool(job.eval_versions()) or bool(job.checkpoint_versions())),
            windowType=choice.workflow,
            windowsPerExecution=asl.windows_per_execution(),
            functionPrefix=function_name(res, job_id, 0)[:-1],
            controlFunction=res.control_function,
        )
        execution = c.sfn.start_execution(stateMachineArn=res.job_state_machine_arn, name=job_id, input=job_input.model_dump_json())[
            "executionArn"
        ]
        return job_id, execution
    except BaseException:
        rollback(job_id, res, c, created_functions, created_sm)
        raise
