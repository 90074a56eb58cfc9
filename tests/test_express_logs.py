"""Express windows' histories read back from CloudWatch Logs (stagecoach.express_logs): unit tests,
no stack (tests/test_express_stack.py and tests/test_express_jobs.py read a stack's logs)."""

from __future__ import annotations

import dataclasses
import datetime
import json

from stagecoach.core.cost import Usage
from stagecoach.cost import express_gates, history_usage
from stagecoach.express_logs import WindowStart, finished, history_event, log_group_name, read_window, window_starts
from stagecoach.inspect.express import window_failures
from stagecoach.local.express import log_record

MACHINE = "arn:aws:states:us-east-1:123456789012:stateMachine:stagecoach-job1-window"
T0 = datetime.datetime(2026, 11, 29, 1, 0, tzinfo=datetime.UTC)


def at(s: float) -> datetime.datetime:
    return T0 + datetime.timedelta(seconds=s)


def gate_output(gets: int) -> str:
    work = {"duration_s": 0.5, "memory_mb": 1024, "puts": 1, "gets": gets}
    return json.dumps({"Payload": {"phase": "gate", "work": work}})


def window_history(n_gates: int) -> list[dict]:
    """A window execution's history as GetExecutionHistory answers it: gates and one failed task."""
    events: list[dict] = [
        {"id": 1, "previousEventId": 0, "type": "ExecutionStarted", "timestamp": at(0), "executionStartedEventDetails": {"input": "{}"}}
    ]
    for i in range(n_gates):
        base = len(events)
        events += [
            {
                "id": base + 1,
                "previousEventId": base,
                "type": "TaskStateEntered",
                "timestamp": at(i + 0.1),
                "stateEnteredEventDetails": {"name": "Gate", "input": "{}"},
            },
            {
                "id": base + 2,
                "previousEventId": base + 1,
                "type": "TaskScheduled",
                "timestamp": at(i + 0.2),
                "taskScheduledEventDetails": {"resource": "invoke", "parameters": "{}"},
            },
            {"id": base + 3, "previousEventId": base + 2, "type": "TaskStarted", "timestamp": at(i + 0.3)},
            {
                "id": base + 4,
                "previousEventId": base + 3,
                "type": "TaskSucceeded",
                "timestamp": at(i + 0.4),
                "taskSucceededEventDetails": {"resource": "invoke", "output": gate_output(i + 1)},
            },
        ]
    n = len(events)
    events.append(
        {
            "id": n + 1,
            "previousEventId": n,
            "type": "ExecutionSucceeded",
            "timestamp": at(9),
            "executionSucceededEventDetails": {"output": "{}"},
        }
    )
    return events


def test_a_logged_event_reads_back_as_the_history_event_it_was():
    """local/express.py logs a history event as Step Functions does; express_logs reads it back to
    GetExecutionHistory's shape: what reads a Standard window's history reads an Express one's."""
    arn = MACHINE.replace(":stateMachine:", ":express:") + ":w0-a:1"
    history = window_history(3)
    records = [json.loads(json.dumps(log_record(e, arn, include_data=True))) for e in history]
    assert records[0] == {
        "id": "1",
        "type": "ExecutionStarted",
        "details": {"input": "{}"},
        "previous_event_id": "0",
        "event_timestamp": str(int(T0.timestamp() * 1000)),
        "execution_arn": arn,
    }
    assert records[3]["details"] == {}  # TaskStarted: no details
    assert [history_event(r) for r in records] == history
    # the gates, read from the logged events as from a Standard window's history (no transitions)
    standard = history_usage(history)["orchestration"]  # the gates and the 3 Gate states entered
    assert express_gates(history_event(r) for r in records) == dataclasses.replace(standard, transitions=0)
    assert express_gates(history_event(r) for r in records).invocations == 3


def test_without_execution_data_the_gates_reports_are_gone():
    records = [log_record(e, "arn", include_data=False) for e in window_history(2)]
    assert not any(k in r["details"] for r in records for k in ("input", "output"))
    assert express_gates(history_event(r) for r in records) == Usage()


def start_sync_events(name: str, t0: float, t1: float | None, ok: bool = True) -> list[dict]:
    params = json.dumps({"StateMachineArn": MACHINE, "Name": name, "Input": {"start": 0}})
    out = [
        {
            "id": 1,
            "type": "TaskScheduled",
            "timestamp": at(t0),
            "taskScheduledEventDetails": {"resource": "startSyncExecution", "parameters": params},
        }
    ]
    if t1 is not None:
        kind, key = ("TaskSucceeded", "taskSucceededEventDetails") if ok else ("TaskFailed", "taskFailedEventDetails")
        out.append({"id": 2, "type": kind, "timestamp": at(t1), key: {"resource": "startSyncExecution"}})
    return out


def test_the_job_history_gives_each_window_start_and_its_time_range():
    other = [
        {"id": 9, "type": "TaskScheduled", "timestamp": at(0), "taskScheduledEventDetails": {"resource": "invoke", "parameters": "{}"}}
    ]
    events = start_sync_events("w0-a", 1, 5, ok=False) + other + start_sync_events("w0-b", 6, 9) + start_sync_events("w2-c", 10, None)
    starts = window_starts(events)
    ms = int(T0.timestamp() * 1000)
    assert starts == [
        WindowStart(MACHINE, "w0-a", ms + 1000, ms + 5000),
        WindowStart(MACHINE, "w0-b", ms + 6000, ms + 9000),
        WindowStart(MACHINE, "w2-c", ms + 10000, None),
    ]
    assert starts[0].arn_head == "arn:aws:states:us-east-1:123456789012:express:stagecoach-job1-window:w0-a:"
    assert log_group_name("arn:aws:logs:us-east-1:1:log-group:/aws/vendedlogs/states/sc-windows:*") == "/aws/vendedlogs/states/sc-windows"


class FakeLogs:
    """FilterLogEvents over stored messages, matching a quoted term as a substring (as moto does)."""

    class exceptions:  # noqa: N801 - as a boto3 client names them
        class ResourceNotFoundException(Exception):
            pass

    def __init__(self, messages: list[dict]) -> None:
        self.messages = messages
        self.calls: list[dict] = []

    def get_paginator(self, name: str) -> FakeLogs:
        assert name == "filter_log_events"
        return self

    def paginate(self, **kw):
        self.calls.append(kw)
        term = kw["filterPattern"].strip('"')
        return [{"events": [{"message": json.dumps(m)} for m in self.messages if term in json.dumps(m)]}]


def test_a_window_start_finds_every_run_under_its_name_and_is_finished_once_each_ended():
    head = MACHINE.replace(":stateMachine:", ":express:") + ":w0-a:"
    first = [log_record(e, head + "1", True) for e in window_history(1)]
    second = [log_record(e, head + "2", True) for e in window_history(2)[:-1]]  # not ended (yet)
    unrelated = [log_record(e, head.replace("w0-a", "w0-ab") + "3", True) for e in window_history(1)]
    logs = FakeLogs(list(reversed(first)) + second + unrelated)
    start = WindowStart(MACHINE, "w0-a", 1000, 5000)
    runs = read_window(logs, "group", start)
    assert sorted(runs) == [head + "1", head + "2"]
    assert [e["id"] for e in runs[head + "1"]] == list(range(1, 7))  # in order, whatever the log's
    assert logs.calls == [{"logGroupName": "group", "filterPattern": f'"{head}"', "startTime": 0, "endTime": 65000}]
    assert not finished(start, runs)
    assert finished(start, {head + "1": runs[head + "1"]})
    assert not finished(WindowStart(MACHINE, "w0-a", 1000, None), {head + "1": runs[head + "1"]})
    assert not finished(start, {})


def test_a_failed_express_windows_tasks_come_from_its_logged_events():
    """inspect's failed tasks of an Express window: from its logged events, as a Standard window's
    history gives them (state, phase, stage, iteration); without them, the window's answer."""
    arn = MACHINE.replace(":stateMachine:", ":express:") + ":w2-a:1"
    params = json.dumps({"FunctionName": "sc-job1-s1", "Payload": {"phase": "backward", "stage": 1, "t": 3}})
    history = [
        {"id": 1, "previousEventId": 0, "type": "ExecutionStarted", "timestamp": at(0), "executionStartedEventDetails": {"input": "{}"}},
        {
            "id": 2,
            "previousEventId": 1,
            "type": "TaskStateEntered",
            "timestamp": at(1),
            "stateEnteredEventDetails": {"name": "Backward1Task"},
        },
        {
            "id": 3,
            "previousEventId": 2,
            "type": "TaskScheduled",
            "timestamp": at(1),
            "taskScheduledEventDetails": {"resource": "invoke", "parameters": params},
        },
        {"id": 4, "previousEventId": 3, "type": "TaskStarted", "timestamp": at(1)},
        {
            "id": 5,
            "previousEventId": 4,
            "type": "TaskFailed",
            "timestamp": at(2),
            "taskFailedEventDetails": {"error": "Boom", "cause": "it broke"},
        },
        {
            "id": 6,
            "previousEventId": 5,
            "type": "ExecutionFailed",
            "timestamp": at(3),
            "executionFailedEventDetails": {"error": "Boom", "cause": "it broke"},
        },
    ]
    logged = {arn: [history_event(log_record(e, arn, True)) for e in history]}
    row = {
        "executionArn": arn,
        "name": "w2-a",
        "status": "FAILED",
        "input": json.dumps({"first": 2}),
        "error": "Boom",
        "cause": "it broke",
        "stopDate": at(3),
    }
    (task,) = window_failures([row], logged)
    assert (task.state, task.phase, task.stage, task.t, task.function, task.error) == (
        "Backward1Task",
        "backward",
        1,
        3,
        "sc-job1-s1",
        "Boom",
    )
    (answer,) = window_failures([row])
    assert (answer.state, answer.t, answer.error) == ("window", 2, "Boom")
