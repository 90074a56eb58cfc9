"""Jobs sharing a stack cannot touch each other: each job's functions run with a role of its own
(deploy/roles.py), which the local stack enforces as IAM would (local/access.py). The probe is user
code — the model factory, which workers run — trying another job's objects and function."""

import json
import time
import uuid

import pytest
import torch
from botocore.exceptions import ClientError
from torch import nn

from stagecoach import Job
from stagecoach.core import keys
from stagecoach.core.samples import Manifest
from stagecoach.deploy.iam_policy import evaluate
from stagecoach.deploy.resources import function_name
from stagecoach.deploy.roles import job_boundary_policy, job_dataset_policy, job_role_arn, job_role_name, job_worker_policy


def _data(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(24, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (24,), generator=g)


def _job(name, model, data=1):
    return Job(
        model=model,
        loss=nn.CrossEntropyLoss(),
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        train=_data(data),
        global_batch=8,
        iterations=2,
        seed=0,
        dtype=torch.float64,
        name=name,
    )


def _plain():
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))


def _probing(victim_job, victim_function, bucket, victim_data):
    """A model factory that, inside a worker (not in the SDK, which builds the model too), tries
    the victim's objects, data set and function and records what AWS answered in its own job's
    prefix. ``victim_data``: the victim's data set's manifest key, a shard's key and its prefix."""
    victim_manifest, victim_shard, victim_prefix = victim_data

    def factory():
        import os

        import boto3

        fn = os.environ.get("AWS_LAMBDA_FUNCTION_NAME", "")
        if fn.endswith("-s0"):
            own = fn[: -len("-s0")].split("-", 1)[1]  # "<stack>-<job>-s0"
            s3, lam = boto3.client("s3"), boto3.client("lambda")

            def attempt(call):
                try:
                    call()
                    return "ok"
                except Exception as e:  # what AWS answers: the error code
                    return getattr(e, "response", {}).get("Error", {}).get("Code", type(e).__name__)

            seen = {
                "read_victim_code": attempt(lambda: s3.get_object(Bucket=bucket, Key=f"jobs/{victim_job}/model/job.pkl")),
                # a copy into its own prefix, to read there: S3 checks s3:GetObject on the source too
                "copy_victim_code": attempt(
                    lambda: s3.copy_object(
                        Bucket=bucket,
                        Key=f"jobs/{own}/stolen.pkl",
                        CopySource={"Bucket": bucket, "Key": f"jobs/{victim_job}/model/job.pkl"},
                    )
                ),
                "overwrite_victim_spec": attempt(lambda: s3.put_object(Bucket=bucket, Key=f"jobs/{victim_job}/job.json", Body=b"{}")),
                "delete_victim_code": attempt(lambda: s3.delete_object(Bucket=bucket, Key=f"jobs/{victim_job}/model/job.pkl")),
                "list_victim": attempt(lambda: s3.list_objects_v2(Bucket=bucket, Prefix=f"jobs/{victim_job}/")),
                "update_victim_function": attempt(lambda: lam.update_function_configuration(FunctionName=victim_function, MemorySize=128)),
                "read_history": attempt(lambda: s3.get_object(Bucket=bucket, Key="history/victim/memory.json")),
                # the victim's training bytes (issue 24 item 6): its set's manifest, a shard, its
                # prefix, and every data set's (listing data/ would name them)
                "read_victim_data_manifest": attempt(lambda: s3.get_object(Bucket=bucket, Key=victim_manifest)),
                "read_victim_data_shard": attempt(lambda: s3.get_object(Bucket=bucket, Key=victim_shard, Range="bytes=0-15")),
                "list_victim_data": attempt(lambda: s3.list_objects_v2(Bucket=bucket, Prefix=victim_prefix)),
                "list_data_sets": attempt(lambda: s3.list_objects_v2(Bucket=bucket, Prefix="data/")),
                "read_own_spec": attempt(lambda: s3.get_object(Bucket=bucket, Key=f"jobs/{own}/job.json")),
            }
            s3.put_object(Bucket=bucket, Key=f"jobs/{own}/probe.json", Body=json.dumps(seen).encode())
        return _plain()

    return factory


def test_a_jobs_workers_cannot_touch_another_jobs_objects_or_function(backend):
    victim = _job("victim", _plain).run(backend=backend)
    assert victim.wait(progress=False, poll_s=0.5, timeout_s=300) == "SUCCEEDED"
    bucket = backend.resources.bucket
    victim_fn = function_name(backend.resources, victim.job_id, 0)
    before = backend.clients.s3.get_object(Bucket=bucket, Key=keys.job_code(victim.job_id))["Body"].read()
    victim_ds = victim.spec().dataset.id
    shard = Manifest.parse(backend.clients.s3.get_object(Bucket=bucket, Key=keys.dataset(victim_ds))["Body"].read()).shards[0]
    victim_data = (keys.dataset(victim_ds), keys.data_shard(victim_ds, shard), keys.dataset_prefix(victim_ds))

    # another data set than the victim's: reading its own is all the prober's role is granted
    prober = _job("prober", _probing(victim.job_id, victim_fn, bucket, victim_data), data=2).run(backend=backend, stages=2)
    assert prober.spec().dataset.id != victim_ds
    assert prober.wait(progress=False, poll_s=0.5, timeout_s=300) == "SUCCEEDED"  # it trains: its own objects and data set
    seen = json.loads(backend.clients.s3.get_object(Bucket=bucket, Key=f"jobs/{prober.job_id}/probe.json")["Body"].read())
    assert seen == {
        "read_victim_code": "AccessDenied",
        "copy_victim_code": "AccessDenied",
        "overwrite_victim_spec": "AccessDenied",
        "delete_victim_code": "AccessDenied",
        "list_victim": "AccessDenied",
        "update_victim_function": "AccessDeniedException",
        "read_history": "AccessDenied",
        "read_victim_data_manifest": "AccessDenied",
        "read_victim_data_shard": "AccessDenied",
        "list_victim_data": "AccessDenied",
        "list_data_sets": "AccessDenied",
        "read_own_spec": "ok",
    }
    # nothing of the victim changed
    assert backend.clients.s3.get_object(Bucket=bucket, Key=keys.job_code(victim.job_id))["Body"].read() == before
    assert backend.clients.lambda_.get_function_configuration(FunctionName=victim_fn)["MemorySize"] != 128
    # each job ran with its own role, under the stack's path and boundary
    for run in (victim, prober):
        conf = backend.clients.lambda_.get_function_configuration(FunctionName=function_name(backend.resources, run.job_id, 0))
        assert conf["Role"] == job_role_arn(backend.resources, run.job_id)
        role = backend.clients.iam.get_role(RoleName=job_role_name(backend.resources, run.job_id))["Role"]
        assert role["PermissionsBoundary"]["PermissionsBoundaryArn"] == backend.resources.job_boundary_arn


def test_cleanup_removes_the_jobs_role(backend):
    run = _job("gone", _plain).run(backend=backend)
    assert run.wait(progress=False, poll_s=0.5, timeout_s=300) == "SUCCEEDED"
    removed = backend.cleanup(run.job_id)
    assert removed.roles == [run.job_id]
    with pytest.raises(ClientError, match="NoSuchEntity"):
        backend.clients.iam.get_role(RoleName=job_role_name(backend.resources, run.job_id))


def test_the_job_role_grants_its_own_objects_and_its_own_data_sets_only(backend):
    res = backend.resources
    own_set, val_set, other_set = "0123456789abcdef" * 2, "fedcba9876543210" * 2, "00112233445566778899aabbccddeeff"
    policy, boundary = (
        job_worker_policy(res, "a-1a2b3c4d"),
        job_boundary_policy("arn:aws:s3:::" + res.bucket, res.log_group_arn, res.prefix),
    )
    datasets = job_dataset_policy(res, [own_set, val_set])
    b = f"arn:aws:s3:::{res.bucket}"

    def can(action, resource, **ctx):
        return evaluate(action, resource, [policy, datasets], boundary, ctx).allowed

    for key in (keys.job_code("a-1a2b3c4d"), keys.act("a-1a2b3c4d", 3, 1, 0, 0), keys.memory_pressure("a-1a2b3c4d", 0)):
        assert can("s3:GetObject", f"{b}/{key}") and can("s3:PutObject", f"{b}/{key}") and can("s3:DeleteObject", f"{b}/{key}")
    # its data sets (training and validation), read only; no other job's, and no listing of data/
    for ds in (own_set, val_set):
        for key in (keys.dataset(ds), keys.data_shard(ds, "ab" * 32)):
            assert can("s3:GetObject", f"{b}/{key}") and not can("s3:PutObject", f"{b}/{key}"), key
        assert can("s3:ListBucket", b, **{"s3:prefix": keys.dataset(ds)})
    for key in (keys.dataset(other_set), keys.data_shard(other_set, "ab" * 32), "data/sets/x", "data/shards/x", f"data/{own_set}"):
        assert not can("s3:GetObject", f"{b}/{key}"), key
    for prefix in ("data/", keys.dataset_prefix(other_set), "data/0123"):
        assert not can("s3:ListBucket", b, **{"s3:prefix": prefix}), prefix
    assert not evaluate("s3:GetObject", f"{b}/{keys.dataset(own_set)}", [policy], boundary).allowed  # only the "datasets" policy grants
    for bad in (["*"], ["0123456789abcdef*"], [own_set + "/../"], []):
        with pytest.raises(ValueError, match="32 hex digits"):
            job_dataset_policy(res, bad)
    for key in (keys.job_code("a-1a2b3c4d0"), keys.job_code("b-1a2b3c4d"), "history/a/memory.json", "jobs/a-1a2b3c4d"):
        assert not can("s3:GetObject", f"{b}/{key}"), key
    assert can("s3:ListBucket", b, **{"s3:prefix": "jobs/a-1a2b3c4d/iter/3/act/s1/r0/m0"})
    assert not can("s3:ListBucket", b, **{"s3:prefix": "jobs/b-1a2b3c4d/"}) and not can("s3:ListBucket", b)
    assert not can("s3:GetObject", f"arn:aws:s3:::other-bucket/{keys.job_code('a-1a2b3c4d')}")
    for action in ("lambda:UpdateFunctionConfiguration", "lambda:InvokeFunction", "iam:PassRole", "states:StartExecution"):
        assert not can(action, "*")
    # the phase watcher runs its own job's tasks again (lambdas/watcher.py): its job's functions by
    # name and tag; not another job's, even one whose name extends this one's, nor an untagged one
    fn = f"arn:aws:lambda:{res.region}:{res.log_group_arn.split(':')[4]}:function:{res.prefix}-"
    own = {"aws:ResourceTag/stagecoach:stack": res.prefix, "aws:ResourceTag/stagecoach:job": "a-1a2b3c4d"}
    for name in ("a-1a2b3c4d-s0", "a-1a2b3c4d-s2-r3", "a-1a2b3c4d-s1-k0"):
        assert can("lambda:InvokeFunction", fn + name, **own), name
    extended = {**own, "aws:ResourceTag/stagecoach:job": "a-1a2b3c4d-s1-deadbeef"}
    assert not can("lambda:InvokeFunction", fn + "a-1a2b3c4d-s1-deadbeef-s0", **extended)
    assert not can("lambda:InvokeFunction", fn + "a-1a2b3c4d-s0", **{"aws:ResourceTag/stagecoach:stack": res.prefix})
    assert not can("lambda:InvokeFunction", fn + "b-1a2b3c4d-s0", **{**own, "aws:ResourceTag/stagecoach:job": "b-1a2b3c4d"})
    assert not can("lambda:UpdateFunctionCode", fn + "a-1a2b3c4d-s0", **own)
    # a policy beyond the boundary grants nothing more (what the deployer cannot escalate to)
    wide = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}
    assert not evaluate("s3:GetObject", f"{b}/history/x", [wide], boundary).allowed
    assert evaluate("s3:GetObject", f"{b}/history/x", [wide], boundary).reason.startswith("no permissions boundary allows")
    assert not evaluate("lambda:UpdateFunctionCode", "arn:aws:lambda:us-east-1:1:function:x", [wide], boundary).allowed


def _call_as(backend, role_arn, service, method, **kwargs):
    """Invoke a function running with ``role_arn`` that makes one call; AWS's answer (code, message)."""
    from helpers import HANDLERS

    from stagecoach.deploy.roles import create_function_when_role_ready

    c, res = backend.clients, backend.resources
    name = f"probe-{uuid.uuid4().hex[:8]}"
    create_function_when_role_ready(
        c,
        dict(
            FunctionName=name,
            Role=role_arn,
            PackageType="Image",
            Code={"ImageUri": res.image_uri},
            ImageConfig={"Command": ["aws_call.handler"]},
            Timeout=30,
            MemorySize=512,
            Environment={"Variables": {"PYTHONPATH": HANDLERS}},
            Tags={"stagecoach:stack": res.prefix},
        ),
    )
    out = c.lambda_.invoke(FunctionName=name, Payload=json.dumps({"service": service, "method": method, "kwargs": kwargs}).encode())
    return json.loads(out["Payload"].read())


def test_the_stack_roles_are_enforced_with_aws_answers(backend):
    from stagecoach.deploy.roles import create_job_role

    res = backend.resources
    job = f"probe-{uuid.uuid4().hex[:8]}"
    role = create_job_role(res, backend.clients, job)
    own = f"jobs/{job}/x"
    assert _call_as(backend, role, "s3", "put_object", Bucket=res.bucket, Key=own, Body="1")["code"] == "ok"
    # a missing key of its own job: 404 (the role may list its prefix), not 403
    assert _call_as(backend, role, "s3", "get_object", Bucket=res.bucket, Key=f"jobs/{job}/missing")["code"] == "NoSuchKey"
    denied = _call_as(backend, role, "s3", "get_object", Bucket=res.bucket, Key="jobs/other-1a2b3c4d/job.json")
    assert denied["code"] == "AccessDenied"
    assert denied["message"].startswith(f"User: arn:aws:sts::123456789012:assumed-role/{res.prefix}-{job}/probe-")
    assert denied["message"].endswith(
        f'is not authorized to perform: s3:GetObject on resource: "arn:aws:s3:::{res.bucket}/jobs/other-1a2b3c4d/job.json" '
        "because no identity-based policy allows the s3:GetObject action"
    )
    # aborting a multipart upload is s3:AbortMultipartUpload, not s3:DeleteObject (which the role
    # has): the workers upload no multipart objects and are not granted it
    upload = backend.clients.s3.create_multipart_upload(Bucket=res.bucket, Key=own + "-multipart")["UploadId"]
    aborted = _call_as(backend, role, "s3", "abort_multipart_upload", Bucket=res.bucket, Key=own + "-multipart", UploadId=upload)
    assert aborted["code"] == "AccessDenied" and "s3:AbortMultipartUpload" in aborted["message"], aborted
    # a call the local stack cannot map to IAM is denied, not waved through; Lambda's and Step
    # Functions' denials in their own shapes
    assert _call_as(backend, role, "stepfunctions", "list_state_machines")["code"] == "AccessDeniedException"
    assert _call_as(backend, role, "lambda", "get_function", FunctionName=res.control_function)["code"] == "AccessDeniedException"
    # the control role: the remediation's calls, on tagged stage functions only
    control = res.control_role_arn
    assert _call_as(backend, control, "s3", "get_object", Bucket=res.bucket, Key=own)["code"] == "AccessDenied"
    assert _call_as(backend, control, "lambda", "get_function_configuration", FunctionName=res.control_function)["code"] == (
        "AccessDeniedException"
    )


def test_a_copy_needs_read_on_its_source_as_on_aws(backend):
    """CopyObject and UploadPartCopy read the object their x-amz-copy-source names: S3 checks
    s3:GetObject on that source as well as s3:PutObject on the destination (S3 API reference,
    CopyObject and UploadPartCopy, "Permissions"; s3:GetObjectVersion for a source ?versionId=, as
    GetObject's page says). A job's worker cannot copy another job's code into its own prefix to
    read it there."""
    from stagecoach.deploy.roles import create_job_role

    res, s3 = backend.resources, backend.clients.s3
    job, victim = f"copier-{uuid.uuid4().hex[:8]}", f"victim-{uuid.uuid4().hex[:8]}"
    role = create_job_role(res, backend.clients, job)
    secret, stolen, own = keys.job_code(victim), f"jobs/{job}/stolen.pkl", f"jobs/{job}/mine.pkl"
    s3.put_object(Bucket=res.bucket, Key=secret, Body=b"the victim's pickled code")
    s3.put_object(Bucket=res.bucket, Key=own, Body=b"its own code")

    def copy(method, source, **kwargs):
        return _call_as(backend, role, "s3", method, Bucket=res.bucket, CopySource={"Bucket": res.bucket, **source}, **kwargs)

    copied = copy("copy_object", {"Key": secret}, Key=stolen)
    assert copied["code"] == "AccessDenied", copied
    assert copied["message"].endswith(
        f'is not authorized to perform: s3:GetObject on resource: "arn:aws:s3:::{res.bucket}/{secret}" '
        "because no identity-based policy allows the s3:GetObject action"
    )
    upload = s3.create_multipart_upload(Bucket=res.bucket, Key=stolen)["UploadId"]
    part = copy("upload_part_copy", {"Key": secret}, Key=stolen, UploadId=upload, PartNumber=1)
    s3.abort_multipart_upload(Bucket=res.bucket, Key=stolen, UploadId=upload)
    assert part["code"] == "AccessDenied" and f's3:GetObject on resource: "arn:aws:s3:::{res.bucket}/{secret}"' in part["message"]
    assert s3.list_objects_v2(Bucket=res.bucket, Prefix=stolen)["KeyCount"] == 0  # nothing landed
    # within its own prefix both sides are granted; a source version needs s3:GetObjectVersion
    assert copy("copy_object", {"Key": own}, Key=stolen)["code"] == "ok"
    assert s3.get_object(Bucket=res.bucket, Key=stolen)["Body"].read() == b"its own code"
    versioned = copy("copy_object", {"Key": own, "VersionId": "3HL4kqtJlcpXroDTDmJ+rmSpXd3dIbrHY"}, Key=stolen)
    assert versioned["code"] == "AccessDenied" and "s3:GetObjectVersion" in versioned["message"], versioned


def test_a_new_role_is_refused_until_iam_propagates_it(backend):
    """Lambda's CreateFunction right after CreateRole (Fidelity.role_propagation_s); the SDK waits it out."""
    from stagecoach.deploy.roles import create_function_when_role_ready, create_job_role

    c, res = backend.clients, backend.resources
    role = create_job_role(res, c, f"fresh-{uuid.uuid4().hex[:8]}")
    spec = dict(
        FunctionName=f"fresh-{uuid.uuid4().hex[:8]}",
        Role=role,
        PackageType="Image",
        Code={"ImageUri": res.image_uri},
        ImageConfig={"Command": ["noop.handler"]},
    )
    with pytest.raises(ClientError, match="The role defined for the function cannot be assumed by Lambda") as e:
        c.lambda_.create_function(**spec)
    assert e.value.response["Error"]["Code"] == "InvalidParameterValueException"
    started = time.monotonic()
    create_function_when_role_ready(c, spec)
    assert time.monotonic() - started < 10
    assert c.lambda_.get_function_configuration(FunctionName=spec["FunctionName"])["Role"] == role


def test_a_worker_cannot_steer_the_remediation_to_another_jobs_memory(backend):
    """Issue 24 item 7 (confused deputy): a worker rewrote its own job.json to name another job, so
    that the remediation, on the stack's control role, wrote that job's history/<name>/memory.json
    (its next run started a stage 6 tiers up). The job's spec is the deployer's: the workers may
    read it, not write or delete it; and the remediation takes the job, its name and its functions
    from the job execution's input, refusing a spec that names another job."""
    from stagecoach.core.records import JobSpec

    c, res = backend.clients, backend.resources
    run = _job("deputy", _plain).run(backend=backend, stages=2)
    assert run.wait(progress=False, poll_s=0.5, timeout_s=300) == "SUCCEEDED"
    role, spec_key = job_role_arn(res, run.job_id), keys.job_spec(run.job_id)
    spec = JobSpec.model_validate_json(c.s3.get_object(Bucket=res.bucket, Key=spec_key)["Body"].read())
    forged = spec.model_copy(update={"name": "victim"}).model_dump_json()
    # the attack as a worker makes it, with the job's own role
    assert _call_as(backend, role, "s3", "put_object", Bucket=res.bucket, Key=spec_key, Body=forged)["code"] == "AccessDenied"
    assert _call_as(backend, role, "s3", "delete_object", Bucket=res.bucket, Key=spec_key)["code"] == "AccessDenied"
    assert _call_as(backend, role, "s3", "get_object", Bucket=res.bucket, Key=spec_key)["code"] == "ok"  # workers read it
    # and had the spec been rewritten anyway, the remediation would not act on another job's name
    c.s3.put_object(Bucket=res.bucket, Key=spec_key, Body=forged.encode())
    victim = keys.learnt_memory("victim")
    before = c.s3.list_objects_v2(Bucket=res.bucket, Prefix=victim).get("Contents", [])
    fn = function_name(res, run.job_id, 1)
    event = {"phase": "remediate", "job": run.job_id, "bucket": res.bucket, "function": fn, "stage": 1}
    out = c.lambda_.invoke(FunctionName=res.control_function, Payload=json.dumps({**event, "error": "Runtime.OutOfMemory"}).encode())
    reply = json.loads(out["Payload"].read())
    assert out.get("FunctionError") and "victim" in reply["errorMessage"] and run.job_id in reply["errorMessage"], reply
    assert c.s3.list_objects_v2(Bucket=res.bucket, Prefix=victim).get("Contents", []) == before
    assert c.lambda_.get_function_configuration(FunctionName=fn)["MemorySize"] == spec.to_plan().memory_mb[1]
