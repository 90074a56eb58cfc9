"""What killed a worker, decided from what AWS reports and the evidence the stage left (lambdas/remediate.py)."""

import json
import uuid

import pytest

from stagecoach.lambdas.remediate import Report, classify, find_report, job_name, parse_report, request_id
from stagecoach.local.runtime import _Meter, out_of_memory_payload, report_record, timeout_payload
from stagecoach.local.stack import UNKNOWN_CAUSE

OOM_SHAPES = ["Runtime.OutOfMemory", "Runtime.ExitError", "Lambda.Unknown"]
RID = str(uuid.uuid4())


def _as_step_functions_reports(payload: str) -> tuple[str, str]:
    """(Error, Cause) of a failed lambda:invoke task, as tests/test_fidelity.py shows the stack reports them."""
    body = json.loads(payload)
    if "errorType" in body:
        return body["errorType"], payload
    return "Lambda.Unknown", UNKNOWN_CAUSE.format(payload=payload)


def _report(status: str, used_mb: int, memory_mb: int = 1024) -> Report:
    """The invocation's REPORT as the local runtime writes it (Lambda's JSON log format), read back."""
    meter = _Meter(peak_mb=used_mb, status=status)
    report = parse_report(report_record(RID, memory_mb, meter, 1234.5))
    assert report is not None
    return report


@pytest.mark.parametrize("shape", OOM_SHAPES)
@pytest.mark.parametrize("watchdog", [True, False])
def test_an_out_of_memory_kill_is_out_of_memory_in_every_shape_with_or_without_the_watchdogs_record(shape, watchdog):
    """Issue 24 item 10: the REPORT Lambda writes for every invocation (Max Memory Used at the
    memory size) is evidence even when the worker was killed before its watchdog wrote anything."""
    error, cause = _as_step_functions_reports(out_of_memory_payload(shape, RID))
    assert request_id(cause) == RID  # every shape's Cause names the invocation
    assert classify(error, cause, memory_pressure=watchdog, report=_report("error", 1024)) == "out_of_memory"


@pytest.mark.parametrize("shape", OOM_SHAPES)
def test_an_out_of_memory_kill_with_the_watchdogs_record_alone_is_out_of_memory(shape):
    error, cause = _as_step_functions_reports(out_of_memory_payload(shape, RID))
    assert classify(error, cause, memory_pressure=True) == "out_of_memory"


def test_without_any_evidence_only_the_explicit_name_counts_as_out_of_memory():
    for shape, expected in (("Runtime.OutOfMemory", "out_of_memory"), ("Runtime.ExitError", "crash"), ("Lambda.Unknown", "crash")):
        error, cause = _as_step_functions_reports(out_of_memory_payload(shape, RID))
        assert classify(error, cause, memory_pressure=False) == expected, shape
        # a REPORT far from the memory size is no evidence either: a crash
        assert classify(error, cause, memory_pressure=False, report=_report("error", 300)) == expected, shape


@pytest.mark.parametrize("shape", ["Sandbox.Timedout", "Lambda.Unknown"])
def test_a_timeout_is_never_taken_for_out_of_memory_even_with_its_memory_full(shape):
    error, cause = _as_step_functions_reports(timeout_payload(shape, RID, 30.0))
    full = _report("timeout", 1024)
    assert full.near_limit()
    assert classify(error, cause, memory_pressure=True, report=full) == "timeout"
    assert classify("States.Timeout", "", memory_pressure=True, report=full) == "timeout"
    # the REPORT's status says timeout even where the name and Cause would not
    assert classify("Lambda.Unknown", "", memory_pressure=True, report=full) == "timeout"


def test_a_report_is_read_in_both_of_lambdas_log_formats():
    text = f"REPORT RequestId: {RID}\tDuration: 158.15 ms\tBilled Duration: 159 ms\tMemory Size: 1024 MB\tMax Memory Used: 1024 MB\t"
    assert parse_report(text) == Report(RID, 1024, 1024)
    assert parse_report(report_record(RID, 2048, _Meter(peak_mb=512.4), 10.0)) == Report(RID, 2048, 512, "success")
    assert parse_report(f"START RequestId: {RID} Version: $LATEST") is None
    assert parse_report('{"type": "platform.start", "record": {"requestId": "x"}}') is None
    assert parse_report("{not json") is None


class _Logs:
    """FilterLogEvents as CloudWatch Logs answers it: pages, the first one possibly empty."""

    def __init__(self, messages):
        self.messages, self.calls = messages, []

    def filter_log_events(self, **kwargs):
        self.calls.append(kwargs)
        if "nextToken" not in kwargs:
            return {"events": [], "nextToken": "t1"}
        rid = kwargs["filterPattern"].strip('"')
        return {"events": [{"message": m} for m in self.messages if rid in m]}


def test_the_report_is_found_by_the_killed_invocations_request_id_across_pages():
    mine = report_record(RID, 1024, _Meter(peak_mb=1024, status="error"), 10.0)
    other = report_record(str(uuid.uuid4()), 1024, _Meter(peak_mb=1024, status="error"), 10.0)
    logs = _Logs([other, mine])
    _, cause = _as_step_functions_reports(out_of_memory_payload("Lambda.Unknown", RID))
    assert find_report(logs, "/aws/lambda/stack-workers", cause) == Report(RID, 1024, 1024, "error")
    assert logs.calls[0] == {"logGroupName": "/aws/lambda/stack-workers", "filterPattern": f'"{RID}"'}
    assert find_report(logs, "/aws/lambda/stack-workers", "no request id here") is None


def test_the_job_name_is_the_job_ids():
    assert job_name("digits-c1234567") == "digits" and job_name("a-b-0123abcd") == "a-b"
    with pytest.raises(ValueError):
        job_name("digits")


def test_the_local_runtime_writes_reports_to_the_log_group_the_stack_provisions():
    """The runtime (stack process) and the backend (which provisions the stack's roles on that
    group's ARN) name the group apart: the remediation finds no REPORT if they drift."""
    from stagecoach.local.backend import LOG_GROUP
    from stagecoach.local.runtime import STACK_LOG_GROUP

    assert STACK_LOG_GROUP == LOG_GROUP
