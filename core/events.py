"""The events a worker accepts, validated by Powertools Parser (pydantic) before any work starts.

A malformed event is refused with an error naming the field, instead of failing deep inside a
phase; Step Functions sees it as ``BadEvent`` and does not retry it.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$"
_BUCKET = r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$"


class _Task(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    job: str = Field(pattern=_NAME)
    bucket: str = Field(pattern=_BUCKET)
    t: int = Field(ge=0)
    stage: int = Field(ge=0)
    window_start: int = Field(ge=0, default=0)
    attempt: str = Field(default="", pattern=r"^[A-Za-z0-9_-]{0,80}$")  # the window execution's name
    # the Task's TimeoutSeconds when the gate learnt it (lambdas/timeouts.py); None: the plan's
    timeout: int | None = Field(default=None, ge=1, le=900)


class ForwardEvent(_Task):
    phase: Literal["forward"]
    replica: int = Field(ge=0)


class BackwardEvent(_Task):
    phase: Literal["backward"]
    replica: int = Field(ge=0)


class SyncEvent(_Task):
    phase: Literal["sync"]
    shard: int = Field(ge=0)


class EvaluateEvent(_Task):
    """Evaluate the parameters after ``t`` iterations: forward only, on this replica's slice of
    the validation set (lambdas/evaluation.py)."""

    phase: Literal["evaluate"]
    replica: int = Field(ge=0)


class CheckpointEvent(_Task):
    """Write stage ``stage``'s part of a loadable state_dict after ``t`` iterations (lambdas/checkpoint.py)."""

    phase: Literal["checkpoint"]
    replica: int = Field(ge=0)


AnyTaskEvent = ForwardEvent | BackwardEvent | SyncEvent | EvaluateEvent | CheckpointEvent  # a task's event, once validated
TaskEvent = Annotated[AnyTaskEvent, Field(discriminator="phase")]  # what validates one, by its phase


class GateEvent(BaseModel):
    """From the window state machine before each iteration t (and once at its end, t = end): may
    the job go on? (lambdas/gate.py)"""

    model_config = ConfigDict(extra="forbid", frozen=True)

    phase: Literal["gate"]
    job: str = Field(pattern=_NAME)
    bucket: str = Field(pattern=_BUCKET)
    t: int = Field(ge=0)
    end: int = Field(ge=0)
    window_start: int = Field(ge=0)
    # the first iteration this window attempt runs: the window's start, or for an attempt that
    # resumed a failed one, the latest complete version (lambdas/resumepoint.py)
    first: int | None = Field(default=None, ge=0)
    attempt: str = Field(default="", pattern=r"^[A-Za-z0-9_-]{0,80}$")


class WatchEvent(BaseModel):
    """From the window state machine beside a phase (planner/emit/asl.py ``_watched``): watch its
    tasks and run again, beside its Map, a task late past what the gate learnt (lambdas/watcher.py)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    phase: Literal["watch"]
    watch: Literal["forward", "backward"]  # Forward's tasks, or BackwardSync's (backward and sync)
    job: str = Field(pattern=_NAME)
    bucket: str = Field(pattern=_BUCKET)
    t: int = Field(ge=0)
    window_start: int = Field(ge=0)
    attempt: str = Field(default="", pattern=r"^[A-Za-z0-9_-]{0,80}$")
    functions: list[str]  # each stage's function, as the phase's Tasks name them
    per_worker: bool = False  # each worker on a function of its own (planner/plan.py worker_function)
    timeouts: dict[str, int]  # the gate's learnt timeouts (lambdas/timeouts.py), which a task's payload carries
    expect: dict[str, float] = Field(default_factory=dict)  # the gate's expected seconds per phase key


class RemediateEvent(BaseModel):
    """From the job state machine after a window failed with a stage's worker killed: ``error``
    and ``cause`` are what Step Functions reported for the killed task."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    phase: Literal["remediate"]
    # the job id from the job execution's input (NAME-8hex, sdk/deploy/resources.py JOB_ID), which
    # names the job the remediation acts on and nothing a worker wrote (lambdas/remediate.py)
    job: str = Field(pattern=r"^[a-z0-9][a-z0-9-]{0,29}-[0-9a-f]{8}$")
    bucket: str = Field(pattern=_BUCKET)
    function: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    stage: int = Field(ge=0)
    error: str = ""
    cause: str = ""


class ProfileEvent(BaseModel):
    """Measure the job's layers at this function's memory tier (the planner's profile phase)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    phase: Literal["profile"]
    job: str = Field(pattern=_NAME)
    bucket: str = Field(pattern=_BUCKET)
    micro_batch_sizes: list[Annotated[int, Field(ge=1, le=4096)]] = Field(default=[1, 2, 4], min_length=1, max_length=16)
    repeats: int = Field(default=2, ge=1, le=20)


class ResumeEvent(BaseModel):
    """From the job state machine after a window attempt failed: where does the window [start, end)
    restart? (lambdas/resumepoint.py; the job id is the job execution's input, as the remediation's)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    phase: Literal["resume"]
    job: str = Field(pattern=r"^[a-z0-9][a-z0-9-]{0,29}-[0-9a-f]{8}$")
    bucket: str = Field(pattern=_BUCKET)
    start: int = Field(ge=0)
    end: int = Field(ge=0)
