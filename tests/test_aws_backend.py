"""The AWS backend against moto (mock_aws): the resources template.yaml creates, then deploy, start,
inspect and cleanup a job, and the errors a user meets (missing stack, region, AccessDenied)."""

import json
import os

import boto3
import pytest
import torch
from botocore.stub import Stubber
from click.testing import CliRunner
from moto import mock_aws
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REGION = "us-east-1"
STACK = "sc"
IMAGE = "123456789012.dkr.ecr.us-east-1.amazonaws.com/sc-worker:py311"


def _trust(service):
    return json.dumps({"Version": "2012-10-17", "Statement": [
        {"Effect": "Allow", "Principal": {"Service": service}, "Action": "sts:AssumeRole"}]})


def make_stack(name=STACK, region=REGION):
    """What `sam deploy` of template.yaml leaves behind (names as CloudFormation generates them)."""
    iam = boto3.client("iam", region_name=region)
    roles = {}
    for logical, svc in (("WorkerRole", "lambda.amazonaws.com"), ("WindowStatesRole", "states.amazonaws.com"),
                         ("JobStatesRole", "states.amazonaws.com")):
        roles[logical] = iam.create_role(RoleName=f"{name}-{logical}-ABC123", AssumeRolePolicyDocument=_trust(svc))["Role"]["Arn"]
    sfn = boto3.client("stepfunctions", region_name=region)
    with open(os.path.join(ROOT, "statemachines", "job.asl.json")) as f:
        job_sm = sfn.create_state_machine(name=f"{name}-job", definition=f.read(), roleArn=roles["JobStatesRole"])["stateMachineArn"]
    lam = boto3.client("lambda", region_name=region)
    lam.create_function(FunctionName=f"{name}-worker", Role=roles["WorkerRole"], PackageType="Image",
                        Code={"ImageUri": IMAGE}, ImageConfig={"Command": ["stagecoach.lambdas.handler.handler"]},
                        MemorySize=2048, Timeout=900)
    # the stack itself: a bucket resource (as in the template) and the outputs the SDK reads
    template = {
        "Resources": {"Bucket": {"Type": "AWS::S3::Bucket", "Properties": {
            "BucketEncryption": {"ServerSideEncryptionConfiguration": [{"ServerSideEncryptionByDefault": {"SSEAlgorithm": "AES256"}}]}}}},
        "Outputs": {
            "BucketName": {"Value": {"Ref": "Bucket"}},
            "WorkerFunctionName": {"Value": f"{name}-worker"},
            "WorkerLogGroupName": {"Value": f"/aws/lambda/{name}-workers"},
            "WorkerRoleArn": {"Value": roles["WorkerRole"]},
            "StatesRoleArn": {"Value": roles["WindowStatesRole"]},
            "JobStateMachineArn": {"Value": job_sm},
            "Region": {"Value": region},
            "Architecture": {"Value": "arm64"},
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
    with mock_aws():
        yield make_stack()


def tiny_job(name="tiny"):
    from stagecoach import Job

    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 4, generator=g)
    y = torch.randint(0, 3, (32,), generator=g)
    return Job(model=lambda: nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)), loss=nn.CrossEntropyLoss(),
               optimizer=lambda p: torch.optim.SGD(p, lr=0.1), train=(x, y), global_batch=16, iterations=4, seed=0, name=name)


def fake_metrics(backend, job_id, plan, iterations, loss0=2.0, t0=1000.0):
    """Metrics objects as the workers write them (docs/runtime.md), with known timings."""
    from stagecoach.lambdas import keys

    s3, bucket = backend.clients.s3, backend.resources.bucket
    for t in range(iterations):
        base = t0 + 10.0 * t
        for phase, off, n_idx, stages in (("forward", 0.0, plan.replicas, range(plan.stages - 1)),
                                          ("backward", 2.0, plan.replicas, range(plan.stages)),
                                          ("sync", 5.0, plan.replicas, range(plan.stages))):
            for s in stages:
                for i in range(n_idx):
                    m = {"phase": phase, "t": t, "stage": s, "index": i, "start": base + off, "end": base + off + 1.5,
                         "duration_s": 1.5, "compute_s": 0.9, "upload_s": 0.2, "download_s": 0.1, "wait_s": 0.3,
                         "container": f"c{s}{i}", "cold": t == 0, "memory_mb": 1024}
                    if phase == "backward" and s == plan.stages - 1:
                        m["loss"] = loss0 / (t + 1)
                    s3.put_object(Bucket=bucket, Key=keys.metrics(job_id, t, phase, s, i), Body=json.dumps(m).encode())


def test_finds_the_stack_from_its_outputs(aws):
    from stagecoach.aws_backend import AwsBackend

    roles, job_sm = aws
    b = AwsBackend(STACK, REGION)
    r = b.resources
    assert (r.prefix, r.region, r.architecture) == (STACK, REGION, "arm64")
    assert r.worker_role_arn == roles["WorkerRole"] and r.states_role_arn == roles["WindowStatesRole"]
    assert r.job_state_machine_arn == job_sm
    assert r.bucket.startswith(f"{STACK}-bucket-")
    # the image comes from the default worker, pinned by digest
    assert r.image_uri.startswith(IMAGE.split(":py311")[0] + "@sha256:")
    assert "console.aws.amazon.com/states" in r.console.format(region=REGION, arn="x")


def test_missing_stack_says_how_to_deploy(aws):
    from stagecoach.aws_backend import AwsBackend, StackNotFound

    with pytest.raises(StackNotFound, match=r"no CloudFormation stack 'nope' in us-east-1.*sam deploy --guided"):
        AwsBackend("nope", REGION)


def test_region_mismatch_from_samconfig(aws, tmp_path):
    from stagecoach.aws_backend import AwsBackend, RegionMismatch

    (tmp_path / "samconfig.toml").write_text(
        'version = 0.1\n[default.deploy.parameters]\nstack_name = "other"\nregion = "eu-west-1"\n')
    with pytest.raises(RegionMismatch, match="eu-west-1"):
        AwsBackend("other", REGION)


def test_region_mismatch_of_an_arn(aws):
    from stagecoach.aws_backend import AwsBackend, RegionMismatch

    b = AwsBackend(STACK, REGION)
    with pytest.raises(RegionMismatch, match="--region eu-west-1"):
        b.check_arn("arn:aws:states:eu-west-1:123456789012:execution:sc-job:x")


def test_not_a_stagecoach_stack(aws):
    from stagecoach.aws_backend import AwsBackend, StackError

    boto3.client("cloudformation", region_name=REGION).create_stack(
        StackName="plain", TemplateBody=json.dumps({"Resources": {"B": {"Type": "AWS::S3::Bucket"}}}))
    with pytest.raises(StackError, match="lacks the outputs"):
        AwsBackend("plain", REGION)


def test_access_denied_names_action_resource_and_statement(aws):
    from stagecoach.aws_backend import AccessDenied, AwsBackend

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
    msg = (f"User: arn:aws:iam::123456789012:user/dev is not authorized to perform: iam:PassRole on resource: "
           f"{b.resources.worker_role_arn}")
    with Stubber(lam) as stub:
        stub.add_client_error("create_function", service_error_code="AccessDeniedException", service_message=msg, http_status_code=403)
        with pytest.raises(AccessDenied) as e:
            lam.create_function(FunctionName="sc-x-s0", Role=b.resources.worker_role_arn, Code={"ImageUri": IMAGE}, PackageType="Image")
    assert (e.value.action, e.value.resource) == ("iam:PassRole", b.resources.worker_role_arn)
    assert e.value.statement["Sid"] == "PassStackRoles"
    assert e.value.statement["Resource"] == "arn:aws:iam::123456789012:role/sc-*"
    # a non-denial error passes through untouched
    with Stubber(s3) as stub:
        stub.add_client_error("get_object", service_error_code="NoSuchKey", http_status_code=404)
        with pytest.raises(s3.exceptions.NoSuchKey):
            s3.get_object(Bucket=b.resources.bucket, Key="jobs/none")


def test_idempotent_function_and_state_machine(aws):
    from stagecoach.aws_backend import AwsBackend, ensure_function, ensure_state_machine

    roles, _ = aws
    b = AwsBackend(STACK, REGION)
    lam, sfn = b.clients.lambda_, b.clients.sfn
    spec = dict(FunctionName="sc-j-s0", Role=roles["WorkerRole"], PackageType="Image", Code={"ImageUri": IMAGE},
                ImageConfig={"Command": ["stagecoach.lambdas.handler.handler"]}, MemorySize=512, Timeout=60)
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
    from stagecoach.aws_backend import StackError, check_name_lengths

    check_name_lengths("stagecoach", "digits", 3)
    with pytest.raises(StackError, match="64"):
        check_name_lengths("a-rather-long-stack-name-x", "a-rather-long-job-name-xyz", 3)


def test_deploy_start_inspect_cleanup(aws, tmp_path):
    from stagecoach.aws_backend import AwsBackend, StackError
    from stagecoach.inspect_run import format_report, inspect_execution, write_plots

    roles, job_sm = aws
    b = AwsBackend(STACK, REGION)
    job = tiny_job()
    plan = job.manual_plan(stages=2, replicas=2, micro_batches=2, memory_mb=1536, timeout_s=120)
    run = b.launch(job, plan)
    c = b.clients
    # per-stage functions from the stack's image, memory and timeout from the plan
    for s in range(2):
        conf = c.lambda_.get_function(FunctionName=f"{STACK}-{run.job_id}-s{s}")
        assert conf["Configuration"]["MemorySize"] == 1536
        assert conf["Configuration"]["Timeout"] == plan.function_timeout_s(s)
        assert conf["Configuration"]["Role"] == roles["WorkerRole"]
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
    from stagecoach.cli_aws import cleanup_command, inspect_command

    out = CliRunner().invoke(inspect_command, [run.execution_arn, "--stack", STACK, "--region", REGION, "--json"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.output)["iterations_done"] == 3

    # cleanup refuses a running job, then stops it with --force; everything of the job is gone
    with pytest.raises(StackError, match="still running"):
        b.cleanup(run.job_id)
    out = CliRunner().invoke(cleanup_command, [run.execution_arn, "--stack", STACK, "--region", REGION, "--force"])
    assert out.exit_code == 0, out.output
    assert "removed 2 functions, 1 state machines" in out.output
    assert c.sfn.describe_execution(executionArn=run.execution_arn)["status"] == "ABORTED"
    names = [f["FunctionName"] for f in c.lambda_.list_functions()["Functions"]]
    assert names == [f"{STACK}-worker"]
    with pytest.raises(c.sfn.exceptions.StateMachineDoesNotExist):
        c.sfn.describe_state_machine(stateMachineArn=window)
    assert c.s3.list_objects_v2(Bucket=b.resources.bucket, Prefix=f"jobs/{run.job_id}/")["KeyCount"] == 0
    assert c.s3.list_objects_v2(Bucket=b.resources.bucket, Prefix="data/")["KeyCount"] == 1  # shared data stays
    again = b.cleanup(run.job_id)  # idempotent
    assert again == {"functions": [], "state_machines": [], "objects": [], "stopped": []}


def test_failed_launch_leaves_nothing_behind(aws):
    from stagecoach.aws_backend import AwsBackend

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
    from stagecoach.cli_aws import train_backend

    monkeypatch.delenv("STAGECOACH_STACK", raising=False)
    import click

    with pytest.raises(click.ClickException, match="--stack"):
        train_backend("aws", None, REGION)
    assert train_backend(None, None, None) == "local"
    assert train_backend(None, STACK, REGION).name == "aws"
