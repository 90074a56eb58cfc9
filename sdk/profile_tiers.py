"""Profile a job's layers inside Lambda, once per memory tier (the planner's per-tier measurements).

On a laptop the planner maps tiers to speed with Lambda's vCPU model (1 vCPU per 1,769 MB). On AWS
the real speed of each tier is measured instead, and measuring creates resources on the stack, as
a launch does: :func:`profile_tiers` uploads the job (its data set, model code, plan, initial
parameters and spec) under a job id of its own ("<name>-xxxxxxxx-prof"), creates that job's worker
role and one function per tier ("<stack>-<job id>-s<i>", the tier's memory, Lambda's longest
timeout), and invokes each function in turn, synchronously, with the handler's ``profile`` phase
(lambdas/handler.py -> core/profiling.profile_phase) on the job's own model and a sample of its
data. The results fold into one ModelProfile whose layers carry times per tier
(``LayerProfile.tier_s``), which the performance model prefers to any estimate. Whether it succeeds
or fails, it then removes the functions, the job's objects and its role (deploy/cleanup.py
rollback); the data set stays, as every job's does (shared by the jobs that use it). The same code
runs on the local stack, where every tier is one thread of this machine: useful to test, not to
learn.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING

from stagecoach.backend import Backend
from stagecoach.core import keys
from stagecoach.core.profiling import combine_tier_phases
from stagecoach.deploy.cleanup import rollback
from stagecoach.deploy.resources import DeployError, check_name_lengths, function_name, new_job_id
from stagecoach.deploy.roles import create_job_role
from stagecoach.deploy.start import create_stage_function, preflight
from stagecoach.deploy.upload import upload_job
from stagecoach.planner.limits import LAMBDA_MAX_MB, LAMBDA_MAX_TIMEOUT_S, LAMBDA_MIN_MB
from stagecoach.planner.profile.layers import ModelProfile

if TYPE_CHECKING:
    from stagecoach.job import Job


PROFILE_SUFFIX = "-prof"


def profile_tiers(
    job: Job,
    backend: Backend,
    tiers: Sequence[int] = (1024, 2048, 4096, 10240),
    micro_batch_sizes: Sequence[int] = (1, 2, 4),
    repeats: int = 2,
) -> ModelProfile:
    """Run the profile phase at every tier on ``backend`` and fold the results.

    Creates on the stack, then removes again (also when a tier fails): the job's objects, a worker
    role, and one function per tier.
    """
    bad = [t for t in tiers if not LAMBDA_MIN_MB <= int(t) <= LAMBDA_MAX_MB]
    if not tiers or bad:
        raise ValueError(f"tiers={list(tiers)}: give Lambda memory sizes of {LAMBDA_MIN_MB}-{LAMBDA_MAX_MB} MB")
    job.validate()
    res, c = backend.resources, backend.deploy_clients()  # on AWS: idempotent, logging to the stack's log group
    # the profile functions are "<stack>-<name>-xxxxxxxx-prof-s<i>": within Lambda's 64 characters too
    check_name_lengths(res.prefix, job.name + PROFILE_SUFFIX, len(tiers))
    preflight(res, backend.clients)
    job_id = new_job_id(job.name) + PROFILE_SUFFIX
    created: list[str] = []
    try:
        spec = upload_job(job, job.manual_plan(), res, c, job_id, window_length=None, window_state_machine=None)
        c.s3.put_object(Bucket=res.bucket, Key=keys.job_spec(job_id), Body=spec.model_dump_json().encode())
        role = create_job_role(res, c, job_id)  # the profile runs the user's code: a role of its own
        names = []
        for i, tier in enumerate(tiers):
            name = function_name(res, job_id, i)
            create_stage_function(res, c, name, job_id, int(tier), LAMBDA_MAX_TIMEOUT_S, role)
            created.append(name)
            names.append(name)
        lam = backend.long_call_client("lambda")  # lambda:InvokeFunction (deployer policy, ProfileFunctions)
        results = []
        for name in names:  # one after another: on the local stack they would share the cores
            lam.get_waiter("function_active_v2").wait(FunctionName=name, WaiterConfig={"Delay": 2, "MaxAttempts": 150})
            event = {
                "phase": "profile",
                "job": job_id,
                "bucket": res.bucket,
                "micro_batch_sizes": [int(b) for b in micro_batch_sizes],
                "repeats": int(repeats),
            }
            out = lam.invoke(FunctionName=name, Payload=json.dumps(event).encode())
            payload = json.loads(out["Payload"].read() or b"null")
            if out.get("FunctionError"):
                msg = payload.get("errorMessage", payload) if isinstance(payload, dict) else payload
                raise DeployError(f"the profile phase failed on {name}: {msg}")
            results.append(payload)
        return combine_tier_phases(results)
    finally:
        rollback(job_id, res, c, created, [])
