"""Express state machines on the embedded stack answer as Step Functions does (stagecoach.local.express).

Each test drives the stack through boto3 and state machines run by its interpreter, and checks what
AWS documents (sources in docs/local-stack.md, "Express workflows"): StartSyncExecution's answer
(HTTP 200 whatever the execution's status), the five-minute limit (shortened here through
Fidelity.express_max_s), no history API for Express executions, and lost synchronous starts.
"""

import json
import time
import uuid

import boto3
import botocore.exceptions
import pytest
from botocore.config import Config

from stagecoach.local.backend import LocalBackend
from stagecoach.local.express import ENV as FAULTS_ENV
from stagecoach.local.fidelity import Fidelity

LIMIT_S = 3.0


@pytest.fixture(scope="module")
def stack():
    """A stack of its own with a short Express limit, and its scripted lost starts: name
    prefixes, each fired once (the env is read when the stack process starts)."""
    mp = pytest.MonkeyPatch()
    mp.setenv(FAULTS_ENV, json.dumps({"lose_before": ["lost-before"], "lose_after": ["lost-after"], "repeat": ["twice"]}))
    try:
        backend = LocalBackend(fidelity=Fidelity(express_max_s=LIMIT_S))
    finally:
        mp.undo()
    return backend


def _client(backend):
    """A Step Functions client that sends StartSyncExecution to the local endpoint itself (boto3
    would prefix the host with "sync-"), and does not retry."""
    return boto3.client(
        "stepfunctions",
        endpoint_url=backend.stack.endpoint_url,
        region_name=backend.resources.region,
        aws_access_key_id="local",
        aws_secret_access_key="local",
        config=Config(inject_host_prefix=False, read_timeout=120, retries={"max_attempts": 0}),
    )


def _machine(backend, definition: dict, kind: str = "EXPRESS") -> str:
    return backend.clients.sfn.create_state_machine(
        name=f"test-{uuid.uuid4().hex[:8]}", definition=json.dumps(definition), roleArn=backend.resources.states_role_arn, type=kind
    )["stateMachineArn"]


PASS = {"StartAt": "P", "States": {"P": {"Type": "Pass", "Parameters": {"doubled.$": "States.MathAdd($.x, $.x)"}, "End": True}}}
FAIL = {"StartAt": "F", "States": {"F": {"Type": "Fail", "Error": "My.Error", "Cause": "it broke"}}}
WAIT = {"StartAt": "W", "States": {"W": {"Type": "Wait", "Seconds": 60, "End": True}}}


def test_an_express_machine_keeps_its_type(stack):
    arn = _machine(stack, PASS)
    assert stack.clients.sfn.describe_state_machine(stateMachineArn=arn)["type"] == "EXPRESS"
    listed = [m for p in stack.clients.sfn.get_paginator("list_state_machines").paginate() for m in p["stateMachines"]]
    assert {m["stateMachineArn"]: m["type"] for m in listed}[arn] == "EXPRESS"
    standard = _machine(stack, PASS, "STANDARD")
    assert stack.clients.sfn.describe_state_machine(stateMachineArn=standard)["type"] == "STANDARD"


def test_start_sync_execution_answers_the_ended_execution(stack):
    sfn = _client(stack)
    arn = _machine(stack, PASS)
    out = sfn.start_sync_execution(stateMachineArn=arn, name="ok-1", input=json.dumps({"x": 21}))
    assert out["status"] == "SUCCEEDED"
    assert json.loads(out["output"]) == {"doubled": 42}
    assert out["executionArn"].startswith(arn.replace(":stateMachine:", ":express:") + ":ok-1:")
    billed = out["billingDetails"]
    assert billed["billedMemoryUsedInMB"] == 64 and billed["billedDurationInMilliseconds"] % 100 == 0
    assert billed["billedDurationInMilliseconds"] >= 100


def test_a_failed_sync_execution_is_a_successful_call_with_status_failed(stack):
    out = _client(stack).start_sync_execution(stateMachineArn=_machine(stack, FAIL), input="{}")
    assert out["ResponseMetadata"]["HTTPStatusCode"] == 200
    assert (out["status"], out["error"], out["cause"]) == ("FAILED", "My.Error", "it broke")
    assert "output" not in out


def test_an_express_execution_past_the_limit_times_out(stack):
    started = time.monotonic()
    out = _client(stack).start_sync_execution(stateMachineArn=_machine(stack, WAIT), input="{}")
    took = time.monotonic() - started
    assert out["status"] == "TIMED_OUT" and out["error"] == "States.Timeout"
    assert LIMIT_S <= took < LIMIT_S + 10


def test_start_sync_execution_refuses_a_standard_machine(stack):
    with pytest.raises(botocore.exceptions.ClientError) as e:
        _client(stack).start_sync_execution(stateMachineArn=_machine(stack, PASS, "STANDARD"), input="{}")
    assert e.value.response["Error"]["Code"] == "StateMachineTypeNotSupported"


def test_there_is_no_history_api_for_express(stack):
    arn = _machine(stack, PASS)
    ex = _client(stack).start_sync_execution(stateMachineArn=arn, input=json.dumps({"x": 1}))["executionArn"]
    sfn = stack.clients.sfn
    for call in (
        lambda: sfn.describe_execution(executionArn=ex),
        lambda: sfn.get_execution_history(executionArn=ex),
        lambda: sfn.stop_execution(executionArn=ex),
    ):
        with pytest.raises(botocore.exceptions.ClientError) as e:
            call()
        assert e.value.response["Error"]["Code"] == "InvalidArn"
        assert "Resource type not valid in this context: express" in e.value.response["Error"]["Message"]
    with pytest.raises(botocore.exceptions.ClientError) as e:
        sfn.list_executions(stateMachineArn=arn)
    assert e.value.response["Error"]["Code"] == "StateMachineTypeNotSupported"


def _express_log(stack) -> list[str]:
    with open(stack.stack.log_path) as f:
        return [line for line in f if line.startswith("[express]")]


@pytest.mark.parametrize("prefix, ran", [("lost-before", 0), ("lost-after", 1)])
def test_a_lost_sync_start_fails_the_call_whether_or_not_it_ran(stack, prefix, ran):
    arn = _machine(stack, PASS)
    with pytest.raises(botocore.exceptions.ClientError) as e:
        _client(stack).start_sync_execution(stateMachineArn=arn, name=f"{prefix}-1", input=json.dumps({"x": 1}))
    assert e.value.response["Error"]["Code"] == "InternalFailure"
    assert e.value.response["ResponseMetadata"]["HTTPStatusCode"] == 500
    lines = [line for line in _express_log(stack) if f"{prefix}-1:" in line]
    assert sum("SUCCEEDED after" in line for line in lines) == ran
    # each fault fires once: the next start of the same name runs
    out = _client(stack).start_sync_execution(stateMachineArn=arn, name=f"{prefix}-1", input=json.dumps({"x": 1}))
    assert out["status"] == "SUCCEEDED"


def test_a_repeated_start_runs_the_execution_twice(stack):
    arn = _machine(stack, PASS)
    out = _client(stack).start_sync_execution(stateMachineArn=arn, name="twice-1", input=json.dumps({"x": 2}))
    assert json.loads(out["output"]) == {"doubled": 4}
    assert sum("twice-1: SUCCEEDED after" in line for line in _express_log(stack)) == 2


def test_a_standard_parent_gets_the_sync_result_through_the_aws_sdk_integration(stack):
    """What a Standard execution's aws-sdk:sfn:startSyncExecution task returns: the API's answer in
    PascalCase (Status, Output as a JSON string, Error/Cause when the child failed)."""
    from helpers import run_state_machine

    child_ok, child_failed = _machine(stack, PASS), _machine(stack, FAIL)
    task = {"Type": "Task", "Resource": "arn:aws:states:::aws-sdk:sfn:startSyncExecution", "TimeoutSeconds": 60}
    parent = {
        "StartAt": "Ok",
        "States": {
            "Ok": {**task, "Parameters": {"StateMachineArn": child_ok, "Input": {"x": 5}}, "ResultPath": "$.ok", "Next": "Failed"},
            "Failed": {**task, "Parameters": {"StateMachineArn": child_failed, "Input": {}}, "ResultPath": "$.failed", "End": True},
        },
    }
    d, _ = run_state_machine(stack, parent, {})
    assert d["status"] == "SUCCEEDED", d
    out = json.loads(d["output"])
    assert out["ok"]["Status"] == "SUCCEEDED" and json.loads(out["ok"]["Output"]) == {"doubled": 10}
    assert out["ok"]["BillingDetails"]["BilledMemoryUsedInMB"] == 64
    assert (out["failed"]["Status"], out["failed"]["Error"], out["failed"]["Cause"]) == ("FAILED", "My.Error", "it broke")


SYNC_CHILD = {
    "StartAt": "Outer",
    "States": {
        "Outer": {
            "Type": "Parallel",
            "Branches": [
                {
                    "StartAt": "Child",
                    "States": {
                        "Child": {
                            "Type": "Task",
                            "Resource": "arn:aws:states:::states:startExecution.sync:2",
                            "Parameters": {"StateMachineArn": "arn:aws:states:us-east-1:123456789012:stateMachine:x"},
                            "End": True,
                        }
                    },
                }
            ],
            "End": True,
        }
    },
}


def test_an_express_machine_refuses_sync_and_callback_integrations(stack):
    """AWS: "Express Workflows do not support Run a Job (.sync) or Wait for Callback
    (.waitForTaskToken)": refused at CreateStateMachine and UpdateStateMachine with
    InvalidDefinition, also inside a Parallel's branch, and so is an activity; a STANDARD machine
    takes them."""
    sfn = stack.clients.sfn
    for resource in (
        "arn:aws:states:::states:startExecution.sync:2",
        "arn:aws:states:::lambda:invoke.waitForTaskToken",
        "arn:aws:states:us-east-1:123456789012:activity:work",
    ):
        definition = json.loads(json.dumps(SYNC_CHILD))
        definition["States"]["Outer"]["Branches"][0]["States"]["Child"]["Resource"] = resource
        with pytest.raises(botocore.exceptions.ClientError) as refused:
            _machine(stack, definition)
        error = refused.value.response["Error"]
        assert error["Code"] == "InvalidDefinition" and "Express state machine does not support" in error["Message"]
        assert ("Activity ARN" if ":activity:" in resource else resource) in error["Message"]
        assert "/States/Outer/Branches[0]/States/Child" in error["Message"]
        _machine(stack, definition, kind="STANDARD")  # Standard: fine
    express = _machine(stack, PASS)
    with pytest.raises(botocore.exceptions.ClientError) as refused:
        sfn.update_state_machine(stateMachineArn=express, definition=json.dumps(SYNC_CHILD))
    assert refused.value.response["Error"]["Code"] == "InvalidDefinition"
    # the request-response form of the same integration is what an Express machine may run
    request_response = json.loads(json.dumps(SYNC_CHILD).replace("startExecution.sync:2", "startExecution"))
    sfn.update_state_machine(stateMachineArn=express, definition=json.dumps(request_response))
    assert json.loads(sfn.describe_state_machine(stateMachineArn=express)["definition"]) == request_response


def _logged_machine(backend, definition: dict, level: str = "ALL", data: bool = True) -> tuple[str, str]:
    """An EXPRESS machine logging to a log group of its own (the ARN form with ":*"); (its ARN, the group)."""
    group = f"/aws/vendedlogs/states/test-{uuid.uuid4().hex[:8]}"
    backend.stack.client("logs").create_log_group(logGroupName=group)  # as template.yaml's WindowLogGroup
    region, account = backend.resources.region, backend.resources.job_state_machine_arn.split(":")[4]
    logging = {
        "level": level,
        "includeExecutionData": data,
        "destinations": [{"cloudWatchLogsLogGroup": {"logGroupArn": f"arn:aws:logs:{region}:{account}:log-group:{group}:*"}}],
    }
    arn = backend.clients.sfn.create_state_machine(
        name=f"test-{uuid.uuid4().hex[:8]}",
        definition=json.dumps(definition),
        roleArn=backend.resources.states_role_arn,
        type="EXPRESS",
        loggingConfiguration=logging,
    )["stateMachineArn"]
    return arn, group


def _logged(backend, group: str, execution_arn: str) -> list[dict]:
    """The execution's log events, as a reader finds them: FilterLogEvents on its ARN (a quoted term)."""
    logs = backend.stack.client("logs")
    pages = logs.get_paginator("filter_log_events").paginate(logGroupName=group, filterPattern=f'"{execution_arn}"')
    events = [e for p in pages for e in p["events"]]
    return [json.loads(e["message"]) for e in events]


def test_an_express_execution_logs_its_history_as_its_logging_configuration_asks(stack):
    """Level ALL with execution data: every event, as Step Functions writes it (docs/local-stack.md:
    id, type, details, previous_event_id, event_timestamp, execution_arn), to a stream states/<machine>/..."""
    arn, group = _logged_machine(stack, PASS)
    out = _client(stack).start_sync_execution(stateMachineArn=arn, name="logged", input=json.dumps({"x": 2}))
    events = _logged(stack, group, out["executionArn"])
    assert [e["type"] for e in events] == ["ExecutionStarted", "PassStateEntered", "PassStateExited", "ExecutionSucceeded"]
    first = events[0]
    assert set(first) == {"id", "type", "details", "previous_event_id", "event_timestamp", "execution_arn"}
    assert (first["id"], first["previous_event_id"], first["execution_arn"]) == ("1", "0", out["executionArn"])
    assert json.loads(first["details"]["input"]) == {"x": 2}
    assert json.loads(events[-1]["details"]["output"]) == {"doubled": 4}
    assert all(e["event_timestamp"].isdigit() for e in events)
    assert int(first["event_timestamp"]) >= int(out["startDate"].timestamp() * 1000) - 1000
    streams = stack.stack.client("logs").describe_log_streams(logGroupName=group)["logStreams"]
    machine = arn.rsplit(":", 1)[1]
    assert [s["logStreamName"].split("/")[:2] for s in streams] == [["states", machine]]
    # another execution of the machine is not among this one's events
    other = _client(stack).start_sync_execution(stateMachineArn=arn, name="logged-2", input=json.dumps({"x": 1}))
    assert len(_logged(stack, group, other["executionArn"])) == 4 and len(_logged(stack, group, out["executionArn"])) == 4


def test_the_log_level_and_include_execution_data_decide_what_is_logged(stack):
    """ERROR: the error types only (FailStateEntered, ExecutionFailed); FATAL: the execution's end
    only; OFF: nothing; includeExecutionData false: no input or output."""
    sfn = _client(stack)
    seen = {}
    for level in ("ALL", "ERROR", "FATAL", "OFF"):
        arn, group = _logged_machine(stack, FAIL, level=level)
        out = sfn.start_sync_execution(stateMachineArn=arn, name=f"lvl-{level}", input="{}")
        seen[level] = [e["type"] for e in _logged(stack, group, out["executionArn"])]
    assert seen["ALL"] == ["ExecutionStarted", "FailStateEntered", "ExecutionFailed"]
    assert seen["ERROR"] == ["FailStateEntered", "ExecutionFailed"]
    assert seen["FATAL"] == ["ExecutionFailed"]
    assert seen["OFF"] == []
    arn, group = _logged_machine(stack, PASS, data=False)
    out = sfn.start_sync_execution(stateMachineArn=arn, name="nodata", input=json.dumps({"x": 2}))
    events = _logged(stack, group, out["executionArn"])
    assert len(events) == 4
    assert not any(k in e["details"] for e in events for k in ("input", "inputDetails", "output", "outputDetails"))
    assert events[1]["details"]["name"] == "P"  # the rest of the details stay
    failed = sfn.start_sync_execution(stateMachineArn=_logged_machine(stack, FAIL, data=False)[0], name="nodata-f", input="{}")
    assert failed["status"] == "FAILED"
