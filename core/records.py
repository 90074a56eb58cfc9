"""The records that cross a process boundary through S3, as pydantic models: writers build them,
readers parse them, and test fixtures build the same types, so a schema change breaks a test
instead of drifting. (Handler events are in events.py; the job execution's input, read by the job
state machine, is planner/emit/job_input.py.)
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from stagecoach.planner.plan import Plan
from stagecoach.planner.profile.flows import Flow


class _Record(BaseModel):
    # A float that is NaN or infinite (a diverged loss, a gradient norm) is written as the JSON
    # strings "NaN", "Infinity", "-Infinity", which a reader parses back to the float: pydantic's
    # default writes it as null, which reads back as "no value" (a NaN loss left out of the mean),
    # and JSON itself (RFC 8259) has no NaN. https://docs.pydantic.dev/latest/api/config/#pydantic.config.ConfigDict.ser_json_inf_nan
    model_config = ConfigDict(extra="forbid", frozen=True, ser_json_inf_nan="strings")


class DatasetRef(_Record):
    id: str
    n_train: int  # its samples (named for the training set, which came first)


class EvalSpec(_Record):
    """Evaluation on Lambda (Job.validation): the versions evaluated and on which data set."""

    dataset: DatasetRef
    versions: list[int]  # the parameters after these many iterations (every eval_every, and the last)
    metrics: list[str]  # the names of Job.metrics, in order
    every: int | None = None  # Job.eval_every (a resumed job with more iterations keeps evaluating by it)


class EvalResult(_Record):
    """``jobs/{job}/eval/v{version}/r{replica}.json``: sums over a replica's slice, so replicas
    combine by adding (the loss and each metric are means per micro-batch, times its samples)."""

    version: int
    replica: int
    samples: int
    loss_sum: float
    metric_sums: dict[str, float]


class JobSpec(_Record):
    """``jobs/{job}/job.json``: what the SDK deployed, read by every worker and by `inspect`."""

    # its untyped values (the plan, the optimizer groups' hyperparameters, the prices) have no
    # float type to read "Infinity" back into: an infinite hyperparameter is written as the bare
    # constant, which only pydantic reads this file with, and parses back to the float
    model_config = ConfigDict(extra="forbid", frozen=True, ser_json_inf_nan="constants")
    job: str
    name: str
    seed: int
    iterations: int
    global_batch: int
    dtype: str
    layers: int
    dataset: DatasetRef
    plan: dict[str, Any]  # Plan.to_dict(): Plan validates itself (to_plan)
    created: float
    # the job's window state machine and iterations per window; None for a profiling job, which
    # runs no windows (sdk/profile_tiers.py)
    window_length: int | None = None
    window_state_machine: str | None = None
    # how a container builds its stage (core/stagebuild.py): "meta", only its own blocks, from
    # the factory run on the meta device and the values the client uploaded; "full", the whole
    # model from the factory, then its blocks kept — for a factory the meta build would not
    # reproduce, which ``full_build_reason`` names (sdk/exactness.py meta_build_refusal)
    build: Literal["meta", "full"] = "full"
    full_build_reason: str | None = None
    # parameter groups of the optimizer over the whole model, when it has more than one: each
    # group's hyperparameters (all but "params"), and the group of each parameter in the order of
    # model.parameters() (sdk/exactness.py optimizer_groups)
    optimizer_groups: list[dict[str, Any]] | None = None
    param_groups: list[int] | None = None
    # BatchNorm's running statistics updated once per iteration from the whole global batch when
    # the plan splits it (Job.deferred_batch_norm; lambdas/deferred_bn.py)
    deferred_batch_norm: bool = False
    # a model cut from its graph: the named values crossing its blocks' boundaries, which each
    # stage sends straight to the stages reading them (lambdas/stageio.py KeyedIO); None for an
    # nn.Sequential, whose block outputs go whole to the next block
    flows: list[Flow] | None = None
    evaluation: EvalSpec | None = None
    clip_grad_norm: float | None = None  # Job.clip_grad_norm (lambdas/clipping.py)
    # the job starts from given weights (Job.init_from): a container that builds the whole model
    # loads its stage's initial buffers from the client's upload, as a meta-built one does
    init_from: bool = False
    checkpoint_every: int | None = None  # Job.checkpoint_every (lambdas/checkpoint.py)
    # whether the optimizer keeps per-parameter state (core/versions.py optimizer_keeps_state): which
    # objects a complete version has; None in specs written before it was recorded
    optimizer_state: bool | None = None
    # parameters and optimizer state stay in the worker's memory between iterations and go to S3
    # only as window checkpoints (Job.warm_state; docs/runtime.md "State that stays warm")
    warm_state: bool = False
    # per stage, whether its warm state is also stored at every version (planner/plan.py
    # ``writes_through``: small shards): a recycled container then reloads it, the window goes on.
    # None: written before it was recorded (only window checkpoints)
    write_through: list[bool] | None = None
    # the cost cap (``--max-cost``): the iteration gate stops the job at the next iteration
    # boundary once the metered cost passes it (lambdas/gate.py); None: no cap
    max_cost_usd: float | None = None
    # Job.stop_on_nonfinite_loss: the iteration gate stops the job at the iteration boundary after
    # an iteration whose loss is NaN or infinite on any replica (lambdas/gate.py)
    stop_on_nonfinite_loss: bool = False
    # the prices the job is metered at (core/cost.py Prices, from the planner's platform for the
    # functions' architecture), fixed at launch so a later price change never re-prices a job
    prices: dict[str, Any] | None = None
    # the client's S3 requests while launching the job ("puts", "gets"): part of its cost
    launch_requests: dict[str, int] | None = None
    # the windows run as EXPRESS state machines billed at this memory (MB, planner/emit/workflow.py
    # window_memory_mb): the iteration gate's cost cap prices them per request and duration
    # (lambdas/gate.py); None: STANDARD windows, billed per state transition
    express_memory_mb: int | None = None

    def to_plan(self, t: int | None = None) -> Plan:
        """The job's plan; with ``t``, the plan iteration t runs (dynamic workers: its segment's)."""
        plan = Plan.from_dict(self.plan)
        return plan if t is None else plan.plan_at(t)


class TaskMetrics(_Record):
    """``jobs/{job}/metrics/...``: one per finished task (docs/runtime.md "Metrics")."""

    phase: Literal["forward", "backward", "sync", "evaluate", "checkpoint"]
    t: int
    stage: int
    index: int  # the replica (forward, backward) or the shard (sync)
    start: float
    end: float
    duration_s: float
    # the channel's counters (lambdas/channel.py ChannelStats)
    upload_s: float
    download_s: float
    transfer_s: float  # seconds with an upload or a download in flight (their union)
    wait_s: float  # seconds waiting for another worker's object, nothing in flight
    bytes_up: int
    bytes_down: int
    puts: int
    gets: int
    misses: int = 0  # of the gets, those answered 404: polls while waiting (none in older records)
    compute_s: float  # the rest of the task
    container: str
    container_started: float
    invocation: int
    cold: bool
    memory_mb: int
    max_rss_mb: float
    # bytes of the parameters and buffers the container's stage modules hold (each storage once)
    model_bytes: int | None = None
    # the last stage's backward: mean loss over its micro-batches (NaN or infinite when one's is)
    loss: float | None = None
    lr: list[float] | None = None  # ... and, under a scheduler, each parameter group's learning rate
    eval_metrics: dict[str, float] | None = None  # an evaluate task of the last stage: its slice's metric means
    grad_norm: float | None = None  # an updating task, under clipping: the global gradient norm before clipping
    # the window attempt (execution name) that ran the task: a consumer that finds its producer's
    # metrics of its own attempt but not the object knows the object is lost (lambdas/channel.py)
    attempt: str = ""
    # a cold task: its container's Init as the worker sees it (its process's start to the end of the
    # handler module's import); the gate's learnt timeouts allow for a cold task (lambdas/timeouts.py)
    init_s: float | None = None


# why a job stopped: on request (Run.stop, `stagecoach stop`), at its cost cap, or on a loss that
# is NaN or infinite (Job.stop_on_nonfinite_loss)
StopReason = Literal["requested", "max_cost", "nonfinite_loss"]


class StopRequest(_Record):
    """``jobs/{job}/stop/request.json``: asks the job to stop at its next iteration boundary.
    Written by the client (``Run.stop()``, ``stagecoach stop``) or by the iteration gate when the
    metered cost passed the job's cap or, under ``stop_on_nonfinite_loss``, the last iteration's
    loss was NaN or infinite; read by the gate before every iteration (lambdas/gate.py)."""

    reason: StopReason
    time: float
    detail: str = ""


class StopRecord(_Record):
    """``jobs/{job}/stop/stopped.json``: the job stopped before iteration ``version``, so its
    checkpoint is version ``version`` of the parameters, optimizer state and running statistics
    (complete: every task of iteration ``version`` - 1 had finished). What a resume starts from."""

    version: int
    reason: StopReason
    time: float
    detail: str = ""
    attempt: str = ""  # the window execution that stopped


class CostTally(_Record):
    """``jobs/{job}/cost/tally.json``: the engine's running count of what the job has used, kept by
    the iteration gate of a job with a cost cap (lambdas/gate.py). ``through``: iterations
    [0, through) are counted; ``last_gate``: the gate call counted last ("attempt:t"), so a
    retried gate does not count twice (and finds the increment it metered in ``usd - previous_usd``)."""

    through: int
    last_gate: str
    usage: dict[str, float]  # core/cost.py Usage fields
    usd: float
    previous_usd: float = 0.0  # ``usd`` before the gate that wrote this (the cap's next-iteration estimate)
    # Express windows (JobSpec.express_memory_mb): when the current window attempt's first gate ran,
    # and the GB-seconds of its duration metered so far (billed in 100 ms steps of the whole execution)
    window_started: float = 0.0
    window_gb_s: float = 0.0


class WatcherUsage(_Record):
    """``jobs/{job}/cost/phase-watcher/...``: what one phase watcher's invocation used (lambdas/watcher.py).
    Step Functions usually abandons the watcher's Task when its phase ends first, so its output
    never reaches the window's history: the watcher writes this itself, as its last act."""

    t: int
    watch: Literal["forward", "backward"]
    attempt: str
    duration_s: float
    memory_mb: int
    puts: int  # this record's own PUT included
    gets: int
    again: int  # tasks it ran again (each a task invocation that writes its own metrics)


class LearntTimeouts(_Record):
    """``jobs/{job}/timeouts.json``: how long the job's tasks take, as the iteration gate has seen
    them (lambdas/timeouts.py), so every window attempt's gate sets the same learnt timeouts.
    ``samples``: per phase key ("f", "b{stage}", "s{stage}"), the slowest task of each sampled
    iteration, the latest last; ``cold_s``: the longest a cold task has worked (its Init and
    duration, less its waits for other workers); ``through``: the last iteration sampled."""

    samples: dict[str, list[float]]
    cold_s: float | None = None
    through: int = -1


class MemoryPressure(_Record):
    """``jobs/{job}/evidence/memory-s{stage}.json``: a container's memory passed the threshold."""

    stage: int
    rss_mb: float
    memory_mb: int
    time: float


class Remediation(_Record):
    """``jobs/{job}/remediations/...``: what the remediation step decided about a killed worker."""

    time: float
    stage: int
    function: str
    kind: Literal["out_of_memory", "timeout", "crash"]
    error: str
    cause: str
    evidence: MemoryPressure | None = None  # the stage's memory-pressure record, if any
    from_mb: int | None = None
    to_mb: int | None = None


class LearntMemory(_Record):
    """``history/{name}/memory.json``: the memory each stage needed, for the next run of this shape."""

    shape: tuple[list[int], int, int]  # (balance, replicas, micro-batches)
    memory_mb: dict[str, int]  # stage (a JSON key) -> MB

    def fits(self, plan: Plan) -> bool:
        return self.shape == plan_shape(plan)


class LearntTaskSeconds(_Record):
    """``history/{name}/task_seconds.json``: the slowest warm task per stage and phase of the last
    successful run, from which the next run of the same shape and sync sets its timeouts."""

    stages: int
    balance: list[int]
    replicas: int
    micro_batches: int
    sync: list[str]
    aggregators: list[int]
    task_seconds: list[dict[str, float]]
    job: str

    def fits(self, plan: Plan) -> bool:
        # task times depend on the sync algorithm too (a fused sync lengthens backward)
        same_sync = self.sync == list(plan.sync) and self.aggregators == list(plan.aggregators)
        return same_sync and (self.balance, self.replicas, self.micro_batches) == plan_shape(plan)


def plan_shape(plan: Plan) -> tuple[list[int], int, int]:
    """What learnt memory and timeouts are specific to: the partition, d and the micro-batches."""
    return (list(plan.balance), plan.replicas, plan.micro_batches)
