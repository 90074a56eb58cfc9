"""The remediation step of the job state machine (DiSDeL's failure manager): out of memory -> one tier up.

Invoked on the stack's control function after a window failed because a stage's worker was killed.
AWS does not say reliably whether the kill was for memory: it has been reported as
``Runtime.OutOfMemory``, as ``Runtime.ExitError`` ("signal: killed") and as ``Lambda.Unknown``,
which also covers timeouts. :func:`classify` decides from the name, the message, and evidence of
memory pressure: the record the stage's watchdog writes (``keys.memory_pressure``) and, whether or
not the worker lived to write it, the invocation's REPORT, which Lambda itself writes to the
function's log group (:func:`find_report`). An out-of-memory kill raises the stage's function by
one memory tier, recorded in the job's history (``jobs/{job}/remediations/``) and for the job's
next run (``history/{name}/memory.json``); any other kill changes nothing. Either way the job state
machine then restarts the window.

It acts on the job of the execution that invoked it and on nothing else (issue 24 item 7): the job
id, the stage and its function come from the job execution's input, which no worker can change; the
job's name is the id's; the spec (``jobs/{job}/job.json``, which the job's role may read but not
write: deploy/roles.py) must name the same job or nothing is done. Never runs user code.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass
from typing import Any, Literal

import boto3

from stagecoach.core import keys
from stagecoach.core.events import RemediateEvent
from stagecoach.core.records import JobSpec, LearntMemory, MemoryPressure, Remediation, plan_shape
from stagecoach.errors import StagecoachError
from stagecoach.lambdas.channel import Channel
from stagecoach.planner.limits import LAMBDA_MAX_MB
from stagecoach.planner.plan import next_memory_tier, per_worker_functions, stage_functions

Kind = Literal["out_of_memory", "timeout", "crash"]

TIMEOUT_MESSAGE = "Task timed out after"
TIMEOUT_ERRORS = ("Sandbox.Timedout", "States.Timeout")
AMBIGUOUS_ERRORS = ("Runtime.ExitError", "Lambda.Unknown")
# A container past this share of its memory writes the pressure evidence (lambdas/watchdog.py); a
# REPORT whose Max Memory Used reached it is the same evidence, measured by Lambda.
PRESSURE_SHARE = 0.85
# The job id (sdk/deploy/resources.py JOB_ID): the job's name, then 8 hex digits (deploy.new_job_id).
JOB_ID = re.compile(r"(?P<name>[a-z0-9][a-z0-9-]{0,29})-[0-9a-f]{8}")
# Every shape of a killed Lambda task carries its request id in the Cause, in the payload's
# errorMessage: "RequestId: <id> Error: Runtime exited with error: signal: killed" for
# Runtime.OutOfMemory (awslabs/aws-deployment-framework#758) and Runtime.ExitError
# (awslabs/amazon-s3-find-and-forget#283); Lambda.Unknown's Cause quotes the untyped payload, e.g.
# "RequestId: <id> Process exited before completing request" (cboscolo/elb2loggly#26).
REQUEST_ID = re.compile(r"RequestId: ([0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})")
# Lambda's REPORT in the plain-text log format: "REPORT RequestId: <id>\tDuration: ... ms\tBilled
# Duration: ... ms\tMemory Size: 1024 MB\tMax Memory Used: 1024 MB" (docs.aws.amazon.com/lambda/
# latest/dg/monitoring-cloudwatchlogs.html). The stack's functions log in JSON, where the same
# facts are a "platform.report" record: {"requestId", "metrics": {"memorySizeMB", "maxMemoryUsedMB",
# ...}, "status": "success" | "error" | "failure" | "timeout"} (telemetry-schema-reference.html,
# monitoring-cloudwatchlogs-logformat.html).
TEXT_REPORT = re.compile(r"REPORT RequestId: (?P<id>\S+).*?Memory Size: (?P<size>\d+) MB\s+Max Memory Used: (?P<used>\d+) MB", re.S)
# CloudWatch Logs delivers a log event seconds after it was written: look again before giving up.
REPORT_WAITS_S = (0.0, 2.0, 4.0)


class MemoryExhausted(StagecoachError):
    """The stage already has Lambda's maximum memory: only a different plan can help."""


class ForeignSpec(StagecoachError):
    """The job's spec names another job than the execution's: the remediation does nothing."""


@dataclass(frozen=True)
class Report:
    """What Lambda reported of one invocation (its REPORT log event), whatever the worker did."""

    request_id: str
    memory_size_mb: int
    max_memory_used_mb: int
    status: str = ""  # the JSON format's ("timeout" for a timeout); "" in the text format

    def near_limit(self) -> bool:
        return self.max_memory_used_mb >= PRESSURE_SHARE * self.memory_size_mb


def job_name(job: str) -> str:
    """The job's name: its id without the 8 hex digits."""
    m = JOB_ID.fullmatch(job)
    if m is None:
        raise ValueError(f"{job!r} is not a job id (NAME-xxxxxxxx)")
    return m["name"]


def request_id(cause: str) -> str | None:
    """The killed invocation's request id, from the task's Cause (every shape carries it)."""
    m = REQUEST_ID.search(cause)
    return m.group(1) if m else None


def parse_report(message: str) -> Report | None:
    """A REPORT log event in either of Lambda's log formats; None for any other event."""
    if message.lstrip().startswith("{"):
        try:
            body = json.loads(message)
            if body.get("type") != "platform.report":
                return None
            record = body["record"]
            metrics = record["metrics"]
            return Report(record["requestId"], int(metrics["memorySizeMB"]), int(metrics["maxMemoryUsedMB"]), record.get("status", ""))
        except (ValueError, KeyError, TypeError, AttributeError):
            return None
    m = TEXT_REPORT.search(message)
    return Report(m["id"], int(m["size"]), int(m["used"])) if m else None


def classify(error: str, cause: str, memory_pressure: bool, report: Report | None = None) -> Kind:
    """What killed a worker. A timeout is never taken for out-of-memory (its message, or its
    REPORT's status, says so in every shape AWS uses), however full its memory was;
    Runtime.OutOfMemory always is; the ambiguous names count as out-of-memory only with evidence of
    memory pressure: the stage's watchdog record, or the invocation's REPORT near its memory size."""
    if error in TIMEOUT_ERRORS or TIMEOUT_MESSAGE in cause or (report is not None and report.status == "timeout"):
        return "timeout"
    if error == "Runtime.OutOfMemory":
        return "out_of_memory"
    if error in AMBIGUOUS_ERRORS and (memory_pressure or (report is not None and report.near_limit())):
        return "out_of_memory"
    return "crash"


def find_report(logs: Any, log_group: str, cause: str) -> Report | None:
    """The killed invocation's REPORT, from the function's log group: FilterLogEvents with the
    request id as a quoted term (an exact phrase), following nextToken, since a page may come back
    empty while more remain (CloudWatch Logs API reference, FilterLogEvents)."""
    rid = request_id(cause)
    if rid is None:
        return None
    for wait in REPORT_WAITS_S:
        time.sleep(wait)
        kwargs: dict[str, Any] = {"logGroupName": log_group, "filterPattern": f'"{rid}"'}
        while True:
            page = logs.filter_log_events(**kwargs)
            for event in page.get("events", []):
                report = parse_report(event.get("message", ""))
                if report is not None and report.request_id == rid:
                    return report
            if not page.get("nextToken"):
                break
            kwargs["nextToken"] = page["nextToken"]
    return None


def log_group_of(configuration: dict[str, Any], function: str) -> str:
    """Where the function logs: its LoggingConfig's group (the stack's, on AWS), else the control
    function's own (the stack's, which the local runtime names), else Lambda's default."""
    return (
        configuration.get("LoggingConfig", {}).get("LogGroup") or os.environ.get("AWS_LAMBDA_LOG_GROUP_NAME") or f"/aws/lambda/{function}"
    )


def remediate(ev: RemediateEvent, ch: Channel) -> dict[str, Any]:
    spec = _spec(ch, ev)
    lam = boto3.client("lambda")
    configuration = lam.get_function_configuration(FunctionName=ev.function)
    pressure = ch.get_bytes(keys.memory_pressure(ev.job, ev.stage))
    report = None
    if pressure is None and classify(ev.error, ev.cause, False) == "crash" and ev.error in AMBIGUOUS_ERRORS:
        report = find_report(boto3.client("logs"), log_group_of(configuration, ev.function), ev.cause)
    kind = classify(ev.error, ev.cause, pressure is not None, report)
    raised: dict[str, int] = {}
    if kind == "out_of_memory":
        raised = _raise_memory(lam, ev, spec, int(configuration["MemorySize"]))
        _learn(ch, ev, spec, raised["to_mb"])
        ch.delete([keys.memory_pressure(ev.job, ev.stage)])  # the new tier starts without pressure
    record = Remediation(
        time=time.time(),
        stage=ev.stage,
        function=ev.function,
        kind=kind,
        error=ev.error,
        cause=ev.cause[:500],
        evidence=_evidence(pressure, report, ev.stage),
        **raised,
    )
    ch.put_bytes(keys.remediation(ev.job, int(record.time * 1000), ev.stage), record.model_dump_json().encode())
    return record.model_dump()


def _evidence(pressure: bytes | None, report: Report | None, stage: int) -> MemoryPressure | None:
    """The watchdog's record, else the REPORT's peak (its Max Memory Used is the resident peak the
    watchdog samples) when it showed pressure."""
    if pressure is not None:
        return MemoryPressure.model_validate_json(pressure)
    if report is not None and report.near_limit():
        return MemoryPressure(stage=stage, rss_mb=report.max_memory_used_mb, memory_mb=report.memory_size_mb, time=time.time())
    return None


def _raise_memory(lam: Any, ev: RemediateEvent, spec: JobSpec, current: int) -> dict[str, int]:
    new = next_memory_tier(current)
    if new is None:
        raise MemoryExhausted(
            f"stage {ev.stage} ran out of memory at Lambda's maximum ({LAMBDA_MAX_MB} MB): "
            "use more stages (fewer layers per stage) or smaller micro-batches"
        )
    for name in _stage_functions(ev, spec):  # with a function per worker, every one of the stage's
        lam.update_function_configuration(FunctionName=name, MemorySize=new)
        # the waiter polls lambda:GetFunction until LastUpdateStatus is Successful
        lam.get_waiter("function_updated_v2").wait(FunctionName=name, WaiterConfig={"Delay": 1, "MaxAttempts": 60})
    return {"from_mb": current, "to_mb": new}


def _stage_functions(ev: RemediateEvent, spec: JobSpec) -> list[str]:
    """The functions the stage's tasks run on: ``ev.function`` (the stage's, from the execution's
    input), and with warm state at d > 1 its replicas' and sync tasks' (planner/plan.py
    worker_function: ``ev.function`` + "-r{i}" / "-k{i}", never another job's)."""
    plan = spec.to_plan()
    return stage_functions(plan, ev.stage, ev.function, per_worker_functions(plan, spec.warm_state))


def _spec(ch: Channel, ev: RemediateEvent) -> JobSpec:
    """The job's spec, if it is this job's: written by the deployer only (the job role is denied
    writing it), and refused if it names another job than the execution's id."""
    body = ch.get_bytes(keys.job_spec(ev.job))
    if body is None:
        raise FileNotFoundError(f"job {ev.job!r} has no spec in s3://{ch.bucket}/{keys.job_spec(ev.job)}")
    spec = JobSpec.model_validate_json(body)
    if spec.name != job_name(ev.job):
        raise ForeignSpec(
            f"the spec of job {ev.job!r} names job {spec.name!r}: not remediating (the spec is the deployer's; "
            "deploy the job again, or remove what rewrote it)"
        )
    return spec


def _learn(ch: Channel, ev: RemediateEvent, spec: JobSpec, new_mb: int) -> None:
    plan = spec.to_plan()
    key = keys.learnt_memory(job_name(ev.job))
    old = ch.get_bytes(key)
    memory = LearntMemory.model_validate_json(old) if old else None
    learnt = dict(memory.memory_mb) if memory is not None and memory.fits(plan) else {}
    learnt[str(ev.stage)] = max(new_mb, learnt.get(str(ev.stage), 0))
    ch.put_bytes(key, LearntMemory(shape=plan_shape(plan), memory_mb=learnt).model_dump_json().encode())
