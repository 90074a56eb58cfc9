"""template.yaml and the deployer policy: the real validators (cfn-lint, asl-validator, sam when
installed) and the IAM, bucket and naming rules the design depends on."""

import glob
import json
import os
import shutil
import subprocess
import sys

import pytest
from cfnlint.decode import decode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEMPLATE = os.path.join(ROOT, "template.yaml")
SUB = "Fn::Sub"


@pytest.fixture(scope="module")
def template():
    t, errors = decode(TEMPLATE)
    assert not errors, errors
    return t


def _cfn_lint(path):
    # cfn-lint has no __main__; its console script calls cfnlint.runner.main
    return subprocess.run([sys.executable, "-c", "import sys; from cfnlint.runner import main; sys.exit(main())", path],
                          capture_output=True, text=True)


def _strings(x):
    """The text of an IAM value (plain string, Fn::Sub string, or a list of either)."""
    if isinstance(x, list):
        return [s for v in x for s in _strings(v)]
    if isinstance(x, dict):
        if SUB in x:
            return [x[SUB] if isinstance(x[SUB], str) else x[SUB][0]]
        if "Fn::GetAtt" in x:
            return ["GetAtt:" + ".".join(x["Fn::GetAtt"] if isinstance(x["Fn::GetAtt"], list) else [x["Fn::GetAtt"]])]
        return [json.dumps(x)]
    return [x]


def role_statements(template, logical):
    props = template["Resources"][logical]["Properties"]
    assert "ManagedPolicyArns" not in props, f"{logical}: managed policies are broader than the design needs"
    return [st for p in props["Policies"] for st in p["PolicyDocument"]["Statement"]]


def allowed(statements):
    return {(a, r) for st in statements if st["Effect"] == "Allow" for a in _strings(st["Action"]) for r in _strings(st["Resource"])}


# ---------------------------------------------------------------------------------- validators
def test_cfn_lint_reports_nothing():
    r = _cfn_lint(TEMPLATE)
    assert r.returncode == 0 and r.stdout.strip() == "", r.stdout + r.stderr


def test_cfn_lint_does_catch_a_broken_template(tmp_path):
    """The lint really lints, through the SAM transform (a bad Serverless::Function property is only
    caught after it), so the test above can fail."""
    with open(TEMPLATE) as f:
        text = f.read()
    broken = tmp_path / "template.yaml"
    broken.write_text(text.replace("SSEAlgorithm: AES256", "SSEAlgorithm: AES257").replace("Architectures: [!Ref Architecture]", "Architectures: [sparc]"))
    (tmp_path / "statemachines").mkdir()
    shutil.copy(os.path.join(ROOT, "statemachines", "job.asl.json"), tmp_path / "statemachines")
    r = _cfn_lint(str(broken))
    assert r.returncode != 0 and "AES257" in r.stdout and "sparc" in r.stdout, r.stdout


def test_asl_validator_accepts_the_deployed_state_machines(asl_validator):
    paths = sorted(glob.glob(os.path.join(ROOT, "statemachines", "*.json")))
    assert paths
    r = subprocess.run([asl_validator, *[a for p in paths for a in ("--json-path", p)]], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_sam_translates_the_template(template, monkeypatch):
    """The SAM transform (what CloudFormation runs) turns the template into plain resources."""
    from samtranslator.translator.transform import transform

    raw = json.loads(json.dumps(template))  # plain dicts, intrinsics as {"Ref": ...} / {"Fn::...": ...}
    raw["Resources"]["DefaultWorker"]["Properties"]["ImageUri"] = "123456789012.dkr.ecr.us-east-1.amazonaws.com/r:t"
    raw["Resources"]["JobStateMachine"]["Properties"]["DefinitionUri"] = {"Bucket": "b", "Key": "k"}

    class NoManagedPolicies:
        def load(self):
            return {}

    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")  # the transform resolves pseudo parameters
    out = transform(raw, {}, NoManagedPolicies())
    types = {r["Type"] for r in out["Resources"].values()}
    assert {"AWS::Lambda::Function", "AWS::StepFunctions::StateMachine", "AWS::S3::Bucket", "AWS::IAM::Role"} <= types
    sm = next(r for r in out["Resources"].values() if r["Type"] == "AWS::StepFunctions::StateMachine")
    assert sm["Properties"]["DefinitionS3Location"] == {"Bucket": "b", "Key": "k"}
    assert "DefinitionSubstitutions" in sm["Properties"]
    # SAM adds no role of its own: the functions and machines use the template's scoped roles
    assert sum(1 for r in out["Resources"].values() if r["Type"] == "AWS::IAM::Role") == 3


# ---------------------------------------------------------------------------------- IAM
def test_no_wildcard_actions_or_resources_beyond_the_design(template):
    justified_star = {"xray:PutTraceSegments", "xray:PutTelemetryRecords"}  # no resource-level permissions
    for logical, res in template["Resources"].items():
        if res["Type"] != "AWS::IAM::Role":
            continue
        for st in role_statements(template, logical):
            assert st["Effect"] == "Allow"
            for a in _strings(st["Action"]):
                assert "*" not in a, f"{logical}: wildcard action {a}"
            for r in _strings(st["Resource"]):
                if r == "*":
                    assert set(_strings(st["Action"])) <= justified_star, f"{logical}: Resource * for {st['Action']}"
                elif "*" in r:
                    # wildcards only after the stack's own prefix or the bucket's own key prefixes
                    assert "${AWS::StackName}-*" in r or r.endswith(("/jobs/*", "/data/*")), f"{logical}: {r}"


def test_worker_role_reaches_only_the_stack_bucket_logs_xray_and_stack_function_memory(template):
    got = allowed(role_statements(template, "WorkerRole"))
    services = {a.split(":")[0] for a, _ in got}
    assert services == {"s3", "logs", "xray", "lambda"}
    lam = {(a, r) for a, r in got if a.startswith("lambda:")}
    assert lam == {(a, "arn:${AWS::Partition}:lambda:${AWS::Region}:${AWS::AccountId}:function:${AWS::StackName}-*")
                   for a in ("lambda:GetFunctionConfiguration", "lambda:UpdateFunctionConfiguration")}
    s3 = {(a, r) for a, r in got if a.startswith("s3:")}
    assert {r for _, r in s3} == {"${Bucket.Arn}/jobs/*", "${Bucket.Arn}/data/*", "GetAtt:Bucket.Arn"}
    assert ("s3:ListBucket", "GetAtt:Bucket.Arn") in s3
    assert {a for a, _ in s3} == {"s3:GetObject", "s3:PutObject", "s3:PutObjectTagging", "s3:DeleteObject", "s3:ListBucket"}
    assert all("log-group:/aws/lambda/${AWS::StackName}-*" in r for a, r in got if a.startswith("logs:"))
    assert not any(a == "logs:CreateLogGroup" for a, _ in got)  # the stack creates the log group


def test_window_role_invokes_only_stack_functions(template):
    got = allowed(role_statements(template, "WindowStatesRole"))
    assert {a for a, _ in got} == {"lambda:InvokeFunction"}
    assert all(":function:${AWS::StackName}-*" in r for _, r in got)


def test_job_role_runs_only_stack_executions_the_sync_rule_and_remediation(template):
    got = allowed(role_statements(template, "JobStatesRole"))
    by_action = {}
    for a, r in got:
        by_action.setdefault(a, set()).add(r)
    assert set(by_action) == {"states:StartExecution", "states:DescribeExecution", "states:StopExecution",
                              "events:PutTargets", "events:PutRule", "events:DescribeRule", "lambda:InvokeFunction"}
    assert by_action["lambda:InvokeFunction"] == {
        "arn:${AWS::Partition}:lambda:${AWS::Region}:${AWS::AccountId}:function:${AWS::StackName}-*"}
    assert by_action["states:StartExecution"] == {
        "arn:${AWS::Partition}:states:${AWS::Region}:${AWS::AccountId}:stateMachine:${AWS::StackName}-*"}
    for a in ("states:DescribeExecution", "states:StopExecution"):
        assert by_action[a] == {"arn:${AWS::Partition}:states:${AWS::Region}:${AWS::AccountId}:execution:${AWS::StackName}-*:*"}
    for a in ("events:PutTargets", "events:PutRule", "events:DescribeRule"):
        assert by_action[a] == {
            "arn:${AWS::Partition}:events:${AWS::Region}:${AWS::AccountId}:rule/StepFunctionsGetEventsForStepFunctionsExecutionRule"}


def test_roles_trust_only_their_service(template):
    for logical, svc in (("WorkerRole", "lambda.amazonaws.com"), ("WindowStatesRole", "states.amazonaws.com"),
                         ("JobStatesRole", "states.amazonaws.com")):
        (st,) = template["Resources"][logical]["Properties"]["AssumeRolePolicyDocument"]["Statement"]
        assert st["Principal"] == {"Service": svc} and st["Action"] == "sts:AssumeRole"


def test_functions_and_machines_use_the_scoped_roles(template):
    r = template["Resources"]
    assert r["DefaultWorker"]["Properties"]["Role"] == {"Fn::GetAtt": ["WorkerRole", "Arn"]}
    assert r["JobStateMachine"]["Properties"]["Role"] == {"Fn::GetAtt": ["JobStatesRole", "Arn"]}
    assert "Policies" not in r["DefaultWorker"]["Properties"] and "Policies" not in r["JobStateMachine"]["Properties"]


# ---------------------------------------------------------------------------------- bucket, outputs
def test_bucket_encrypted_private_tls_only_with_expiry(template):
    b = template["Resources"]["Bucket"]["Properties"]
    (rule,) = b["BucketEncryption"]["ServerSideEncryptionConfiguration"]
    assert rule["ServerSideEncryptionByDefault"]["SSEAlgorithm"] in ("AES256", "aws:kms")
    assert all(b["PublicAccessBlockConfiguration"][k] is True for k in
               ("BlockPublicAcls", "BlockPublicPolicy", "IgnorePublicAcls", "RestrictPublicBuckets"))
    pol = template["Resources"]["BucketPolicy"]["Properties"]
    assert pol["Bucket"] == {"Ref": "Bucket"}
    deny = [st for st in pol["PolicyDocument"]["Statement"] if st["Effect"] == "Deny"]
    assert any(st["Condition"] == {"Bool": {"aws:SecureTransport": "false"}} and st["Principal"] == "*"
               and set(_strings(st["Resource"])) == {"GetAtt:Bucket.Arn", "${Bucket.Arn}/*"} for st in deny)
    rules = {r["Id"]: r for r in b["LifecycleConfiguration"]["Rules"]}
    exp = rules["ExpireTransientIterationObjects"]
    assert exp["Status"] == "Enabled" and exp["Prefix"] == "jobs/"
    assert exp["ExpirationInDays"] == {"Ref": "IterationObjectExpiryDays"}
    assert template["Parameters"]["IterationObjectExpiryDays"]["Default"] in (1, 2)
    assert exp["TagFilters"] == [{"Key": "stagecoach:transient", "Value": "true"}]


def test_parameters_outputs_and_names(template):
    p = template["Parameters"]
    assert p["Architecture"]["AllowedValues"] == ["x86_64", "arm64"]
    assert "LogRetentionDays" in p
    assert template["Resources"]["WorkerLogGroup"]["Properties"]["RetentionInDays"] == {"Ref": "LogRetentionDays"}
    outputs = set(template["Outputs"])
    assert {"BucketName", "WorkerRoleArn", "StatesRoleArn", "JobStateMachineArn", "Region", "Architecture"} <= outputs
    assert "WorkerImageUri" in outputs or "WorkerFunctionName" in outputs
    assert template["Outputs"]["StatesRoleArn"]["Value"] == {"Fn::GetAtt": ["WindowStatesRole", "Arn"]}
    sm = template["Resources"]["JobStateMachine"]["Properties"]
    assert sm["DefinitionUri"] == "statemachines/job.asl.json" and sm["Name"] == {SUB: "${AWS::StackName}-job"}
    fn = template["Resources"]["DefaultWorker"]
    assert fn["Properties"]["PackageType"] == "Image"
    assert fn["Properties"]["ImageConfig"]["Command"] == ["stagecoach.lambdas.handler.handler"]
    assert fn["Metadata"]["Dockerfile"] == "lambdas/Dockerfile"
    assert fn["Properties"]["Environment"]["Variables"]["STAGECOACH_BUCKET"] == {"Ref": "Bucket"}


def test_dockerfile_builds_on_the_lambda_base_with_cpu_torch():
    with open(os.path.join(ROOT, "lambdas", "Dockerfile")) as f:
        text = f.read()
    assert "FROM public.ecr.aws/lambda/python:${PYTHON_VERSION}" in text and "PYTHON_VERSION=3.11" in text
    assert "download.pytorch.org/whl/cpu" in text and "TORCH_VERSION=2.13.0" in text
    assert 'CMD ["stagecoach.lambdas.handler.handler"]' in text


# ---------------------------------------------------------------------------------- deployer policy
def test_deployer_policy_document_is_the_generated_one():
    from stagecoach.aws_backend import deployer_policy

    with open(os.path.join(ROOT, "docs", "deployer-policy.json")) as f:
        assert json.load(f) == deployer_policy(), "regenerate docs/deployer-policy.json from stagecoach.aws_backend.deployer_policy()"


def test_deployer_policy_is_scoped_to_the_stack():
    from stagecoach.aws_backend import deployer_policy

    pol = deployer_policy("sc", "us-east-1", "123456789012")
    sids = [st["Sid"] for st in pol["Statement"]]
    assert len(sids) == len(set(sids))
    list_actions = {"lambda:ListFunctions", "states:ListStateMachines"}  # no resource-level permissions
    for st in pol["Statement"]:
        for a in st["Action"]:
            assert "*" not in a
        for r in _strings(st["Resource"]):
            if r == "*":
                assert set(st["Action"]) <= list_actions, st
            elif st["Sid"] != "WorkerImage":
                assert ":sc-" in r or "/sc-" in r or "/sc/" in r or ":::sc-bucket-" in r, r
    pass_role = next(st for st in pol["Statement"] if "iam:PassRole" in st["Action"])
    assert pass_role["Condition"]["StringEquals"]["iam:PassedToService"] == ["lambda.amazonaws.com", "states.amazonaws.com"]


# ---------------------------------------------------------------------------------- sam (opt-in)
@pytest.mark.slow
def test_sam_validate_and_build(tmp_path):
    """`sam validate --lint` and `sam build` in a copy of the repository (needs aws-sam-cli; the
    image build also needs a Docker engine)."""
    sam = shutil.which("sam")
    if sam is None:
        pytest.skip("aws-sam-cli is not installed (pip install aws-sam-cli in a separate virtualenv)")
    work = tmp_path / "repo"
    shutil.copytree(ROOT, work, ignore=shutil.ignore_patterns(".git", ".venv", "node_modules", ".aws-sam", "stagecoach-runs", "__pycache__"))
    env = dict(os.environ, AWS_DEFAULT_REGION=os.environ.get("AWS_DEFAULT_REGION", "us-east-1"), SAM_CLI_TELEMETRY="0")
    r = subprocess.run([sam, "validate", "--lint", "--template", "template.yaml"], cwd=work, capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    if shutil.which("docker") is None or subprocess.run(["docker", "info"], capture_output=True).returncode != 0:
        pytest.skip("sam build of an image function needs a Docker engine")
    r = subprocess.run([sam, "build", "--template", "template.yaml"], cwd=work, capture_output=True, text=True, env=env, timeout=3600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (work / ".aws-sam" / "build" / "template.yaml").exists()
