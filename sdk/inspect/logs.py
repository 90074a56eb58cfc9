"""A job's worker output, per task: what `stagecoach logs` prints.

Where it is. On AWS every function of the stack logs to the stack's log group (template.yaml
``WorkerLogGroup``, ``/aws/lambda/<stack>-workers``; a job's functions get the same LoggingConfig,
aws/idempotent.py), in JSON: the handler's Powertools records carry the task's ``job``, ``phase``,
``t`` and ``stage`` (lambdas/handler.py), Lambda's own ``platform.report`` record its request id,
and ``print`` output stays plain text ("Lambda can only send log outputs to CloudWatch Logs in
plain text format": https://docs.aws.amazon.com/lambda/latest/dg/python-logging.html). A
function's streams in a custom log group are named ``YYYY/MM/DD/<function>[$LATEST]<environment>``
(https://docs.aws.amazon.com/lambda/latest/dg/monitoring-cloudwatchlogs-loggroups.html): the
stream names the function, hence the job and stage (and, with a function per worker, the replica
or sync shard: planner/plan.py ``worker_function``). The local stack writes the same REPORT
records to the same log group (local/runtime.py) and the workers' own output to its
``workers.log`` (local/process.py), one file for every job of the stack.

How it is read: FilterLogEvents over the job's lifetime (its first execution's start to its latest
one's end), every page (https://docs.aws.amazon.com/boto3/latest/reference/services/logs/paginator/FilterLogEvents.html),
keeping the job's functions' streams; the stream's date prefix comes first in its name, so no
``logStreamNamePrefix`` can select one function across days. A REPORT is tied to its task by its
request id (the Powertools records' ``function_request_id``), so a task filter keeps its REPORT too.
"""

from __future__ import annotations

import ast
import datetime
import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from stagecoach.deploy.resources import BotoClient

# the task filter, as a task's metrics object is named (core/keys.py metrics): PHASE[-sSTAGE[-INDEX]]
TASK = re.compile(r"(?P<phase>[a-z]+)(?:-s(?P<stage>\d+)(?:-(?P<index>\d+))?)?")
# a job's function: <prefix>-<job>-s<stage>, or a worker's own: ...-r<replica> / ...-k<shard>
FUNCTION = re.compile(r"-s(?P<stage>\d+)(?:-(?P<kind>[rk])(?P<index>\d+))?$")
PHASES = ("forward", "backward", "sync", "evaluate", "checkpoint")


class LogsError(ValueError):
    """A task filter that does not name a task, or one the logs cannot tell apart."""


@dataclass(frozen=True)
class TaskFilter:
    """Which tasks' lines to keep, named as TaskMetrics names a task: ``phase``, ``stage``,
    ``index`` (the replica; for sync, the shard) and ``t`` (the iteration; for evaluate and
    checkpoint, the version). None: any."""

    phase: str | None = None
    stage: int | None = None
    index: int | None = None
    t: int | None = None

    @classmethod
    def parse(cls, task: str | None, t: int | None) -> TaskFilter:
        if not task:
            return cls(t=t)
        m = TASK.fullmatch(task)
        if m is None or m["phase"] not in PHASES:
            raise LogsError(
                f"--task {task!r}: give PHASE[-sSTAGE[-INDEX]] as a task's metrics are named, e.g. backward, backward-s1, "
                f"backward-s1-0 (PHASE one of {', '.join(PHASES)})"
            )
        stage, index = m["stage"], m["index"]
        return cls(m["phase"], int(stage) if stage else None, int(index) if index else None, t)

    @property
    def needs_task(self) -> bool:
        """Whether a line must be tied to a task to pass (the stage alone is in the function's name)."""
        return self.phase is not None or self.t is not None


@dataclass
class LogLine:
    """One line of a job's worker output."""

    time: float  # epoch seconds
    function: str
    message: str
    task: dict[str, Any] = field(default_factory=dict)  # phase, t, stage of the record, if it names them
    request_id: str | None = None

    def format(self, prefix: str) -> str:
        when = datetime.datetime.fromtimestamp(self.time, datetime.UTC).strftime("%H:%M:%S.%f")[:-3]
        who = self.function[len(prefix) :] if self.function.startswith(prefix) else self.function
        task = f" {self.task['phase']} t={self.task['t']}" if "phase" in self.task and "t" in self.task else ""
        return f"{when} {who:<8}{task} {self.message}"


def function_stage(function: str) -> tuple[int | None, int | None]:
    """(stage, worker index) a job's function name says: the index only for a worker's own
    function (``-r1``, ``-k2``); the stage's function runs index 0 when the job has a function per
    worker, and every index when not (the caller knows which)."""
    m = FUNCTION.search(function)
    if m is None:
        return None, None
    return int(m["stage"]), int(m["index"]) if m["index"] else None


def _parse_record(message: str) -> dict[str, Any] | None:
    try:
        record = json.loads(message)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def describe(record: dict[str, Any]) -> str:
    """A JSON record as one line: a REPORT's figures, or a Powertools record's level, message and
    its own keys (duration, error) without the ones every record carries."""
    if record.get("type") == "platform.report":
        r = record.get("record", {})
        m = r.get("metrics", {})
        return (
            f"REPORT {r.get('status', '')}: {m.get('durationMs', '?')} ms (billed {m.get('billedDurationMs', '?')} ms), "
            f"memory {m.get('maxMemoryUsedMB', '?')} of {m.get('memorySizeMB', '?')} MB"
        )
    common = {"level", "location", "message", "timestamp", "service", "cold_start", "job", "phase", "t", "stage", "xray_trace_id"}
    extra = {k: v for k, v in record.items() if k not in common and not k.startswith("function_")}
    text = f"{record.get('level', '')} {record.get('message', '')}".strip()
    return text + (" " + " ".join(f"{k}={v}" for k, v in extra.items()) if extra else "")


def _line(time_s: float, function: str, message: str) -> LogLine:
    record = _parse_record(message)
    if record is None:
        return LogLine(time_s, function, message.rstrip("\n"))
    task: dict[str, Any] = {k: record[k] for k in ("phase", "t", "stage") if k in record}
    rid = record.get("function_request_id") or (record.get("record") or {}).get("requestId")
    return LogLine(time_s, function, describe(record), task, rid)


def group_lines(logs: BotoClient, group: str, function_prefix: str, start_ms: int, end_ms: int) -> Iterator[LogLine]:
    """The log group's events of the job's functions (``function_prefix``: ``<prefix>-<job>-s``)
    between ``start_ms`` and ``end_ms``."""
    for page in logs.get_paginator("filter_log_events").paginate(logGroupName=group, startTime=start_ms, endTime=end_ms):
        for ev in page.get("events", []):
            parts = ev.get("logStreamName", "").split("/")
            function = parts[3].split("[")[0] if len(parts) > 3 else ""
            if function.startswith(function_prefix):
                yield _line(ev["timestamp"] / 1000.0, function, ev.get("message", ""))


def workers_log_lines(path: str, job: str, function_prefix: str) -> tuple[list[LogLine], int]:
    """The local stack's workers.log lines of the job: its functions' JSON records and the
    runtime's notes naming them; and how many lines name no job (print output, tracebacks: the
    local runtime writes every worker's output to the one file, unlabelled)."""
    out: list[LogLine] = []
    unlabelled = 0
    with open(path, errors="replace") as f:
        for text in f:
            record = _parse_record(text)
            if record is None:
                if text.startswith("[runtime] ") and function_prefix in text:
                    out.append(_runtime_note(text, out[-1].time if out else 0.0))
                elif text.strip() and not text.startswith("[runtime] "):
                    unlabelled += 1
                continue
            if record.get("job") != job and not str(record.get("function_name", "")).startswith(function_prefix):
                continue
            when = datetime.datetime.strptime(str(record.get("timestamp")), "%Y-%m-%d %H:%M:%S,%f%z").timestamp()
            out.append(_line(when, str(record.get("function_name", "")), text))
    return out, unlabelled


def _runtime_note(text: str, when: float) -> LogLine:
    """A local runtime's note, "[runtime] <function>[ <request id>]: <what> [{task fields}]"
    (local/runtime.py: an injected fault with where it struck, a kill for memory with the
    invocation's request id), tied to its task as a handler's record is."""
    head, _, what = text[len("[runtime] ") :].rstrip("\n").partition(":")
    function, _, request_id = head.partition(" ")
    task: dict[str, Any] = {}
    if what.rstrip().endswith("}") and "{" in what:
        try:
            fields = ast.literal_eval(what[what.index("{") :].strip())
        except (ValueError, SyntaxError):
            fields = {}
        task = {k: fields[k] for k in ("phase", "t", "stage") if isinstance(fields, dict) and k in fields}
    return LogLine(when, function, text.rstrip("\n"), task, request_id or None)


def select(lines: Iterable[LogLine], want: TaskFilter, per_worker: bool) -> list[LogLine]:
    """The lines of the tasks ``want`` names, in time order. A line that names no task (a REPORT,
    a plain line) passes a phase or iteration filter when a record of the same request (the same
    invocation) does; the stage and index come from the function's name (``per_worker``: the job
    has a function per worker, so a stage's own function runs index 0)."""
    if want.index is not None and not per_worker:
        raise LogsError(
            "this job's replicas share their stage's function, so its logs do not say which replica a line is from: "
            "drop the index from --task (PHASE-sSTAGE)"
        )
    lines = sorted(lines, key=lambda x: x.time)
    tasks = {x.request_id: x.task for x in lines if x.request_id and x.task}
    out = []
    for x in lines:
        task = x.task or tasks.get(x.request_id or "", {})
        stage, index = function_stage(x.function)
        if want.stage is not None and stage != want.stage:
            continue
        if want.index is not None and (index or 0) != want.index:
            continue
        if want.needs_task and not task:
            continue
        if (want.phase is not None and task.get("phase") != want.phase) or (want.t is not None and task.get("t") != want.t):
            continue
        out.append(x if x.task else replace(x, task=task))  # a REPORT shown with its task
    return out
