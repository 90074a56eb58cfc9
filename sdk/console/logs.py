"""The worker's log of a failed task, for the console's failed-task panel.

On the local stack every worker writes to one file, the stack's ``workers.log``
(stagecoach.local.process ``log_path``): the handler's structured JSON lines (``function_name``,
``phase``, ``t``, ``stage`` ...) and the runtime's own notes (``[runtime] <function>: injected
fail {...}``, a kill for memory or time). A task's lines are those that name its function and, when
they say so, its phase, iteration and stage. On AWS the same lines are in CloudWatch Logs, in the
stack's log group; the console points there rather than reading it (the SDK's clients have no
Logs client).
"""

from __future__ import annotations

import json
import os
from collections import deque
from datetime import datetime
from typing import Any

from stagecoach.backend import Backend
from stagecoach.inspect.events import FailedTask

MAX_LINES = 40


def log_file(backend: Backend) -> str | None:
    """The local stack's workers.log, if this backend is a local stack that writes one."""
    stack = getattr(backend, "stack", None)
    path = getattr(stack, "log_path", None)
    return path if isinstance(path, str) and os.path.exists(path) else None


def _fields(f: FailedTask) -> dict[str, Any]:
    return {k: v for k, v in (("phase", f.phase), ("t", f.t), ("stage", f.stage)) if v is not None}


def _matches(line: str, f: FailedTask) -> bool:
    """Whether a workers.log line is the failed task's: its function, and its phase, iteration
    and stage wherever the line carries them."""
    if not f.function or f.function not in line:
        return False
    want = _fields(f)
    try:
        record = json.loads(line)
    except ValueError:
        record = None
    if isinstance(record, dict):
        return all(record.get(k, v) == v for k, v in want.items()) and not _after(record, f)
    # a runtime note: "[runtime] fn: injected fail {'phase': 'forward', 't': 1, 'stage': 0, ...}"
    return all(f"{k!r}: {v!r}" in line for k, v in want.items()) if "{" in line else True


def _after(record: dict[str, Any], f: FailedTask) -> bool:
    """Whether a structured line was written after the failure (a later attempt's, which succeeded):
    the handler's lines carry a timestamp such as "2026-11-28 09:55:25,551+0000"."""
    stamp = record.get("timestamp")
    if f.time is None or not isinstance(stamp, str):
        return False
    try:
        return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f%z").timestamp() > f.time + 1.0
    except ValueError:
        return False


def worker_log(backend: Backend, f: FailedTask) -> dict[str, Any]:
    """The last lines of the failed task's worker log (``lines``), where they come from (``source``)."""
    path = log_file(backend)
    if path is None:
        where = backend.resources.log_group_arn
        return {"source": f"CloudWatch Logs: {where}", "lines": []}
    lines: deque[str] = deque(maxlen=MAX_LINES)
    with open(path, errors="replace") as fh:
        for line in fh:
            if _matches(line, f):
                lines.append(line.rstrip("\n"))
    return {"source": path, "lines": list(lines)}
