"""Dynamic workers (issue 27): the data-parallel degree d changes at iteration boundaries.

A schedule ``{first iteration: d}`` becomes one Plan whose ``segments`` hold each segment's plan
(docs/runtime.md "Dynamic workers"). The stages stay fixed across segments; per stage K (how many
shards the parameters and the elementwise optimizer state are cut into, and how many sync tasks
update them) and the chunks may change with d: every version is stored in one layout that serves
every segment, the common refinement of their chunks (core/stored_layout.py), each iteration's
shard a run of whole stored chunks, so a version written by one segment is read by the next
unchanged and its optimizer state is each stored chunk's own (nothing is re-cut; an elementwise
update does not depend on the cut). The replicas change, and with them the micro-batch size, and
optionally the global batch (``global_batch={first iteration: G}``, the data order continuing:
core/training.py batch_position) with a learning-rate multiplier (``lr_scale={first iteration:
factor}``, cumulative, each segment's ``Plan.lr_scale``): Hydrozoa's AdaBatch policy. Refused
here, each named: a sync algorithm outside ``SCHEDULED_SYNC`` (the fused ones keep state in their
containers, the hierarchical chain is not covered by a test), a different stage split, and
segments past GROUP_SIZE replicas; a by-epoch schedule (sdk/dynamic.py by_epoch) reaches here
already keyed by iteration. A schedule is predicted segment by
segment (sdk/dynamic.py, sdk/cost.py predict_schedule), with the joined window's own states below.
A policy (``ReplicaPolicy``) declares its choices of d; its plan is the largest choice's with
``choices``, each choice checked as a segment is (``policy_plan``), its decisions applied at run
time (``decided_plan``: lambdas/policy.py records them); its choices share the largest's K
(``POLICY_SYNC``), their chunks may differ.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from stagecoach.planner.limits import GROUP_SIZE
from stagecoach.planner.plan import Plan, PlanError

# the sync algorithms a segment with d > 1 may use: backward writes K shards, K sync tasks reduce
# and update them from S3 (lambdas/collectives.py reduce_shard), K = that segment's (scatter_reduce: d)
SCHEDULED_SYNC = ("k_reduce", "all_reduce", "scatter_reduce")
# a policy's choices are the largest choice's plan at each d (choice_plan): the same K, so not scatter_reduce
POLICY_SYNC = ("k_reduce", "all_reduce")
# State transitions of the joined window (planner/emit/segments.py) beyond its segments' own, in a
# fault-free run: every window enters Start (a Choice) and its first segment's Enter_s{j} (a Pass);
# an iteration that leaves its segment inside a window enters Segment (a Choice), Switch_s{j} (a
# Pass) and that segment's Go? once more (the gate ran once). A change at a window boundary adds
# nothing: the next window enters its segment through Start.
TRANSITIONS_SEGMENT_ENTRY = 2
TRANSITIONS_SEGMENT_SWITCH = 3


@dataclass(frozen=True)
class PolicyMetrics:
    """What a replica policy sees at a window's first iteration: the run so far. ``iteration``: the
    window's first (the next to run); ``epoch``: its epoch; ``replicas``: the d the iteration
    before it ran (None at iteration 0); ``losses``: each iteration's loss so far (the global
    batch's mean, as Run.losses() reads it; NaN where a replica's was not finite)."""

    iteration: int
    epoch: int
    replicas: int | None
    losses: tuple[float, ...]


@dataclass(frozen=True)
class ReplicaPolicy:
    """A worker-scaling policy (Hydrozoa's, seed 002 §3.5): ``choose(metrics)`` returns the next
    window's d, one of ``choices``. The gate calls it in the cloud, on the job's stage-0 function
    with the job's role, at each window's first iteration (docs/runtime.md "Dynamic workers");
    declaring the choices up front lets every one's functions and window graph exist, and be
    checked, before anything is deployed. It must be a deterministic function of ``metrics``: a
    window that restarts, or a resumed job, reuses the recorded decision instead of calling it."""

    choose: Callable[[PolicyMetrics], int]
    choices: tuple[int, ...]

    def __post_init__(self) -> None:
        if not callable(self.choose):
            raise PlanError(f"ReplicaPolicy(choose={self.choose!r}): choose must be a function of the run's metrics returning d")
        choices = tuple(self.choices) if isinstance(self.choices, (list, tuple)) else ()
        if not choices or any(not isinstance(d, int) or isinstance(d, bool) or d < 1 for d in choices) or len(set(choices)) < len(choices):
            raise PlanError(f"ReplicaPolicy(choices={self.choices!r}): give the distinct d values it may choose, e.g. (1, 2, 4)")
        object.__setattr__(self, "choices", tuple(sorted(choices)))

    def __repr__(self) -> str:
        return f"ReplicaPolicy(choose={getattr(self.choose, '__name__', self.choose)!r}, choices={self.choices})"


def choice_plan(plan: Plan, d: int) -> Plan:
    """A policy plan's plan at d (one of ``plan.choices``): the largest d's plan with d replicas,
    so the same stages, K, micro-batches, global batch, memory and timeouts."""
    return replace(plan, replicas=d, choices=(), decided=0, segments=(), prediction=None)


def policy_plan(policy: ReplicaPolicy, make: Callable[[int], Plan]) -> Plan:
    """The plan of ``replicas=policy``: the largest choice's plan (``make(d)``), its ``choices``
    the policy's; every choice's plan checked as a schedule's segments are (the same K, a sync
    with fixed shards, no phases in groups) before anything is deployed."""
    top = replace(make(max(policy.choices)), choices=policy.choices, decided=0, segments=())
    for s in range(top.stages):
        if top.sync[s] not in POLICY_SYNC:
            raise PlanError(
                f"replica policy choosing from {list(policy.choices)}, stage {s}: sync {top.sync[s]!r} is not supported with a policy, "
                "whose choices share the largest choice's K (re-cutting the shards between choices is not supported); use sync='k_reduce' "
                "(or 'all_reduce'), or a fixed schedule "
                "(replicas={first iteration: d}), whose segments may each use their own K"
            )
    plans = []
    for d in policy.choices:
        try:
            plans.append(choice_plan(top, d))
        except PlanError as e:
            raise PlanError(
                f"replica policy choice d={d}: {e} (every choice runs the largest's stages and K: aggregators <= the smallest choice, "
                f"e.g. aggregators={min(policy.choices)})"
            ) from None
    check_segments(replace(top, segments=tuple(enumerate(plans))), "replica policy choice #")
    return top


def decided_plan(plan: Plan, decisions: Sequence[tuple[int, int, int]]) -> Plan:
    """A policy ``plan`` with its ``decisions`` ((first, end, d) per window, in order) as segments
    (consecutive equal d merged) and ``decided`` their end: every reader that takes the plan of
    iteration t (Plan.plan_at) reads the d the policy chose for it."""
    segs: list[tuple[int, Plan]] = []
    for first, _, d in decisions:
        if not segs or segs[-1][1].replicas != d:
            segs.append((first, choice_plan(plan, d)))
    return replace(plan, segments=tuple(segs), decided=max((end for _, end, _ in decisions), default=0))


def replica_schedule(
    schedule: object, iterations: int, what: str = "replicas", value: str = "data-parallel degree"
) -> list[tuple[int, int]]:
    """``schedule`` as sorted (first iteration, d) pairs, checked: a dict of int iteration keys,
    starting at 0, each below ``iterations``, to a positive int d. Refuses, by name, what this slice
    does not run yet."""
    if isinstance(schedule, ReplicaPolicy):
        raise PlanError(f"replicas={schedule!r}: a replica policy is no fixed schedule: build its plan with policy_plan")
    if callable(schedule):
        raise PlanError(
            "replicas=<function>: a worker-scaling policy must declare the d values it may choose, so every one's "
            "functions exist before its window starts: replicas=ReplicaPolicy(choose=<function>, choices=(1, 2, 4)) "
            "(stagecoach.dynamic.ReplicaPolicy)"
        )
    if type(schedule).__name__ == "ByEpoch":  # sdk/dynamic.py by_epoch: needs the job's data order
        raise PlanError(
            f"{what}=by_epoch(...): an epoch's first iteration depends on the job's training set and batch; "
            "pass it to Job.run, or key it by iteration first: stagecoach.dynamic.iteration_keys(job, {...})"
        )
    if not isinstance(schedule, Mapping) or not schedule:
        raise PlanError(f"replicas={schedule!r}: give an int d, or a schedule {{first iteration: d}} such as {{0: 1, 300: 2}}")
    pairs: list[tuple[int, int]] = []
    for first, d in schedule.items():
        if isinstance(first, str):
            raise PlanError(
                f"{what} key {first!r}: by-epoch (or any non-iteration) keys are not keys: key by first iteration, "
                "or by epoch with stagecoach.dynamic.by_epoch({epoch: value}) (Job.run converts it)"
            )
        if not isinstance(first, int) or isinstance(first, bool) or not 0 <= first < iterations:
            raise PlanError(f"{what} key {first!r}: must be an iteration in [0, {iterations})")
        if not isinstance(d, int) or isinstance(d, bool) or d < 1:
            raise PlanError(f"{what}[{first}]={d!r}: the {value} must be a positive int")
        pairs.append((first, d))
    pairs.sort()
    if pairs[0][0] != 0:
        raise PlanError(f"{what} schedule {dict(pairs)}: it must say the {value} from iteration 0 (add a key 0)")
    return pairs


def batch_schedule(schedule: object, iterations: int, what: str = "global_batch") -> list[tuple[int, int]]:
    """A growing global batch ``{first iteration: G}`` as sorted pairs, checked as a replica
    schedule is (key 0 required, iteration keys, positive int values)."""
    if not isinstance(schedule, Mapping) or not schedule:
        raise PlanError(f"{what}={schedule!r}: give a schedule {{first iteration: global batch}} such as {{0: 16, 300: 32}}")
    return replica_schedule(dict(schedule), iterations, what=what, value="global batch")


def lr_schedule(schedule: object, iterations: int) -> list[tuple[int, float]]:
    """``lr_scale={first iteration: factor}`` as sorted pairs: at each key every parameter group's
    learning rate is multiplied by the factor (cumulatively: {4: 0.75, 8: 0.75} is 0.75 from 4 and
    0.5625 from 8), as AdaBatch and Hydrozoa decay it when the batch doubles."""
    if callable(schedule) or not isinstance(schedule, Mapping):
        raise PlanError(f"lr_scale={schedule!r}: give a schedule {{first iteration: factor}} such as {{300: 0.75}}")
    pairs: list[tuple[int, float]] = []
    for first, f in schedule.items():
        if not isinstance(first, int) or isinstance(first, bool) or not 0 <= first < iterations:
            raise PlanError(f"lr_scale key {first!r}: must be an iteration in [0, {iterations}) (by epoch: stagecoach.dynamic.by_epoch)")
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f < float("inf"):
            raise PlanError(f"lr_scale[{first}]={f!r}: a positive, finite factor, e.g. 0.75")
        pairs.append((first, float(f)))
    return sorted(pairs)


def _value_at(pairs: Sequence[tuple[int, Any]], t: int) -> Any:
    return [v for first, v in pairs if first <= t][-1]


def scheduled_plan(
    schedule: object,
    iterations: int,
    make: Callable[[int], Plan],
    global_batch: object = None,
    lr_scale: object = None,
) -> Plan:
    """The plan of a replica schedule: ``make(d)`` builds each segment's plan; ``global_batch``
    ({first iteration: G}) and ``lr_scale`` ({first iteration: factor}, cumulative) change its global
    batch and learning-rate multiplier. The result is the largest d's plan (whose functions serve
    every segment) with the segments attached; a schedule that never changes is one plain plan."""
    pairs = replica_schedule(schedule, iterations)
    batches = batch_schedule(global_batch, iterations) if global_batch is not None else []
    scales = lr_schedule(lr_scale, iterations) if lr_scale is not None else []
    merged: list[tuple[int, tuple[int, int | None, float]]] = []
    factor = 1.0
    for first in sorted({f for f, _ in pairs} | {f for f, _ in batches} | {f for f, _ in scales}):
        factor *= dict(scales).get(first, 1.0)  # in key order: the runtime and the reference multiply alike
        key = (_value_at(pairs, first), _value_at(batches, first) if batches else None, factor)
        if not merged or merged[-1][1] != key:  # a key that changes nothing is no change point
            merged.append((first, key))
    plans = tuple((first, _segment_plan(make, d, g, f)) for first, (d, g, f) in merged)
    if len(plans) == 1:
        return plans[0][1]
    top = max((p for _, p in plans), key=lambda p: (p.replicas, p.micro_batch_size))
    combined = replace(top, segments=plans, lr_scale=1.0)
    check_segments(combined)
    return combined


def _segment_plan(make: Callable[[int], Plan], d: int, global_batch: int | None, factor: float) -> Plan:
    plan = make(d)
    if global_batch is None and factor == 1.0:
        return plan
    return replace(plan, global_batch=plan.global_batch if global_batch is None else global_batch, lr_scale=factor)


def check_segments(plan: Plan, what: str = "segment at iteration") -> None:
    """Refuse a segmented plan whose segments would not read each other's stored state unchanged:
    a different stage split, a sync algorithm outside ``SCHEDULED_SYNC``, or a segment whose
    phases run in groups (a K or chunk layout that changes is stored in the common refinement:
    core/stored_layout.py). A policy plan's segments are its decisions so far (``decided_plan``),
    its largest d its largest choice."""
    if not plan.segments:
        return
    firsts = [first for first, _ in plan.segments]
    largest = max(plan.choices or [seg.replicas for _, seg in plan.segments])
    if plan.replicas != largest:
        raise PlanError(
            f"plan.replicas={plan.replicas}: a plan with segments is the largest d's ({largest}), whose functions serve every segment"
        )
    if plan.lr_scale != 1.0:
        raise PlanError(
            f"plan.lr_scale={plan.lr_scale}: a plan with segments carries each segment's lr_scale; leave the top-level one at 1.0"
        )
    if firsts[0] != 0 or firsts != sorted(set(firsts)):
        raise PlanError(f"plan.segments start at iterations {firsts}: they must start at 0 and increase")
    for first, seg in plan.segments:
        if seg.segments:
            raise PlanError(f"plan.segments[{first}] has segments of its own: a schedule is one level deep")
        if seg.balance != plan.balance:
            raise PlanError(
                f"{what} {first}: balance {seg.balance} must equal the other segments' ({plan.balance}): "
                "the stages stay fixed across a schedule (changing them is not supported yet)"
            )
        if seg.replicas > GROUP_SIZE:
            raise PlanError(
                f"{what} {first}: d={seg.replicas} > {GROUP_SIZE} runs its phases in groups, not supported with a replica schedule yet"
            )
        _check_shards(plan, first, seg, what)


def _check_shards(plan: Plan, first: int, seg: Plan, what: str) -> None:
    """Every stage's sync reduces K shards from S3, K the segment's own (a K that changes is served
    by the stored layout, core/stored_layout.py); a policy's choices share one K (``choice_plan``)."""
    for s in range(seg.stages):
        if seg.replicas > 1 and seg.sync[s] not in SCHEDULED_SYNC:
            raise PlanError(
                f"{what} {first}, stage {s}: sync {seg.sync[s]!r} is not supported with a replica schedule yet "
                "(the fused algorithms keep state in their containers; the hierarchical chain is not covered by a test): "
                "use sync='k_reduce', 'scatter_reduce' or 'all_reduce'"
            )
        ks = {p.grad_shards(s) for _, p in plan.segments if p.replicas > 1}
        if plan.choices and len(ks) > 1:
            smallest = min(plan.choices)
            raise PlanError(
                f"stage {s}: K would be {sorted(ks)} across the replica policy's choices; a policy's choices share the largest "
                f"choice's K: aggregators <= the smallest choice ({smallest}), e.g. aggregators={smallest}"
            )


def segment_bounds(plan: Plan, iterations: int) -> list[tuple[int, int, Plan]]:
    """[first, end) and the plan of each segment that starts before ``iterations``."""
    segs = plan.segments or ((0, plan),)
    out = []
    for i, (first, seg) in enumerate(segs):
        end = segs[i + 1][0] if i + 1 < len(segs) else iterations
        if first < iterations:
            out.append((first, min(end, iterations), plan.plan_at(first) if plan.segments else seg))
    return out
