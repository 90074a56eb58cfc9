"""What the console shows, as JSON-ready dicts, built from the SDK's own readers.

Every view is the SDK's: the stack's jobs (``Backend.jobs``), a job's Run (``Backend.attach``:
status, executions, losses, learning rates, evaluations, metrics, measured cost), failed tasks
(stagecoach.inspect.events), the Gantt chart's rows (stagecoach.inspect.plots), the time per
iteration (``Run.time_breakdown``). Only the shapes for the browser are made here.

A page polls every few seconds while a job runs, so a job's Run is kept between requests: it
reads each task's metrics object once (``Run.metrics`` lists from the first unfinished
iteration), and the histories of ended window executions, which no longer change, are read once.
One lock serialises the readers: a Run is not safe to share between threads, and the server
answers each request on a thread of its own.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from typing import Any

from stagecoach.backend import Backend
from stagecoach.console.graph import elements, state_statuses
from stagecoach.console.logs import worker_logs
from stagecoach.deploy.resume import job_executions
from stagecoach.inspect.events import FailedTask, failed_tasks
from stagecoach.inspect.express import express_windows
from stagecoach.inspect.plots import gantt_rows
from stagecoach.run import TERMINAL, Run, job_status

ENDED = ("SUCCEEDED", "FAILED", "TIMED_OUT", "ABORTED")
MAX_EVENTS = 1000  # the latest events of a history the page lists
COST_TTL_S = 30.0  # how long a running job's measured cost is shown before it is read again
GANTT_ITERATIONS = 5  # the Gantt chart's latest iterations, as `stagecoach inspect --plot` draws them


class NoSuchJob(LookupError):
    """The stack has no job of that id (or it was cleaned up)."""


class ConsoleData:
    """The console's views of one backend's stack; thread-safe (one lock)."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self._lock = threading.Lock()
        self._runs: dict[str, Run] = {}
        self._ended_histories: dict[str, list[dict[str, Any]]] = {}
        self._inputs: dict[str, dict[str, Any]] = {}
        self._costs: dict[str, tuple[float, str, str, dict[str, Any]]] = {}  # job -> (when, execution, status, view)

    # -- reading, cached ---------------------------------------------------------------------------
    def _run(self, job_id: str) -> Run:
        """The job's Run, attached again when the job got a new execution (a resumption)."""
        execs = job_executions(self.backend.clients, self.backend.resources, job_id)
        if not execs:
            raise NoSuchJob(f"no job {job_id} in stack {self.backend.resources.prefix} ({self.backend.name})")
        latest = str(execs[-1]["executionArn"])
        run = self._runs.get(job_id)
        if run is None or latest not in run.executions():
            run = self._runs[job_id] = self.backend.attach(job_id)
        return run

    def _history(self, arn: str, status: str) -> list[dict[str, Any]]:
        """An execution's events (GetExecutionHistory, paged); an ended one's are read once."""
        if arn in self._ended_histories:
            return self._ended_histories[arn]
        events: list[dict[str, Any]] = []
        for page in self.backend.clients.sfn.get_paginator("get_execution_history").paginate(executionArn=arn):
            events += page["events"]
        if status in ENDED:
            self._ended_histories[arn] = events
        return events

    def _input(self, arn: str) -> dict[str, Any]:
        """An execution's input (it never changes: read once)."""
        if arn not in self._inputs:
            d = self.backend.clients.sfn.describe_execution(executionArn=arn)
            self._inputs[arn] = json.loads(d.get("input") or "{}")
        return self._inputs[arn]

    def _windows(self, run: Run) -> list[dict[str, Any]]:
        """The job's window executions, oldest first, with the iterations each was started for."""
        spec = run.spec()
        if spec.window_state_machine is None:
            return []
        sfn, out, express = self.backend.clients.sfn, [], False
        try:
            for page in sfn.get_paginator("list_executions").paginate(stateMachineArn=spec.window_state_machine):
                out += page["executions"]
        except sfn.exceptions.StateMachineDoesNotExist:  # cleaned up
            return []
        except sfn.exceptions.StateMachineTypeNotSupported:  # Express windows: from the job's history
            out, express = express_windows(run.history()), True  # in the order they started
        rows = []
        for e in out if express else sorted(out, key=lambda e: e["startDate"]):
            inp = json.loads(e["input"]) if express else self._input(e["executionArn"])
            rows.append(
                {
                    "arn": e["executionArn"],
                    "name": e["name"],
                    "status": e["status"],
                    "start": inp.get("start"),
                    "end": inp.get("end"),
                    "started": str(e["startDate"]),
                    "stopped": str(e["stopDate"]) if e.get("stopDate") else None,
                }
            )
        return rows

    # -- views ------------------------------------------------------------------------------------
    def jobs(self) -> list[dict[str, Any]]:
        with self._lock:
            return [dataclasses.asdict(j) for j in self.backend.jobs()]

    def job(self, job_id: str) -> dict[str, Any]:
        """Status, plan, progress, the chain of job executions and the window executions."""
        with self._lock:
            run = self._run(job_id)
            spec = run.spec()
            d = run.describe()
            chain = []
            for arn in run.executions():
                ed = self.backend.clients.sfn.describe_execution(executionArn=arn)
                chain.append(
                    {"arn": arn, "status": job_status(ed), "started": str(ed["startDate"]), "stopped": str(ed.get("stopDate") or "")}
                )
            stop = run.stopped()
            run.metrics()  # reads the metrics objects not yet read: iterations_done counts from them
            return {
                "job": job_id,
                "name": spec.name,
                "status": job_status(d),
                "error": d.get("error"),
                "cause": (d.get("cause") or "")[:1000] or None,
                "stop": stop.model_dump() if stop else None,
                "iterations": spec.iterations,
                "iterations_done": run.iterations_done(),
                "plan": spec.plan,
                "console_url": run.console_url,
                "executions": chain,
                "windows": self._windows(run),
            }

    def curves(self, job_id: str) -> dict[str, Any]:
        """Loss per iteration, each parameter group's learning rate, gradient norms, evaluations."""
        with self._lock:
            run = self._run(job_id)
            return {
                "losses": run.losses(),
                "learning_rates": run.learning_rates(),
                "grad_norms": run.grad_norms(),
                "evaluations": [dataclasses.asdict(e) for e in run.evaluations()],
            }

    def gantt(self, job_id: str) -> dict[str, Any]:
        """The latest iterations' tasks as bars on the rows `stagecoach inspect --plot` draws."""
        with self._lock:
            run = self._run(job_id)
            ms = [m for m in run.metrics() if m.phase in ("forward", "backward", "sync")]
            if not ms:
                return {"rows": [], "tasks": [], "iterations": []}
            last = max(m.t for m in ms)
            ms = [m for m in ms if m.t > last - GANTT_ITERATIONS]
            rows = gantt_rows(ms)
            index = {r: i for i, r in enumerate(rows)}
            t0 = min(m.start for m in ms)
            tasks = [
                {
                    "row": index[(int(m.stage), m.phase == "sync", int(m.index))],
                    "phase": m.phase,
                    "t": m.t,
                    "start": m.start - t0,
                    "end": m.end - t0,
                    "wait_s": m.wait_s,
                    "cold": m.cold,
                }
                for m in ms
            ]
            labels = [f"stage {s} {'sync' if sync else 'replica'} {i}" for s, sync, i in rows]
            return {"rows": labels, "tasks": tasks, "iterations": [min(m.t for m in ms), last]}

    def cost(self, job_id: str) -> dict[str, Any]:
        """Measured cost so far (Run.cost) beside the planner's prediction per iteration, in USD
        and seconds (the planner's, or the cost `stagecoach train` predicted and recorded: Run.record_prediction).

        Run.cost reads every execution's history (its state transitions): seconds for a job of a
        hundred windows. So it is kept: for good once the job has ended, else for COST_TTL_S."""
        with self._lock:
            run = self._run(job_id)
            status = run.status()
            kept = self._costs.get(job_id)
            if kept is not None and kept[1] == run.execution_arn and (kept[2] in TERMINAL or time.monotonic() - kept[0] < COST_TTL_S):
                return kept[3]
            view = self._cost(run)
            self._costs[job_id] = (time.monotonic(), run.execution_arn, status, view)
            return view

    def _cost(self, run: Run) -> dict[str, Any]:
        """The cost view itself (``cost`` keeps it)."""
        spec = run.spec()
        prediction = dict(spec.plan.get("prediction") or {})
        recorded = run.recorded_prediction()  # what `stagecoach train` predicted, a plan given by hand too
        if recorded is not None and recorded.get("iterations"):
            prediction.setdefault("usd_per_iteration", recorded["usd"] / recorded["iterations"])
        measured = run.cost() if spec.prices is not None else None
        return {
            "measured": measured.to_dict() if measured else None,
            "measured_usd_per_iteration": measured.per_iteration_usd() if measured else None,
            "measured_s_per_iteration": run.time_breakdown().get("iteration_s"),
            "predicted_usd_per_iteration": prediction.get("usd_per_iteration"),
            "predicted_s_per_iteration": prediction.get("s_per_iteration"),
            "predicted_usd": prediction["usd_per_iteration"] * spec.iterations if prediction.get("usd_per_iteration") else None,
            "iterations": spec.iterations,
        }

    def failures(self, job_id: str) -> list[dict[str, Any]]:
        """Failed task attempts in every window execution, each with its worker's log lines."""
        with self._lock:
            run = self._run(job_id)
            found: list[FailedTask] = []
            for w in self._windows(run):
                found += failed_tasks(self._history(w["arn"], w["status"]), w["arn"])
            logs = worker_logs(self.backend, job_id, found)
            return [{**dataclasses.asdict(f), "log": log} for f, log in zip(found, logs, strict=True)]

    def execution(self, arn: str) -> dict[str, Any]:
        """One execution (a job link or a window): its state machine's graph with each state's
        status, and its latest events."""
        with self._lock:
            self.backend.check_arn(arn)
            sfn = self.backend.clients.sfn
            d = sfn.describe_execution(executionArn=arn)
            # the definition this execution ran (https://docs.aws.amazon.com/step-functions/latest/apireference/API_DescribeStateMachineForExecution.html)
            definition = json.loads(sfn.describe_state_machine_for_execution(executionArn=arn)["definition"])
            events = self._history(arn, d["status"])
            return {
                "arn": arn,
                "status": d["status"],
                "elements": elements(definition),
                "states": state_statuses(definition, events, d["status"]),
                "events": [_event(e) for e in events[-MAX_EVENTS:]],
                "events_total": len(events),
            }


def _event(e: dict[str, Any]) -> dict[str, Any]:
    """A history event for the events table: id, time, type, state, and its details as JSON."""
    details = next((v for k, v in e.items() if k.endswith("EventDetails") and isinstance(v, dict)), {})
    return {
        "id": e["id"],
        "previous": e.get("previousEventId"),
        "timestamp": str(e.get("timestamp", "")),
        "type": e["type"],
        "state": details.get("name"),
        "error": details.get("error"),
        "cause": (details.get("cause") or "")[:1000] or None,
        "details": json.dumps(details, default=str)[:2000] if details else "",
    }
