"""Express windows as inspect reads them: from the job's own history, since Step Functions keeps
none of theirs (no ListExecutions, DescribeExecution or GetExecutionHistory for Express:
docs/local-stack.md "Express workflows").

The job starts each Express window with a startSyncExecution Task (planner/emit/asl.py
RunExpressWindow), and its history keeps the call's answer (TaskSucceeded: the window's ARN, name,
input, dates, status, error and cause) or its failure (TaskFailed: a start lost, the window's name
and input in the TaskScheduled parameters). These are the window rows `inspect` shows, in
ListExecutions' shape; a failed window's error and cause are its failed task's (the window's Fail
state passes them on), reported as that window's failed task; with the window's events logged to
CloudWatch Logs (sdk/express_logs.py), its failed tasks as a Standard window's history shows them.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Iterable, Mapping
from typing import Any

from stagecoach.inspect.events import FailedTask, failed_tasks

RESOURCE = "startSyncExecution"


def _date(ms: Any) -> datetime.datetime | None:
    return datetime.datetime.fromtimestamp(ms / 1000.0, tz=datetime.UTC) if isinstance(ms, int | float) else None


def _answer_row(answer: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "executionArn": answer.get("ExecutionArn", ""),
        "name": answer.get("Name", ""),
        "status": answer.get("Status", "FAILED"),
        "startDate": _date(answer.get("StartDate")),
        "stopDate": _date(answer.get("StopDate")),
        "input": answer.get("Input") or "{}",
        "error": answer.get("Error"),
        "cause": answer.get("Cause"),
    }


def express_windows(events: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The Express windows a job's history started, oldest first, as ListExecutions items (with
    ``input``, ``error`` and ``cause``); a lost start is a FAILED row without an ARN."""
    rows: list[dict[str, Any]] = []
    scheduled: dict[int, Mapping[str, Any]] = {}
    for ev in events:
        kind = ev.get("type")
        if kind == "TaskScheduled" and ev.get("taskScheduledEventDetails", {}).get("resource") == RESOURCE:
            scheduled[int(ev.get("id", 0))] = ev
        elif kind == "TaskSucceeded" and ev.get("taskSucceededEventDetails", {}).get("resource") == RESOURCE:
            try:
                rows.append(_answer_row(json.loads(ev["taskSucceededEventDetails"].get("output") or "{}")))
            except ValueError:
                continue
        elif kind == "TaskFailed" and ev.get("taskFailedEventDetails", {}).get("resource") == RESOURCE:
            rows.append(_lost_row(ev, scheduled))
    return rows


def _lost_row(ev: Mapping[str, Any], scheduled: Mapping[int, Mapping[str, Any]]) -> dict[str, Any]:
    """A start that failed: its name and input from the latest scheduled call before it."""
    before = [e for i, e in scheduled.items() if i < int(ev.get("id", 0))]
    params: dict[str, Any] = {}
    if before:
        try:
            params = json.loads(before[-1]["taskScheduledEventDetails"].get("parameters") or "{}")
        except ValueError:
            params = {}
    det = ev["taskFailedEventDetails"]
    when = ev.get("timestamp")
    given = params.get("Input", {})
    return {
        "executionArn": "",
        "name": params.get("Name", ""),
        "status": "FAILED",
        "startDate": when,
        "stopDate": when,
        "input": given if isinstance(given, str) else json.dumps(given),
        "error": det.get("error"),
        "cause": det.get("cause"),
    }


def window_failures(rows: Iterable[Mapping[str, Any]], logged: Mapping[str, list[dict[str, Any]]] | None = None) -> list[FailedTask]:
    """Each failed Express window's failed tasks, as a Standard window's history shows them
    (state, phase, stage, iteration, function: inspect/events.py) from its events logged to
    CloudWatch Logs (``logged``, by execution ARN: Run.express_window_runs()); without them its
    answer's error and cause (its failed task's, which the window's Fail state passes on), or its
    lost start's."""
    out: list[FailedTask] = []
    for r in rows:
        if r["status"] == "SUCCEEDED":
            continue
        tasks = failed_tasks(logged[r["executionArn"]], r["executionArn"]) if logged and r["executionArn"] in logged else []
        if tasks:
            out += tasks
            continue
        try:
            t = json.loads(r["input"]).get("first")
        except (ValueError, AttributeError):
            t = None
        out.append(
            FailedTask(
                execution_arn=r["executionArn"] or r["name"],
                state="RunExpressWindow" if not r["executionArn"] else "window",
                error=str(r.get("error") or r["status"]),
                cause=str(r.get("cause") or "")[:1000],
                t=t if isinstance(t, int) else None,
                timestamp=str(r.get("stopDate") or ""),
            )
        )
    return out
