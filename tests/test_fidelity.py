"""The local stack answers as AWS does where moto is kinder (stagecoach.local.fidelity).

Each test drives the behaviour through the stack's public APIs (boto3 against the local endpoint,
state machines run by the interpreter) and checks the shape AWS documents or has been reported
to produce; the sources are cited in stagecoach/local/fidelity.py and docs/local-stack.md.
"""

import json
import threading
import time

import boto3
import botocore.exceptions
import pytest
from botocore.config import Config
from helpers import create_function, run_state_machine, task_failure, task_machine

from stagecoach.local.backend import LocalBackend
from stagecoach.local.fidelity import OOM_SHAPES, TIMEOUT_SHAPES, Fidelity


@pytest.fixture(scope="module")
def seeded():
    """A stack whose error shapes are drawn from seed 7: several failures meet every shape."""
    return LocalBackend(fidelity=Fidelity(error_seed=7))


def test_out_of_memory_kills_reach_step_functions_in_each_of_aws_shapes(seeded):
    fn = create_function(seeded, "hog.handler", memory_mb=300)
    seen: dict[str, str] = {}
    for _ in range(12):
        d, events = run_state_machine(seeded, task_machine(fn), {"allocate_mb": 500})
        assert d["status"] == "FAILED"
        det = task_failure(events)
        seen[det["error"]] = det["cause"]
        if len(seen) == len(OOM_SHAPES):
            break
    assert set(seen) == set(OOM_SHAPES), seen
    assert "signal: killed" in seen["Runtime.OutOfMemory"] and "signal: killed" in seen["Runtime.ExitError"]
    assert seen["Lambda.Unknown"].startswith("The cause could not be determined because Lambda did not return an error type")
    # AWS's messages do not say how much memory was used; neither may ours
    assert all("MB" not in cause for cause in seen.values()), seen


def test_timeouts_reach_step_functions_as_sandbox_timedout_or_lambda_unknown(seeded):
    fn = create_function(seeded, "hog.handler", timeout_s=1)
    seen: dict[str, str] = {}
    for _ in range(8):
        _, events = run_state_machine(seeded, task_machine(fn), {"sleep_s": 5})
        det = task_failure(events)
        seen[det["error"]] = det["cause"]
        if len(seen) == len(TIMEOUT_SHAPES):
            break
    assert set(seen) == set(TIMEOUT_SHAPES), seen
    assert all("Task timed out after 1.00 seconds" in cause for cause in seen.values()), seen


def test_a_forced_shape_is_the_only_one_reported():
    forced = LocalBackend(fidelity=Fidelity(error_shapes="Runtime.ExitError"))
    fn = create_function(forced, "hog.handler", memory_mb=300)
    errors = {task_failure(run_state_machine(forced, task_machine(fn), {"allocate_mb": 500})[1])["error"] for _ in range(3)}
    assert errors == {"Runtime.ExitError"}


def _child_and_parent(backend: LocalBackend, child_fails: bool) -> tuple[dict, list]:
    c, res = backend.clients, backend.resources
    child = {"StartAt": "F", "States": {"F": {"Type": "Fail", "Error": "Child.Broke", "Cause": "on purpose"}}}
    if not child_fails:
        child = {"StartAt": "P", "States": {"P": {"Type": "Pass", "Result": {"ok": 1}, "End": True}}}
    arn = c.sfn.create_state_machine(name=f"child-{time.time_ns()}", definition=json.dumps(child), roleArn=res.states_role_arn)[
        "stateMachineArn"
    ]
    parent = {
        "StartAt": "Run",
        "States": {
            "Run": {
                "Type": "Task",
                "Resource": "arn:aws:states:::states:startExecution.sync:2",
                "Parameters": {"StateMachineArn": arn, "Input": {"x": 1}},
                "Catch": [{"ErrorEquals": ["States.ALL"], "ResultPath": "$.failure", "Next": "Caught"}],
                "End": True,
            },
            "Caught": {"Type": "Pass", "Parameters": {"child.$": "States.StringToJson($.failure.Cause)"}, "End": True},
        },
    }
    return run_state_machine(backend, parent, {})


def test_sync2_results_and_causes_use_step_functions_casing(backend):
    d, _ = _child_and_parent(backend, child_fails=False)
    out = json.loads(d["output"])
    assert out["Status"] == "SUCCEEDED" and "ExecutionArn" in out and out["Output"] == {"ok": 1}
    assert "status" not in out and "executionArn" not in out

    d, _ = _child_and_parent(backend, child_fails=True)
    child = json.loads(d["output"])["child"]
    assert child["Error"] == "Child.Broke" and child["Cause"] == "on purpose" and child["Status"] == "FAILED"
    assert "error" not in child


def test_an_execution_fails_at_the_history_limit_and_no_catch_sees_it():
    # A limit of 60 instead of 25,000 only to keep the test short; the mechanism is the same.
    small = LocalBackend(fidelity=Fidelity(history_limit=60))
    loop = {
        "StartAt": "Loop",
        "States": {
            "Loop": {
                "Type": "Parallel",
                "Branches": [{"StartAt": "P", "States": {"P": {"Type": "Pass", "End": True}}}],
                "Catch": [{"ErrorEquals": ["States.ALL"], "Next": "Caught"}],
                "Next": "Loop",
            },
            "Caught": {"Type": "Succeed"},
        },
    }
    d, events = run_state_machine(small, loop, {})
    assert d["status"] == "FAILED"
    assert d["error"] == "States.Runtime"
    assert d["cause"] == "The execution reached the maximum number of history events (60)."
    assert len(events) == 60 and events[-1]["type"] == "ExecutionFailed"


def test_start_execution_refuses_an_input_over_256_kib(backend):
    c, res = backend.clients, backend.resources
    arn = c.sfn.create_state_machine(
        name=f"big-{time.time_ns()}",
        definition=json.dumps({"StartAt": "P", "States": {"P": {"Type": "Pass", "End": True}}}),
        roleArn=res.states_role_arn,
    )["stateMachineArn"]
    fits = json.dumps({"x": "a" * (262_144 - 9)})
    assert len(fits.encode()) == 262_144
    c.sfn.start_execution(stateMachineArn=arn, input=fits)
    with pytest.raises(botocore.exceptions.ClientError) as e:
        c.sfn.start_execution(stateMachineArn=arn, input=json.dumps({"x": "a" * 262_144}))
    assert e.value.response["Error"]["Code"] == "ValidationException"
    assert "262144" in e.value.response["Error"]["Message"]


def _no_retry_lambda(backend: LocalBackend):
    return boto3.client(
        "lambda",
        endpoint_url=backend.stack.endpoint_url,
        region_name="us-east-1",
        aws_access_key_id="local",
        aws_secret_access_key="local",
        config=Config(retries={"total_max_attempts": 1}),
    )


def _busy(backend: LocalBackend, fn: str, n: int, sleep_s: float = 4) -> list[threading.Thread]:
    """``n`` invocations of ``fn`` in flight (each sleeping), started from threads."""
    lam = _no_retry_lambda(backend)
    threads = [
        threading.Thread(target=lam.invoke, kwargs={"FunctionName": fn, "Payload": json.dumps({"sleep_s": sleep_s})}) for _ in range(n)
    ]
    for t in threads:
        t.start()
    deadline = time.time() + 20
    while backend.stack.alive() and time.time() < deadline:
        time.sleep(0.3)
        if all(t.is_alive() for t in threads) and time.time() > deadline - 18:
            break
    return threads


def test_invocations_beyond_the_account_concurrency_are_throttled_as_lambda_throttles():
    small = LocalBackend(fidelity=Fidelity(account_concurrency=2))
    fn = create_function(small, "hog.handler")
    _no_retry_lambda(small).invoke(FunctionName=fn, Payload=b"{}")  # warm: the busy ones start at once
    busy = _busy(small, fn, 2)
    with pytest.raises(botocore.exceptions.ClientError) as e:
        _no_retry_lambda(small).invoke(FunctionName=fn, Payload=b"{}")
    err = e.value.response
    assert err["ResponseMetadata"]["HTTPStatusCode"] == 429
    assert err["Error"]["Code"] == "TooManyRequestsException" and err["Error"]["Message"] == "Rate Exceeded."
    assert err.get("Reason") == "ConcurrentInvocationLimitExceeded"
    for t in busy:
        t.join()
    _no_retry_lambda(small).invoke(FunctionName=fn, Payload=b"{}")  # capacity is back


def test_reserved_concurrency_throttles_the_function_with_its_own_reason(backend):
    fn = create_function(backend, "hog.handler")
    backend.clients.lambda_.put_function_concurrency(FunctionName=fn, ReservedConcurrentExecutions=1)
    busy = _busy(backend, fn, 1)
    with pytest.raises(botocore.exceptions.ClientError) as e:
        _no_retry_lambda(backend).invoke(FunctionName=fn, Payload=b"{}")
    assert e.value.response.get("Reason") == "ReservedFunctionConcurrentInvocationLimitExceeded"
    for t in busy:
        t.join()


def test_a_plan_the_account_cannot_run_at_once_is_refused_before_anything_is_created():
    """A new account may have 10 concurrent executions: a 2 x 3 plan runs 6 workers at once and a
    restarted window briefly doubles that, so it is refused with what to do, and nothing is left."""
    import torch
    from torch import nn

    from stagecoach import Job
    from stagecoach.deploy.resources import DeployError

    small = LocalBackend(fidelity=Fidelity(account_concurrency=10))
    job = Job(
        model=lambda: nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)),
        loss=nn.CrossEntropyLoss(),
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        train=(torch.randn(24, 4), torch.randint(0, 2, (24,))),
        global_batch=6,
        iterations=2,
        name="toomany",
    )
    functions = {f["FunctionName"] for f in small.clients.lambda_.list_functions()["Functions"]}
    with pytest.raises(DeployError, match=r"up to 6 Lambda invocations at once.*\(13 with the remediation step\).*allows 10.*quota"):
        job.run(stages=2, replicas=3, backend=small)
    assert {f["FunctionName"] for f in small.clients.lambda_.list_functions()["Functions"]} == functions
    run = job.run(stages=2, replicas=2, backend=small)  # 4 at once, 9 with headroom: fits
    assert run.wait(progress=False, poll_s=0.2, timeout_s=300) == "SUCCEEDED"


def test_a_job_can_reserve_the_concurrency_its_stages_need(backend):
    """Job.run(reserve_concurrency=True): each stage function gets twice its most tasks at once
    reserved, and the job still runs (the local stack throttles beyond a reservation, as Lambda does)."""
    import torch
    from torch import nn

    from stagecoach import Job

    job = Job(
        model=lambda: nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)),
        loss=nn.CrossEntropyLoss(),
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        train=(torch.randn(24, 4), torch.randint(0, 2, (24,))),
        global_batch=6,
        iterations=2,
        name="reserved",
    )
    run = job.run(stages=2, replicas=3, sync="k_reduce", aggregators=2, backend=backend, reserve_concurrency=True)
    assert run.wait(progress=False, poll_s=0.2, timeout_s=300) == "SUCCEEDED"
    lam = backend.clients.lambda_
    # warm state with d = 3: a function per replica and per sync task, each running one task at a
    # time, so each reserves 2 (one function per stage would reserve twice max(d = 3, K = 2) = 6);
    # and the phase watcher's function (lambdas/watcher.py), one watcher at a time, 2
    for s, w in [(s, w) for s in range(2) for w in ("", "-r1", "-r2", "-k0", "-k1")] + [(0, "-w")]:
        got = lam.get_function_concurrency(FunctionName=f"{backend.resources.prefix}-{run.job_id}-s{s}{w}")
        assert got["ReservedConcurrentExecutions"] == 2, (s, w)


def test_a_put_whose_sha256_checksum_is_not_its_body_is_refused_as_s3_refuses_it(backend):
    """S3 computes the checksum of what a PUT carries and refuses a mismatch with 400 BadDigest
    (S3 user guide, "Checking object integrity for data uploads"); moto would store the given
    value, and the data upload trusts the stored one (deploy/dataset.py)."""
    import base64
    import hashlib

    s3, bucket = backend.clients.s3, backend.resources.bucket
    key = "data/shards/fidelity-checksum"
    lie = base64.b64encode(hashlib.sha256(b"other bytes").digest()).decode()
    with pytest.raises(botocore.exceptions.ClientError) as e:
        s3.put_object(Bucket=bucket, Key=key, Body=b"these bytes", ChecksumAlgorithm="SHA256", ChecksumSHA256=lie)
    assert e.value.response["Error"]["Code"] == "BadDigest"
    assert e.value.response["Error"]["Message"] == "The SHA256 you specified did not match the calculated checksum."
    assert s3.list_objects_v2(Bucket=bucket, Prefix=key)["KeyCount"] == 0
    right = base64.b64encode(hashlib.sha256(b"these bytes").digest()).decode()
    s3.put_object(Bucket=bucket, Key=key, Body=b"these bytes", ChecksumAlgorithm="SHA256", ChecksumSHA256=right)
    assert s3.head_object(Bucket=bucket, Key=key, ChecksumMode="ENABLED")["ChecksumSHA256"] == right
    s3.delete_object(Bucket=bucket, Key=key)
