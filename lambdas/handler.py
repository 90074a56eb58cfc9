"""The worker's Lambda entry point: validate the event, run its phase, record the task's metrics.

One handler serves every phase; a function per stage keeps that stage's parameters warm in its
containers. The handler holds no training logic of its own (see phases.py).
"""

from __future__ import annotations

import json
import os
import resource
import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

import boto3
import torch
from aws_lambda_powertools import Logger
from aws_lambda_powertools.utilities.parser import ValidationError, parse
from botocore.config import Config
from pydantic import TypeAdapter

from stagecoach.core import boundary, keys
from stagecoach.core.events import (
    AnyTaskEvent,
    GateEvent,
    ProfileEvent,
    RemediateEvent,
    ResumeEvent,
    SyncEvent,
    TaskEvent,
    WatchEvent,
)
from stagecoach.core.optim_state import warm_up
from stagecoach.core.profiling import profile_phase
from stagecoach.core.records import TaskMetrics
from stagecoach.core.training import build_model
from stagecoach.errors import StagecoachError
from stagecoach.lambdas.channel import Channel, poll_cap_s
from stagecoach.lambdas.gate import gate, job_plan
from stagecoach.lambdas.jobctx import JobContext, job_context
from stagecoach.lambdas.phases import run_phase
from stagecoach.lambdas.remediate import remediate
from stagecoach.lambdas.resumepoint import resume_point
from stagecoach.lambdas.watchdog import MemoryWatch
from stagecoach.lambdas.watcher import lambda_invoke, watch_and_record

logger = Logger(service="stagecoach-worker")
_TASK_EVENT: TypeAdapter[AnyTaskEvent] = TypeAdapter(TaskEvent)
warm_up()  # at import: Lambda's init phase, and locally the zygote every worker is forked from


def _load_sdk_models() -> None:
    """Parse the S3 service model and endpoint rules into boto3's default session now, in the init
    phase (AWS's advice: initialise SDK clients outside the handler, docs.aws.amazon.com/lambda/
    latest/dg/best-practices.html): on the first invocation it was ~1 s of JSON decoding (measured
    0.8-1.5 s of a cold task's 1.0-1.8 s), on the path of every task that follows a killed one. The
    client made here is thrown away: the function's credentials, region and endpoint are read when
    the task's own client is made (_client), in the environment the invocation runs in (locally a
    zygote forks every environment, so its parsed models are shared and its variables are not)."""
    boto3.client("s3", region_name="us-east-1", aws_access_key_id="init", aws_secret_access_key="init")


_load_sdk_models()
_LOADED = time.time()  # the end of this module's import: of the container's Init, as the worker sees it

_container: tuple[int, str, float] | None = None  # (pid, id, started): set on the first invocation
_invocations = 0
_s3 = None
_lambda_client = None
E = TypeVar("E")


def _container_id() -> tuple[str, float]:
    """Identity of this execution environment, made on its first invocation (not at import, which
    a local zygote does once for many environments)."""
    global _container
    if _container is None or _container[0] != os.getpid():
        _container = (os.getpid(), uuid.uuid4().hex[:12], time.time())
    return _container[1], _container[2]


def _init_s() -> float:
    """How long this container's Init took: its process's start to the end of this module's import.
    Not to its first invocation, which may come long after (Lambda may initialise an environment
    ahead of demand; a container may serve gates first). A process forked from a local zygote
    that had imported the module already took none."""
    return max(0.0, _LOADED - _process_started())


def _process_started() -> float:
    """When this process started (epoch s), from /proc (Lambda runs on Linux): with the handler's
    start, how long the container's Init took as far as the worker can see."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, after the command name
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


class BadEvent(StagecoachError):
    """The event does not describe a task; Step Functions should not retry it."""


def _client() -> Any:
    global _s3
    if _s3 is None:
        # botocore owns transient-error retries of single requests (standard mode)
        _s3 = boto3.client("s3", config=Config(retries={"mode": "standard", "max_attempts": 5}, max_pool_connections=16))
    return _s3


def _lambda() -> Any:
    """Lambda's client, for the phase watcher's re-runs: a re-run's read timeout covers the task."""
    global _lambda_client
    if _lambda_client is None:
        _lambda_client = boto3.client("lambda", config=Config(read_timeout=900, retries={"mode": "standard", "max_attempts": 3}))
    return _lambda_client


def profile(ev: ProfileEvent) -> dict[str, Any]:
    """The profile phase: time the job's layers at this function's memory (its vCPU share), so the
    planner learns each tier as measured rather than from the vCPU model (core/profiling.py)."""
    ch = Channel(_client(), ev.bucket)
    ctx = job_context(ch, ev.job)
    sample = boundary.map_leaves(lambda t: t[0], ctx.inputs(ch, 0, torch.tensor([0]), 0))
    return profile_phase(
        build_model(ctx.model_factory, ctx.seed, ctx.dtype), sample, micro_batch_sizes=ev.micro_batch_sizes, repeats=ev.repeats
    )


def _parsed(event: Any, what: str, validate: Callable[[Any], E]) -> E:
    """The event as its model, or BadEvent naming the field (Step Functions does not retry it)."""
    try:
        return validate(event)
    except (ValidationError, ValueError, TypeError) as e:
        raise BadEvent(f"malformed {what} event {json.dumps(event)[:300]}: {e}") from None


@logger.inject_lambda_context(log_event=False)
def handler(event: dict[str, Any], context: Any) -> dict[str, Any]:
    global _invocations
    phase = event.get("phase") if isinstance(event, dict) else None
    if phase == "gate":
        return _gate(event, context)
    if phase == "watch":  # beside a phase (lambdas/watcher.py): not a task either
        wev = _parsed(event, "watch", lambda e: parse(event=e, model=WatchEvent))
        wch = Channel(_client(), wev.bucket)
        return watch_and_record(wev, wch, job_plan(wch, wev.job, wev.t), lambda_invoke(_lambda()), int(context.memory_limit_in_mb))
    if phase == "resume":  # the job state machine's ResumePoint, on the control function
        rsv = _parsed(event, "resume", lambda e: parse(event=e, model=ResumeEvent))
        return resume_point(rsv, Channel(_client(), rsv.bucket))
    _invocations += 1
    t0 = time.time()
    container, started = _container_id()
    if phase == "remediate":
        rev = _parsed(event, "remediation", lambda e: parse(event=e, model=RemediateEvent))
        return remediate(rev, Channel(_client(), rev.bucket))
    if phase == "profile":
        return profile(_parsed(event, "profile", lambda e: parse(event=e, model=ProfileEvent)))
    ev = _parsed(event, "worker", _TASK_EVENT.validate_python)
    logger.append_keys(job=ev.job, phase=ev.phase, t=ev.t, stage=ev.stage)
    ch = Channel(_client(), ev.bucket)
    ctx = job_context(ch, ev.job, ev.t)
    ch.poll_cap = poll_cap_s(ctx.plan.peak_invocations())
    ch.abort_key = keys.window_abort(ev.job, ev.attempt) if ev.attempt else None
    ch.attempt = ev.attempt
    ch.waits_of = ev.phase  # its waits recur, phase by phase, every iteration (Channel.wait_bytes)
    deadline = t0 + wait_budget(context.get_remaining_time_in_millis() / 1000.0, _task_timeout(ctx, ev))
    try:
        with MemoryWatch(_client(), ev.bucket, ev.job, ev.stage, int(context.memory_limit_in_mb)):
            result = run_phase(ctx, ch, ev, deadline)
    except BaseException as e:
        ch.settle(failed=True)
        logger.warning("task failed", extra={"error": type(e).__name__, "detail": str(e)[:300]})
        raise
    ch.settle()  # every upload of the task has landed before it reports success
    index = ev.shard if isinstance(ev, SyncEvent) else ev.replica
    m = _task_metrics(ctx, ch, ev, index, t0, int(context.memory_limit_in_mb), (container, started), result)
    ch.put_bytes(keys.metrics(ev.job, ev.t, ev.phase, ev.stage, index), m.model_dump_json(exclude_none=True).encode())
    logger.info("task done", extra={"duration_s": m.duration_s, "cold": m.cold})
    # the output goes to Step Functions, which reads only valid JSON: a NaN or infinite loss goes as
    # the string the metrics hold ("NaN"; core/records.py), never Python's bare NaN, which its parser
    # refuses (https://github.com/nasa/cumulus-message-adapter/issues/105; RFC 8259 has no NaN)
    return {"phase": ev.phase, "t": ev.t, "stage": ev.stage, "index": index, **json.loads(m.model_dump_json(include=set(result)))}


def _gate(event: dict[str, Any], context: Any) -> dict[str, Any]:
    """The iteration gate: not a task, so it leaves the container's task counters alone."""
    t_gate = time.time()
    gev = _parsed(event, "gate", lambda e: parse(event=e, model=GateEvent))
    gch = Channel(_client(), gev.bucket)
    out = gate(gev, gch, t_gate, int(context.memory_limit_in_mb))
    # what this invocation did, for the client's measured cost (sdk/cost.py reads it from the history)
    work = {
        "duration_s": time.time() - t_gate,
        "memory_mb": int(context.memory_limit_in_mb),
        "puts": gch.stats.puts,
        "gets": gch.stats.gets,
    }
    return {"phase": "gate", **out, "work": work}


def wait_budget(remaining_s: float, task_timeout_s: float) -> float:
    """Seconds a task may wait for other workers' objects: until just before its Task's timeout
    (``_task_timeout``), so a wait in vain is an ObjectWaitTimeout its Map runs again at once, not a
    timeout; by a second, or a quarter of a timeout under 4 s (a learnt one is at least 2 s:
    lambdas/timeouts.py; Step Functions takes 1 s, where a second before would be at once); and
    within the function's own time."""
    return min(remaining_s - 0.5, task_timeout_s - min(1.0, task_timeout_s / 4))


def _task_timeout(ctx: JobContext, ev: AnyTaskEvent) -> float:
    """The Task's own timeout: the worker gives up waiting for another worker's object just before
    it, so a wait in vain is reported as ObjectWaitTimeout (retried once more: lambdas/timeouts.py)
    rather than as a timeout. A training task's is the gate's learnt one when its event carries it;
    an evaluate or checkpoint task's is its function's (planner/emit/asl.py)."""
    if ev.timeout is not None:
        return float(ev.timeout)
    if ev.phase in ("evaluate", "checkpoint"):
        return ctx.plan.function_timeout_s(ev.stage)
    return ctx.plan.timeouts_s[ev.stage][ev.phase]


def _task_metrics(
    ctx: JobContext,
    ch: Channel,
    ev: AnyTaskEvent,
    index: int,
    t0: float,
    memory_mb: int,
    container: tuple[str, float],
    result: dict[str, Any],
) -> TaskMetrics:
    """The task's record (jobs/{job}/metrics/...): its times, transfers, container and the phase's own fields."""
    end = time.time()
    stats = ch.stats.as_dict()
    return TaskMetrics(
        phase=ev.phase,
        t=ev.t,
        stage=ev.stage,
        index=index,
        start=t0,
        end=end,
        duration_s=end - t0,
        **stats,
        compute_s=max(0.0, end - t0 - stats["transfer_s"] - stats["wait_s"]),
        container=container[0],
        container_started=container[1],
        invocation=_invocations,
        cold=_invocations == 1,
        init_s=_init_s() if _invocations == 1 else None,
        attempt=ev.attempt,
        memory_mb=memory_mb,
        max_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
        model_bytes=ctx.held_bytes(),
        **result,
    )
