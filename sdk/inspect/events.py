"""Failed task attempts read off Step Functions execution histories, traced back to their worker."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from stagecoach.planner.emit.asl import PHASE_DONE

_FAIL_EVENTS = {
    "TaskFailed",
    "TaskTimedOut",
    "LambdaFunctionFailed",
    "LambdaFunctionTimedOut",
    "TaskStartFailed",
    "TaskSubmitFailed",
    "LambdaFunctionStartFailed",
    "LambdaFunctionScheduleFailed",
}


@dataclass
class FailedTask:
    """One failed task attempt (a retried attempt that later succeeded is reported as ``retried``)."""

    execution_arn: str
    state: str
    error: str
    cause: str
    phase: str | None = None
    stage: int | None = None
    index: int | None = None
    t: int | None = None
    function: str | None = None
    timestamp: str = ""
    retried: bool = False
    time: float | None = None  # the failure's epoch seconds (for the Gantt chart)


def _payload(params: str | None) -> dict[str, Any]:
    try:
        p = json.loads(params or "{}")
    except ValueError:
        return {}
    payload = p.get("Payload", {})
    if isinstance(payload, str):
        try:
            payload = json.loads(payload)
        except ValueError:
            payload = {}
    return {"function": p.get("FunctionName"), **(payload if isinstance(payload, dict) else {})}


def _cause_text(cause: str) -> str:
    """A Lambda error's cause is JSON (errorType, errorMessage, stackTrace); keep the message."""
    try:
        c = json.loads(cause)
    except (ValueError, TypeError):
        return cause or ""
    if isinstance(c, dict) and "errorMessage" in c:
        return f"{c.get('errorType', '')}: {c['errorMessage']}".strip(": ")
    return cause


def failed_tasks(events: list[dict[str, Any]], execution_arn: str) -> list[FailedTask]:
    """Failed task attempts in one execution's history, traced back to their state and worker.

    A failure event points (previousEventId) at its TaskStarted, which points at TaskScheduled
    (the Lambda parameters: function and payload with phase, stage, replica/shard, t) — the
    state's name is on the TaskStateEntered before that.
    """
    by_id = {e["id"]: e for e in events}
    out: list[FailedTask] = []
    succeeded_payloads: list[tuple[object, ...]] = []
    for e in events:
        if e["type"] in ("TaskSucceeded", "LambdaFunctionSucceeded"):
            sched = _walk_to(by_id, e, {"TaskScheduled", "LambdaFunctionScheduled"})
            if sched is not None:
                succeeded_payloads.append(_worker_key(_payload(_sched_params(sched))))
    for e in events:
        if e["type"] not in _FAIL_EVENTS:
            continue
        det = next((v for k, v in e.items() if k.endswith("EventDetails") and isinstance(v, dict)), {})
        if det.get("error") == PHASE_DONE:  # a phase watcher ending its phase (lambdas/watcher.py): no failure
            continue
        sched = _walk_to(by_id, e, {"TaskScheduled", "LambdaFunctionScheduled"})
        entered = _walk_to(by_id, e, {"TaskStateEntered"})
        p = _payload(_sched_params(sched)) if sched else {}
        index = p.get("replica", p.get("shard"))
        ft = FailedTask(
            execution_arn=execution_arn,
            state=(entered or {}).get("stateEnteredEventDetails", {}).get("name", "?"),
            error=str(det.get("error", e["type"])),
            cause=_cause_text(str(det.get("cause", "")))[:1000],
            phase=p.get("phase"),
            stage=p.get("stage"),
            index=index,
            t=p.get("t"),
            function=p.get("function"),
            timestamp=str(e.get("timestamp", "")),
            time=e["timestamp"].timestamp() if hasattr(e.get("timestamp"), "timestamp") else None,
        )
        ft.retried = bool(p) and _worker_key(p) in succeeded_payloads
        out.append(ft)
    return out


def _sched_params(ev: dict[str, Any]) -> str | None:
    det = ev.get("taskScheduledEventDetails") or ev.get("lambdaFunctionScheduledEventDetails") or {}
    return det.get("parameters") or det.get("input")


def _worker_key(p: dict[str, Any]) -> tuple[object, ...]:
    return (p.get("phase"), p.get("stage"), p.get("replica", p.get("shard")), p.get("t"))


def _walk_to(by_id: dict[int, dict[str, Any]], ev: dict[str, Any], types: set[str], limit: int = 20) -> dict[str, Any] | None:
    cur: dict[str, Any] | None = ev
    for _ in range(limit):
        if cur is None:
            return None
        prev = cur.get("previousEventId")
        cur = by_id.get(prev) if prev else None
        if cur is not None and cur["type"] in types:
            return cur
    return None
