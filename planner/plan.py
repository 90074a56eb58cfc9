"""The contract between the planner and the runtime: one small, validated, JSON-able Plan.

Like torchgpipe's ``balance``, a plan names how many consecutive layers (children of the user's
nn.Sequential) each pipeline stage holds. Everything else the runtime needs — data-parallel degree,
micro-batching, sync algorithm, Lambda memory and per-phase timeouts — sits beside it. A plan is
checked when it is built, so a bad one is refused before any object, function or state machine
exists.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from stagecoach.errors import StagecoachError
from stagecoach.planner import hap
from stagecoach.planner.limits import (
    GROUP_SIZE,
    INLINE_MAP_MAX_CONCURRENCY,
    LAMBDA_MAX_MB,
    LAMBDA_MAX_TIMEOUT_S,
    LAMBDA_MIN_MB,
    MAP_MAX_TASKS,
    fits_lambda_timeout,
    peak_invocations,
    timeout_refusal,
    watchable,
)

# Gradient synchronisation per stage (docs/runtime.md "Sync algorithms"):
#   scatter_reduce            LambdaML's split, reduced by a sync Map: backward writes d shards, d sync tasks reduce them
#   k_reduce                  FasDL: backward writes K shards, a sync Map of K aggregators (1 <= K <= d)
#   all_reduce                K = 1: one aggregator reduces and updates the whole stage
#   pipelined_scatter_reduce  FuncPipe: the d backward tasks exchange shards among themselves, uploading
#                             and downloading at once in a staggered order; the stage has no sync Map
#   lambdaml_scatter_reduce   LambdaML's own: the d backward tasks reduce their own shards among themselves
#                             after the backward pass, in phases one after another; no sync Map
#   hierarchical              DiSDeL's aggregation with a bounded fan-in: backward writes K shards; in the sync
#                             Map, per shard, a chain of level-1 aggregators, one per block of fan_in replicas,
#                             each extending the running left fold by its block; the shard's root reads the
#                             last prefix and updates the shard (K roots alone when d <= fan_in: k_reduce)
SYNC_ALGORITHMS = ("scatter_reduce", "k_reduce", "all_reduce", "pipelined_scatter_reduce", "lambdaml_scatter_reduce", "hierarchical")
FUSED_SYNC = ("pipelined_scatter_reduce", "lambdaml_scatter_reduce")  # no sync Map: K = d, in the backward tasks
CHOSEN_K = ("k_reduce", "hierarchical")  # the algorithms whose K the plan chooses (1 <= K <= d)
PHASES = ("forward", "backward", "sync")
# The memory ladder an out-of-memory stage climbs, one step per failure (FuncPipe's tiers, MB).
MEMORY_TIERS_MB = (512, 1024, 2048, 3072, 4096, 6144, 8192, 10240)
# A task's TimeoutSeconds is its predicted (or observed) duration times this factor, plus slack.
TIMEOUT_SAFETY = 2.0
# A hierarchical stage's block of replicas (docs/runtime.md "Hierarchical"): one level-1 aggregator
# per block of fan_in consecutive replicas and shard, each a link of the shard's chain. It changes no
# bits: every algorithm sums the d replicas' gradients as PyTorch does, one left fold g_0 + ... +
# g_{d-1} (docs/runtime.md "Same bits everywhere"); it bounds what one aggregator reads per chunk
# (f gradients and a prefix: its memory and requests in flight), and B = ceil(d / f) is the chain's
# length (its hops of latency). 40: a level-1 aggregator then reads about one stage's gradient at K = f.
DEFAULT_FAN_IN = 40
# The most gradients a level-1 aggregator reads per chunk (its downloads in flight and its memory grow
# with it), and the longest chain of them (B hops of latency): 1,600 replicas (MAP_MAX_TASKS) fit 40 x 40.
MAX_FAN_IN = 64


def reduction_blocks(replicas: int, fan_in: int) -> int:
    """B: the blocks of ``fan_in`` consecutive replicas the gradients are summed in (the last may be
    shorter); 1 when d <= fan_in, the one left fold g_0 + g_1 + ... + g_{d-1}."""
    return max(1, -(-replicas // max(1, fan_in)))


class PlanError(StagecoachError, ValueError):
    """A plan that the runtime cannot execute; the message says what to change."""


@dataclass(frozen=True)
class Prediction:
    """What the planner's performance model predicts for a plan (docs/performance-model.md): the
    runtime's timeout manager starts from ``task_s``; the rest is reported to the user."""

    task_s: tuple[Mapping[str, float], ...]  # per stage, per phase: seconds of one task
    s_per_iteration: float
    usd_per_iteration: float
    phase_s: Mapping[str, float] = field(default_factory=dict)  # "forward", "backward_sync" spans
    sync_algorithms: tuple[str, ...] = ()  # per stage, as the planner labels them
    platform: str = ""
    planner_method: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "task_s", tuple(dict(t) for t in self.task_s))
        object.__setattr__(self, "phase_s", dict(self.phase_s))
        object.__setattr__(self, "sync_algorithms", tuple(self.sync_algorithms))

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["task_s"] = [dict(t) for t in self.task_s]
        d["sync_algorithms"] = list(self.sync_algorithms)
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Prediction:
        try:
            return cls(**dict(data))
        except TypeError as e:
            raise PlanError(f"malformed plan.prediction: {e}") from None


@dataclass(frozen=True)
class Plan:
    """How one training job runs.

    balance:        layers per stage, e.g. (2, 3, 1) puts layers 0-1 in stage 0, 2-4 in stage 1, 5 in 2.
    replicas:       data-parallel degree d (every stage is replicated d times).
    micro_batches:  micro-batches per replica per iteration (m).
    global_batch:   samples per iteration over all replicas; must equal d * m * micro-batch size.
    sync:           gradient synchronisation algorithm, per stage (SYNC_ALGORITHMS).
    aggregators:    per stage, K: how many shards the gradient is cut into and how many sync tasks
                    reduce them (d for scatter-reduce, 1 for all-reduce, 1..d for K-reduce).
    memory_mb:      Lambda memory per stage.
    timeouts_s:     per stage, per phase, the Task's TimeoutSeconds.
    prediction:     what the planner predicted for it (None for a plan written by hand).
    fan_in:         per stage, f >= 2: a hierarchical stage runs a level-1 aggregator per block of f
                    consecutive replicas (DEFAULT_FAN_IN: d <= 40 is one block); it bounds an
                    aggregator's inputs and changes no bits (every algorithm sums as PyTorch does).
    workflow:       the windows' workflow type, "auto", "standard" or "express" (planner/emit/
                    workflow.py); empty: the job's (Job.workflow).
    phase_watchers: whether each window phase runs beside a phase watcher (lambdas/watcher.py),
                    where the plan allows one (limits.watchable); False: the phases' learnt Task
                    timeouts alone end a hung task (Job.phase_watchers).
    chunks:         per stage, C: the chunks each gradient/parameter shard is cut into (``stage_chunks``);
                    0 = the size rule ``chunk_count``; the planner records the C its predicted cost
                    chose (planner/model/chunking.py). Changes no bits: a chunk is a range of a shard.
    """

    balance: tuple[int, ...]
    replicas: int = 1
    micro_batches: int = 1
    global_batch: int = 1
    sync: tuple[str, ...] = ()
    aggregators: tuple[int, ...] = ()
    memory_mb: tuple[int, ...] = ()
    timeouts_s: tuple[Mapping[str, int], ...] = ()
    prediction: Prediction | None = None
    fan_in: tuple[int, ...] = ()
    # the windows' workflow type ("auto", "standard", "express": planner/emit/workflow.py); "": the job's
    workflow: str = ""
    phase_watchers: bool = True
    # dynamic workers (planner/segments.py, docs/runtime.md "Dynamic workers"): (first iteration,
    # the plan from there on) in order; empty for a fixed d. The fields above are then the largest
    # d's plan (the functions, memory and timeouts every segment runs on).
    segments: tuple[tuple[int, Plan], ...] = ()
    # a segment's learning-rate multiplier (a growing global batch, planner/segments.py): every
    # parameter group's lr is the optimizer factory's times this, from the segment's first iteration
    lr_scale: float = 1.0
    # a replica policy (planner/segments.py ReplicaPolicy): the d values it may choose, in order
    # (the fields above are the largest's plan), and the iterations [0, decided) its decisions so
    # far cover, materialized in ``segments`` by the gate (lambdas/gate.py); empty and 0 otherwise
    choices: tuple[int, ...] = ()
    decided: int = 0
    chunks: tuple[int, ...] = ()
    # FasDL's HAP (sync "k_reduce_hap", planner/hap.py): the extra samples each non-aggregator
    # takes beyond each aggregator per iteration (HapSplit.extra); 0 for every other sync
    hap_extra: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "balance", _int_tuple("balance", self.balance))
        n = len(self.balance)
        if not self.sync:
            object.__setattr__(self, "sync", ("scatter_reduce",) * n)
        elif isinstance(self.sync, str):
            object.__setattr__(self, "sync", (self.sync,) * n)
        else:
            object.__setattr__(self, "sync", tuple(self.sync))
        if self.fan_in is None or (not isinstance(self.fan_in, int) and len(self.fan_in) == 0):  # 0 is checked, not defaulted
            object.__setattr__(self, "fan_in", (DEFAULT_FAN_IN,) * n)
        elif isinstance(self.fan_in, int):
            object.__setattr__(self, "fan_in", (self.fan_in,) * n)
        else:
            object.__setattr__(self, "fan_in", _int_tuple("fan_in", self.fan_in))
        object.__setattr__(self, "chunks", _per_stage_ints("chunks", self.chunks, n, 0))
        if not self.aggregators:
            fans = self.fan_in if len(self.fan_in) == len(self.sync) else (DEFAULT_FAN_IN,) * len(self.sync)
            object.__setattr__(self, "aggregators", tuple(_default_k(a, self.replicas, f) for a, f in zip(self.sync, fans)))
        elif isinstance(self.aggregators, int):
            object.__setattr__(self, "aggregators", (self.aggregators,) * n)
        else:
            object.__setattr__(self, "aggregators", _int_tuple("aggregators", self.aggregators))
        object.__setattr__(self, "memory_mb", _per_stage_ints("memory_mb", self.memory_mb, n, 2048))
        if not self.timeouts_s:
            object.__setattr__(self, "timeouts_s", tuple({p: 300 for p in PHASES} for _ in range(n)))
        else:
            object.__setattr__(self, "timeouts_s", tuple(dict(t) for t in self.timeouts_s))
        if not isinstance(self.phase_watchers, bool):  # JSON's true/false; no "yes", no 0
            raise PlanError(f"plan.phase_watchers={self.phase_watchers!r}: true or false")
        if self.workflow not in ("", "auto", "standard", "express"):
            raise PlanError(f"plan.workflow={self.workflow!r}: choose one of auto, standard, express (or leave it empty: the job's)")
        if isinstance(self.prediction, Mapping):  # from JSON
            object.__setattr__(self, "prediction", Prediction.from_dict(self.prediction))
        object.__setattr__(self, "segments", _segment_tuple(self.segments))
        object.__setattr__(self, "choices", _int_tuple("choices", self.choices) if self.choices else ())
        if isinstance(self.lr_scale, bool) or not isinstance(self.lr_scale, (int, float)) or not 0 < self.lr_scale < float("inf"):
            raise PlanError(f"plan.lr_scale={self.lr_scale!r}: a positive, finite learning-rate multiplier")
        object.__setattr__(self, "lr_scale", float(self.lr_scale))
        self.validate()

    # -- derived -------------------------------------------------------------------------------
    @property
    def stages(self) -> int:
        return len(self.balance)

    @property
    def micro_batch_size(self) -> int:
        return self.global_batch // (self.replicas * self.micro_batches)

    @property
    def layers(self) -> int:
        return sum(self.balance)

    def stage_layers(self, stage: int) -> range:
        """Indices (into the nn.Sequential) of the layers stage ``stage`` holds."""
        start = sum(self.balance[:stage])
        return range(start, start + self.balance[stage])

    def plan_at(self, t: int) -> Plan:
        """The plan iteration ``t`` runs (dynamic workers: its segment's), on this plan's memory
        and timeouts (the deployed functions'); this plan itself when d is fixed."""
        if not self.segments:
            return self
        seg = [p for first, p in self.segments if first <= t][-1] if t >= self.segments[0][0] else self.segments[0][1]
        return replace(
            seg, memory_mb=self.memory_mb, timeouts_s=self.timeouts_s, workflow=self.workflow, phase_watchers=self.phase_watchers
        )

    def batch_sizes(self) -> tuple[tuple[int, int], ...]:
        """(first iteration, global batch) per segment, in order; one pair when it never changes
        (core/training.py batch_position: the data order continues across a change)."""
        pairs = [(first, p.global_batch) for first, p in self.segments] or [(0, self.global_batch)]
        return tuple(p for i, p in enumerate(pairs) if i == 0 or p[1] != pairs[i - 1][1])

    def workers(self) -> Iterator[tuple[int, int]]:
        """Every (stage, replica) worker, stage-major."""
        for s in range(self.stages):
            for r in range(self.replicas):
                yield s, r

    def grad_shards(self, stage: int) -> int:
        """How many shards stage ``stage``'s gradient is written in (1 when there is no sync)."""
        return 1 if self.replicas == 1 else self.aggregators[stage]

    def sync_tasks(self, stage: int) -> int:
        """Tasks in stage ``stage``'s sync Map: 0 without one (d = 1, or a sync fused into backward);
        hierarchical with B > 1 blocks: K roots and K x B level-1 aggregators (lambdas/collectives.py
        ``sync_role`` numbers them), else K."""
        if self.replicas == 1 or self.sync[stage] in FUSED_SYNC:
            return 0
        k = self.aggregators[stage]
        blocks = self.blocks(stage)
        return k * (blocks + 1) if self.sync[stage] == "hierarchical" and blocks > 1 else k

    def blocks(self, stage: int) -> int:
        """B: the blocks of ``fan_in[stage]`` replicas stage ``stage``'s gradients are summed in."""
        return reduction_blocks(self.replicas, self.fan_in[stage])

    def peak_invocations(self) -> int:
        """The most Lambda invocations one iteration runs at once (limits.peak_invocations: the
        forward phase, or BackwardSync, whose stages' branches run in parallel)."""
        return peak_invocations(self.stages, self.replicas, [self.sync_tasks(s) for s in range(self.stages)])

    def function_timeout_s(self, stage: int) -> int:
        """The Lambda function's own timeout: the longest phase it runs, within Lambda's limit."""
        return min(LAMBDA_MAX_TIMEOUT_S, max(self.timeouts_s[stage].values()) + 5)

    # -- validation ----------------------------------------------------------------------------
    def validate(self, layers: int | None = None) -> None:
        """Raise PlanError naming what is wrong and how to fix it. ``layers``: the model's count.
        The checks run in this order, so a plan with several faults names the first of them."""
        self._check_balance(layers)
        self._check_batch()
        self._check_per_stage_lengths()
        self._check_sync()
        self._check_chunks()
        self._check_concurrency()  # after the per-stage settings sync_tasks reads
        self._check_memory()
        self._check_prediction()
        self._check_timeouts()

    def _check_balance(self, layers: int | None) -> None:
        """Every stage holds at least one layer, and (given the model's count) all layers are held."""
        if len(self.balance) == 0:
            raise PlanError("plan.balance is empty: give at least one stage, e.g. balance=[4]")
        bad = [b for b in self.balance if b < 1]
        if bad:
            raise PlanError(f"plan.balance={list(self.balance)}: every stage needs at least one layer")
        if layers is not None and sum(self.balance) != layers:
            raise PlanError(
                f"plan.balance={list(self.balance)} covers {sum(self.balance)} layers but the model has "
                f"{layers}: the balance must sum to the number of children of the nn.Sequential"
            )

    def _check_batch(self) -> None:
        """d, m and the global batch are positive integers, and the batch splits into d x m equal micro-batches."""
        for name in ("replicas", "micro_batches", "global_batch"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise PlanError(f"plan.{name}={v!r}: must be a positive integer")
        per = self.replicas * self.micro_batches
        if self.global_batch % per and hap.HAP_SYNC not in self.sync:  # HAP's unequal cut: planner/hap.py checks it
            raise PlanError(
                f"global batch {self.global_batch} is not divisible into {self.replicas} replicas x "
                f"{self.micro_batches} micro-batches: choose a global batch that is a multiple of {per}"
            )

    def _check_concurrency(self) -> None:
        """Every worker of a phase runs at once: one stage's Map, of its replicas or its sync shards,
        runs at most MAP_MAX_TASKS tasks at once (groups of child executions, planner/limits.py);
        the account's concurrency is checked before launch (deploy/start.py check_concurrency)."""
        if self.stages > INLINE_MAP_MAX_CONCURRENCY:  # the Checkpoint Map runs a task per stage
            raise PlanError(
                f"{self.stages} stages exceed the {INLINE_MAP_MAX_CONCURRENCY} tasks one inline Map runs at once: use fewer stages"
            )
        widest = max([self.replicas, *(self.sync_tasks(s) for s in range(self.stages))])
        if widest > MAP_MAX_TASKS:
            raise PlanError(
                f"{widest} workers in one stage's phase exceed the {MAP_MAX_TASKS} tasks a Map runs at once "
                f"({INLINE_MAP_MAX_CONCURRENCY} child executions of {GROUP_SIZE}): use fewer replicas"
            )

    def _check_per_stage_lengths(self) -> None:
        """The per-stage settings have one entry per stage (the checks after this one index them by stage)."""
        n = len(self.balance)
        for what, seq in (
            ("sync", self.sync),
            ("aggregators", self.aggregators),
            ("fan_in", self.fan_in),
            ("chunks", self.chunks),
            ("memory_mb", self.memory_mb),
            ("timeouts_s", self.timeouts_s),
        ):
            if len(seq) != n:
                raise PlanError(f"plan.{what} has {len(seq)} entries but the plan has {n} stages: give one per stage")

    def _check_sync(self) -> None:
        """Each stage's algorithm is one the runtime runs, with a K it admits (only k_reduce lets the user choose).
        The fan-in first: a hierarchical stage's default K follows from it."""
        self._check_fan_in()
        if self.hap_extra and hap.HAP_SYNC not in self.sync:
            raise PlanError(f"plan.hap_extra={self.hap_extra!r} is for sync {hap.HAP_SYNC!r} (FasDL's unequal partitioning): give 0")
        for s, algo in enumerate(self.sync):
            if algo == hap.HAP_SYNC:  # FasDL's HAP: opt-in by name, one stage only (planner/hap.py)
                problem = hap.plan_problem(self, s)
                if problem is not None:
                    raise PlanError(problem)
                continue
            if algo not in SYNC_ALGORITHMS:
                raise PlanError(f"plan.sync[{s}]={algo!r} is unknown: choose one of {', '.join(SYNC_ALGORITHMS)}")
            k, d = self.aggregators[s], self.replicas
            if not 1 <= k <= d:
                raise PlanError(f"plan.aggregators[{s}]={k}: K must be between 1 and the {d} replicas")
            want = _default_k(algo, d, self.fan_in[s])
            if algo not in CHOSEN_K and k != want:
                raise PlanError(
                    f"plan.aggregators[{s}]={k} does not fit sync {algo!r}, which uses K={want}: use sync 'k_reduce' "
                    "or 'hierarchical' to choose K yourself"
                )

    def _check_chunks(self) -> None:
        """Each stage's C is 0 (the size rule) or 1..MAX_CHUNKS; a stage of one replica exchanges
        nothing, so its shard is one object (0 or 1)."""
        for s, c in enumerate(self.chunks):
            if not 0 <= c <= MAX_CHUNKS:
                raise PlanError(
                    f"plan.chunks[{s}]={c}: give 1..{MAX_CHUNKS} chunks per shard, or 0 for the size rule (planner/plan.py chunk_count)"
                )
            if c > 1 and self.replicas == 1:
                raise PlanError(f"plan.chunks[{s}]={c} with 1 replica: nothing is exchanged, a shard is one object; give 0 or 1")
        if self.segments and any(any(p.chunks) for p in (self, *(seg for _, seg in self.segments))):
            raise PlanError(
                "plan.chunks with dynamic workers (segments): a change of d re-lays the shards by the size rule "
                "(sdk/dynamic.py), so every segment's chunks must be 0"
            )

    def _check_fan_in(self) -> None:
        """Each stage's fan-in is an aggregator's count of inputs: at least 2; a hierarchical stage's
        level-1 aggregators each read f gradients and form a chain of B = ceil(d / f) links, so
        neither may exceed MAX_FAN_IN."""
        for s, f in enumerate(self.fan_in):
            if f < 2:
                raise PlanError(
                    f"plan.fan_in[{s}]={f}: an aggregator sums at least 2 gradients; give 2..{MAX_FAN_IN} "
                    f"(the default {DEFAULT_FAN_IN} keeps up to {DEFAULT_FAN_IN} replicas in one block)"
                )
            if self.sync[s] != "hierarchical":
                continue
            blocks = self.blocks(s)
            if f > MAX_FAN_IN or blocks > MAX_FAN_IN:
                lo = -(-self.replicas // MAX_FAN_IN)
                raise PlanError(
                    f"plan.fan_in[{s}]={f} with {self.replicas} replicas gives level-1 aggregators of {min(f, self.replicas)} "
                    f"gradients in a chain of {blocks} links; at most {MAX_FAN_IN} of each: choose fan_in "
                    f"between {max(2, lo)} and {MAX_FAN_IN} (about sqrt(d) = {max(2, math.isqrt(self.replicas))} balances the two)"
                )

    def _check_memory(self) -> None:
        """Each stage's memory is a size Lambda accepts."""
        for s, mb in enumerate(self.memory_mb):
            if not LAMBDA_MIN_MB <= mb <= LAMBDA_MAX_MB:
                raise PlanError(f"plan.memory_mb[{s}]={mb}: Lambda memory must be {LAMBDA_MIN_MB}-{LAMBDA_MAX_MB} MB")

    def _check_prediction(self) -> None:
        """A predicted task that cannot fit Lambda's 15 minutes (with the safety factor) is refused before it runs."""
        if self.prediction is None:
            return
        for s, per_phase in enumerate(self.prediction.task_s):
            for p, secs in per_phase.items():
                if not fits_lambda_timeout(secs, TIMEOUT_SAFETY):
                    raise PlanError(timeout_refusal(s, p, secs, TIMEOUT_SAFETY, predicted=True))

    def _check_timeouts(self) -> None:
        """Each stage gives every phase, and only the phases, a TimeoutSeconds Lambda accepts."""
        for s, t in enumerate(self.timeouts_s):
            missing = [p for p in PHASES if p not in t]
            if missing:
                raise PlanError(f"plan.timeouts_s[{s}] lacks {missing}: give seconds for {list(PHASES)}")
            for p, v in t.items():
                if p not in PHASES:
                    raise PlanError(f"plan.timeouts_s[{s}] has unknown phase {p!r}: phases are {list(PHASES)}")
                if not isinstance(v, int) or not 1 <= v <= LAMBDA_MAX_TIMEOUT_S:
                    raise PlanError(
                        f"plan.timeouts_s[{s}][{p!r}]={v!r}: a Lambda task runs 1-{LAMBDA_MAX_TIMEOUT_S} s; "
                        "if a phase needs longer, use more stages, more replicas or smaller micro-batches"
                    )

    # -- (de)serialisation ---------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["balance"] = list(self.balance)
        d["sync"] = list(self.sync)
        d["aggregators"] = list(self.aggregators)
        d["memory_mb"] = list(self.memory_mb)
        d["timeouts_s"] = [dict(t) for t in self.timeouts_s]
        d["fan_in"] = list(self.fan_in)
        d["chunks"] = list(self.chunks)
        if not any(self.chunks):  # the size rule everywhere: the plan reads as it did before the field
            d.pop("chunks")
        d["prediction"] = None if self.prediction is None else self.prediction.to_dict()
        d.pop("segments")  # a fixed d's plan reads as it always did
        if self.phase_watchers:  # likewise a watched one
            d.pop("phase_watchers")
        if self.segments:
            d["segments"] = [[first, p.to_dict()] for first, p in self.segments]
        if self.lr_scale == 1.0:  # a plan without a learning-rate rule reads as it always did
            d.pop("lr_scale")
        if not self.hap_extra:  # likewise a plan that is not HAP's unequal partitioning
            d.pop("hap_extra")
        d["choices"] = list(self.choices)
        if not self.choices:  # likewise a plan without a replica policy
            d.pop("choices")
            d.pop("decided")
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Plan:
        if not isinstance(data, Mapping):
            raise PlanError(f"a plan must be a JSON object, got {type(data).__name__}")
        data = _upgrade(data)
        known = {
            "balance",
            "replicas",
            "micro_batches",
            "global_batch",
            "sync",
            "aggregators",
            "memory_mb",
            "timeouts_s",
            "prediction",
            "fan_in",
            "workflow",
            "phase_watchers",
            "segments",
            "lr_scale",
            "choices",
            "decided",
            "chunks",
            "hap_extra",
        }
        unknown = sorted(set(data) - known)
        if unknown:
            raise PlanError(f"plan has unknown fields {unknown}: known fields are {sorted(known)}")
        if "balance" not in data:
            raise PlanError("plan lacks 'balance' (layers per stage, e.g. [2, 2])")
        try:
            return cls(**dict(data))
        except TypeError as e:  # wrong types inside tuples etc.
            raise PlanError(f"malformed plan: {e}") from None

    @classmethod
    def from_json(cls, text: str) -> Plan:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise PlanError(f"plan is not valid JSON: {e}") from None
        return cls.from_dict(data)


def _upgrade(data: Mapping[str, Any]) -> Mapping[str, Any]:
    """A plan saved before predictions were typed kept them in a free-form ``extras`` object: read
    its predictions into a Prediction (they never changed what the runtime does)."""
    if "extras" not in data:
        return data
    out = {k: v for k, v in data.items() if k != "extras"}
    ex = data["extras"] or {}
    if isinstance(ex, Mapping) and "predicted_task_s" in ex:
        out["prediction"] = {
            "task_s": ex["predicted_task_s"],
            "s_per_iteration": ex.get("predicted_s_per_iteration", float("nan")),
            "usd_per_iteration": ex.get("predicted_usd_per_iteration", float("nan")),
            "phase_s": ex.get("predicted_phase_s", {}),
            "sync_algorithms": ex.get("sync_algorithms", []),
            "platform": ex.get("platform", ""),
            "planner_method": ex.get("planner_method", ""),
        }
    return out


def timeouts_from(task_s: Sequence[Mapping[str, float]], minimum: int = 60) -> tuple[dict[str, int], ...]:
    """Per stage and phase TimeoutSeconds from predicted or observed task seconds.

    Raises PlanError, through Plan validation, when a phase cannot fit Lambda's 15 minutes.
    """
    out = []
    for s, per_phase in enumerate(task_s):
        row = {}
        for p in PHASES:
            secs = float(per_phase.get(p, 0.0))
            if not fits_lambda_timeout(secs, TIMEOUT_SAFETY):
                raise PlanError(timeout_refusal(s, p, secs, TIMEOUT_SAFETY))
            row[p] = int(min(LAMBDA_MAX_TIMEOUT_S, max(minimum, math.ceil(secs * TIMEOUT_SAFETY + 10))))
        out.append(row)
    return tuple(out)


# Chunking of shards (docs/runtime.md "Sync algorithms"): a consumer waits for one chunk, not a
# whole shard, before it can reduce, update and pass it on. The exchange then trails the data by
# about one chunk; PIPELINE_CHUNKS chunk rounds over the d-1 peers keep that lag near 5%, and
# MIN_CHUNK_BYTES keeps each request large against S3's per-request latency and price.
PIPELINE_CHUNKS = 20
MIN_CHUNK_BYTES = 1 << 20
# The most chunks a plan may name per shard (Plan.chunks): the size rule never exceeds PIPELINE_CHUNKS.
MAX_CHUNKS = 64


def chunk_count(shard_numel: float, itemsize: int, replicas: int) -> int:
    """Chunks per gradient/parameter shard of a stage replicated ``replicas`` times."""
    if replicas <= 1:
        return 1
    want = math.ceil(PIPELINE_CHUNKS / (replicas - 1))
    most = max(1, int(shard_numel * itemsize // MIN_CHUNK_BYTES))
    return int(max(1, min(want, most)))


def stage_chunks(chosen: int, shard_numel: float, itemsize: int, replicas: int) -> int:
    """C, the chunks of a shard of ``shard_numel`` elements: the plan's ``chosen`` (Plan.chunks; never
    more than the shard's elements, so no chunk is empty), or the size rule ``chunk_count`` where it
    is 0. The runtime (core/training.py stage_layout) and the performance model both call this."""
    if replicas <= 1:
        return 1
    if chosen > 0:
        return int(max(1, min(chosen, int(shard_numel))))
    return chunk_count(shard_numel, itemsize, replicas)


# Warm state written through (docs/runtime.md "State that stays warm"): a warm shard whose stored
# parameters are at most this many bytes also goes to S3 at every version, while its container
# keeps it (and skips the download). Its write (Adam: three times these bytes, about 35 ms at
# Lambda's ~90 MB/s, overlapped with the update) costs less than one window restart, which a
# container recycled with state only in memory costs (its window's iterations since the last
# checkpoint, and seconds of restart): a recycled container then costs its task's re-run.
WRITE_THROUGH_BYTES = 1 << 20


def writes_through(shard_bytes: float) -> bool:
    """Whether a warm shard of ``shard_bytes`` stored parameter bytes is written every version."""
    return shard_bytes <= WRITE_THROUGH_BYTES


# A worker keeps the whole training set in memory when it is at most this share of its function's
# memory (one GET per shard, once per container); else it reads each micro-batch's samples by
# ranged GETs (lambdas/datafetch.py). The performance model charges the second case per micro-batch.
DATA_RESIDENT_SHARE = 1 / 8


def data_resident(data_bytes: float, memory_mb: int) -> bool:
    return data_bytes <= DATA_RESIDENT_SHARE * memory_mb * 2**20


def _default_k(algo: str, replicas: int, fan_in: int = DEFAULT_FAN_IN) -> int:
    """K implied by an algorithm: 1 for all-reduce, d otherwise (K-reduce defaults to d too);
    hierarchical's default is min(d, fan_in): a level-1 aggregator then downloads f/K = about one
    stage's gradient, as a replica uploads, and the roots are few (docs/performance-model.md §5)."""
    if algo == "hierarchical":
        return min(replicas, fan_in)
    return 1 if algo == "all_reduce" else replicas


def next_memory_tier(mb: int) -> int | None:
    """The next tier above ``mb``, or None at Lambda's maximum."""
    return next((t for t in MEMORY_TIERS_MB if t > mb), None)


def even_balance(layers: int, stages: int) -> tuple[int, ...]:
    """Split ``layers`` into ``stages`` contiguous groups as evenly as possible (earlier stages larger)."""
    if stages < 1 or stages > layers:
        raise PlanError(f"cannot split {layers} layers into {stages} stages: need 1 <= stages <= {layers}")
    q, r = divmod(layers, stages)
    return tuple(q + (1 if i < r else 0) for i in range(stages))


def _per_stage_ints(name: str, value: Any, n: int, default: int) -> tuple[int, ...]:
    """A per-stage setting given as nothing (``default`` everywhere), one int for every stage, or a list."""
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,) * n
    return _int_tuple(name, value) if value else (default,) * n


def _int_tuple(name: str, seq: Sequence[Any]) -> tuple[int, ...]:
    if isinstance(seq, (str, bytes)) or not hasattr(seq, "__iter__"):
        raise PlanError(f"plan.{name}={seq!r}: must be a list of integers")
    out = tuple(seq)
    for v in out:
        if not isinstance(v, int) or isinstance(v, bool):
            raise PlanError(f"plan.{name}={list(out)!r}: every entry must be an integer")
    return out


# -- one function per worker (docs/runtime.md "State that stays warm") --------------------------------
# With warm state and d > 1 every (stage, replica) worker and every (stage, shard) sync task has a
# Lambda function of its own: a function's invocations are then sequential, so Lambda serves them
# from one execution environment while it keeps it, and the state that worker owns (its shard's
# optimizer state) stays in that environment's memory. With d = 1 the stage's one function already is.
def per_worker_functions(plan: Plan, warm_state: bool) -> bool:
    """Whether the job gets one function per worker (else one per stage, shared by its replicas)."""
    return warm_state and plan.replicas > 1


def worker_function(stage_function: str, kind: str, index: int) -> str:
    """The function of a stage's worker: replica r of the forward and backward tasks (kind "r"),
    sync task k (kind "k"). Replica 0 runs on the stage's own function, so the stage's function
    name (the job state machine's remediation key) stays what it was."""
    if kind not in ("r", "k"):
        raise ValueError(f"kind is 'r' (replica) or 'k' (sync shard), not {kind!r}")
    return stage_function if kind == "r" and index == 0 else f"{stage_function}-{kind}{index}"


def watcher_function(stage0_function: str) -> str:
    """The function the phase watcher runs on (lambdas/watcher.py): a job's own, beside stage 0's.
    Not a worker's: an invocation beside a worker's task would take an execution environment the
    worker's warm state lives in, and the task would land in another and reload it."""
    return f"{stage0_function}-w"


def stage_functions(plan: Plan, stage: int, stage_function: str, per_worker: bool) -> list[str]:
    """Every function a stage's tasks run on: its own, and with one per worker, the replicas' and
    the sync tasks' (what deploy creates, the remediation raises and cleanup deletes); stage 0's
    also the phase watcher's, when the plan's phases are watched (limits.watchable)."""
    watcher = [watcher_function(stage_function)] if stage == 0 and plan_watchable(plan) else []
    if not per_worker:
        return [stage_function, *watcher]
    names = [worker_function(stage_function, "r", r) for r in range(plan.replicas)]
    return names + [worker_function(stage_function, "k", k) for k in range(plan.sync_tasks(stage))] + watcher


def plan_watchable(plan: Plan) -> bool:
    """Whether ``plan``'s phases run beside a phase watcher: asked for (``phase_watchers``) and
    possible (limits.watchable)."""
    return plan.phase_watchers and watchable(plan.replicas, [plan.sync_tasks(s) for s in range(plan.stages)])


def _segment_tuple(segments: Any) -> tuple[tuple[int, Plan], ...]:
    """``Plan.segments`` as (first iteration, Plan) pairs, from the pairs or from JSON's lists of
    [first, plan dict]; the schedule's own rules are planner/segments.py's."""
    out = []
    for item in segments or ():
        if not isinstance(item, Sequence) or len(item) != 2:
            raise PlanError(f"plan.segments: each is [first iteration, plan], got {item!r}")
        first, seg = item
        out.append((int(first), seg if isinstance(seg, Plan) else Plan.from_dict(seg)))
    return tuple(out)
