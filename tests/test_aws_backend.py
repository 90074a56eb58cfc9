"""The AWS backend against moto (mock_aws): the resources template.yaml creates, then deploy, start,
inspect and cleanup a job, with IAM enforced for the deployer policy, and the errors a user meets
(missing stack, unusable stack, region, Python version, AccessDenied)."""

import json
import os
import sys

import boto3
import click
import pytest
import torch
from botocore.exceptions import ClientError, WaiterError
from botocore.stub import Stubber
from click.testing import CliRunner
from moto import mock_aws
from moto.core import enable_iam_authentication
from moto.iam import access_control
from torch import nn

from stagecoach import Job, history
from stagecoach.aws.__main__ import _main
from stagecoach.aws.access import AccessDenied
from stagecoach.aws.backend import AwsBackend
from stagecoach.aws.idempotent import IdempotentStepFunctions, ensure_function, ensure_state_machine, wait_function
from stagecoach.aws.stack import RegionMismatch, StackError, StackNotFound, stack_outputs
from stagecoach.cli.cleanup import cleanup_command
from stagecoach.cli.inspect import inspect_command
from stagecoach.cli.options import backend_for
from stagecoach.cli.stop import stop_command
from stagecoach.core import keys
from stagecoach.core.records import TaskMetrics
from stagecoach.deploy.cleanup import Removed
from stagecoach.deploy.iam_policy import arn_matches
from stagecoach.deploy.resources import DeployError, check_name_lengths
from stagecoach.deploy.roles import job_boundary_policy, job_role_arn, role_path
from stagecoach.inspect.plots import write_plots
from stagecoach.inspect.report import InspectError, format_report, inspect_execution

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REGION = "us-east-1"
ACCOUNT = "123456789012"
STACK = "sc"
IMAGE = "123456789012.dkr.ecr.us-east-1.amazonaws.com/sc-worker:py311"


def _trust(service):
    return json.dumps(
        {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Principal": {"Service": service}, "Action": "sts:AssumeRole"}]}
    )


def make_stack(name=STACK, region=REGION, python=None):
    """What `sam deploy` of template.yaml leaves behind (names as CloudFormation generates them)."""
    iam = boto3.client("iam", region_name=region)
    roles = {}
    for logical, svc in (
        ("ControlRole", "lambda.amazonaws.com"),
        ("WindowStatesRole", "states.amazonaws.com"),
        ("JobStatesRole", "states.amazonaws.com"),
    ):
        roles[logical] = iam.create_role(RoleName=f"{name}-{logical}-ABC123", Path=role_path(name), AssumeRolePolicyDocument=_trust(svc))[
            "Role"
        ]["Arn"]
    log_group = f"arn:aws:logs:{region}:{ACCOUNT}:log-group:/aws/lambda/{name}-workers:*"
    boundary = iam.create_policy(
        PolicyName=f"{name}-JobRoleBoundary-ABC123",
        Path=role_path(name),
        PolicyDocument=json.dumps(job_boundary_policy(f"arn:aws:s3:::{name}-bucket", log_group, name)),
    )["Policy"]["Arn"]
    sfn = boto3.client("stepfunctions", region_name=region)
    with open(os.path.join(ROOT, "statemachines", "job.asl.json")) as f:
        job_sm = sfn.create_state_machine(name=f"{name}-job", definition=f.read(), roleArn=roles["JobStatesRole"])["stateMachineArn"]
    lam = boto3.client("lambda", region_name=region)
    lam.create_function(
        FunctionName=f"{name}-worker",
        Role=roles["ControlRole"],
        PackageType="Image",
        Code={"ImageUri": IMAGE},
        ImageConfig={"Command": ["stagecoach.lambdas.handler.handler"]},
        MemorySize=2048,
        Timeout=900,
    )
    # the stack itself: a bucket resource (as in the template) and the outputs the SDK reads
    template = {
        "Resources": {
            "Bucket": {
                "Type": "AWS::S3::Bucket",
                "Properties": {
                    "BucketEncryption": {
                        "ServerSideEncryptionConfiguration": [{"ServerSideEncryptionByDefault": {"SSEAlgorithm": "AES256"}}]
                    }
                },
            }
        },
        "Outputs": {
            "BucketName": {"Value": {"Ref": "Bucket"}},
            "WorkerFunctionName": {"Value": f"{name}-worker"},
            "WorkerLogGroupName": {"Value": f"/aws/lambda/{name}-workers"},
            "ControlRoleArn": {"Value": roles["ControlRole"]},
            "JobRoleBoundaryArn": {"Value": boundary},
            "StatesRoleArn": {"Value": roles["WindowStatesRole"]},
            "JobStateMachineArn": {"Value": job_sm},
            "Region": {"Value": region},
            "Architecture": {"Value": "arm64"},
            "WorkerPython": {"Value": python or f"{sys.version_info.major}.{sys.version_info.minor}"},
        },
    }
    cfn = boto3.client("cloudformation", region_name=region)
    cfn.create_stack(StackName=name, TemplateBody=json.dumps(template))
    return roles, job_sm


@pytest.fixture
def aws(monkeypatch, tmp_path):
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.setenv(k, "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    monkeypatch.chdir(tmp_path)  # no samconfig.toml unless a test writes one
    # moto answers GetAccountSettings with 404 (not implemented): the account's concurrency is
    # checked against a stubbed Lambda in test_the_account_concurrency_is_read_and_its_denial_explained
    monkeypatch.setattr(AwsBackend, "available_concurrency", lambda self: (1000, "moto's account"))
    with mock_aws():
        yield make_stack()


def tiny_job(name="tiny"):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 4, generator=g)
    y = torch.randint(0, 3, (32,), generator=g)
    return Job(
        model=lambda: nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)),
        loss=nn.CrossEntropyLoss(),
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        train=(x, y),
        global_batch=16,
        iterations=4,
        seed=0,
        name=name,
    )


def fake_metrics(backend, job_id, plan, iterations, loss0=2.0, t0=1000.0):
    """Metrics objects as the workers write them (docs/runtime.md), with known timings: forward at
    +0 s, backward at +2 s, sync at +5 s, each task 1.5 s; sync tasks as the plan has them (K per
    stage, none for a fused sync)."""
    s3, bucket = backend.clients.s3, backend.resources.bucket
    for t in range(iterations):
        base = t0 + 10.0 * t
        for phase, off, count, stages in (
            ("forward", 0.0, lambda s: plan.replicas, range(plan.stages - 1)),
            ("backward", 2.0, lambda s: plan.replicas, range(plan.stages)),
            ("sync", 5.0, plan.sync_tasks, range(plan.stages)),
        ):
            for s in stages:
                for i in range(count(s)):
                    m = TaskMetrics(
                        phase=phase,
                        t=t,
                        stage=s,
                        index=i,
                        start=base + off,
                        end=base + off + 1.5,
                        duration_s=1.5,
                        upload_s=0.2,
                        download_s=0.1,
                        transfer_s=0.3,
                        wait_s=0.3,
                        bytes_up=1000,
                        bytes_down=2000,
                        puts=2,
                        gets=3,
                        compute_s=0.9,
                        container=f"c{s}{i}",
                        container_started=base,
                        invocation=t + 1,
                        cold=t == 0,
                        memory_mb=1024,
                        max_rss_mb=300.0,
                        loss=loss0 / (t + 1) if phase == "backward" and s == plan.stages - 1 else None,
                    )
                    s3.put_object(Bucket=bucket, Key=keys.metrics(job_id, t, phase, s, i), Body=m.model_dump_json().encode())


def test_finds_the_stack_from_its_outputs(aws):
    roles, job_sm = aws
    b = AwsBackend(STACK, REGION)
    r = b.resources
    assert (r.prefix, r.region, r.architecture) == (STACK, REGION, "arm64")
    assert r.control_role_arn == roles["ControlRole"] and r.states_role_arn == roles["WindowStatesRole"]
    assert r.job_state_machine_arn == job_sm
    assert r.bucket.startswith(f"{STACK}-bucket-")
    # the image comes from the default worker, pinned by digest
    assert r.image_uri.startswith(IMAGE.split(":py311")[0] + "@sha256:")
    assert "console.aws.amazon.com/states" in r.console.format(region=REGION, arn="x")


def test_missing_stack_says_how_to_deploy(aws):
    with pytest.raises(StackNotFound, match=r"no CloudFormation stack 'nope' in us-east-1.*sam deploy --guided"):
        AwsBackend("nope", REGION)


def test_region_mismatch_from_samconfig(aws, tmp_path):
    (tmp_path / "samconfig.toml").write_text('version = 0.1\n[default.deploy.parameters]\nstack_name = "other"\nregion = "eu-west-1"\n')
    with pytest.raises(RegionMismatch, match="eu-west-1"):
        AwsBackend("other", REGION)


def test_region_mismatch_of_an_arn(aws):
    b = AwsBackend(STACK, REGION)
    with pytest.raises(RegionMismatch, match="--region eu-west-1"):
        b.check_arn("arn:aws:states:eu-west-1:123456789012:execution:sc-job:x")


def test_not_a_stagecoach_stack(aws):
    boto3.client("cloudformation", region_name=REGION).create_stack(
        StackName="plain", TemplateBody=json.dumps({"Resources": {"B": {"Type": "AWS::S3::Bucket"}}})
    )
    with pytest.raises(StackError, match="lacks the outputs"):
        AwsBackend("plain", REGION)


def test_access_denied_names_action_resource_and_statement(aws):
    roles, _ = aws
    b = AwsBackend(STACK, REGION)
    s3 = b.clients.s3
    with Stubber(s3) as stub:
        stub.add_client_error("put_object", service_error_code="AccessDenied", service_message="Access Denied", http_status_code=403)
        with pytest.raises(AccessDenied) as e:
            s3.put_object(Bucket=b.resources.bucket, Key="jobs/j/plan.json", Body=b"{}")
    err = e.value
    assert err.action == "s3:PutObject"
    assert err.resource == f"arn:aws:s3:::{b.resources.bucket}/jobs/j/plan.json"
    assert err.statement["Sid"] == "JobObjects" and "statement 'JobObjects'" in str(err)
    # paginated listing maps to s3:ListBucket
    with Stubber(s3) as stub:
        stub.add_client_error("list_objects_v2", service_error_code="AccessDenied", http_status_code=403)
        with pytest.raises(AccessDenied, match=r"s3:ListBucket on arn:aws:s3:::"):
            list(s3.get_paginator("list_objects_v2").paginate(Bucket=b.resources.bucket, Prefix="jobs/"))
    # when AWS names the action (iam:PassRole inside CreateFunction), that is what is reported
    lam = b.clients.lambda_

    def pass_role_denied(role):
        msg = f"User: arn:aws:iam::123456789012:user/dev is not authorized to perform: iam:PassRole on resource: {role}"
        with Stubber(lam) as stub:
            stub.add_client_error("create_function", service_error_code="AccessDeniedException", service_message=msg, http_status_code=403)
            with pytest.raises(AccessDenied) as e:
                lam.create_function(FunctionName="sc-x-s0", Role=role, Code={"ImageUri": IMAGE}, PackageType="Image")
        assert (e.value.action, e.value.resource) == ("iam:PassRole", role)
        return e.value

    job_role = job_role_arn(b.resources, "x-1a2b3c4d")
    err = pass_role_denied(job_role)
    assert err.statement["Sid"] == "PassJobRoles" and err.covered
    # rendered for this stack: the jobs' roles under its IAM path, its bucket
    path = f"arn:aws:iam::{ACCOUNT}:role/stagecoach/{STACK}/"
    assert err.statement["Resource"] == [f"{path}{STACK}-*-????????", f"{path}{STACK}-*-????????-prof"]
    assert all(r.startswith(path) for r in roles.values())
    # the stack's control role is never passed to a function: the statement does not cover it
    err = pass_role_denied(b.resources.control_role_arn)
    assert err.statement["Sid"] == "PassJobRoles" and not err.covered and "grants iam:PassRole only on" in str(err)
    assert f"arn:aws:s3:::{b.resources.bucket}/jobs/*" in b.deployer_policy()["Statement"][1]["Resource"]
    # S3's newer messages quote the resource
    quoted = (
        f"User: arn:aws:iam::123456789012:user/dev is not authorized to perform: s3:GetObject on resource: "
        f'"arn:aws:s3:::{b.resources.bucket}/history/j/memory.json" because no identity-based policy allows the s3:GetObject action'
    )
    with Stubber(s3) as stub:
        stub.add_client_error("get_object", service_error_code="AccessDenied", service_message=quoted, http_status_code=403)
        with pytest.raises(AccessDenied) as e:
            s3.get_object(Bucket=b.resources.bucket, Key="history/j/memory.json")
    assert e.value.resource == f"arn:aws:s3:::{b.resources.bucket}/history/j/memory.json"
    assert e.value.statement["Sid"] == "JobObjects" and e.value.covered
    # an explicit Deny cannot be fixed by adding the statement: say so
    deny = (
        f"User: arn:aws:iam::123456789012:user/dev is not authorized to perform: iam:PassRole on resource: {job_role} "
        "with an explicit deny in a service control policy"
    )
    with Stubber(lam) as stub:
        stub.add_client_error("create_function", service_error_code="AccessDeniedException", service_message=deny, http_status_code=403)
        with pytest.raises(AccessDenied, match="explicit Deny .* cannot override") as e:
            lam.create_function(FunctionName="sc-x-s0", Role=job_role, Code={"ImageUri": IMAGE}, PackageType="Image")
    assert e.value.explicit_deny
    # a resource that is not the stack's: the statement exists but does not cover it
    with Stubber(s3) as stub:
        stub.add_client_error("get_object", service_error_code="AccessDenied", http_status_code=403)
        with pytest.raises(AccessDenied, match=r"grants s3:GetObject only on .* is arn:aws:s3:::other-bucket/x a resource of stack 'sc'"):
            s3.get_object(Bucket="other-bucket", Key="x")
    # bad credentials are not a missing permission: they pass through as they are
    with Stubber(lam) as stub:
        stub.add_client_error(
            "get_function",
            service_error_code="UnrecognizedClientException",
            http_status_code=403,
            service_message="The security token included in the request is invalid.",
        )
        with pytest.raises(ClientError) as e:
            lam.get_function(FunctionName="sc-x-s0")
    assert not isinstance(e.value, AccessDenied)
    # ... and AccessDenied is a DeployError, which `stagecoach train` reports as a message
    assert issubclass(AccessDenied, DeployError) and issubclass(AccessDenied, ClientError)
    # a non-denial error passes through untouched
    with Stubber(s3) as stub:
        stub.add_client_error("get_object", service_error_code="NoSuchKey", http_status_code=404)
        with pytest.raises(s3.exceptions.NoSuchKey):
            s3.get_object(Bucket=b.resources.bucket, Key="jobs/none")


def test_idempotent_function_and_state_machine(aws):
    roles, _ = aws
    b = AwsBackend(STACK, REGION)
    lam, sfn = b.clients.lambda_, b.clients.sfn
    spec = dict(
        FunctionName="sc-j-s0",
        Role=roles["ControlRole"],
        PackageType="Image",
        Code={"ImageUri": IMAGE},
        ImageConfig={"Command": ["stagecoach.lambdas.handler.handler"]},
        MemorySize=512,
        Timeout=60,
    )
    ensure_function(lam, dict(spec))
    ensure_function(lam, dict(spec, MemorySize=1536, Timeout=120))
    conf = lam.get_function_configuration(FunctionName="sc-j-s0")
    assert (conf["MemorySize"], conf["Timeout"], conf["State"]) == (1536, 120, "Active")
    d1 = json.dumps({"StartAt": "A", "States": {"A": {"Type": "Pass", "End": True}}})
    d2 = json.dumps({"StartAt": "B", "States": {"B": {"Type": "Succeed"}}})
    a1 = ensure_state_machine(sfn, name="sc-j-window", definition=d1, roleArn=roles["WindowStatesRole"])["stateMachineArn"]
    a2 = ensure_state_machine(sfn, name="sc-j-window", definition=d2, roleArn=roles["WindowStatesRole"])["stateMachineArn"]
    assert a1 == a2 and sfn.describe_state_machine(stateMachineArn=a1)["definition"] == d2


def test_name_length_is_checked_before_creating_anything(aws):
    check_name_lengths("stagecoach", "digits", 3)
    with pytest.raises(DeployError, match="64"):
        check_name_lengths("a-rather-long-stack-name-x", "a-rather-long-job-name-xyz", 3)


def test_deploy_start_inspect_cleanup(aws, tmp_path):
    roles, job_sm = aws
    b = AwsBackend(STACK, REGION)
    job = tiny_job()
    plan = job.manual_plan(stages=2, replicas=2, micro_batches=2, memory_mb=1536, timeout_s=120)
    run = b.launch(job, plan)
    c = b.clients
    # warm state with d = 2: a function per (stage, replica) and per (stage, sync task), from the
    # stack's image, memory and timeout from the plan (docs/runtime.md "State that stays warm"),
    # and the phase watcher's beside stage 0's (plan.watcher_function)
    workers = ["", "-r1", "-k0", "-k1"]
    expected = [(s, w) for s in range(2) for w in workers] + [(0, "-w")]
    job_fns = sorted(f["FunctionName"] for f in c.lambda_.list_functions()["Functions"] if run.job_id in f["FunctionName"])
    assert job_fns == sorted(f"{STACK}-{run.job_id}-s{s}{w}" for s, w in expected)
    for s, w in expected:
        conf = c.lambda_.get_function(FunctionName=f"{STACK}-{run.job_id}-s{s}{w}")
        assert conf["Configuration"]["MemorySize"] == 1536
        assert conf["Configuration"]["Timeout"] == plan.function_timeout_s(s)
        # the job's own role, under the stack's path, bounded by the stack's boundary
        assert conf["Configuration"]["Role"] == f"arn:aws:iam::{ACCOUNT}:role/stagecoach/{STACK}/{STACK}-{run.job_id}"
        assert conf["Tags"]["stagecoach:stack"] == STACK
        assert conf["Configuration"]["Architectures"] == ["arm64"]
        assert conf["Code"]["ImageUri"] == b.resources.image_uri
    window = f"arn:aws:states:{REGION}:123456789012:stateMachine:{STACK}-{run.job_id}-window"
    assert c.sfn.describe_state_machine(stateMachineArn=window)["roleArn"] == roles["WindowStatesRole"]
    d = c.sfn.describe_execution(executionArn=run.execution_arn)
    assert d["stateMachineArn"] == job_sm and d["status"] == "RUNNING"
    assert json.loads(d["input"])["windowStateMachineArn"] == window
    assert run.console_url.startswith(f"https://{REGION}.console.aws.amazon.com/states/") and run.execution_arn in run.console_url
    assert run.history()  # paged through get_execution_history

    fake_metrics(b, run.job_id, plan, iterations=3)
    ins = inspect_execution(b, run.execution_arn)
    assert ins.status == "RUNNING" and ins.job_id == run.job_id
    assert (ins.iterations_done, ins.iterations) == (3, 4)
    assert ins.losses == pytest.approx([2.0, 1.0, 2.0 / 3])
    assert ins.phase_timings["backward"]["span_s"] == pytest.approx(1.5)
    assert ins.phase_timings["forward"]["tasks"] == 2 * 1 * 2  # iterations 1, 2 x stage 0 x 2 replicas
    # 10 s per iteration; phases cover 4.5 s of it, so 5.5 s is orchestration
    assert [x["iteration_s"] for x in ins.breakdown] == pytest.approx([10.0, 10.0])
    assert ins.breakdown[0]["orchestration_s"] == pytest.approx(5.5)
    assert ins.breakdown[0]["compute_s"] == pytest.approx(4.5 * 0.9 / 1.5)
    report = format_report(ins)
    assert "iteration 3/4 done" in report and "failed tasks: none" in report
    paths = write_plots(ins, str(tmp_path / "plots"))
    assert len(paths) == 3 and all(os.path.getsize(p) > 5000 for p in paths)

    # the CLI: inspect finds the stack from --stack
    out = CliRunner().invoke(inspect_command, [run.execution_arn, "--stack", STACK, "--region", REGION, "--json"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.output)["iterations_done"] == 3

    # stop (moto's account is the local stack's, so the stack is named, not inferred from the ARN);
    # the request is what the job's iteration gate reads
    out = CliRunner().invoke(stop_command, [run.job_id, "--stack", STACK, "--region", REGION])
    assert out.exit_code == 0 and "stop requested" in out.output, out.output
    body = c.s3.get_object(Bucket=b.resources.bucket, Key=keys.stop_request(run.job_id))["Body"].read()
    assert json.loads(body)["reason"] == "requested"

    # cleanup refuses a running job, then stops it with --force; everything of the job is gone
    with pytest.raises(DeployError, match="still running"):
        b.cleanup(run.job_id)
    out = CliRunner().invoke(cleanup_command, [run.execution_arn, "--stack", STACK, "--region", REGION, "--force"])
    assert out.exit_code == 0, out.output
    assert "removed 9 functions, 1 state machines" in out.output and "the job's role" in out.output
    assert c.sfn.describe_execution(executionArn=run.execution_arn)["status"] == "ABORTED"
    names = [f["FunctionName"] for f in c.lambda_.list_functions()["Functions"]]
    assert names == [f"{STACK}-worker"]
    with pytest.raises(c.sfn.exceptions.StateMachineDoesNotExist):
        c.sfn.describe_state_machine(stateMachineArn=window)
    assert c.s3.list_objects_v2(Bucket=b.resources.bucket, Prefix=f"jobs/{run.job_id}/")["KeyCount"] == 0
    assert c.s3.list_objects_v2(Bucket=b.resources.bucket, Prefix="data/")["KeyCount"] == 2  # shared data stays: a shard, its manifest
    # the job's role went with it; the stack's own roles stay
    left = [r["RoleName"] for r in boto3.client("iam").list_roles(PathPrefix=f"/stagecoach/{STACK}/")["Roles"]]
    assert sorted(left) == sorted(arn.rsplit("/", 1)[1] for arn in roles.values())
    again = b.cleanup(run.job_id)  # idempotent
    assert again == Removed()


def test_failed_launch_leaves_nothing_behind(aws):
    b = AwsBackend(STACK, REGION)
    job = tiny_job("broken")
    plan = job.manual_plan(stages=2, replicas=1)
    real = b.clients.sfn

    class Refuse:
        def __getattr__(self, n):
            return getattr(real, n)

        def start_execution(self, **kw):
            raise RuntimeError("refused")

    b.clients.sfn = Refuse()
    with pytest.raises(RuntimeError, match="refused"):
        b.launch(job, plan)
    assert [f["FunctionName"] for f in b.clients.lambda_.list_functions()["Functions"]] == [f"{STACK}-worker"]
    assert [m["name"] for m in real.list_state_machines()["stateMachines"]] == [f"{STACK}-job"]


def test_train_cli_needs_a_stack_for_aws(aws, monkeypatch):
    monkeypatch.delenv("STAGECOACH_STACK", raising=False)
    with pytest.raises(click.ClickException, match="--stack"):
        backend_for("aws", None, REGION)
    assert backend_for(None, STACK, REGION).name == "aws"  # --stack alone means aws


# ------------------------------------------------------------------------------ IAM, enforced
def _identity_with(policy, user):
    """Credentials of a new IAM user whose only permissions are ``policy`` (moto's IAM)."""
    iam = boto3.client("iam", region_name=REGION)
    iam.create_user(UserName=user)
    iam.put_user_policy(UserName=user, PolicyName="stagecoach-deployer", PolicyDocument=json.dumps(policy))
    key = iam.create_access_key(UserName=user)["AccessKey"]
    return boto3.Session(aws_access_key_id=key["AccessKeyId"], aws_secret_access_key=key["SecretAccessKey"], region_name=REGION)


def _for_moto(policy):
    """The deployer policy as moto can evaluate it. moto checks S3 requests against the bucket and
    key ARNs, so the S3 statements stay exactly as they are; it checks Lambda, Step Functions and
    CloudFormation requests only against Resource "*", so their statements keep their actions
    (every action the SDK calls must be listed) with Resource "*" (the resource scoping of those is
    checked against the real names in test_template.py). moto also calls HeadBucket's action
    s3:HeadBucket, where AWS authorises it as s3:ListBucket."""
    out = json.loads(json.dumps(policy))
    for st in out["Statement"]:
        if not any(a.startswith("s3:") for a in st["Action"]):
            st["Resource"] = "*"
            st.pop("Condition", None)  # moto does not know iam:PassedToService (and does not check PassRole)
        if "s3:ListBucket" in st["Action"]:
            st["Action"].append("s3:HeadBucket")
    return out


@pytest.fixture
def enforced_iam(aws, monkeypatch):
    """IAM enforcement in moto. Request signatures are not what is under test (moto recomputes
    Lambda's REST signatures differently from botocore), so their check is switched off."""
    monkeypatch.setattr(access_control.IAMRequestBase, "check_signature", lambda self: None)
    return enable_iam_authentication


def test_deployer_policy_grants_every_call_of_a_job_s_life(aws, enforced_iam):
    """Launch (history read, uploads, functions, window machine, start), watch, inspect, record what
    the run taught, clean up: as an identity holding only the deployer policy, with IAM enforced.
    A call the policy lacks fails here with AccessDenied, as it would on AWS."""
    admin = AwsBackend(STACK, REGION)
    dev = _identity_with(_for_moto(admin.deployer_policy()), "dev")
    job = tiny_job()
    with enforced_iam():
        b = AwsBackend(STACK, REGION, session=dev)
        run = job.run(plan=job.manual_plan(stages=2, replicas=2, memory_mb=1024, timeout_s=60), backend=b)
        assert run.status() == "RUNNING" and run.history()
    fake_metrics(admin, run.job_id, run.plan, iterations=2)  # what the workers would write
    with enforced_iam():
        ins = inspect_execution(b, run.execution_arn)
        assert ins.iterations_done == 2
        history.record(b.clients.s3, b.resources.bucket, job.name, run.job_id, run.plan, run.metrics())  # as Run.wait does
        assert run.cost().phases["client"].puts > 0  # the measured cost: metrics, histories, the launch's requests
        run.stop()  # the stop request, as Run.stop() and `stagecoach stop` write it
        assert b.clients.s3.get_object(Bucket=b.resources.bucket, Key=keys.stop_request(run.job_id))
        removed = b.cleanup(run.job_id, stop_running=True)
    # d = 2, warm: one per worker, and the phase watcher's
    assert len(removed.functions) == 8 + 1 and removed.state_machines and removed.objects
    assert admin.clients.s3.get_object(Bucket=admin.resources.bucket, Key=history.history_key(job.name))


def test_a_missing_statement_is_named_in_the_error(aws, enforced_iam):
    admin = AwsBackend(STACK, REGION)
    job = tiny_job()
    run = job.run(plan=job.manual_plan(stages=1, replicas=1, timeout_s=60), backend=admin)
    policy = _for_moto(admin.deployer_policy())
    policy["Statement"] = [st for st in policy["Statement"] if st["Sid"] != "Executions"]
    dev = _identity_with(policy, "dev-without-executions")
    with enforced_iam():
        b = AwsBackend(STACK, REGION, session=dev)
        with pytest.raises(AccessDenied) as e:
            inspect_execution(b, run.execution_arn)
    assert e.value.action == "states:DescribeExecution" and e.value.resource == run.execution_arn
    assert e.value.statement["Sid"] == "Executions" and "Add the statement 'Executions'" in str(e.value)
    assert f"execution:{STACK}-*:*" in str(e.value)  # the statement, rendered for the stack


# ------------------------------------------------------------------------------ stack problems
def test_worker_image_for_another_python_is_refused(monkeypatch, tmp_path):
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.setenv(k, "testing")
    monkeypatch.chdir(tmp_path)
    with mock_aws():
        make_stack(python="3.99")
        with pytest.raises(StackError, match=r"worker image runs Python 3\.99 but this SDK runs Python 3\.\d+.*cloudpickle"):
            AwsBackend(STACK, REGION)


@pytest.mark.parametrize(
    "status, reason, expect",
    [
        ("CREATE_IN_PROGRESS", None, "wait until it is complete"),
        (
            "ROLLBACK_COMPLETE",
            "The following resource(s) failed to create: [DefaultWorker]",
            r"ROLLBACK_COMPLETE \(The following resource\(s\) failed to create: \[DefaultWorker\]\).*sam delete --stack-name sc",
        ),
        ("UPDATE_ROLLBACK_FAILED", None, "its events in the CloudFormation console"),
    ],
)
def test_unusable_stack_says_what_to_do(status, reason, expect):
    cfn = boto3.client("cloudformation", region_name=REGION, aws_access_key_id="x", aws_secret_access_key="x")
    st = {"StackName": STACK, "CreationTime": "2025-01-01T00:00:00Z", "StackStatus": status}
    if reason:
        st["StackStatusReason"] = reason
    with Stubber(cfn) as stub:
        stub.add_response("describe_stacks", {"Stacks": [st]}, {"StackName": STACK})
        with pytest.raises(StackError, match=expect):
            stack_outputs(cfn, STACK, REGION)


def test_arn_of_another_account_is_refused(aws):
    b = AwsBackend(STACK, REGION)
    with pytest.raises(StackError, match="account 999999999999.*credentials of that account"):
        b.check_arn("arn:aws:states:us-east-1:999999999999:execution:sc-job:x")


def test_deployer_policy_rendered_for_a_deployed_stack(aws, capsys):
    roles, _ = aws
    assert _main(["deployer-policy", "--stack", STACK, "--region", REGION]) == 0
    pol = json.loads(capsys.readouterr().out)
    bucket = boto3.client("s3", region_name=REGION).list_buckets()["Buckets"][0]["Name"]
    sts = {st["Sid"]: st for st in pol["Statement"]}
    assert sts["ListJobObjects"]["Resource"] == f"arn:aws:s3:::{bucket}"
    path = f"arn:aws:iam::{ACCOUNT}:role/stagecoach/{STACK}/"
    assert sts["PassJobRoles"]["Resource"] == [f"{path}{STACK}-*-????????", f"{path}{STACK}-*-????????-prof"]
    assert sts["PassWindowRole"]["Resource"] == f"{path}*-WindowStatesRole-*"
    assert arn_matches(sts["PassWindowRole"]["Resource"], roles["WindowStatesRole"])  # the role the SDK passes
    assert not any(arn_matches(p, roles[r]) for r in roles for p in sts["RemoveJobRoles"]["Resource"])  # the stack's own
    boundary = boto3.client("iam").list_policies(Scope="Local", PathPrefix=f"/stagecoach/{STACK}/")["Policies"][0]["Arn"]
    assert sts["JobRoles"]["Condition"] == {"ArnLike": {"iam:PermissionsBoundary": boundary}}
    assert sts["StageFunctions"]["Resource"] == f"arn:aws:lambda:{REGION}:123456789012:function:{STACK}-*-s*"
    assert _main(["deployer-policy", "--stack", "nope", "--region", REGION]) == 1
    assert "no CloudFormation stack 'nope'" in capsys.readouterr().err


# ------------------------------------------------------------------------------ waiting for functions
class _FakeLambda:
    """Just enough of a Lambda client for the waiting logic: a waiter that fails or not."""

    def __init__(self, state="Active", reason_code=None, reason=None):
        self.state, self.reason_code, self.reason, self.waited = state, reason_code, reason, []

    def get_waiter(self, name):
        fake = self

        class W:
            def wait(self, FunctionName, WaiterConfig):  # botocore's parameter names
                fake.waited.append((name, FunctionName))
                if fake.state == "Failed":
                    raise WaiterError(name=name, reason="terminal failure state", last_response={})

        return W()

    def get_function_configuration(self, FunctionName):
        return {"State": self.state, "StateReasonCode": self.reason_code, "StateReason": self.reason, "LastUpdateStatus": "Failed"}


def test_a_function_that_fails_to_become_active_says_why():
    lam = _FakeLambda("Failed", "ImageAccessDenied", "Lambda does not have permission to access the ECR image.")
    with pytest.raises(
        DeployError,
        match=r"sc-j-s0 is Failed .*ImageAccessDenied: Lambda does not have permission.*"
        r"ecr:BatchGetImage",
    ):
        wait_function(lam, "sc-j-s0")


def test_the_job_starts_only_after_every_function_is_active():
    """Functions are created without waiting (their images are optimised at the same time); the
    start waits for all of them."""

    class Sfn:
        def __init__(self, lam):
            self.lam, self.started_after = lam, None

        def start_execution(self, **kw):
            self.started_after = list(self.lam.waited)
            return {"executionArn": "arn"}

    lam = _FakeLambda()
    sfn = Sfn(lam)
    pending = ["sc-j-s0", "sc-j-s1"]
    IdempotentStepFunctions(sfn, lam, pending).start_execution(stateMachineArn="x", name="j", input="{}")
    assert {fn for _, fn in sfn.started_after} == {"sc-j-s0", "sc-j-s1"}
    assert {w for w, _ in sfn.started_after} == {"function_active_v2", "function_updated_v2"} and pending == []


# ------------------------------------------------------------------------------ cleanup, sync algorithms
def test_cleanup_refuses_what_is_not_a_job_and_stops_running_windows(aws):
    b = AwsBackend(STACK, REGION)
    for bad in ("", "digits", "jobs/x", "arn:aws:states:us-east-1:123456789012:execution:sc-job:"):
        with pytest.raises(DeployError, match="is not a job"):
            b.cleanup(bad)
    job = tiny_job()
    run = b.launch(job, job.manual_plan(stages=2, replicas=1, timeout_s=60))
    window = json.loads(b.clients.sfn.describe_execution(executionArn=run.execution_arn)["input"])["windowStateMachineArn"]
    w = b.clients.sfn.start_execution(stateMachineArn=window, name="w0-x", input=json.dumps({"start": 0, "end": 4}))["executionArn"]
    stopped = []
    real_stop = b.clients.sfn.stop_execution
    b.clients.sfn.stop_execution = lambda **kw: (stopped.append(kw["executionArn"]), real_stop(**kw))[1]
    removed = b.cleanup(run.job_id, stop_running=True)
    # both stopped (moto forgets a deleted machine's executions, so the calls are what is checked)
    assert removed.stopped == stopped == [run.execution_arn, w]


@pytest.mark.parametrize("sync, aggregators, sync_tasks", [("k_reduce", 1, 1), ("pipelined_scatter_reduce", None, 0)])
def test_inspect_counts_iterations_by_each_stage_s_own_sync_tasks(aws, sync, aggregators, sync_tasks):
    """K aggregators (not one sync task per replica), or no sync Map at all for the fused sync."""
    b = AwsBackend(STACK, REGION)
    job = tiny_job()
    plan = job.manual_plan(stages=2, replicas=2, timeout_s=60, sync=sync, aggregators=aggregators)
    assert all(plan.sync_tasks(s) == sync_tasks for s in range(2))
    run = b.launch(job, plan)
    fake_metrics(b, run.job_id, plan, iterations=3)
    ins = inspect_execution(b, run.execution_arn)
    assert ins.iterations_done == 3
    assert ins.phase_timings.get("sync", {}).get("tasks", 0) == 2 * 2 * sync_tasks  # iterations 1, 2 x 2 stages
    label = "k_reduce (K=1)" if sync == "k_reduce" else "pipelined_scatter_reduce"
    assert f"sync {label}" in format_report(ins)


def test_inspect_of_a_cleaned_up_job_says_so(aws):
    b = AwsBackend(STACK, REGION)
    job = tiny_job()
    run = b.launch(job, job.manual_plan(stages=1, replicas=1, timeout_s=60))
    b.cleanup(run.job_id, stop_running=True)
    with pytest.raises(InspectError, match=r"ABORTED, but its objects .* are gone: was it cleaned up"):
        inspect_execution(b, run.execution_arn)


def test_a_denied_bucket_check_is_not_reported_as_a_missing_stack(aws, enforced_iam):
    """deploy.preflight turns any HeadBucket error into 'deploy the stack first'; the AWS backend
    checks first, so a missing s3:ListBucket is reported as what it is."""
    admin = AwsBackend(STACK, REGION)
    policy = _for_moto(admin.deployer_policy())
    policy["Statement"] = [st for st in policy["Statement"] if st["Sid"] != "ListJobObjects"]
    dev = _identity_with(policy, "dev-without-list")
    job = tiny_job()
    with enforced_iam():
        b = AwsBackend(STACK, REGION, session=dev)
        with pytest.raises(AccessDenied) as e:
            job.run(plan=job.manual_plan(stages=1, replicas=1, timeout_s=60), backend=b)
    assert e.value.action == "s3:ListBucket" and e.value.statement["Sid"] == "ListJobObjects"
    assert [f["FunctionName"] for f in admin.clients.lambda_.list_functions()["Functions"]] == [f"{STACK}-worker"]


def test_the_account_concurrency_is_read_and_its_denial_explained():
    """lambda:GetAccountSettings' UnreservedConcurrentExecutions is what a job may use; a denied
    call names the permission and the deployer-policy statement that grants it."""
    b = object.__new__(AwsBackend)  # only the Lambda client and the names are used
    lam = boto3.client("lambda", region_name=REGION, aws_access_key_id="x", aws_secret_access_key="x")
    b.clients, b.account, b.region = type("C", (), {"lambda_": lam})(), ACCOUNT, REGION
    with Stubber(lam) as st:
        st.add_response(
            "get_account_settings",
            {"AccountLimit": {"ConcurrentExecutions": 10, "UnreservedConcurrentExecutions": 10}, "AccountUsage": {}},
        )
        assert b.available_concurrency() == (10, f"account {ACCOUNT} in {REGION}")
        st.add_client_error("get_account_settings", service_error_code="AccessDeniedException", http_status_code=403)
        with pytest.raises(DeployError, match="lambda:GetAccountSettings.*ListFunctionsAndStateMachines"):
            b.available_concurrency()
