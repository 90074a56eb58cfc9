"""What a container keeps between invocations: the job's spec and code, its stage modules, its data.

Module-level caches survive between invocations of a warm Lambda execution environment, so a
stage's parameters are downloaded once per version, not once per phase.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import cloudpickle
import torch
from torch import nn

from stagecoach.core import keys
from stagecoach.core.decisions import decisions_key, with_decisions
from stagecoach.core.optim_state import group_runs
from stagecoach.core.records import EvalSpec, JobSpec
from stagecoach.core.schedule import MakeScheduler, Schedule, hyperparameters, stand_in
from stagecoach.core.stagebuild import build_stage, held_bytes, load_buffers, stage_buffers
from stagecoach.core.stored_layout import Cut, iteration_cut, stored_layout
from stagecoach.core.training import (
    DTYPES,
    Ownership,
    Tied,
    assign_flat,
    epoch_of,
    flat_params,
    load_running_stats,
    master_dtype,
    running_stats,
)
from stagecoach.errors import StagecoachError
from stagecoach.lambdas.channel import Channel
from stagecoach.lambdas.clipping import Clip
from stagecoach.lambdas.collectives import Layout, SyncSpec, gather, read_range
from stagecoach.lambdas.datafetch import RemoteSamples
from stagecoach.lambdas.stageio import ChainIO, KeyedIO, StageIO
from stagecoach.planner import hap
from stagecoach.planner.model.syncmodel import one_gradient_object
from stagecoach.planner.plan import Plan
from stagecoach.planner.profile.flows import routes


@dataclass
class JobContext:
    job: str
    bucket: str
    spec: JobSpec
    plan: Plan
    model_factory: Callable[[], nn.Module]
    loss_fn: Callable[..., torch.Tensor]
    make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer]
    stages: dict[int, nn.ModuleList] = field(default_factory=dict)
    loaded_version: dict[int, int] = field(default_factory=dict)
    transform: Callable[[Any], Any] | None = None  # Job.transform: per-sample, on the input
    data: dict[str, RemoteSamples] = field(default_factory=dict)
    metric_fns: dict[str, Callable[..., Any]] = field(default_factory=dict)  # Job.metrics
    make_scheduler: MakeScheduler | None = None  # Job.scheduler
    _schedule: Schedule | None = None
    runs: dict[int, tuple[tuple[int, int, int], ...]] = field(default_factory=dict)
    stats_version: dict[int, int] = field(default_factory=dict)  # the running statistics' version held
    own: dict[int, Ownership] = field(default_factory=dict)
    param_index: dict[int, dict[int, int]] = field(default_factory=dict)  # id -> position in model.parameters()
    tied_version: dict[int, int] = field(default_factory=dict)  # the owners' version of the tied parameters held
    buffers_pending: set[int] = field(default_factory=set)
    master: dict[int, torch.Tensor] = field(
        default_factory=dict
    )  # mixed precision: fp32 flat parameters  # meta-built stages whose initial buffers are not loaded yet
    # warm optimizer state (docs/runtime.md "State that stays warm"): per (stage, shard) this
    # container owns, the version held and each chunk's state as optim_state.dump_state wrote it
    optim_held: dict[tuple[int, int], tuple[int, list[bytes]]] = field(default_factory=dict)
    # a sync task's own shard of the parameters (d > 1, a function per sync task): (version, chunks)
    shard_held: dict[tuple[int, int], tuple[int, list[torch.Tensor]]] = field(default_factory=dict)
    retried_window: dict[str, bool] = field(default_factory=dict)  # window attempt -> an earlier attempt failed
    cuts: dict[tuple[int, ...], Cut] = field(default_factory=dict)  # (stage, d, K, C) -> the iteration's layout (per spec)

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.spec.dtype]

    @property
    def seed(self) -> int:
        return self.spec.seed

    def stage_module(self, stage: int) -> nn.ModuleList:
        """The stage's blocks, built once per container (core/stagebuild.py): on the meta device
        and given storage for this stage only, unless the job's spec says the factory needs the
        full build. A meta-built stage holds no values until :meth:`ensure_params` loads them."""
        if stage not in self.stages:
            ranges = [self.plan.stage_layers(s) for s in range(self.plan.stages)]
            built = build_stage(self.model_factory, self.seed, self.dtype, ranges, stage, self.spec.build)
            self.own[stage] = built.own
            self.param_index[stage] = built.param_index
            self.stages[stage] = nn.ModuleList(built.layers).train()
            if self.spec.build == "full" and not self.spec.init_from:
                self.stats_version[stage] = 0  # a freshly built model holds the initial statistics, as every container's does
            else:
                self.buffers_pending.add(stage)
        return self.stages[stage]

    def stage_io(self, stage: int, space: str = "") -> StageIO:
        """How ``stage`` receives and sends its values (lambdas/stageio.py); ``space``: keys.act."""
        last = stage == self.plan.stages - 1
        if self.spec.flows is None:
            return ChainIO(self.job, stage, last, space)
        ranges = [self.plan.stage_layers(s) for s in range(self.plan.stages)]
        return KeyedIO(self.job, stage, last, routes(self.spec.flows, ranges)[stage], space)

    def ensure_initial_buffers(self, channel: Channel, stage: int) -> None:
        """A meta-built stage's buffers as the factory initialised them (uploaded by the client:
        keys.initial_buffers), once per container; they then hold the initial running statistics."""
        module = self.stage_module(stage)
        if stage not in self.buffers_pending:
            return
        first = self.plan.stage_layers(stage).start
        if stage_buffers(list(module), first):
            values = channel.get_tensors(keys.initial_buffers(self.job, stage))
            if values is None:
                raise FileNotFoundError(f"initial buffers {keys.initial_buffers(self.job, stage)} are missing")
            load_buffers(list(module), first, values)
        self.buffers_pending.discard(stage)
        self.stats_version[stage] = 0

    def held_bytes(self) -> int:
        """Bytes of the parameters and buffers this container's stage modules hold."""
        return held_bytes(self.stages.values())

    def ownership(self, stage: int) -> Ownership:
        """Who owns which parameter, as seen from this container's instance of ``stage``'s model."""
        self.stage_module(stage)
        return self.own[stage]

    def tied(self, stage: int) -> list[Tied]:
        """The parameters ``stage`` uses that an earlier stage owns (tied weights)."""
        return self.ownership(stage).tied[stage]

    def ensure_tied(self, channel: Channel, stage: int, version: int, deadline: float) -> None:
        """Hold the owners' ``version`` of the parameters this stage shares with earlier stages."""
        tied = self.tied(stage)
        if not tied or self.tied_version.get(stage) == version:
            return
        with torch.no_grad():
            for t in tied:
                values = read_range(
                    channel, self.job, t.owner, self.stored_layout(t.owner), version, t.offset, t.offset + t.param.numel(), deadline
                )
                t.param.copy_(values.view_as(t.param))
        self.tied_version[stage] = version

    @property
    def deferred_batch_norm(self) -> bool:
        """Whether BatchNorms defer their running statistics to one update per iteration
        (lambdas/deferred_bn.py): the job opted in and the plan splits the global batch. With one
        replica and one micro-batch they update themselves, as in plain PyTorch."""
        return self.spec.deferred_batch_norm and self.plan.replicas * self.plan.micro_batches > 1

    def running_stats(self, stage: int) -> dict[str, torch.Tensor]:
        return running_stats(self.stage_module(stage), self.plan.stage_layers(stage).start)

    def ensure_running_stats(self, channel: Channel, stage: int, version: int) -> None:
        """Hold the stage's running statistics after ``version`` iterations (from S3 unless held),
        for the forward pass about to update them: until :meth:`save_running_stats` stores the
        result, this container's copy is no version (a task that fails half-way, retried in the
        same warm container, must start again from ``version``, not from a half update)."""
        if not self.running_stats(stage):
            return
        if self.stats_version.get(stage) != version:
            values = channel.get_tensors(keys.buffers(self.job, version, stage))
            if values is None:
                raise FileNotFoundError(f"running statistics {keys.buffers(self.job, version, stage)} are missing")
            load_running_stats(self.stage_module(stage), self.plan.stage_layers(stage).start, values)
        self.stats_version[stage] = -1

    def save_running_stats(self, channel: Channel, stage: int, version: int, window_start: int) -> None:
        """Store the statistics this task's forward pass updated as ``version``; drop the version
        before the previous one unless it is the window's checkpoint (a restart starts there)."""
        stats = self.running_stats(stage)
        if not stats:
            return
        # in the background (the task settles them before it returns): not on the task's end
        channel.submit_put(keys.buffers(self.job, version, stage), {k: v.detach().clone() for k, v in stats.items()})
        self.stats_version[stage] = version
        old = version - 2
        if old >= 0 and old != window_start:
            channel.submit_delete([keys.buffers(self.job, old, stage)])

    def stage_params(self, stage: int) -> list[nn.Parameter]:
        """The parameters ``stage`` owns (its flat vector), each once."""
        return self.ownership(stage).owned[stage]

    def layout(self, stage: int, at: int | None = None) -> Layout:
        """How stage ``stage``'s flat vector is cut into K shards of chunks in this task's iteration
        (``at``: in iteration ``at``'s): the plan's own layout (training.stage_layout), or, when K
        or the chunks change between segments, the stored chunks inside each of its shards
        (core/stored_layout.py)."""
        return self.cut(stage, at).layout

    def cut(self, stage: int, at: int | None = None) -> Cut:
        """The iteration's layout of ``stage`` and its chunks' stored names (core/stored_layout.py)."""
        plan = self.plan if at is None else self.spec.to_plan(at) if self.spec.plan.get("segments") else self.plan
        key = (stage, plan.replicas, plan.grad_shards(stage), plan.chunks[stage])
        if key not in self.cuts:
            own = next(iter(self.own.values())) if self.own else self.ownership(stage)
            itemsize = torch.empty(0, dtype=master_dtype(self.dtype)).element_size()  # the stored parameters'
            whole = self.spec.to_plan() if self.spec.plan.get("segments") or self.spec.plan.get("choices") else plan
            self.cuts[key] = iteration_cut(whole, plan, stage, own.numel(stage), itemsize)
        return self.cuts[key]

    def stored_layout(self, stage: int) -> Layout:
        """How every version of ``stage`` is stored: the keys' shards and chunks (core/stored_layout.py)."""
        own = next(iter(self.own.values())) if self.own else self.ownership(stage)
        itemsize = torch.empty(0, dtype=master_dtype(self.dtype)).element_size()
        whole = self.spec.to_plan() if self.spec.plan.get("segments") or self.spec.plan.get("choices") else self.plan
        return stored_layout(whole, stage, own.numel(stage), itemsize)

    @property
    def batch_sizes(self) -> tuple[tuple[int, int], ...] | None:
        """A growing global batch's (first iteration, G) pairs (core/training.py batch_position),
        from the whole plan in the spec; None when it is fixed."""
        segments = self.spec.plan.get("segments") or ()
        sizes = [(int(first), int(p["global_batch"])) for first, p in segments]
        return tuple(sizes) if len({g for _, g in sizes}) > 1 else None

    @property
    def lr_scaled(self) -> bool:
        """Whether some segment of the job's plan multiplies the learning rate (Plan.lr_scale)."""
        return any(float(p.get("lr_scale", 1.0)) != 1.0 for _, p in self.spec.plan.get("segments") or ())

    def hparams(self, t: int) -> tuple[dict[str, Any], ...]:
        """The parameter groups' hyperparameters of iteration t: the scheduler's, or the factory's;
        with a learning-rate multiplier (a growing batch's segment, Plan.lr_scale) every group's lr
        times it, so any task of iteration t — in a restarted or resumed window too — steps alike."""
        base = self.schedule.at(t) if self.schedule is not None else self.spec.optimizer_groups
        if not self.lr_scaled:
            return tuple(base or ())
        groups = base or hyperparameters(stand_in(self.make_optimizer, None))
        at_t = [p for first, p in self.spec.plan["segments"] if int(first) <= t]  # the segment iteration t runs
        factor = float(at_t[-1].get("lr_scale", 1.0))
        return tuple({**g, "lr": g["lr"] * factor} for g in groups)

    def group_runs(self, stage: int) -> tuple[tuple[int, int, int], ...]:
        """The stage's flat vector as (start, end, parameter group) runs; () for one group (unless
        a scheduler or a learning-rate multiplier sets its hyperparameters per iteration: then one
        run of group 0)."""
        if not self.spec.param_groups:
            per_iteration = self.schedule is not None or self.lr_scaled
            return ((0, self.ownership(stage).numel(stage), 0),) if per_iteration else ()
        params = self.stage_params(stage)  # builds the stage (and its param_index) if needed
        index = self.param_index[stage]
        return group_runs([self.spec.param_groups[index[id(p)]] for p in params], [p.numel() for p in params])

    def sync_spec(self, stage: int, t: int, window_start: int, deadline: float) -> SyncSpec:
        if stage not in self.runs:
            self.runs[stage] = self.group_runs(stage)
        return SyncSpec(
            self.job,
            stage,
            t,
            self.plan.replicas,
            self.layout(stage),
            self.make_optimizer,
            window_start,
            deadline,
            groups=self.runs[stage],
            group_hparams=self.hparams(t),
            clip=self.clip,
            one_object=self.one_gradient_object(stage),
            stale_readers=self.hap_split is not None,
            names=self.cut(stage).names,
        )

    @property
    def hap_split(self) -> hap.HapSplit | None:
        """FasDL's HAP configuration when the plan runs sync "k_reduce_hap" (one stage: planner/hap.py
        ``plan_problem``): the unequal cut, each replica's loss weight and parameter version
        (lambdas/phases.py). None for every other plan."""
        if self.plan.sync[0] != hap.HAP_SYNC:
            return None
        return hap.split_of(self.plan)

    def one_gradient_object(self, stage: int) -> torch.dtype | None:
        """The gradient's dtype if each replica writes ``stage``'s gradient as one object (the
        performance model's rule, syncmodel.one_gradient_object, on this stage's layout), else None.
        Every parameter must be of the job's dtype: the readers view the bytes as that.
        ``GRADIENT_OBJECTS_ENV`` = "chunks" turns it off (benchmarks/requests.py measures both)."""
        plan = self.plan
        if plan.replicas == 1 or os.environ.get(GRADIENT_OBJECTS_ENV) == "chunks":
            return None
        layout = self.layout(stage)
        chunks = max(len(shard) for shard in layout)
        nonempty = all(len(shard) == 1 and shard[0][1] > shard[0][0] for shard in layout)
        numel = sum(b - a for shard in layout for a, b in shard)
        size = torch.empty(0, dtype=self.dtype).element_size()
        same = all(p.dtype == self.dtype for p in self.stage_params(stage))
        blocks = plan.blocks(stage) if plan.sync[stage] == "hierarchical" else 1
        one = one_gradient_object(plan.sync[stage], len(layout), chunks, numel * size, blocks)
        return self.dtype if (one and nonempty and same) else None

    @property
    def clip(self) -> Clip | None:
        """Clipping by the global gradient norm (Job.clip_grad_norm): every (stage, shard) that
        one task reduces and updates takes part (lambdas/clipping.py)."""
        if self.spec.clip_grad_norm is None:
            return None
        updaters = tuple((s, k) for s in range(self.plan.stages) for k in range(self.plan.grad_shards(s)))
        return Clip(self.spec.clip_grad_norm, updaters)

    @property
    def schedule(self) -> Schedule | None:
        """The job's learning-rate schedule (core/schedule.py), kept by the container."""
        if self.make_scheduler is None:
            return None
        if self._schedule is None:
            self._schedule = Schedule(self.make_optimizer, self.make_scheduler, self.spec.optimizer_groups)
        return self._schedule

    def warm(self, stage: int) -> bool:
        """Whether ``stage``'s state stays in the memory of the containers that own it between
        iterations and reaches S3 only as the window's checkpoint (docs/runtime.md "State that
        stays warm"): every worker has a function of its own (d = 1: the stage's; d > 1:
        plan.per_worker_functions), so its invocations are sequential. With one replica that is the
        parameters and the optimizer state; with d > 1 the optimizer state of the shard the
        worker owns (the parameters' shards are read by the others, so they are stored anyway)."""
        return self.spec.warm_state and self.spec.window_length is not None

    def warm_attempt(self, channel: Channel, stage: int, window_start: int, attempt: str) -> bool:
        """Whether this window attempt keeps ``stage``'s state warm: a warm stage's, unless an
        earlier attempt at the same window failed (its abort marker exists). A window restarted
        once runs stored, every version through S3, so a container recycled again costs a task
        retry, not another restart: under many faults the window still completes. One LIST per
        container and attempt."""
        if not self.warm(stage):
            return False
        if not attempt:
            return True
        if attempt not in self.retried_window:
            self.retried_window.clear()
            self.retried_window[attempt] = channel.any_under(keys.window_aborts(self.job, window_start))
        return not self.retried_window[attempt]

    def checkpoint(self, version: int, window_start: int, stage: int) -> bool:
        """Whether ``version`` of ``stage``'s warm state is stored in S3: every version if the
        stage writes through (JobSpec.write_through); else the job's start, the window's first
        iteration (the checkpoint a restart starts from) and the version after its last (the next one's)."""
        if not self.spec.window_length or self.writes_through(stage):
            return True
        end = min(window_start + self.spec.window_length, self.spec.iterations)
        return version in (0, window_start, end)

    def writes_through(self, stage: int) -> bool:
        """Whether ``stage``'s warm state also goes to S3 at every version (planner/plan.py
        ``writes_through``): its container keeps it and skips the download, and one recycled
        reloads it, so a lost container costs its task's re-run, not a window restart."""
        return bool(self.spec.write_through and self.spec.write_through[stage])

    def publishes_params(self, stage: int) -> bool:
        """Whether later stages read ``stage``'s parameters (tied weights): then every version is stored."""
        return bool(self.ownership(stage).users(stage))

    def require_warm(self, stage: int, version: int, window_start: int, held: int | None) -> None:
        """The version check: a warm stage's ``version`` not in this container (recycled, never
        warm, or behind) and not a checkpoint cannot be found anywhere: the window restarts."""
        if held != version and not self.checkpoint(version, window_start, stage):
            raise WarmStateLost(
                f"stage {stage}: this container holds version {held} of the stage's state, the task needs "
                f"{version}, and only versions {window_start} (the window's checkpoint) and its end are in S3: "
                "the window restarts from its checkpoint"
            )

    def ensure_params(
        self, channel: Channel, stage: int, version: int, deadline: float, window_start: int = 0, warm: bool = False
    ) -> nn.ModuleList:
        """Load the stage's parameters at ``version`` (every chunk of every shard) unless this
        container has them: its last task may have gathered them (pipelined scatter-reduce), or,
        for a warm stage, updated them itself."""
        module = self.stage_module(stage)
        self.ensure_initial_buffers(channel, stage)
        if warm and self.plan.replicas == 1 and not self.publishes_params(stage):
            self.require_warm(stage, version, window_start, self.loaded_version.get(stage))
        if self.loaded_version.get(stage) != version:
            flat = gather(channel, self.sync_spec(stage, version, 0, deadline), version)
            self.set_params(stage, version, flat)
        self.ensure_tied(channel, stage, version, deadline)
        return module

    def set_params(self, stage: int, version: int, flat: torch.Tensor) -> None:
        """Install the stage's flat parameters at ``version`` in this container's module (under
        mixed precision: keep them as the master copy, the module computing in bfloat16)."""
        assign_flat(self.stage_params(stage), flat)
        if flat.dtype != self.dtype:
            self.master[stage] = flat
        self.loaded_version[stage] = version

    def master_params(self, stage: int) -> torch.Tensor:
        """The stage's flat parameters as stored and updated: the master copy under mixed
        precision, else the module's own."""
        if self.dtype != master_dtype(self.dtype):
            return self.master[stage]
        return flat_params(self.stage_params(stage))

    def cached_params(self, stage: int, version: int) -> torch.Tensor | None:
        """The stage's flat parameters at ``version`` if this container holds them."""
        if self.loaded_version.get(stage) != version:
            return None
        return self.master_params(stage)

    def samples(self, channel: Channel, stage: int, split: str = "train") -> RemoteSamples:
        """A data set as this container reads it (lambdas/datafetch.py): kept whole when small
        beside the stage's memory, else read by sample. ``split``: "train" or "validation"."""
        if split not in self.data:
            ref = self.spec.dataset if split == "train" else self.eval_spec.dataset
            self.data[split] = RemoteSamples(channel, ref.id, self.plan.memory_mb[stage])
        return self.data[split]

    @property
    def eval_spec(self) -> EvalSpec:
        if self.spec.evaluation is None:
            raise ValueError(f"job {self.job} has no validation set: it runs no evaluate tasks")
        return self.spec.evaluation

    def inputs(self, channel: Channel, stage: int, indices: torch.Tensor, t: int, split: str = "train") -> Any:
        """The inputs of samples ``indices`` in iteration t, in the job's dtype; training inputs
        transformed (augmentation), validation inputs as they are."""
        if split != "train":
            return self.samples(channel, stage, split).inputs(channel, indices, None, self.seed, 0, self.dtype)
        epoch = epoch_of(t, self.spec.dataset.n_train, self.plan.global_batch, self.batch_sizes)
        return self.samples(channel, stage).inputs(channel, indices, self.transform, self.seed, epoch, self.dtype)

    def targets(self, channel: Channel, stage: int, indices: torch.Tensor, split: str = "train") -> Any:
        return self.samples(channel, stage, split).targets(channel, indices)


class WarmStateLost(StagecoachError, RuntimeError):
    """A warm stage's task found neither its state in memory nor a checkpoint of that version."""


# "chunks": every replica writes its gradient as one object per chunk, also where one object would
# do (JobContext.one_gradient_object): the layout before the cut, for benchmarks/requests.py
GRADIENT_OBJECTS_ENV = "STAGECOACH_GRADIENT_OBJECTS"

_CACHE: dict[tuple[str, str], JobContext] = {}


def job_context(channel: Channel, job: str, t: int | None = None) -> JobContext:
    """The job's context, loaded from its own bucket once per container. ``t``: the task's
    iteration; one at or past the spec's iterations means the job was resumed to more of them
    (sdk/deploy/resume.py rewrote its spec): the spec is read again, the container's warm state kept."""
    key = (channel.bucket, job)
    ctx = _CACHE.get(key)
    if ctx is not None and t is not None and (t >= ctx.spec.iterations or _undecided(ctx.spec, t)):
        body = channel.get_bytes(keys.job_spec(job))
        if body is not None:
            ctx.spec = _with_decisions(channel, job, JobSpec.model_validate_json(body))
            ctx.cuts.clear()  # a resumed job's plan may have other segments
    if key not in _CACHE:
        spec_body = channel.get_bytes(keys.job_spec(job))
        code_body = channel.get_bytes(keys.job_code(job))
        if spec_body is None or code_body is None:
            raise FileNotFoundError(f"job {job!r} has no spec or code in s3://{channel.bucket}/{keys.job_prefix(job)}")
        spec = _with_decisions(channel, job, JobSpec.model_validate_json(spec_body))
        code = cloudpickle.loads(code_body)  # the user's own code, from the job's own bucket
        _CACHE.clear()  # one job per function: drop any other job's state
        _CACHE[key] = JobContext(
            job=job,
            bucket=channel.bucket,
            spec=spec,
            plan=spec.to_plan(),
            model_factory=code["model"],
            loss_fn=code["loss"],
            make_optimizer=code["optimizer"],
            transform=code.get("transform"),
            metric_fns=code.get("metrics") or {},
            make_scheduler=code.get("scheduler"),
        )
    ctx = _CACHE[key]
    if t is not None and ctx.spec.plan.get("choices") and not ctx.spec.plan.get("segments"):  # the gate decides first
        raise RuntimeError(f"job {job!r}: its replica policy has decided no iteration's d yet (iteration {t})")
    if t is not None and ctx.spec.plan.get("segments"):  # dynamic workers: the plan iteration t runs
        ctx.plan = ctx.spec.to_plan(t)
    return ctx


def _with_decisions(channel: Channel, job: str, spec: JobSpec) -> JobSpec:
    """A replica policy's spec with its decisions so far (core/decisions.py); any other as it is."""
    return with_decisions(spec, channel.get_bytes(decisions_key(job))) if spec.plan.get("choices") else spec


def _undecided(spec: JobSpec, t: int) -> bool:
    """Whether the spec's plan is a replica policy's (lambdas/policy.py) that has not decided
    iteration t's d as this copy of it says: read the spec again (the gate has since, for an
    iteration; a version at the decided end, a checkpoint's, runs in the last decision's plan)."""
    return bool(spec.plan.get("choices")) and not (spec.plan.get("segments") and t < int(spec.plan.get("decided", 0)))
