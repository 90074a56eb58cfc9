"""Deploy a job onto a stack and start it: the same boto3 calls for the local stack and for AWS.

A stack (SAM on AWS, the embedded moto server locally) provides the bucket, the worker image, the
roles and the job state machine. Per job this creates one Lambda function per stage (memory and
timeout from the plan) and the window state machine, uploads the job, its data and its initial
parameters, and starts the job state machine. If anything fails, whatever was created is removed.
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

import cloudpickle
import torch
from safetensors.torch import save as st_save

from stagecoach.job import DTYPE_NAMES, Job
from stagecoach.lambdas import keys
from stagecoach.lambdas.training import flat_params, stage_layout
from stagecoach.planner import asl
from stagecoach.planner.plan import Plan

HANDLER = "stagecoach.lambdas.handler.handler"


@dataclass(frozen=True)
class StackResources:
    """What a deployed stack offers a job (CloudFormation outputs on AWS)."""

    prefix: str
    region: str
    bucket: str
    image_uri: str
    worker_role_arn: str
    states_role_arn: str
    job_state_machine_arn: str
    architecture: str = "x86_64"
    console: str = "https://{region}.console.aws.amazon.com/states/home?region={region}#/v2/executions/details/{arn}"


@dataclass
class Clients:
    s3: Any
    lambda_: Any
    sfn: Any


def function_name(res: StackResources, job: str, stage: int) -> str:
    return f"{res.prefix}-{job}-s{stage}"


def window_state_machine_name(res: StackResources, job: str) -> str:
    return f"{res.prefix}-{job}-window"


def new_job_id(job: Job) -> str:
    return f"{job.name}-{uuid.uuid4().hex[:8]}"


def _safetensors(tensors: dict[str, torch.Tensor]) -> bytes:
    return st_save({k: v.contiguous() for k, v in tensors.items()})


def _exists(s3: Any, bucket: str, key: str) -> bool:
    try:
        s3.head_object(Bucket=bucket, Key=key)
        return True
    except s3.exceptions.ClientError:
        return False


def upload_dataset(s3: Any, bucket: str, x: torch.Tensor, y: torch.Tensor, split: str) -> str:
    """Content-addressed: the same data is uploaded once and shared by jobs."""
    body = _safetensors({"x": x, "y": y})
    ds_id = hashlib.sha256(body).hexdigest()[:16]
    key = keys.dataset(ds_id, split)
    if not _exists(s3, bucket, key):
        s3.put_object(Bucket=bucket, Key=key, Body=body)
    return ds_id


def _user_modules(*objs: Any) -> list[Any]:
    """Modules of the user's callables that workers cannot import (scripts, tests, notebooks)."""
    import inspect
    import sys
    import sysconfig

    site = sysconfig.get_paths()["purelib"]
    out = []
    for obj in objs:
        mod = inspect.getmodule(obj) or inspect.getmodule(type(obj))
        if mod is None or mod.__name__ == "__main__" or mod.__name__.split(".")[0] in ("torch", "stagecoach", "builtins"):
            continue
        path = getattr(mod, "__file__", None) or ""
        if not path.startswith(site) and not path.startswith(sys.base_prefix) and mod not in out:
            out.append(mod)
    return out


def pickle_job_code(job: Job) -> bytes:
    """cloudpickle the model factory, loss and optimizer; user code ships by value, not by import."""
    modules = _user_modules(job.model, job.loss, job.optimizer)
    for m in modules:
        cloudpickle.register_pickle_by_value(m)
    try:
        return cloudpickle.dumps({"model": job.model, "loss": job.loss, "optimizer": job.optimizer})
    finally:
        for m in modules:
            cloudpickle.unregister_pickle_by_value(m)


def window_timeout_s(plan: Plan, length: int) -> int:
    """A window must finish within its iterations' worst case (every phase at its timeout) plus slack."""
    per_iter = max(t["forward"] for t in plan.timeouts_s) + max(t["backward"] + t["sync"] for t in plan.timeouts_s)
    return min(365 * 24 * 3600, length * per_iter + 300)


class DeployError(RuntimeError):
    """The stack cannot take the job; the message says what is missing and how to fix it."""


def preflight(res: StackResources, c: Clients) -> None:
    """Check the stack's bucket and job state machine exist before creating anything.

    A denied check is not a missing stack: it is reported as such, naming the action to grant.
    """
    try:
        c.s3.head_bucket(Bucket=res.bucket)
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


def upload_job(job: Job, plan: Plan, res: StackResources, c: Clients, job_id: str) -> dict[str, Any]:
    """Upload what the workers read: the data set, the model code, the plan and the initial
    parameters (version 0, in the plan's shard and chunk layout). Returns the job's spec."""
    x, y = job.train
    ds_id = upload_dataset(c.s3, res.bucket, x, y, "train")
    spec = {
        "job": job_id,
        "name": job.name,
        "seed": job.seed,
        "iterations": job.iterations,
        "global_batch": job.global_batch,
        "dtype": DTYPE_NAMES[job.dtype],
        "layers": job.layers,
        "dataset": {"id": ds_id, "n_train": int(x.shape[0])},
        "plan": plan.to_dict(),
        "created": time.time(),
    }
    code = pickle_job_code(job)
    c.s3.put_object(Bucket=res.bucket, Key=keys.job_code(job_id), Body=code)
    c.s3.put_object(Bucket=res.bucket, Key=keys.plan(job_id), Body=plan.to_json().encode())
    model = job.build_model()
    layers = list(model)
    for s in range(plan.stages):
        params = [p for i in plan.stage_layers(s) for p in layers[i].parameters()]
        flat = flat_params(params)
        for k, chunks in enumerate(stage_layout(flat.numel(), flat.element_size(), plan.grad_shards(s), plan.replicas)):
            for ci, (a, b) in enumerate(chunks):
                c.s3.put_object(Bucket=res.bucket, Key=keys.params(job_id, 0, s, k, ci), Body=_safetensors({"p": flat[a:b]}))
    return spec


def create_stage_function(res: StackResources, c: Clients, name: str, job_id: str, memory_mb: int, timeout_s: int) -> None:
    """One Lambda function of the worker image (a stage's, or a profiling tier's)."""
    c.lambda_.create_function(
        FunctionName=name,
        Role=res.worker_role_arn,
        PackageType="Image",
        Code={"ImageUri": res.image_uri},
        ImageConfig={"Command": [HANDLER]},
        MemorySize=memory_mb,
        Timeout=timeout_s,
        Architectures=[res.architecture],
        Environment={"Variables": {"STAGECOACH_BUCKET": res.bucket, "POWERTOOLS_SERVICE_NAME": "stagecoach-worker"}},
        Tags={"stagecoach:job": job_id},
    )


def deploy_and_start(job: Job, plan: Plan, res: StackResources, c: Clients) -> tuple[str, str]:
    """Create the job's resources and start it; returns (job id, job execution ARN)."""
    preflight(res, c)
    job_id = new_job_id(job)
    created_functions: list[str] = []
    created_sm: list[str] = []
    try:
        spec = upload_job(job, plan, res, c, job_id)
        functions = []
        for s in range(plan.stages):
            name = function_name(res, job_id, s)
            create_stage_function(res, c, name, job_id, plan.memory_mb[s], plan.function_timeout_s(s))
            created_functions.append(name)
            functions.append(name)
        window = c.sfn.create_state_machine(
            name=window_state_machine_name(res, job_id),
            definition=json.dumps(asl.window_definition(plan, functions)),
            roleArn=res.states_role_arn,
            type="STANDARD",
            tags=[{"key": "stagecoach:job", "value": job_id}],
        )["stateMachineArn"]
        created_sm.append(window)
        length = asl.window_length(plan)
        spec["window_length"] = length
        spec["window_state_machine"] = window
        c.s3.put_object(Bucket=res.bucket, Key=keys.job_spec(job_id), Body=json.dumps(spec, indent=2).encode())
        wins = asl.windows(job.iterations, length)
        for w in wins:
            w["timeout"] = window_timeout_s(plan, w["end"] - w["start"])
        execution = c.sfn.start_execution(
            stateMachineArn=res.job_state_machine_arn,
            name=job_id,
            input=json.dumps({"job": job_id, "bucket": res.bucket, "windowStateMachineArn": window, "windows": wins,
                              "functionPrefix": function_name(res, job_id, 0)[:-1]}),
        )["executionArn"]
        return job_id, execution
    except BaseException:
        cleanup(job_id, res, c, functions=created_functions, state_machines=created_sm)
        raise


def cleanup(
    job_id: str,
    res: StackResources,
    c: Clients,
    functions: list[str] | None = None,
    state_machines: list[str] | None = None,
    keep_results: bool = False,
) -> None:
    """Remove a job's functions, state machines and (unless ``keep_results``) objects."""
    for name in functions or []:
        try:
            c.lambda_.delete_function(FunctionName=name)
        except Exception:
            pass
    for arn in state_machines or []:
        try:
            c.sfn.delete_state_machine(stateMachineArn=arn)
        except Exception:
            pass
    if keep_results:
        return
    paginator = c.s3.get_paginator("list_objects_v2")
    for page in paginator.paginate(Bucket=res.bucket, Prefix=keys.job_prefix(job_id)):
        objs = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if objs:
            c.s3.delete_objects(Bucket=res.bucket, Delete={"Objects": objs, "Quiet": True})


def read_json(s3: Any, bucket: str, key: str) -> Any:
    return json.loads(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
