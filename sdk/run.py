"""A started training run: wait on it, watch it, read its metrics, history and trained model."""

from __future__ import annotations

import dataclasses
import json
import os
import time
import uuid
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

import cloudpickle
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save_file
from torch import nn
from tqdm import tqdm

from stagecoach import cost as costs
from stagecoach import express_logs as xlogs
from stagecoach import history as learnt
from stagecoach.core import keys
from stagecoach.core.decisions import decisions_key, with_decisions
from stagecoach.core.graph_split import Blocks, SplitFactory
from stagecoach.core.records import EvalResult, JobSpec, StopRecord, StopRequest, TaskMetrics, WatcherUsage
from stagecoach.core.stagebuild import load_buffers
from stagecoach.core.stored_layout import stored_layout
from stagecoach.core.training import (
    DTYPES,
    assign_flat,
    build_model,
    load_running_stats,
    master_dtype,
    ownership,
    running_stats,
)
from stagecoach.deploy.chain import follow
from stagecoach.deploy.resources import (
    BotoClient,
    Clients,
    StackResources,
    first_execution_arn,
    group_state_machine_of,
    window_log_group_arn,
)
from stagecoach.deploy.resume import job_executions, last_checkpoint
from stagecoach.errors import StagecoachError
from stagecoach.evaluation import Evaluation, combine
from stagecoach.metrics import iteration_breakdown, mean_loss
from stagecoach.planner.emit.asl import PHASE_DONE, STOPPED_ERROR
from stagecoach.planner.model.platforms import aws_platform
from stagecoach.planner.plan import Plan
from stagecoach.summaries import write_summaries

if TYPE_CHECKING:  # both sit above this module (pyproject [tool.importlinter]): annotations only
    from stagecoach.backend import Backend
    from stagecoach.job import Job

# "STOPPED": the job ended at an iteration boundary on request, at its cost cap or on a non-finite
# loss (Job.stop_on_nonfinite_loss), its checkpoint kept (Step Functions reports it as FAILED with
# the error Stagecoach.Stopped; Run tells them apart)
TERMINAL = {"SUCCEEDED", "FAILED", "TIMED_OUT", "ABORTED", "STOPPED"}
# How long a finished job's measured cost waits for a phase watcher's record (Run._settled_watchers):
# a watcher ends within its poll (lambdas/watcher.py POLL_S) of its phase's end, then writes it
WATCHER_SETTLE_S = 20.0


class RunFailed(StagecoachError, RuntimeError):
    """The run's job execution ended without succeeding; the message carries the failing task's error."""


class Run:
    def __init__(self, backend: Backend, job: Job | None, plan: Plan, job_id: str, execution_arn: str) -> None:
        self.backend = backend
        self.job = job
        self.plan = plan
        self.job_id = job_id
        self.execution_arn = execution_arn  # the job's first execution; it may continue as new ones
        self._links = [execution_arn]
        self._metrics: list[TaskMetrics] = []
        self._seen: set[str] = set()
        self._evals: dict[str, EvalResult] = {}
        self._watchers: dict[str, WatcherUsage] = {}  # phase watchers' records read so far (written once each)
        self._unrecorded: set[tuple[int, str, str]] = set()  # watchers waited for in vain (_settled_watchers)
        self._watch_requests = {"puts": 0, "gets": 0}  # this Run's own S3 requests (list, get): part of the cost
        # where wait() records them, so that every reader of the job prices them alike (``cost``)
        self._watch_key = watch_key(job_id, uuid.uuid4().hex)
        self._model_source: ModelSource | None = job
        # what never changes once read: a succeeded execution's history, a finished Express
        # window's logged runs (the local console reads the cost every 2 s)
        self._ended_histories: dict[str, list[dict[str, Any]]] = {}
        self._window_logs: dict[xlogs.WindowStart, dict[str, list[dict[str, Any]]]] = {}
        self._logs: BotoClient | None = None

    @property
    def _c(self) -> Clients:
        return self.backend.clients

    @property
    def bucket(self) -> str:
        return self.backend.resources.bucket

    @property
    def console_url(self) -> str:
        r = self.backend.resources
        return r.console.format(region=r.region, arn=self.execution_arn, job=self.job_id)

    # -- status ----------------------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        """DescribeExecution of the job's latest execution (following its continuations)."""
        links, d = follow(self._c.sfn, self._links[-1])
        self._links += links[1:]
        return d

    def executions(self) -> list[str]:
        """The job's executions so far: the first, then each it continued as (deploy/chain.py)."""
        self.describe()
        return list(self._links)

    def status(self) -> str:
        """The job's status: Step Functions' (RUNNING, SUCCEEDED, FAILED, TIMED_OUT, ABORTED), or
        STOPPED when it ended at an iteration boundary by ``stop()``, its cost cap or a non-finite
        loss (``stopped()`` says which)."""
        return job_status(self.describe())

    def job_state(self) -> tuple[str, dict[str, Any]]:
        """The job's status and latest DescribeExecution, as `inspect` and `list` show it: its
        latest execution's (``job_state``: a later resumption's, if the job was resumed since this
        Run's execution), or this Run's chain's where ListExecutions does not show it yet. Not
        ``status()``, which ``wait`` polls: that reads this Run's own chain only (no listing)."""
        d = self.describe()
        status, latest = job_state(self._c, self.backend.resources, self.job_id)
        if latest["startDate"] >= d["startDate"]:
            return status, latest
        return job_status(d), d

    # -- stopping --------------------------------------------------------------------------------
    def stop(self) -> None:
        """Ask the job to stop at its next iteration boundary, keeping its checkpoint.

        Returns at once (like SageMaker's ``stop_training_job``); ``wait()`` then returns
        "STOPPED". The job's iteration gate, before each iteration, finds the request and ends the
        window (lambdas/gate.py), so the job stops whether or not this client is still there;
        ``stopped()`` then says at which version. A second call changes nothing.
        """
        request_stop(self._c.s3, self.bucket, self.job_id)

    def stopped(self) -> StopRecord | None:
        """Where and why the job stopped (the version of its checkpoint), or None if it has not."""
        try:
            body = self._c.s3.get_object(Bucket=self.bucket, Key=keys.stopped(self.job_id))["Body"].read()
        except self._c.s3.exceptions.NoSuchKey:
            return None
        return StopRecord.model_validate_json(body)

    def version(self) -> int:
        """The version of the parameters the job reached: its iterations if it finished, the
        checkpoint it stopped at if it stopped, else the iterations done so far."""
        status = self.status()
        if status == "STOPPED":
            record = self.stopped()
            if record is not None:
                # with warm state the versions inside a window live in the workers' memory: the
                # latest stored one (the window's checkpoint) is what a stopped job keeps, and what
                # `resume` continues from (sdk/deploy/resume.py)
                return min(record.version, last_checkpoint(self._c, self.bucket, self.job_id))
        if status == "SUCCEEDED":
            return int(self.job.iterations if self.job is not None else self.spec().iterations)
        return self.iterations_done()

    def wait(self, progress: bool = True, poll_s: float = 1.0, timeout_s: float | None = None) -> str:
        """Block until the run ends; show iteration, loss and phase times. Returns "SUCCEEDED", or
        "STOPPED" for a job that ended at an iteration boundary (``stop()``, its cost cap, a
        non-finite loss); raises
        RunFailed otherwise. Ctrl-C stops nothing: it prints the commands that reach the job."""

        # the Job's (a resumed job's has the deployed total), else the deployed spec's
        total = self.job.iterations if self.job is not None else self.spec().iterations
        bar = tqdm(total=total, unit="it", disable=not progress, dynamic_ncols=True)
        # the versions whose evaluation the bar shows (with progress only): the Job's, if the Run has it
        versions = set(self.job.eval_versions()) if progress and self.job is not None else set()
        evaluates, latest = bool(versions), None
        start = time.time()
        done = 0
        status = "RUNNING"
        try:
            while True:
                status = self.status()
                self._fetch_metrics()
                it = self.iterations_done()
                if it > done:
                    bar.update(it - done)
                    done = it
                    summary = self.iteration_summary(it - 1)
                    if evaluates and min(versions) < it:  # the evaluation of version v runs before iteration v
                        latest = next(iter(self.evaluations()[-1:]), latest)
                    bar.set_postfix_str(
                        f"loss {summary.get('loss', float('nan')):.4f} "
                        + " ".join(f"{p} {summary[p + '_s']:.2f}s" for p in ("forward", "backward", "sync") if p + "_s" in summary)
                        + (f" | {latest.describe('val')} @{latest.version}" if latest is not None else "")
                    )
                if status in TERMINAL:
                    break
                if timeout_s is not None and time.time() - start > timeout_s:
                    raise TimeoutError(f"run {self.job_id} still {status} after {timeout_s} s")
                time.sleep(poll_s)
        except KeyboardInterrupt:
            # asks nothing and stops nothing: say how to reach the job from elsewhere
            bar.close()
            print(self.interrupted_message(), flush=True)
            raise
        finally:
            bar.close()
            self.record_watching()
        if status == "STOPPED":
            return status
        if status != "SUCCEEDED":
            raise RunFailed(f"run {self.job_id} {status}: {self.failure()}")
        self.record_learnt()
        return status

    def record_learnt(self) -> None:
        """Remember this succeeded run's task durations: the next run of the job (its name, the
        same shape) sets its task timeouts from them (sdk/history.py). ``wait`` calls it; for a run
        nobody waited on (`train --no-wait`), whoever next sees it succeeded does (`stagecoach
        inspect`, ``attach(...).wait()``): the client, not the engine, learns, as the job's role
        may not write the stack's ``history/``."""
        name = self.job.name if self.job is not None else self.spec().name
        learnt.record(self._c.s3, self.bucket, name, self.job_id, self.plan, self.metrics())

    def learn_if_newest(self) -> bool:
        """``record_learnt`` for a succeeded run nobody waited on, unless the job's name already
        learnt from this run or from a run started after it (a newer run's timeouts are kept).
        True if it recorded."""
        spec = self.spec()
        prior = learnt.recorded_job(self._c.s3, self.bucket, spec.name)
        if prior == self.job_id or (prior is not None and self._first_started(prior) > self._first_started(self.job_id)):
            return False
        self.record_learnt()
        return True

    def _first_started(self, job_id: str) -> float:
        """When the job's first execution (named after it: deploy/start.py) started, in epoch
        seconds; 0 if Step Functions no longer has it (90 days after it ended)."""
        arn = first_execution_arn(self.backend.resources, job_id)
        try:
            return float(self._c.sfn.describe_execution(executionArn=arn)["startDate"].timestamp())
        except self._c.sfn.exceptions.ExecutionDoesNotExist:
            return 0.0

    def record_prediction(self, report: costs.CostReport) -> None:
        """Keep the run's predicted cost beside it (``keys.predicted_cost``), so that a reader
        without the Job (which predicting needs: it profiles the model) shows predicted against
        measured cost, a plan given by hand too (its Plan carries no planner prediction). The PUT
        is this Run's request, billed with the others (``record_watching``)."""
        self._watch_requests["puts"] += 1
        self._c.s3.put_object(Bucket=self.bucket, Key=keys.predicted_cost(self.job_id), Body=json.dumps(report.to_dict()).encode())

    def recorded_prediction(self) -> dict[str, Any] | None:
        """What ``record_prediction`` kept (CostReport.to_dict), or None if nothing was."""
        try:
            body = self._c.s3.get_object(Bucket=self.bucket, Key=keys.predicted_cost(self.job_id))["Body"].read()
        except self._c.s3.exceptions.NoSuchKey:
            return None
        self._watch_requests["gets"] += 1
        out: dict[str, Any] = json.loads(body)
        return out

    def record_watching(self) -> None:
        """Store the S3 requests this Run made watching the job (listing and reading its metrics)
        under the job's ``cost/watch/`` prefix, one object per Run, its own PUT counted: they are
        part of the job's bill, and ``cost()`` reads them from there, so `train`, `inspect` and
        ``Run.cost()`` price the job alike whoever asks (before, only the Run that watched knew them)."""
        if not any(self._watch_requests.values()):
            return
        self._watch_requests["puts"] += 1  # this PUT
        body = json.dumps(self._watch_requests).encode()
        self._c.s3.put_object(Bucket=self.bucket, Key=self._watch_key, Body=body)

    def interrupted_message(self) -> str:
        """What Ctrl-C in ``wait`` prints: the job goes on (where it can outlive this process),
        and the commands that stop or inspect it from another shell."""
        commands = self.backend.job_commands(self.job_id, self.execution_arn)
        if commands is None:
            return (
                f"\ninterrupted: job {self.job_id} ran on the local stack inside this process, which ends with it "
                "(the `stagecoach` command, or `stagecoach local start` before a script, keeps jobs on a stack that outlives it)"
            )
        lines = [f"\ninterrupted: job {self.job_id} keeps running (nothing was stopped). From any shell:"]
        lines += [f"  {what:<40} {cmd}" for what, cmd in commands]
        return "\n".join(lines)

    def failure(self) -> str:
        """The execution's error, and the first failed task's error and cause inside its windows
        (an Express window's from its logged events)."""
        d = self.describe()
        first = ""
        for events in self._window_histories():
            for ev in events:
                det = ev.get("taskFailedEventDetails") or ev.get("taskTimedOutEventDetails")
                if det and det.get("error") and det["error"] != PHASE_DONE:  # a watcher's, no failure
                    first = f"{det.get('error')}: {str(det.get('cause', ''))[:500]}"
                    break
            if first:
                break
        return f"{d.get('error', '')}: {d.get('cause', '')[:300]} | first failed task: {first or 'none'}"

    # -- history ---------------------------------------------------------------------------------
    def _window_histories(self) -> Iterator[list[dict[str, Any]]]:
        """Each window execution's events, oldest first, read as they are asked for: a Standard
        window's history, then each Express window execution's logged events."""
        for arn in self.window_executions():
            yield self.history(execution_arn=arn)
        yield from self.express_window_histories()

    def express_window_histories(self, job_events: list[dict[str, Any]] | None = None) -> list[list[dict[str, Any]]]:
        """Every run of the job's Express windows, oldest first: its logged events
        (``express_window_runs``)."""
        return list(self.express_window_runs(job_events).values())

    def express_window_runs(self, job_events: list[dict[str, Any]] | None = None) -> dict[str, list[dict[str, Any]]]:
        """Every run of the job's Express windows by its ARN, oldest first: its events as logged
        to the stack's window log group (sdk/express_logs.py), in GetExecutionHistory's shape; a
        run whose start's answer was lost too, and both runs of one run twice. ``job_events``: the
        job's history, if read already. A window is searched until it has finished."""
        starts = xlogs.window_starts(job_events if job_events is not None else self._events(self.job_executions()))
        if not starts:
            return {}  # Standard windows, or none started yet
        if self._logs is None:
            self._logs = self.backend.long_call_client("logs")
        group = xlogs.log_group_name(window_log_group_arn(self.backend.resources))
        out: dict[str, list[dict[str, Any]]] = {}
        for start in starts:
            runs = self._window_logs.get(start)
            if runs is None:
                runs = xlogs.read_window(self._logs, group, start)
                if xlogs.finished(start, runs):
                    self._window_logs[start] = runs
            out.update(sorted(runs.items(), key=lambda run: run[1][0]["timestamp"]))
        return out

    def window_executions(self) -> list[str]:
        window = self.spec().window_state_machine
        return [] if window is None else self._executions_of(window)  # a profiling job: no windows

    def group_executions(self) -> list[str]:
        """The child executions of the groups of a phase past 40 workers (planner/emit/groups.py)."""
        window = self.spec().window_state_machine
        return [] if window is None else self._executions_of(group_state_machine_of(window))

    def _executions_of(self, state_machine: str) -> list[str]:
        arns: list[str] = []
        try:
            for page in self._c.sfn.get_paginator("list_executions").paginate(stateMachineArn=state_machine):
                arns += [e["executionArn"] for e in page["executions"]]
        except self._c.sfn.exceptions.StateMachineDoesNotExist:  # a plan without groups has no group machine
            pass
        except self._c.sfn.exceptions.StateMachineTypeNotSupported:  # Express windows: no ListExecutions (local/express.py)
            pass
        return arns

    def history(self, windows: bool = False, execution_arn: str | None = None) -> list[dict[str, Any]]:
        """Events of the job execution (paged); with ``windows``, of every window execution and
        group execution too."""
        arns = [execution_arn] if execution_arn else self.executions()
        if windows and not execution_arn:
            arns += self.window_executions() + self.group_executions()
        return self._events(arns)

    def job_executions(self) -> list[str]:
        """Every job execution of the job, oldest first: its first, each resumption (`resume`
        starts a new chain), and each link they continued as; this Run's own chain too where
        ListExecutions does not show it yet (eventually consistent). ``executions()`` is this
        Run's chain only: a job stopped and resumed has two."""
        listed = [str(e["executionArn"]) for e in job_executions(self._c, self.backend.resources, self.job_id)]
        return listed + [a for a in self.executions() if a not in listed]

    def _events(self, arns: list[str]) -> list[dict[str, Any]]:
        """The events of these executions' histories, one after the other (paged). A succeeded
        execution's is read once: on AWS a finished execution's history never changes. (moto may
        record a stopped Parallel branch's events after the end, docs/local-stack.md: after a
        success only the phase watchers' TaskFailed PhaseDone, which count for nothing; after a
        failure also a hung task's re-run, so a failed execution's is read again.)"""
        events: list[dict[str, Any]] = []
        for arn in arns:
            if arn in self._ended_histories:
                events += self._ended_histories[arn]
                continue
            mine: list[dict[str, Any]] = []
            paginator = self._c.sfn.get_paginator("get_execution_history")
            for page in paginator.paginate(executionArn=arn):
                mine += page["events"]
            if any(ev.get("type") == "ExecutionSucceeded" for ev in mine):
                self._ended_histories[arn] = mine
            events += mine
        return events

    # -- metrics ---------------------------------------------------------------------------------
    def spec(self) -> JobSpec:
        """What was deployed (``jobs/{job}/job.json``)."""
        return read_spec(self._c.s3, self.bucket, self.job_id)

    def _fetch_metrics(self) -> None:
        """Read metrics objects not yet seen, listing from the first unfinished iteration on."""
        prefix = keys.metrics_prefix(self.job_id)
        kw: dict[str, str] = {"Bucket": self.bucket, "Prefix": prefix}
        start = self.iterations_done()
        if start > 0:
            kw["StartAfter"] = f"{prefix}it{start - 1:08d}/~"
        paginator = self._c.s3.get_paginator("list_objects_v2")
        for page in paginator.paginate(**kw):
            self._watch_requests["puts"] += 1  # a LIST is billed as S3's PUT class
            for o in page.get("Contents", []):
                if o["Key"] in self._seen:
                    continue
                self._watch_requests["gets"] += 1
                body = self._c.s3.get_object(Bucket=self.bucket, Key=o["Key"])["Body"].read()
                self._metrics.append(TaskMetrics.model_validate_json(body))
                self._seen.add(o["Key"])

    def metrics(self) -> list[TaskMetrics]:
        """Every task's metrics (phase, stage, index, timings, bytes, container, loss)."""
        self._fetch_metrics()
        return list(self._metrics)

    def _by_iteration(self) -> dict[int, list[TaskMetrics]]:
        """The training tasks by iteration (evaluate tasks are Run.evaluations' business)."""
        out: dict[int, list[TaskMetrics]] = defaultdict(list)
        for m in self._metrics:
            if m.phase in ("forward", "backward", "sync"):  # not evaluate or checkpoint tasks
                out[m.t].append(m)
        return out

    def evaluations(self) -> list[Evaluation]:
        """The validation set's loss and metrics at each evaluated version so far (every replica's
        record in), oldest first (lambdas/evaluation.py)."""
        spec = self.spec()
        if spec.evaluation is None:
            return []
        paginator = self._c.s3.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.bucket, Prefix=f"{keys.job_prefix(self.job_id)}eval/"):
            for o in page.get("Contents", []):
                if o["Key"] not in self._evals:  # each record read once, however often the bar asks
                    body = self._c.s3.get_object(Bucket=self.bucket, Key=o["Key"])["Body"].read()
                    self._evals[o["Key"]] = EvalResult.model_validate_json(body)
        by_version: dict[int, list[EvalResult]] = defaultdict(list)
        for r in self._evals.values():
            by_version[r.version].append(r)
        return [combine(rs) for v, rs in sorted(by_version.items()) if len({r.replica for r in rs}) == self.plan.replicas]

    def checkpoints(self) -> list[int]:
        """The versions (iterations done) whose state_dict the workers kept (Job.checkpoint_every)."""
        stages: dict[int, set[int]] = defaultdict(set)
        for page in self._c.s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=keys.checkpoints_prefix(self.job_id)):
            for o in page.get("Contents", []):
                version, stage = keys.checkpoint_of(self.job_id, o["Key"])
                stages[version].add(stage)
        n = self.spec().to_plan().stages
        return sorted(v for v, ss in stages.items() if len(ss) == n)

    def checkpoint(self, version: int) -> dict[str, torch.Tensor]:
        """The model's state_dict after ``version`` iterations, under its own names: load it with
        model.load_state_dict, or start a job from it with Job(init_from=...)."""
        if version not in self.checkpoints():
            raise ValueError(f"run {self.job_id} kept no checkpoint of version {version}: it has {self.checkpoints()}")
        out: dict[str, torch.Tensor] = {}
        for s in range(self.spec().to_plan().stages):
            body = self._c.s3.get_object(Bucket=self.bucket, Key=keys.checkpoint(self.job_id, version, s))["Body"].read()
            for k, v in st_load(body).items():
                out.setdefault(k, v)
        return out

    def learning_rates(self) -> list[list[float]]:
        """Per finished iteration, each parameter group's learning rate (under a scheduler)."""
        self._fetch_metrics()
        by_it = self._by_iteration()
        out = []
        for t in range(self.iterations_done()):
            lrs = [m.lr for m in by_it[t] if m.lr is not None]
            if not lrs:
                break
            out.append(lrs[0])
        return out

    def grad_norms(self) -> list[float]:
        """Per finished iteration, the global gradient norm before clipping (Job.clip_grad_norm)."""
        self._fetch_metrics()
        by_it = self._by_iteration()
        out = []
        for t in range(self.iterations_done()):
            norms = [m.grad_norm for m in by_it[t] if m.grad_norm is not None]
            if not norms:
                break
            out.append(norms[0])
        return out

    def iterations_done(self) -> int:
        """Iterations whose every stage has finished its last phase: the sync tasks, or the backward
        tasks where there is no sync Map (d = 1, or a sync fused into backward)."""

        def last(plan: Plan) -> list[tuple[str, int]]:
            return [("sync", plan.sync_tasks(s)) if plan.sync_tasks(s) else ("backward", plan.replicas) for s in range(plan.stages)]

        done = 0
        by_it = self._by_iteration()
        if self.plan.choices and by_it and max(by_it) >= self.plan.decided:  # a replica policy has decided more since
            self.plan = self.spec().to_plan()  # with its decisions (read_spec)
        # dynamic workers: each iteration by its own segment's plan (planner/segments.py)
        while by_it.get(done) and all(
            sum(1 for m in by_it[done] if m.stage == s and m.phase == phase) >= need
            for s, (phase, need) in enumerate(last(self.plan.plan_at(done)))
        ):
            done += 1
        return done

    def iteration_summary(self, t: int) -> dict[str, float]:
        """Loss (global-batch mean) and each phase's span (first start to last end) at iteration t."""
        ms = self._by_iteration().get(t, [])
        out: dict[str, float] = {}
        loss = mean_loss(ms)  # NaN or infinite when one replica's is (stagecoach.metrics)
        if loss is not None:
            out["loss"] = loss
        for phase in ("forward", "backward", "sync"):
            pm = [m for m in ms if m.phase == phase]
            if pm:
                out[phase + "_s"] = max(m.end for m in pm) - min(m.start for m in pm)
        if ms:
            out["span_s"] = max(m.end for m in ms) - min(m.start for m in ms)
        return out

    def time_breakdown(self, skip_first: int = 1) -> dict[str, float]:
        """Mean seconds per iteration spent in orchestration versus inside tasks (compute, transfer, waiting).

        Per iteration (stagecoach.metrics.iteration_breakdown): from its first task start to the
        next iteration's; the time some task ran (the union of task intervals: parallel stages
        count once) split by the tasks' compute / transfer / wait shares; the rest is orchestration
        (Step Functions transitions and Lambda invocation). The first ``skip_first`` iterations
        (cold starts) are left out when later ones exist.
        """
        rows = iteration_breakdown(self.metrics(), complete=self.iterations_done())
        rows = [r for r in rows if r["t"] >= skip_first] or rows
        if not rows:
            return {}
        keys_ = ("iteration_s", "orchestration_s", "compute_s", "transfer_s", "wait_s")
        return {k: sum(r[k] for r in rows) / len(rows) for k in keys_}

    def losses(self) -> list[float]:
        """Per finished iteration, the loss: the mean over the global batch, as a single process
        would compute it, so NaN (or infinite) when any replica's is."""
        self._fetch_metrics()
        return [self.iteration_summary(t).get("loss", float("nan")) for t in range(self.iterations_done())]

    # -- cost ------------------------------------------------------------------------------------
    def cost(self) -> costs.CostReport:
        """The measured cost so far, per phase (sdk/cost.py): the tasks' billed GB-seconds and
        requests, the state transitions in every execution's history, the iteration gates (an
        Express window's from its logged events: ``express_window_histories``), and the client's
        S3 requests: the launch's (in the spec) and what watching the job took, as every
        watching Run recorded it (``record_watching``). Only stored records count, not this
        object's own reading since, so any reader of the job gets the same figure: the one
        source of `train`'s, `inspect`'s and ``Run.cost()``'s."""
        metrics = self.metrics()
        watched = recorded_watching(self._c.s3, self.bucket, self.job_id)
        jobs = self._events(self.job_executions())
        histories = jobs + self._events(self.window_executions() + self.group_executions())
        express = self.express_window_histories(jobs)  # their gates: Express windows keep no history
        watchers = self._settled_watchers([*histories, *(e for run in express for e in run)])
        return costs.measure(self.spec(), metrics, [histories], self.iterations_done(), watched, watchers=watchers, express=express)

    def _settled_watchers(self, events: list[dict[str, Any]], settle_s: float = WATCHER_SETTLE_S) -> list[WatcherUsage]:
        """The phase watchers' records, once every watcher the histories started has written its own
        (``events``). A watcher's Task is abandoned when its phase ends first and the invocation
        writes its record as its last act (lambdas/watcher.py), so the last phase's may land just
        after the job ended: a finished job's cost waits for it (``settle_s`` at most; a watcher
        that died before writing is named in a warning, its use missing from the figure)."""
        started = started_watchers(events)
        while True:
            watchers = phase_watchers(self._c.s3, self.bucket, self.job_id, self._watchers)
            missing = started - {(w.t, w.watch, w.attempt) for w in watchers} - self._unrecorded
            if not missing or self.status() == "RUNNING":
                return watchers
            if settle_s <= 0:  # once per Run: asked again, it does not wait for these again
                self._unrecorded |= missing
                warnings.warn(
                    f"job {self.job_id}: phase watchers {sorted(missing)} left no record: the measured cost misses their use", stacklevel=3
                )
                return watchers
            time.sleep(0.2)
            settle_s -= 0.2

    def predicted_cost(self) -> costs.CostReport:
        """The performance model's cost of the whole run on AWS, for this plan (docs/cost.md).
        Needs the Job (it profiles the model): not available on a Run opened from an ARN."""
        if self.job is None:
            raise RuntimeError(f"run {self.job_id} was opened without its Job: predicting its cost needs the model (Job.predict_cost)")
        spec = self.spec()
        platform = aws_platform("x86_64" if self.backend.resources.architecture == "x86_64" else "arm64")
        return self.job.predict_cost(self.plan, platform, capped=spec.max_cost_usd is not None)

    # -- results ---------------------------------------------------------------------------------
    def stage_vector(self, stage: int, version: int | None = None) -> torch.Tensor:
        """Stage ``stage``'s flat parameters after ``version`` updates (default: the version the job
        reached: its last iteration, or the checkpoint it stopped at)."""
        v = self.version() if version is None else version
        job = self._model()
        model = job.build_model()
        numel = ownership(list(model), [self.plan.stage_layers(s) for s in range(self.plan.stages)]).numel(stage)
        itemsize = torch.empty(0, dtype=master_dtype(job.dtype)).element_size()  # as stored
        parts = []
        for k, chunks in enumerate(stored_layout(self.plan, stage, numel, itemsize)):  # as every version is stored
            for c in range(len(chunks)):
                body = self._c.s3.get_object(Bucket=self.bucket, Key=keys.params(self.job_id, v, stage, k, c))["Body"].read()
                parts.append(st_load(body)["p"])
        return torch.cat(parts)

    def _model(self) -> ModelSource:
        """What builds the model: the Job, or, for a Run attached or resumed without it, the job's
        code as the launch uploaded it (``StoredModel``)."""
        if self._model_source is None:
            self._model_source = StoredModel.load(self._c.s3, self.bucket, self.spec())
        return self._model_source

    def trained_model(self) -> nn.Module:
        """The model with the parameters, and the running statistics (BatchNorm), of the version
        the job reached (``version()``: the last iteration, or the checkpoint a stopped job kept):
        the user's own module (for a job with ``blocks``, not the chain it was cut into). A Run
        attached or resumed without its Job builds it from the job's uploaded code (``StoredModel``)."""
        job = self._model()
        version = self.version()
        model = job.build_model(master_dtype(job.dtype))  # the stored weights' dtype (fp32 under bf16)
        layers = list(model)
        own = ownership(layers, [self.plan.stage_layers(s) for s in range(self.plan.stages)])
        for s in range(self.plan.stages):
            assign_flat(own.owned[s], self.stage_vector(s, version))  # a parameter shared by stages is its owner's
            stage = [layers[i] for i in self.plan.stage_layers(s)]
            first = self.plan.stage_layers(s).start
            if isinstance(job, StoredModel):  # frozen weights and buffers that init_from gave, as uploaded
                job.load_initial_buffers(self._c.s3, self.bucket, self.job_id, s, stage, first)
            if running_stats(stage, first):
                body = self._c.s3.get_object(Bucket=self.bucket, Key=keys.buffers(self.job_id, version, s))["Body"].read()
                load_running_stats(stage, first, st_load(body))
        return job.user_model(model)

    def save(self, directory: str) -> str:
        """Write the trained model (safetensors), the plan, the metrics, the loss curve and
        TensorBoard event files (stagecoach.summaries) to ``directory``."""
        os.makedirs(directory, exist_ok=True)
        save_state_dict(self.trained_model(), os.path.join(directory, "model.safetensors"))
        with open(os.path.join(directory, "plan.json"), "w") as f:
            f.write(self.plan.to_json())
        with open(os.path.join(directory, "metrics.jsonl"), "w") as f:
            for m in self.metrics():
                f.write(m.model_dump_json(exclude_none=True) + "\n")
        with open(os.path.join(directory, "losses.json"), "w") as f:
            json.dump(self.losses(), f)
        write_summaries(self, directory)
        return directory


def save_state_dict(model: nn.Module, path: str) -> None:
    """``model.state_dict()`` as a safetensors file with every name, so that
    ``model.load_state_dict(load_file(path), strict=True)`` and ``Job(init_from=path)`` take it.

    A tensor the model holds under several names (tied weights) is stored under each, as a copy
    after the first: safetensors refuses tensors that share memory, and its ``save_model`` would
    keep one name only, which a strict load then misses. Loading writes the same values into the
    one tensor once per name, which keeps it tied.
    """
    seen: set[int] = set()
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        t = t.detach()
        storage = t.untyped_storage().data_ptr() if t.numel() else None
        out[name] = t.clone().contiguous() if storage in seen else t.contiguous()
        if storage is not None:
            seen.add(storage)
    save_file(out, path)


def job_status(description: dict[str, Any]) -> str:
    """A job execution's status as Stagecoach names it: Step Functions', except STOPPED for an
    execution that failed with the stop error (the job ended at an iteration boundary)."""
    if description["status"] == "FAILED" and description.get("error") == STOPPED_ERROR:
        return "STOPPED"
    return str(description["status"])


def read_spec(s3: BotoClient, bucket: str, job_id: str) -> JobSpec:
    """What was deployed for the job (``jobs/{job}/job.json``): a Run's spec, and the plan of a Run
    opened on a job started elsewhere (Backend.attach, resume). A replica policy's plan comes with
    its decisions so far (core/decisions.py), so iteration t's plan is the one it ran."""
    spec = JobSpec.model_validate_json(s3.get_object(Bucket=bucket, Key=keys.job_spec(job_id))["Body"].read())
    if not spec.plan.get("choices"):
        return spec
    try:
        body = s3.get_object(Bucket=bucket, Key=decisions_key(job_id))["Body"].read()
    except s3.exceptions.NoSuchKey:
        body = None
    return with_decisions(spec, body)


def request_stop(s3: BotoClient, bucket: str, job_id: str) -> bool:
    """Write the job's stop request unless one exists (the gate's own, for the cost cap, is kept);
    True if this call wrote it."""
    key = keys.stop_request(job_id)
    try:
        s3.head_object(Bucket=bucket, Key=key)
        return False
    except s3.exceptions.ClientError:
        pass
    s3.put_object(Bucket=bucket, Key=key, Body=StopRequest(reason="requested", time=time.time()).model_dump_json().encode())
    return True


# -- one status of a job ------------------------------------------------------------------------------
def status_of(sfn: BotoClient, execution_arn: str) -> tuple[str, dict[str, Any]]:
    """The status of the job whose latest execution (or resumption) is ``execution_arn``, and
    DescribeExecution of its latest link: the chain followed (a link that continued says
    SUCCEEDED while the job runs on), and STOPPED read off the execution's own error
    (``job_status``), which outlives `stagecoach cleanup` (the stop record in S3 does not)."""
    _, d = follow(sfn, execution_arn)
    return job_status(d), d


def latest_execution(c: Clients, res: StackResources, job_id: str) -> str:
    """The ARN of the job's latest execution (its first, or its latest resumption), as ``attach``,
    `inspect`, `stop` and `list` read the job. ListExecutions "is eventually consistent"
    (https://docs.aws.amazon.com/step-functions/latest/apireference/API_ListExecutions.html): a
    job started a moment ago may not be listed yet, so then its first execution, named after the
    job (deploy/start.py), is read by its ARN; raises ClientError ExecutionDoesNotExist if none."""
    execs = job_executions(c, res, job_id)
    if execs:
        return str(execs[-1]["executionArn"])
    arn = first_execution_arn(res, job_id)
    c.sfn.describe_execution(executionArn=arn)
    return arn


def job_state(c: Clients, res: StackResources, job_id: str) -> tuple[str, dict[str, Any]]:
    """The job's status wherever it is shown (`train`, `inspect`, `list`, `stop`): its latest
    execution's (``latest_execution``), followed to its latest link (``status_of``)."""
    return status_of(c.sfn, latest_execution(c, res, job_id))


# -- what watching a job cost -------------------------------------------------------------------------
def watch_key(job_id: str, watcher: str) -> str:
    """Where a watching Run records its S3 requests (``Run.record_watching``); under the job's
    prefix, so `stagecoach cleanup` removes it with the job."""
    return f"{keys.job_prefix(job_id)}cost/watch/{watcher}.json"


def phase_watchers(s3: BotoClient, bucket: str, job_id: str, seen: dict[str, WatcherUsage] | None = None) -> list[WatcherUsage]:
    """What the job's phase watchers used (lambdas/watcher.py), each as it recorded it; ``seen``
    keeps the records read before (each is written once), so a Run asked again GETs only new ones."""
    seen = {} if seen is None else seen
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=keys.watcher_usage_prefix(job_id)):
        for o in page.get("Contents", []):
            if o["Key"] not in seen:
                seen[o["Key"]] = WatcherUsage.model_validate_json(s3.get_object(Bucket=bucket, Key=o["Key"])["Body"].read())
    return list(seen.values())


def started_watchers(events: list[dict[str, Any]]) -> set[tuple[int, str, str]]:
    """The phase watchers (t, watch, attempt) that ``events`` (window histories, or an Express
    window's logged events in their shape) invoked: each writes one record under that key."""
    out = set()
    for e in events:
        if e.get("type") != "TaskScheduled":
            continue
        payload = json.loads(e["taskScheduledEventDetails"].get("parameters") or "{}").get("Payload") or {}
        if isinstance(payload, dict) and payload.get("phase") == "watch":
            out.add((int(payload["t"]), str(payload["watch"]), str(payload["attempt"])))
    return out


def recorded_watching(s3: BotoClient, bucket: str, job_id: str) -> dict[str, int]:
    """The S3 requests every Run that watched the job recorded, summed ({"puts", "gets"})."""
    out = {"puts": 0, "gets": 0}
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=watch_key(job_id, "")[: -len(".json")]):
        for o in page.get("Contents", []):
            counts = json.loads(s3.get_object(Bucket=bucket, Key=o["Key"])["Body"].read())
            out = {k: out[k] + int(counts.get(k, 0)) for k in out}
    return out


# -- the model, with or without the Job -------------------------------------------------------------
class ModelSource(Protocol):
    """What a Run builds the trained model with: the Job (``stagecoach.Job``) or ``StoredModel``."""

    @property
    def dtype(self) -> torch.dtype: ...

    def build_model(self, dtype: torch.dtype | None = None) -> nn.Sequential: ...

    def user_model(self, blocks: nn.Sequential) -> nn.Module: ...


@dataclasses.dataclass(frozen=True)
class StoredModel:
    """The job's model code as the launch uploaded it for the workers (``jobs/{job}/model/job.pkl``:
    cloudpickle of the factory, by value: deploy/upload.py ``pickle_job_code``) with the spec's
    seed and dtype: a Run attached or resumed without its Job builds the trained model from it,
    as every container does (lambdas/jobctx.py). Unpickling runs that code here, in the client: it
    comes from the stack's own bucket, which only the stack's roles and its users write."""

    factory: Callable[[], nn.Module]
    seed: int
    dtype: torch.dtype
    init_from: bool  # Job(init_from=...): frozen weights and buffers came from it, not the factory

    @classmethod
    def load(cls, s3: BotoClient, bucket: str, spec: JobSpec) -> StoredModel:
        try:
            body = s3.get_object(Bucket=bucket, Key=keys.job_code(spec.job))["Body"].read()
        except s3.exceptions.NoSuchKey:
            raise ValueError(
                f"job {spec.job} has no model code in s3://{bucket}/{keys.job_code(spec.job)} (cleaned up?): "
                f"attach with stagecoach.attach({spec.job!r}, job=job), or read a kept state_dict with run.checkpoint(t)"
            ) from None
        code = cloudpickle.loads(body)
        return cls(factory=code["model"], seed=spec.seed, dtype=DTYPES[spec.dtype], init_from=bool(spec.init_from))

    def build_model(self, dtype: torch.dtype | None = None) -> nn.Sequential:
        """As ``Job.build_model``: the factory under the job's seed, in ``dtype`` (a model cut at
        ``blocks`` is cut again in it)."""
        factory = self.factory
        if dtype is not None and isinstance(factory, SplitFactory):
            factory = dataclasses.replace(factory, dtype=dtype)
        model = build_model(factory, self.seed, dtype or self.dtype)
        assert isinstance(model, nn.Sequential)  # the launch checked it (Job.build_model)
        return model

    def user_model(self, blocks: nn.Sequential) -> nn.Module:
        """As ``Job.user_model``: the user's own module holding the chain's values."""
        if not isinstance(blocks, Blocks) or not isinstance(self.factory, SplitFactory):
            return blocks
        return blocks.user_module(self.factory.factory, self.seed, self.dtype)

    def load_initial_buffers(self, s3: BotoClient, bucket: str, job_id: str, stage: int, layers: list[nn.Module], first: int) -> None:
        """A job started from ``init_from``: its stage's frozen weights and buffers as uploaded
        (``keys.initial_buffers``), which the factory alone does not make; the running statistics
        are loaded after, over them."""
        if not self.init_from:
            return
        try:
            body = s3.get_object(Bucket=bucket, Key=keys.initial_buffers(job_id, stage))["Body"].read()
        except s3.exceptions.NoSuchKey:  # a stage without buffers or frozen weights stores none
            return
        load_buffers(layers, first, st_load(body))
