"""Express windows' histories, read from CloudWatch Logs: Step Functions keeps none of theirs
(no GetExecutionHistory for Express), but logs every event of an execution to its state
machine's log group (the stack's WindowLogGroup, sdk/deploy/start.py asks for level ALL with the
execution data; docs/local-stack.md "Express workflows").

The job's history says which windows it started: each startSyncExecution Task's parameters name
the window machine and the execution (planner/emit/asl.py RunExpressWindow), and its timestamps
bound when the execution ran. Every run under that name (a start whose answer was lost, one run
twice) has an ARN ``arn:...:express:<machine>:<name>:<id>``, which each of its log events carries
as ``execution_arn``: one FilterLogEvents on the group with that ARN's head as a quoted term
(CloudWatch Logs matches a quoted term as an exact phrase) and the Task's time range finds them
all. Here they become events of GetExecutionHistory's shape, so that what reads a Standard
window's history (the gate's usage, sdk/cost.py; the failed tasks, inspect/events.py) reads them.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # deploy is this module's sibling layer (pyproject [tool.importlinter]): the name only
    from stagecoach.deploy.resources import BotoClient

RESOURCE = "startSyncExecution"  # the job's Task that starts an Express window
ENDED = frozenset({"ExecutionSucceeded", "ExecutionFailed", "ExecutionTimedOut", "ExecutionAborted"})
_TASK_ENDS = ("TaskSucceeded", "TaskFailed", "TaskTimedOut")
# the search's margin around the Task's time range: clocks of the job's and the window's events differ
SLACK_MS = 60_000


@dataclass(frozen=True)
class WindowStart:
    """One startSyncExecution call of the job: the window machine, the execution's name, and the
    call's time range in epoch ms (``end_ms`` None while it runs)."""

    state_machine_arn: str
    name: str
    start_ms: int
    end_ms: int | None

    @property
    def arn_head(self) -> str:
        """What every Express execution ARN of this start begins with."""
        return self.state_machine_arn.replace(":stateMachine:", ":express:", 1) + f":{self.name}:"


def _ms(when: Any) -> int:
    if isinstance(when, datetime.datetime):
        return round(when.timestamp() * 1000)
    return round(float(when) * 1000) if isinstance(when, int | float) else 0


def window_starts(job_events: Iterable[Mapping[str, Any]]) -> list[WindowStart]:
    """The Express windows a job's history started, oldest first (each call, also one that failed)."""
    out: list[WindowStart] = []
    pending: tuple[str, str, int] | None = None
    for ev in job_events:
        kind = str(ev.get("type", ""))
        if kind == "TaskScheduled" and ev.get("taskScheduledEventDetails", {}).get("resource") == RESOURCE:
            try:
                params = json.loads(ev["taskScheduledEventDetails"].get("parameters") or "{}")
            except ValueError:
                continue
            if pending is not None:  # a start without its end in this history (a later link's)
                out.append(WindowStart(pending[0], pending[1], pending[2], None))
            pending = (str(params.get("StateMachineArn", "")), str(params.get("Name", "")), _ms(ev.get("timestamp")))
        elif kind in _TASK_ENDS and pending is not None:
            details = next((v for k, v in ev.items() if k.endswith("EventDetails") and isinstance(v, dict)), {})
            if details.get("resource") == RESOURCE:
                out.append(WindowStart(pending[0], pending[1], pending[2], _ms(ev.get("timestamp"))))
                pending = None
    if pending is not None:
        out.append(WindowStart(pending[0], pending[1], pending[2], None))
    return [w for w in out if w.state_machine_arn and w.name]


def details_key(event_type: str) -> str:
    """The key GetExecutionHistory gives an event type's details (``stateEnteredEventDetails`` for
    every ``*StateEntered``, ``taskSucceededEventDetails`` for TaskSucceeded, ...)."""
    for suffix in ("Entered", "Exited"):
        if event_type.endswith(f"State{suffix}"):
            return f"state{suffix}EventDetails"
    return event_type[:1].lower() + event_type[1:] + "EventDetails"


def history_event(record: Mapping[str, Any]) -> dict[str, Any]:
    """A logged event (id, type, details, previous_event_id, event_timestamp, execution_arn) in
    GetExecutionHistory's shape."""
    kind = str(record.get("type", ""))
    out: dict[str, Any] = {
        "id": int(record.get("id", 0)),
        "previousEventId": int(record.get("previous_event_id", 0)),
        "type": kind,
        "timestamp": datetime.datetime.fromtimestamp(int(record.get("event_timestamp", 0)) / 1000, tz=datetime.UTC),
    }
    if record.get("details"):
        out[details_key(kind)] = dict(record["details"])
    return out


def read_window(logs: BotoClient, group: str, start: WindowStart) -> dict[str, list[dict[str, Any]]]:
    """Every logged execution of ``start``, by its Express ARN: its events in order, in
    GetExecutionHistory's shape (one FilterLogEvents search, paged)."""
    kw: dict[str, Any] = {"logGroupName": group, "filterPattern": f'"{start.arn_head}"', "startTime": max(0, start.start_ms - SLACK_MS)}
    if start.end_ms is not None:
        kw["endTime"] = start.end_ms + SLACK_MS
    runs: dict[str, list[dict[str, Any]]] = {}
    try:
        pages = list(logs.get_paginator("filter_log_events").paginate(**kw))
    except logs.exceptions.ResourceNotFoundException:  # no group yet: nothing logged (locally, until a first window ends)
        return {}
    for page in pages:
        for logged in page.get("events", []):
            try:
                record = json.loads(logged.get("message") or "")
            except ValueError:
                continue
            arn = record.get("execution_arn") if isinstance(record, dict) else None
            if isinstance(arn, str) and arn.startswith(start.arn_head):  # the term's match, made exact
                runs.setdefault(arn, []).append(history_event(record))
    return {arn: sorted(events, key=lambda e: int(e["id"])) for arn, events in runs.items()}


def finished(start: WindowStart, runs: Mapping[str, list[dict[str, Any]]]) -> bool:
    """Whether ``runs`` are all ``start`` will ever log: its call has ended, and each run logged its
    end (the logs arrive some time after the events: an unfinished read is read again)."""
    return start.end_ms is not None and bool(runs) and all(any(e["type"] in ENDED for e in ev) for ev in runs.values())


def log_group_name(log_group_arn: str) -> str:
    """``/aws/vendedlogs/...`` of ``arn:<partition>:logs:<region>:<account>:log-group:<name>:*``."""
    return log_group_arn.split(":log-group:", 1)[1].removesuffix(":*")
