"""template.yaml, the worker image and the deployer policy: the real validators (cfn-lint,
asl-validator, the SAM transform, sam when installed) and the IAM, bucket and naming rules the
design depends on, checked against the names and keys the SDK and the workers really use."""

import fnmatch
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib

import pytest
from cfnlint.decode import decode

from stagecoach.core import keys

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
    return subprocess.run(
        [sys.executable, "-c", "import sys; from cfnlint.runner import main; sys.exit(main())", path], capture_output=True, text=True
    )


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
    if template["Resources"][logical]["Type"] == "AWS::IAM::ManagedPolicy":
        return props["PolicyDocument"]["Statement"]
    assert "ManagedPolicyArns" not in props, f"{logical}: managed policies are broader than the design needs"
    return [st for p in props["Policies"] for st in p["PolicyDocument"]["Statement"]]


def allowed(statements):
    return {(a, r) for st in statements if st["Effect"] == "Allow" for a in _strings(st["Action"]) for r in _strings(st["Resource"])}


# ---------------------------------------------------------------------------------- validators
def test_cfn_lint_reports_nothing():
    """No error, no warning, and no informational finding either (I3011's deletion policies are explicit)."""
    r = _cfn_lint(TEMPLATE)
    assert r.returncode == 0 and r.stdout.strip() == "", r.stdout + r.stderr
    r = subprocess.run(
        [sys.executable, "-c", "import sys; from cfnlint.runner import main; sys.exit(main())", "--include-checks", "I", "--", TEMPLATE],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0 and r.stdout.strip() == "", r.stdout + r.stderr


def test_cfn_lint_does_catch_a_broken_template(tmp_path):
    """The lint really lints, through the SAM transform (a bad Serverless::Function property is only
    caught after it), so the test above can fail."""
    with open(TEMPLATE) as f:
        text = f.read()
    broken = tmp_path / "template.yaml"
    broken.write_text(
        text.replace("SSEAlgorithm: AES256", "SSEAlgorithm: AES257").replace("Architectures: [!Ref Architecture]", "Architectures: [sparc]")
    )
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
STACK = "sc"
ACCOUNT = "123456789012"
REGION = "us-east-1"
BUCKET = "sc-bucket-1a2b3c4d5e6f"
DS = "0123456789abcdef" * 2  # a data set id (core/samples.py Manifest.dataset_id: 32 hex digits)


def render(pattern):
    """A template Resource pattern with the stack's values substituted (the way CloudFormation would)."""
    return (
        pattern.replace("${AWS::Partition}", "aws")
        .replace("${AWS::Region}", REGION)
        .replace("${AWS::AccountId}", ACCOUNT)
        .replace("${AWS::StackName}", STACK)
        .replace("${Bucket.Arn}", f"arn:aws:s3:::{BUCKET}")
        .replace("GetAtt:Bucket.Arn", f"arn:aws:s3:::{BUCKET}")
        .replace("GetAtt:WorkerLogGroup.Arn", f"arn:aws:logs:{REGION}:{ACCOUNT}:log-group:/aws/lambda/{STACK}-workers:*")
    )


def stack_resources():
    """What the SDK would read from this template's outputs, for stack STACK."""
    from stagecoach.deploy.resources import StackResources

    return StackResources(
        prefix=STACK,
        region=REGION,
        bucket=BUCKET,
        image_uri="i",
        control_role_arn=f"arn:aws:iam::{ACCOUNT}:role/stagecoach/{STACK}/c",
        states_role_arn="s",
        job_state_machine_arn=f"arn:aws:states:{REGION}:{ACCOUNT}:stateMachine:{STACK}-job",
        control_function=f"{STACK}-worker",
        job_boundary_arn=f"arn:aws:iam::{ACCOUNT}:policy/stagecoach/{STACK}/b",
        log_group_arn=render("GetAtt:WorkerLogGroup.Arn"),
    )


def rendered(x):
    """Template values with the stack's values substituted: Fn::Sub, Fn::GetAtt and Ref resolved."""
    if isinstance(x, list):
        return [rendered(v) for v in x]
    if isinstance(x, dict):
        if SUB in x:
            return render(x[SUB] if isinstance(x[SUB], str) else x[SUB][0])
        if "Fn::GetAtt" in x:
            return render("GetAtt:" + ".".join(x["Fn::GetAtt"]))
        if x.keys() == {"Ref"}:
            return {"AWS::StackName": STACK}[x["Ref"]]
        return {k: rendered(v) for k, v in x.items()}
    return x


TAGGED = {"aws:ResourceTag/stagecoach:stack": STACK}  # what the SDK tags its functions with


def grants(statements, action, arn, context=TAGGED):
    """Whether the statements allow ``action`` on ``arn`` as IAM decides it (conditions included);
    by default for a function the SDK created (tagged with the stack)."""
    from stagecoach.deploy.iam_policy import evaluate

    return evaluate(action, arn, [{"Statement": rendered(statements)}], context=context).allowed


def test_no_wildcard_actions_or_resources_beyond_the_design(template):
    justified_star = {"xray:PutTraceSegments", "xray:PutTelemetryRecords"}  # no resource-level permissions
    # CloudWatch Logs' log delivery (an Express window's logging): no resource-level permissions either
    justified_star |= LOG_DELIVERY
    for logical, res in template["Resources"].items():
        if res["Type"] not in ("AWS::IAM::Role", "AWS::IAM::ManagedPolicy"):
            continue
        for st in role_statements(template, logical):
            assert st["Effect"] == "Allow"
            for a in _strings(st["Action"]):
                assert "*" not in a, f"{logical}: wildcard action {a}"
            for r in _strings(st["Resource"]):
                if r == "*":
                    assert set(_strings(st["Action"])) <= justified_star, f"{logical}: Resource * for {st['Action']}"
                elif "*" in r:
                    # wildcards only after the stack's own prefix or inside the bucket's own key prefixes
                    assert "${AWS::StackName}-*" in r or r in {
                        "${Bucket.Arn}/jobs/*/*",
                        "${Bucket.Arn}/data/*",
                        "${Bucket.Arn}/history/*",
                        "${Bucket.Arn}/jobs/*/abort/*",
                        "${Bucket.Arn}/jobs/*/job.json",
                        "${Bucket.Arn}/jobs/*/evidence/*",
                        "${Bucket.Arn}/jobs/*/remediations/*",
                    }, f"{logical}: {r}"


def test_the_template_states_the_sdks_role_policies(template):
    """deploy/roles.py writes the control role and the job roles' boundary once: the local stack
    provisions them from there, and the template must say the same for AWS."""
    from stagecoach.deploy.roles import control_policy, job_boundary_policy

    b, logs = f"arn:aws:s3:::{BUCKET}", render("GetAtt:WorkerLogGroup.Arn")
    assert rendered(role_statements(template, "ControlRole")) == control_policy(b, logs, STACK, "aws", REGION, ACCOUNT)["Statement"]
    assert rendered(role_statements(template, "JobRoleBoundary")) == job_boundary_policy(b, logs, STACK)["Statement"]
    for logical in ("ControlRole", "WindowStatesRole", "JobStatesRole"):
        assert template["Resources"][logical]["Properties"]["Path"] == {SUB: "/stagecoach/${AWS::StackName}/"}
    assert template["Resources"]["JobRoleBoundary"]["Properties"]["Path"] == {SUB: "/stagecoach/${AWS::StackName}/"}


def test_control_role_covers_the_remediation_and_nothing_a_job_runs(template):
    """The default worker runs no user code: it reads a job's spec and evidence, records the
    remediation and what the job's name learnt, and raises a stage function's memory."""
    from stagecoach import history

    sts = role_statements(template, "ControlRole")
    job = "digits-1a2b3c4d"
    b = f"arn:aws:s3:::{BUCKET}"
    assert grants(sts, "s3:GetObject", f"{b}/{keys.job_spec(job)}") and grants(sts, "s3:GetObject", f"{b}/{keys.memory_pressure(job, 1)}")
    assert grants(sts, "s3:DeleteObject", f"{b}/{keys.memory_pressure(job, 1)}")
    assert grants(sts, "s3:PutObject", f"{b}/{keys.remediation(job, 1700000000000, 1)}")
    assert grants(sts, "s3:GetObject", f"{b}/{history.memory_key('digits')}") and grants(
        sts, "s3:PutObject", f"{b}/{history.memory_key('digits')}"
    )
    for key in (keys.job_code(job), keys.act(job, 3, 1, 0, 1), keys.params(job, 0, 0, 0, 0), keys.dataset(DS), keys.data_shard(DS, "e")):
        for action in ("s3:GetObject", "s3:PutObject", "s3:DeleteObject"):
            assert not grants(sts, action, f"{b}/{key}"), (action, key)
    fn = f"arn:aws:lambda:{REGION}:{ACCOUNT}:function:{STACK}-{job}-s1"
    for action in ("lambda:GetFunction", "lambda:GetFunctionConfiguration", "lambda:UpdateFunctionConfiguration", "lambda:ListTags"):
        assert grants(sts, action, fn)
        # a function the stack did not create, even one whose name fits the pattern
        assert not grants(sts, action, f"arn:aws:lambda:{REGION}:{ACCOUNT}:function:{STACK}-prod-stripe-webhook", context={})
    assert not grants(sts, "lambda:UpdateFunctionCode", fn) and not grants(sts, "lambda:InvokeFunction", fn)
    assert {a for st in sts for a in _strings(st["Action"])} >= {"logs:CreateLogStream", "logs:PutLogEvents"}


def test_job_roles_cover_every_key_the_workers_use_and_nothing_else(template):
    """The keys come from the code (core.keys), so a new key tree the workers start to write
    fails here before it fails on AWS with AccessDenied. Checked on the boundary (every job) and on
    one job's own role, which must not reach another job's keys."""
    from stagecoach.deploy.roles import job_dataset_policy, job_worker_policy

    job = "digits-1a2b3c4d"
    used = [
        keys_.format(job=job)
        for keys_ in (
            "jobs/{job}/job.json",
            "jobs/{job}/model/job.pkl",
            "jobs/{job}/plan.json",
        )
    ]

    used += [
        keys.act(job, 3, 1, 0, 1),
        keys.grad(job, 3, 1, 0, 1),
        keys.params(job, 2, 1, 0, 0),
        keys.optim(job, 2, 1, 0, 0),
        keys.gshard(job, 3, 1, 0, 0, 0),
        keys.metrics(job, 3, "sync", 1, 0),
        keys.memory_pressure(job, 1),
        # the iteration gate (lambdas/gate.py), on the stage-0 function: its role, no new one
        keys.stop_request(job),
        keys.stopped(job),
        keys.cost_tally(job),
    ]
    res = stack_resources()
    boundary = role_statements(template, "JobRoleBoundary")
    own = job_worker_policy(res, job)["Statement"] + job_dataset_policy(res, [DS])["Statement"]
    for sts in (boundary, own):
        for key in used:
            for action in ("s3:GetObject", "s3:PutObject", "s3:DeleteObject"):
                # the job's spec is the deployer's: its own role reads it only (issue 24 item 7)
                writes_spec = sts is own and key == keys.job_spec(job) and action != "s3:GetObject"
                assert grants(sts, action, f"arn:aws:s3:::{BUCKET}/{key}") != writes_spec, (action, key)
        for key in (keys.dataset(DS), keys.data_shard(DS, "ab" * 32)):
            assert grants(sts, "s3:GetObject", f"arn:aws:s3:::{BUCKET}/{key}")
            assert not grants(sts, "s3:PutObject", f"arn:aws:s3:::{BUCKET}/{key}")
        assert grants(sts, "s3:ListBucket", f"arn:aws:s3:::{BUCKET}", context={"s3:prefix": keys.dataset(DS)})
        for key in ("other/x", "jobsx/y", "history/digits/memory.json"):
            assert not grants(sts, "s3:GetObject", f"arn:aws:s3:::{BUCKET}/{key}"), key
        assert not grants(sts, "s3:GetObject", f"arn:aws:s3:::another-bucket/{keys.job_spec(job)}")
        # the iteration objects are tagged (the lifecycle rule's filter), which needs PutObjectTagging
        assert grants(sts, "s3:PutObjectTagging", f"arn:aws:s3:::{BUCKET}/{keys.act(job, 3, 1, 0, 1)}")
        # beyond S3, logs and traces: only the phase watcher's invocation of the job's own functions
        # (lambdas/watcher.py), by name and tag (tests/test_isolation.py checks whose)
        others = {a for st in sts for a in _strings(st["Action"]) if a.startswith(("lambda:", "iam:", "states:"))}
        assert others == {"lambda:InvokeFunction"}
        (invoke,) = [st for st in sts if "lambda:InvokeFunction" in _strings(st["Action"])]
        assert invoke["Condition"]["StringEquals"], invoke
    assert not grants(own, "s3:GetObject", f"arn:aws:s3:::{BUCKET}/{keys.job_code('other-1a2b3c4d')}")
    # a job reads only the data sets it uses (issue 24 item 6): not another's, and it lists no data/
    other = "f" * 32
    assert not grants(own, "s3:GetObject", f"arn:aws:s3:::{BUCKET}/{keys.dataset(other)}")
    assert not grants(own, "s3:GetObject", f"arn:aws:s3:::{BUCKET}/{keys.data_shard(other, 'ab' * 32)}")
    for prefix in ("data/", keys.dataset_prefix(other)):
        assert not grants(own, "s3:ListBucket", f"arn:aws:s3:::{BUCKET}", context={"s3:prefix": prefix})


def test_role_patterns_match_exactly_the_names_the_sdk_gives(template):
    """The naming contract: stage functions and window machines of this stack's jobs, and nothing
    else (not the default worker, not the job machine itself, not another stack's)."""
    from stagecoach.deploy import resources as deploy

    res = stack_resources()

    def fn(name):
        return f"arn:aws:lambda:{REGION}:{ACCOUNT}:function:{name}"

    def sm(name):
        return f"arn:aws:states:{REGION}:{ACCOUNT}:stateMachine:{name}"

    def ex(name):
        return f"arn:aws:states:{REGION}:{ACCOUNT}:execution:{name}:w0-abc"

    job = "my-job-1a2b3c4d"
    stage_fns = [deploy.function_name(res, job, s) for s in (0, 1, 12)]
    window = deploy.window_state_machine_name(res, job)
    window_role, job_role, worker = (role_statements(template, r) for r in ("WindowStatesRole", "JobStatesRole", "ControlRole"))
    for name in stage_fns:
        assert grants(window_role, "lambda:InvokeFunction", fn(name))
        assert not grants(job_role, "lambda:InvokeFunction", fn(name))  # remediation runs elsewhere...
        assert grants(worker, "lambda:UpdateFunctionConfiguration", fn(name))
    assert grants(job_role, "lambda:InvokeFunction", fn(res.control_function))  # ...on the stack's worker
    # a function of another application whose name happens to fit "<stack>-*-s*": not tagged by the SDK
    for sts in (window_role, worker):
        assert grants(sts, "lambda:InvokeFunction", fn(stage_fns[0])) or sts is worker
        assert not grants(sts, "lambda:InvokeFunction", fn(f"{STACK}-prod-stripe-webhook"), context={})
        assert not grants(sts, "lambda:UpdateFunctionConfiguration", fn(f"{STACK}-prod-stripe-webhook"), context={})
    for other in (f"other-{job}-s0", "unrelated"):
        for sts in (window_role, job_role, worker):
            assert not grants(sts, "lambda:InvokeFunction", fn(other)) and not grants(sts, "lambda:UpdateFunctionConfiguration", fn(other))
    for sts in (window_role, worker):
        assert not grants(sts, "lambda:InvokeFunction", fn(res.control_function))
        assert not grants(sts, "lambda:UpdateFunctionConfiguration", fn(res.control_function))
    assert grants(job_role, "states:StartExecution", sm(window))
    assert grants(job_role, "states:DescribeExecution", ex(window)) and grants(job_role, "states:StopExecution", ex(window))
    assert grants(job_role, "states:StartExecution", sm(f"{STACK}-job"))  # continue-as-new
    for other in ("other-job", f"other-{job}-window", f"{STACK}-jobs"):
        assert not grants(job_role, "states:StartExecution", sm(other))


# startExecution.sync:2: start the child, watch it, and the EventBridge rule it is watched through
# (Step Functions' IAM policies for nested executions)
SYNC_ACTIONS = {
    "states:StartExecution",
    "states:DescribeExecution",
    "states:StopExecution",
    "events:PutTargets",
    "events:PutRule",
    "events:DescribeRule",
}
# an Express window's logging: CloudWatch Logs' log delivery (Step Functions guide, cw-logs.html)
LOG_DELIVERY = {
    "logs:CreateLogDelivery",
    "logs:GetLogDelivery",
    "logs:UpdateLogDelivery",
    "logs:DeleteLogDelivery",
    "logs:ListLogDeliveries",
    "logs:PutResourcePolicy",
    "logs:DescribeResourcePolicies",
    "logs:DescribeLogGroups",
}


def test_roles_grant_what_the_state_machines_call(template):
    """Each Task resource of the job and window definitions needs IAM actions (Step Functions'
    policies for its service integrations); the machine's role must grant them."""
    from stagecoach.planner.emit import asl
    from stagecoach.planner.plan import Plan

    needs = {
        "arn:aws:states:::lambda:invoke": {"lambda:InvokeFunction"},
        # startExecution (no wait): the job continuing as a new execution of itself
        "arn:aws:states:::states:startExecution": {"states:StartExecution"},
        # a window's abort marker (aws-sdk integration: the S3 action itself)
        "arn:aws:states:::aws-sdk:s3:putObject": {"s3:PutObject"},
        "arn:aws:states:::states:startExecution.sync:2": SYNC_ACTIONS,
        # an Express window (aws-sdk integration: the API action itself)
        "arn:aws:states:::aws-sdk:sfn:startSyncExecution": {"states:StartSyncExecution"},
    }

    def resources(d):
        out = set()
        for st in d.get("States", {}).values():
            if st.get("Type") == "Task":
                out.add(st["Resource"])
            for sub in [st.get("ItemProcessor") or st.get("Iterator") or {}] + st.get("Branches", []):
                out |= resources(sub)
        return out

    with open(os.path.join(ROOT, "statemachines", "job.asl.json")) as f:
        job_def = json.load(f)
    window_def = asl.window_definition(
        Plan(balance=[1, 1], replicas=2, micro_batches=1, global_batch=2), ["a-s0", "a-s1"], abort_key_format=keys.WINDOW_ABORT
    )
    for d, role in ((job_def, "JobStatesRole"), (window_def, "WindowStatesRole")):
        used = resources(d)
        assert used and used <= set(needs), used - set(needs)
        granted = {a for a, _ in allowed(role_statements(template, role))}
        for r in used:
            assert needs[r] <= granted, (role, r, needs[r] - granted)


def test_window_role_invokes_only_stack_functions_writes_only_abort_markers_and_starts_only_groups(template):
    got = allowed(role_statements(template, "WindowStatesRole"))
    assert {a for a, _ in got} == {"lambda:InvokeFunction", "s3:PutObject"} | SYNC_ACTIONS | LOG_DELIVERY
    # a phase past 40 workers runs its groups as child executions of the job's group machine
    # (planner/emit/groups.py), and of nothing else: not the windows, not the job machine
    states = "arn:${AWS::Partition}:states:${AWS::Region}:${AWS::AccountId}"
    assert {r for a, r in got if a == "states:StartExecution"} == {f"{states}:stateMachine:${{AWS::StackName}}-*-group"}
    for a in ("states:DescribeExecution", "states:StopExecution"):
        assert {r for a2, r in got if a2 == a} == {f"{states}:execution:${{AWS::StackName}}-*-group:*"}
    rule = "arn:${AWS::Partition}:events:${AWS::Region}:${AWS::AccountId}:rule/StepFunctionsGetEventsForStepFunctionsExecutionRule"
    assert {r for a, r in got if a.startswith("events:")} == {rule}
    assert {r for a, r in got if a == "lambda:InvokeFunction"} == {
        "arn:${AWS::Partition}:lambda:${AWS::Region}:${AWS::AccountId}:function:${AWS::StackName}-*-s*",
        "arn:${AWS::Partition}:lambda:${AWS::Region}:${AWS::AccountId}:function:${AWS::StackName}-*-s*:*",
    }

    assert {r for a, r in got if a == "s3:PutObject"} == {"${Bucket.Arn}/jobs/*/abort/*"}
    assert fnmatch.fnmatchcase(keys.window_abort("j-1a2b3c4d", "w0-uuid"), "jobs/*/abort/*")


def test_job_role_runs_only_stack_windows_the_sync_rule_and_remediation(template):
    got = allowed(role_statements(template, "JobStatesRole"))
    by_action = {}
    for a, r in got:
        by_action.setdefault(a, set()).add(r)
    assert set(by_action) == SYNC_ACTIONS | {"lambda:InvokeFunction", "states:StartSyncExecution"}
    assert by_action["states:StartSyncExecution"] == {
        "arn:${AWS::Partition}:states:${AWS::Region}:${AWS::AccountId}:stateMachine:${AWS::StackName}-*-window"
    }
    # remediation runs on the stack's own worker function only, never on a job's stage function
    assert by_action["lambda:InvokeFunction"] == {
        "arn:${AWS::Partition}:lambda:${AWS::Region}:${AWS::AccountId}:function:${AWS::StackName}-worker"
    }
    assert by_action["states:StartExecution"] == {
        "arn:${AWS::Partition}:states:${AWS::Region}:${AWS::AccountId}:stateMachine:${AWS::StackName}-*-window",
        # continue-as-new: a job execution starts the next link of its chain
        "arn:${AWS::Partition}:states:${AWS::Region}:${AWS::AccountId}:stateMachine:${AWS::StackName}-job",
    }
    for a in ("states:DescribeExecution", "states:StopExecution"):
        assert by_action[a] == {"arn:${AWS::Partition}:states:${AWS::Region}:${AWS::AccountId}:execution:${AWS::StackName}-*-window:*"}
    for a in ("events:PutTargets", "events:PutRule", "events:DescribeRule"):
        assert by_action[a] == {
            "arn:${AWS::Partition}:events:${AWS::Region}:${AWS::AccountId}:rule/StepFunctionsGetEventsForStepFunctionsExecutionRule"
        }


def test_roles_trust_only_their_service(template):
    for logical, svc in (
        ("ControlRole", "lambda.amazonaws.com"),
        ("WindowStatesRole", "states.amazonaws.com"),
        ("JobStatesRole", "states.amazonaws.com"),
    ):
        (st,) = template["Resources"][logical]["Properties"]["AssumeRolePolicyDocument"]["Statement"]
        assert st["Principal"] == {"Service": svc} and st["Action"] == "sts:AssumeRole"


def test_functions_and_machines_use_the_scoped_roles(template):
    r = template["Resources"]
    assert r["DefaultWorker"]["Properties"]["Role"] == {"Fn::GetAtt": ["ControlRole", "Arn"]}
    assert r["JobStateMachine"]["Properties"]["Role"] == {"Fn::GetAtt": ["JobStatesRole", "Arn"]}
    assert "Policies" not in r["DefaultWorker"]["Properties"] and "Policies" not in r["JobStateMachine"]["Properties"]


# ---------------------------------------------------------------------------------- bucket, outputs
def test_bucket_encrypted_private_tls_only_with_expiry(template):
    b = template["Resources"]["Bucket"]["Properties"]
    (rule,) = b["BucketEncryption"]["ServerSideEncryptionConfiguration"]
    assert rule["ServerSideEncryptionByDefault"]["SSEAlgorithm"] == "AES256"  # SSE-S3: no KMS key to grant
    assert all(
        b["PublicAccessBlockConfiguration"][k] is True
        for k in ("BlockPublicAcls", "BlockPublicPolicy", "IgnorePublicAcls", "RestrictPublicBuckets")
    )
    pol = template["Resources"]["BucketPolicy"]["Properties"]
    assert pol["Bucket"] == {"Ref": "Bucket"}
    deny = [st for st in pol["PolicyDocument"]["Statement"] if st["Effect"] == "Deny"]
    assert any(
        st["Condition"] == {"Bool": {"aws:SecureTransport": "false"}}
        and st["Principal"] == "*"
        and st["Action"] == "s3:*"
        and set(_strings(st["Resource"])) == {"GetAtt:Bucket.Arn", "${Bucket.Arn}/*"}
        for st in deny
    )
    rules = {r["Id"]: r for r in b["LifecycleConfiguration"]["Rules"]}
    exp = rules["ExpireTransientIterationObjects"]
    assert exp["Status"] == "Enabled" and exp["Prefix"] == "jobs/"
    assert exp["ExpirationInDays"] == {"Ref": "IterationObjectExpiryDays"}
    assert template["Parameters"]["IterationObjectExpiryDays"]["Default"] in (1, 2)
    assert exp["TagFilters"] == [{"Key": "stagecoach:transient", "Value": "true"}]


def test_lifecycle_tag_is_the_one_the_workers_put_on_iteration_objects(template):
    from urllib.parse import parse_qs

    from stagecoach.lambdas import channel

    (f,) = template["Resources"]["Bucket"]["Properties"]["LifecycleConfiguration"]["Rules"][0]["TagFilters"]
    assert parse_qs(channel.TRANSIENT_TAG) == {f["Key"]: [f["Value"]]}


def test_parameters_outputs_and_names(template):
    p = template["Parameters"]
    assert p["Architecture"]["AllowedValues"] == ["x86_64", "arm64"]
    assert "LogRetentionDays" in p
    assert template["Resources"]["WorkerLogGroup"]["Properties"]["RetentionInDays"] == {"Ref": "LogRetentionDays"}
    outputs = set(template["Outputs"])
    from stagecoach.aws.stack import REQUIRED_OUTPUTS

    assert set(REQUIRED_OUTPUTS) | {"Region", "Architecture", "WorkerPython"} <= outputs
    assert "WorkerImageUri" in outputs or "WorkerFunctionName" in outputs
    assert template["Outputs"]["StatesRoleArn"]["Value"] == {"Fn::GetAtt": ["WindowStatesRole", "Arn"]}
    sm = template["Resources"]["JobStateMachine"]["Properties"]
    assert sm["DefinitionUri"] == "statemachines/job.asl.json" and sm["Name"] == {SUB: "${AWS::StackName}-job"}
    assert sm["Type"] == "STANDARD" and "DefinitionSubstitutions" in sm
    fn = template["Resources"]["DefaultWorker"]
    assert fn["Properties"]["PackageType"] == "Image"
    assert fn["Properties"]["Architectures"] == [{"Ref": "Architecture"}]
    assert fn["Metadata"]["Dockerfile"] == "lambdas/Dockerfile" and fn["Metadata"]["DockerContext"] == "."
    assert fn["Properties"]["Environment"]["Variables"]["STAGECOACH_BUCKET"] == {"Ref": "Bucket"}


# ---------------------------------------------------------------------------------- worker image
def _dockerfile():
    with open(os.path.join(ROOT, "lambdas", "Dockerfile")) as f:
        return f.read()


def test_handler_path_is_the_package_layout():
    """The handler the image runs, the default worker's and the SDK's per-stage functions' are one,
    and it is a function of the installed package (lambdas/ is stagecoach.lambdas through the link
    sdk/lambdas, docs/architecture.md "Layout")."""
    import importlib

    from stagecoach.deploy import resources as deploy

    t, _ = decode(TEMPLATE)
    assert t["Resources"]["DefaultWorker"]["Properties"]["ImageConfig"]["Command"] == [deploy.HANDLER]
    assert f'CMD ["{deploy.HANDLER}"]' in _dockerfile()
    module, fn = deploy.HANDLER.rsplit(".", 1)
    assert callable(getattr(importlib.import_module(module), fn))
    assert _package_sources()["stagecoach.lambdas"] == "lambdas"
    assert _package_sources()["stagecoach"] == "sdk"


def _package_sources() -> dict[str, str]:
    """Each package of pyproject.toml and the top-level folder it lives in, through the checkout's
    links (stagecoach -> sdk, sdk/planner -> ../planner, ...)."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        packages = tomllib.load(f)["tool"]["setuptools"]["packages"]
    out = {}
    for pkg in packages:
        real = os.path.realpath(os.path.join(ROOT, *pkg.split(".")))
        assert os.path.isfile(os.path.join(real, "__init__.py")), pkg
        out[pkg] = os.path.relpath(real, ROOT)
    return out


def test_the_links_name_the_top_level_folders():
    """stagecoach.* resolves from the checkout itself: the links are in git, not built."""
    assert os.readlink(os.path.join(ROOT, "stagecoach")) == "sdk"
    for sub in ("planner", "lambdas", "core"):
        assert os.readlink(os.path.join(ROOT, "sdk", sub)) == f"../{sub}"
        assert _package_sources()[f"stagecoach.{sub}"] == sub


def test_dockerfile_python_torch_and_entry_point():
    """Lambda's python:3.11 image is Amazon Linux 2 (glibc 2.26), too old for torch 2.13's
    manylinux_2_28 wheels: the image is the OS-only AL2023 base with Python 3.11 and awslambdaric.
    Python, torch and the entry point must agree with the template and the project."""
    text = _dockerfile()
    t, _ = decode(TEMPLATE)
    args = t["Resources"]["DefaultWorker"]["Metadata"]["DockerBuildArgs"]
    assert re.findall(r"^FROM (\S+)", text, re.M) == ["public.ecr.aws/lambda/provided:al2023"]
    assert re.search(r"^ARG PYTHON_VERSION=(\S+)$", text, re.M).group(1) == args["PYTHON_VERSION"] == t["Outputs"]["WorkerPython"]["Value"]
    assert args["PYTHON_VERSION"] == f"{sys.version_info.major}.{sys.version_info.minor}"  # the SDK's own (cloudpickle)
    assert re.search(r"^ARG TORCH_VERSION=(\S+)$", text, re.M).group(1) == args["TORCH_VERSION"]
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    assert f"<={args['TORCH_VERSION']}" in next(d for d in deps if d.startswith("torch"))  # the pin the project allows
    assert "--index-url https://download.pytorch.org/whl/cpu" in text  # CPU-only torch, no CUDA libraries
    assert 'ENTRYPOINT ["/usr/local/bin/stagecoach-python", "-m", "awslambdaric"]' in text
    assert "/usr/local/bin/stagecoach-python" in text.split("ENTRYPOINT")[0]  # made before it is used


def test_dockerfile_copies_what_the_package_needs_and_dockerignore_keeps_it():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)
    top = {s.split("/")[0] for s in _package_sources().values()} | {"stagecoach"}  # the folders and the link
    copied = set(re.findall(r"^COPY (\S+) \./", _dockerfile(), re.M)) | {"pyproject.toml", "README.md"}
    assert top <= copied, top - copied
    assert project["project"]["readme"] == "README.md"
    with open(os.path.join(ROOT, ".dockerignore")) as f:
        ignored = {line.strip().rstrip("/") for line in f if line.strip() and not line.startswith("#")}
    assert not ignored & (top | {"pyproject.toml", "README.md"})
    assert {".git", ".venv", "node_modules", "tests"} <= ignored


# ---------------------------------------------------------------------------------- deployer policy
def test_deployer_policy_document_is_the_generated_one():
    from stagecoach.aws.policy import deployer_policy

    with open(os.path.join(ROOT, "docs", "deployer-policy.json")) as f:
        assert json.load(f) == deployer_policy(), "regenerate docs/deployer-policy.json from stagecoach.aws.policy.deployer_policy()"


def test_deployer_policy_is_scoped_to_the_stack():
    from stagecoach.aws.policy import deployer_policy

    pol = deployer_policy(STACK, REGION, ACCOUNT, bucket=BUCKET)
    sids = [st["Sid"] for st in pol["Statement"]]
    assert len(sids) == len(set(sids))
    list_actions = {"lambda:ListFunctions", "states:ListStateMachines", "lambda:GetAccountSettings"}  # no resource-level permissions
    for st in pol["Statement"]:
        for a in st["Action"]:
            assert "*" not in a
        for r in _strings(st["Resource"]):
            if r == "*":
                assert set(st["Action"]) <= list_actions, st
            else:
                assert f":{STACK}-" in r or f"/{STACK}-" in r or f"/{STACK}/" in r or f":::{BUCKET}" in r, r
    assert not any(a.startswith("ecr:") for st in pol["Statement"] for a in st["Action"])
    # roles live under the stack's IAM path (template.yaml Path, deploy/roles.py): nothing else is
    # there; Lambda gets the jobs' roles, Step Functions the window machines' role
    passed = {
        st["Condition"]["StringEquals"]["iam:PassedToService"]: st["Resource"] for st in pol["Statement"] if "iam:PassRole" in st["Action"]
    }
    path = f"arn:aws:iam::{ACCOUNT}:role/stagecoach/{STACK}/"
    assert passed == {
        "lambda.amazonaws.com": [f"{path}{STACK}-*-????????", f"{path}{STACK}-*-????????-prof"],
        "states.amazonaws.com": f"{path}*-WindowStatesRole-*",
    }


def test_deployer_policy_has_no_privilege_escalation():
    """What parliament flags as escalation: creating or changing a role's policies without a bound,
    passing roles the stack did not create, and changing code of functions the stack did not create."""
    from stagecoach.aws.policy import deployer_policy
    from stagecoach.deploy.iam_policy import evaluate

    boundary = f"arn:aws:iam::{ACCOUNT}:policy/stagecoach/{STACK}/{STACK}-JobRoleBoundary-X"
    pol = deployer_policy(STACK, REGION, ACCOUNT, bucket=BUCKET, boundary=boundary)

    def can(action, resource, **context):
        return evaluate(action, resource, [pol], context=context).allowed

    job_role = f"arn:aws:iam::{ACCOUNT}:role/stagecoach/{STACK}/{STACK}-digits-1a2b3c4d"
    for action in ("iam:CreateRole", "iam:PutRolePolicy", "iam:DeleteRolePolicy"):
        assert can(action, job_role, **{"iam:PermissionsBoundary": boundary})
        assert not can(action, job_role)  # without the stack's boundary
        assert not can(action, job_role, **{"iam:PermissionsBoundary": "arn:aws:iam::aws:policy/AdministratorAccess"})
        assert not can(action, f"arn:aws:iam::{ACCOUNT}:role/{STACK}-admin", **{"iam:PermissionsBoundary": boundary})
    for action in (
        "iam:PutRolePermissionsBoundary",
        "iam:DeleteRolePermissionsBoundary",
        "iam:AttachRolePolicy",
        "iam:UpdateAssumeRolePolicy",
    ):
        assert not can(action, job_role, **{"iam:PermissionsBoundary": boundary})
    assert can("iam:PassRole", job_role, **{"iam:PassedToService": "lambda.amazonaws.com"})
    assert not can("iam:PassRole", job_role, **{"iam:PassedToService": "ec2.amazonaws.com"})
    assert not can("iam:PassRole", f"arn:aws:iam::{ACCOUNT}:role/{STACK}-prod-admin", **{"iam:PassedToService": "lambda.amazonaws.com"})
    ours = f"arn:aws:lambda:{REGION}:{ACCOUNT}:function:{STACK}-digits-1a2b3c4d-s0"
    foreign = f"arn:aws:lambda:{REGION}:{ACCOUNT}:function:{STACK}-prod-stripe-webhook"  # fits "<stack>-*"
    tagged = {"aws:ResourceTag/stagecoach:stack": STACK}
    for action in (
        "lambda:UpdateFunctionCode",
        "lambda:UpdateFunctionConfiguration",
        "lambda:DeleteFunction",
        "lambda:PutFunctionConcurrency",
    ):
        assert can(action, ours, **tagged) and not can(action, foreign)
    created = {"aws:RequestTag/stagecoach:stack": STACK, "aws:ResourceTag/stagecoach:stack": STACK}  # the new function's tags
    assert can("lambda:CreateFunction", ours, **created) and not can("lambda:CreateFunction", ours)
    # tagging cannot adopt another application's untagged function into the stack
    assert not can("lambda:TagResource", foreign, **{"aws:RequestTag/stagecoach:stack": STACK})
    assert not can("lambda:InvokeFunction", foreign) and not can("lambda:InvokeFunction", ours, **tagged)  # only profile functions
    assert can("lambda:InvokeFunction", ours.replace("-s0", "-prof-s0"), **tagged)


def test_deployer_policy_reaches_none_of_the_stacks_own_roles_functions_or_machines():
    """The stack's own resources are not the deployer's to change: its roles (CloudFormation names
    them "<stack>-<LogicalId>-<random>", under the same path as the jobs' roles), its default worker
    (which runs as the control role: new code or a new command there would run with that role, the
    escalation parliament reports as EditExistingLambdaFunctionWithRole) and its job state machine.
    Deleting, changing and passing roles reach only the roles jobs get ("<stack>-<job id>", a job id
    ending in 8 hex digits, "-prof" after them for a profiling job: deploy/roles.py, profile_tiers.py);
    changing, creating and deleting functions only job functions ("<stack>-<job>-s<stage>..."); creating,
    changing and deleting state machines only windows ("<stack>-<job>-window")."""
    from stagecoach.aws.policy import deployer_policy
    from stagecoach.deploy import resources as deploy
    from stagecoach.deploy.iam_policy import evaluate
    from stagecoach.deploy.roles import job_role_arn

    boundary = f"arn:aws:iam::{ACCOUNT}:policy/stagecoach/{STACK}/{STACK}-JobRoleBoundary-X"
    pol = deployer_policy(STACK, REGION, ACCOUNT, bucket=BUCKET, boundary=boundary)

    def can(action, resource, **context):
        return evaluate(action, resource, [pol], context=context).allowed

    res = stack_resources()
    path = f"arn:aws:iam::{ACCOUNT}:role/stagecoach/{STACK}/"
    own_roles = [
        f"{path}{STACK}-{logical}-{suffix}"
        for logical in ("ControlRole", "WindowStatesRole", "JobStatesRole")
        for suffix in ("1A2B3C4D5E6F", "aBcDeFgHiJkLm")
    ]
    job_roles = [job_role_arn(res, job) for job in ("digits-1a2b3c4d", "a-0f0f0f0f", "my-long-job-name-deadbeef", "digits-1a2b3c4d-prof")]
    for role in own_roles:
        for action in ("iam:DeleteRole", "iam:DeleteRolePolicy", "iam:PutRolePolicy"):
            assert not can(action, role), (action, role)
        assert not can("iam:PassRole", role, **{"iam:PassedToService": "lambda.amazonaws.com"}), role
    for role in job_roles:
        assert can("iam:DeleteRole", role), role
        assert can("iam:DeleteRolePolicy", role, **{"iam:PermissionsBoundary": boundary}), role
        assert can("iam:PassRole", role, **{"iam:PassedToService": "lambda.amazonaws.com"}), role
        assert not can("iam:PassRole", role, **{"iam:PassedToService": "states.amazonaws.com"}), role
    window_role = own_roles[2]
    assert can("iam:PassRole", window_role, **{"iam:PassedToService": "states.amazonaws.com"})
    assert not can("iam:PassRole", own_roles[4], **{"iam:PassedToService": "states.amazonaws.com"})  # the job machine's role
    fn = f"arn:aws:lambda:{REGION}:{ACCOUNT}:function:"
    tagged = {"aws:ResourceTag/stagecoach:stack": STACK, "aws:RequestTag/stagecoach:stack": STACK}
    changes = ("lambda:UpdateFunctionCode", "lambda:UpdateFunctionConfiguration", "lambda:DeleteFunction", "lambda:PutFunctionConcurrency")
    for action in (*changes, "lambda:CreateFunction", "lambda:TagResource", "lambda:InvokeFunction"):
        assert not can(action, fn + res.control_function, **tagged), action  # even if someone tagged it
    job = "digits-1a2b3c4d"
    functions = [deploy.function_name(res, job, 0), deploy.function_name(res, job, 3) + "-r1", deploy.function_name(res, job, 3) + "-k0"]
    for name in functions + [deploy.function_name(res, job + "-prof", 1)]:
        for action in (*changes, "lambda:CreateFunction"):
            assert can(action, fn + name, **tagged), (action, name)
    assert can("lambda:GetFunction", fn + res.control_function)  # the SDK reads the worker image from it
    sm = f"arn:aws:states:{REGION}:{ACCOUNT}:stateMachine:"
    window = deploy.window_state_machine_name(res, job)
    for action in ("states:CreateStateMachine", "states:UpdateStateMachine", "states:DeleteStateMachine", "states:TagResource"):
        assert can(action, sm + window) and not can(action, sm + f"{STACK}-job"), action
    for action in ("states:StartExecution", "states:DescribeStateMachine", "states:ListExecutions"):
        assert can(action, sm + f"{STACK}-job"), action


def test_deployer_policy_covers_the_keys_the_sdk_uses():
    from stagecoach import history
    from stagecoach.aws.policy import deployer_policy

    sts = deployer_policy(STACK, REGION, ACCOUNT, bucket=BUCKET)["Statement"]
    job = "digits-1a2b3c4d"
    for key in (
        keys.job_spec(job),
        keys.metrics(job, 0, "forward", 0, 0),
        keys.dataset(DS),
        keys.data_shard(DS, "abc"),
        history.history_key("digits"),
        history.memory_key("digits"),
        keys.stop_request(job),  # Run.stop(), `stagecoach stop`
        keys.stopped(job),
    ):
        for action in ("s3:GetObject", "s3:PutObject"):
            assert grants(sts, action, f"arn:aws:s3:::{BUCKET}/{key}"), (action, key)
    assert grants(sts, "s3:ListBucket", f"arn:aws:s3:::{BUCKET}")
    assert not grants(sts, "s3:GetObject", f"arn:aws:s3:::other-bucket/{keys.job_spec(job)}")


# ---------------------------------------------------------------------------------- sam (opt-in)
SAM_MISSING = (
    "aws-sam-cli is not installed: install it in a separate virtualenv (its pins clash with this "
    "project's), e.g. python -m venv ~/.sam && ~/.sam/bin/pip install aws-sam-cli, then put its sam on "
    "PATH or set STAGECOACH_SAM=~/.sam/bin/sam"
)


def _sam():
    """The sam executable: STAGECOACH_SAM (e.g. in its own virtualenv) or the one on PATH."""
    sam = os.environ.get("STAGECOACH_SAM") or shutil.which("sam")
    if not sam or not os.access(os.path.expanduser(sam), os.X_OK):
        pytest.skip(SAM_MISSING)
    return os.path.expanduser(sam)


def _sam_env():
    return dict(os.environ, AWS_DEFAULT_REGION=os.environ.get("AWS_DEFAULT_REGION", "us-east-1"), SAM_CLI_TELEMETRY="0")


def _repo_copy(tmp_path):
    work = tmp_path / "repo"
    shutil.copytree(
        ROOT,
        work,
        ignore=shutil.ignore_patterns(".git", ".venv", "node_modules", ".aws-sam", "stagecoach-runs", "__pycache__", "*.egg-info"),
    )
    return work


@pytest.mark.slow
def test_sam_validate_lint(tmp_path):
    """`sam validate --lint`: SAM CLI's own transform and its (newer) cfn-lint. Skips only without aws-sam-cli."""
    sam = _sam()
    work = _repo_copy(tmp_path)
    r = subprocess.run(
        [sam, "validate", "--lint", "--template", "template.yaml"], cwd=work, capture_output=True, text=True, env=_sam_env(), timeout=600
    )
    assert r.returncode == 0 and "is a valid SAM Template" in r.stdout + r.stderr, r.stdout + r.stderr


@pytest.mark.slow
def test_sam_build(tmp_path):
    """`sam build` of the worker image. Skips without aws-sam-cli. Without a container engine sam
    cannot build an image at all: the test then checks that sam read the template, found the
    Dockerfile and its build arguments and stopped only for the missing engine, and says so."""
    sam = _sam()
    work = _repo_copy(tmp_path)
    r = subprocess.run(
        [sam, "build", "--template", "template.yaml"], cwd=work, capture_output=True, text=True, env=_sam_env(), timeout=3600
    )
    out = r.stdout + r.stderr
    engine = shutil.which("docker") and subprocess.run(["docker", "info"], capture_output=True).returncode == 0
    if not engine:
        assert r.returncode != 0 and "Building image for DefaultWorker function" in out, out
        assert "Setting DockerBuildArgs for DefaultWorker function" in out and "container runtime" in out, out
        pytest.skip(
            "sam build accepted the template, the Dockerfile and its build arguments, but building the image "
            "needs a Docker (or Finch) engine, which is not running here"
        )
    assert r.returncode == 0, out
    built = (work / ".aws-sam" / "build" / "template.yaml").read_text()
    assert "defaultworker:py311-torch2.13.0" in built, built  # the image sam deploy pushes
