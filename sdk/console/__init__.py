"""The local console: a page in the browser with the stack's jobs, their executions and windows,
each window's state machine graph, events, Gantt chart, curves, cost and failed tasks
(docs/console.md). `stagecoach console` serves it."""

from stagecoach.console.app import create_app, missing_libraries, serve
from stagecoach.console.data import ConsoleData

__all__ = ["ConsoleData", "create_app", "missing_libraries", "serve"]
