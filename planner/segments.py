"""Dynamic workers (issue 27): the data-parallel degree d changes at iteration boundaries.

A schedule ``{first iteration: d}`` becomes one Plan whose ``segments`` hold each segment's plan
(docs/runtime.md "Dynamic workers"). This first slice is exact by keeping everything the stored
state depends on fixed across segments: the stages, the global batch, and per stage K (how many
shards the parameters and the elementwise optimizer state are cut into, and how many sync tasks
update them), so a version written by one segment is read unchanged by the next; only the replicas
(and with them the micro-batch size) change. What would need the state re-cut (a changing K or
chunk layout), a policy callable, a growing global batch with a learning-rate rule, by-epoch keys,
and the planner's per-segment prediction are refused here, each named.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace

from stagecoach.planner.limits import GROUP_SIZE
from stagecoach.planner.plan import Plan, PlanError

# the sync algorithms a segment with d > 1 may use: K sync tasks that own K fixed shards
SCHEDULED_SYNC = ("k_reduce", "all_reduce")


def replica_schedule(schedule: object, iterations: int) -> list[tuple[int, int]]:
    """``schedule`` as sorted (first iteration, d) pairs, checked: a dict of int iteration keys,
    starting at 0, each below ``iterations``, to a positive int d. Refuses, by name, what this slice
    does not run yet."""
    if callable(schedule):
        raise PlanError(
            "replicas=<policy>: a worker-scaling policy called at window boundaries is not supported yet; "
            "pass a fixed schedule {first iteration: d}, e.g. {0: 1, 300: 2}"
        )
    if not isinstance(schedule, Mapping) or not schedule:
        raise PlanError(f"replicas={schedule!r}: give an int d, or a schedule {{first iteration: d}} such as {{0: 1, 300: 2}}")
    pairs: list[tuple[int, int]] = []
    for first, d in schedule.items():
        if isinstance(first, str):
            raise PlanError(f"replicas key {first!r}: by-epoch (or any non-iteration) keys are not supported yet; key by first iteration")
        if not isinstance(first, int) or isinstance(first, bool) or not 0 <= first < iterations:
            raise PlanError(f"replicas key {first!r}: must be an iteration in [0, {iterations})")
        if not isinstance(d, int) or isinstance(d, bool) or d < 1:
            raise PlanError(f"replicas[{first}]={d!r}: the data-parallel degree must be a positive int")
        pairs.append((first, d))
    pairs.sort()
    if pairs[0][0] != 0:
        raise PlanError(f"replicas schedule {dict(pairs)}: it must say d from iteration 0 (add a key 0)")
    return pairs


def scheduled_plan(schedule: object, iterations: int, make: Callable[[int], Plan]) -> Plan:
    """The plan of a replica schedule: ``make(d)`` builds each segment's plan; the result is the
    largest d's plan (whose functions serve every segment) with the segments attached. A schedule
    of one d is that d's plain plan."""
    pairs = replica_schedule(schedule, iterations)
    merged: list[tuple[int, int]] = []
    for first, d in pairs:  # a key that does not change d is no change point
        if not merged or merged[-1][1] != d:
            merged.append((first, d))
    if len(merged) == 1:
        return make(merged[0][1])
    plans = tuple((first, make(d)) for first, d in merged)
    top = max((p for _, p in plans), key=lambda p: p.replicas)
    combined = replace(top, segments=plans)
    check_segments(combined)
    return combined


def check_segments(plan: Plan) -> None:
    """Refuse a segmented plan whose segments would not read each other's stored state unchanged:
    a different stage split or global batch, a sync algorithm without fixed shards, a K that
    changes (the state would need re-cutting), or a segment whose phases run in groups."""
    if not plan.segments:
        return
    firsts = [first for first, _ in plan.segments]
    largest = max(seg.replicas for _, seg in plan.segments)
    if plan.replicas != largest:
        raise PlanError(
            f"plan.replicas={plan.replicas}: a plan with segments is the largest d's ({largest}), whose functions serve every segment"
        )
    if firsts[0] != 0 or firsts != sorted(set(firsts)):
        raise PlanError(f"plan.segments start at iterations {firsts}: they must start at 0 and increase")
    for first, seg in plan.segments:
        if seg.segments:
            raise PlanError(f"plan.segments[{first}] has segments of its own: a schedule is one level deep")
        if seg.balance != plan.balance or seg.global_batch != plan.global_batch:
            raise PlanError(
                f"segment at iteration {first}: balance {seg.balance} and global batch {seg.global_batch} must equal "
                f"the other segments' ({plan.balance}, {plan.global_batch}): only the replicas change (a growing batch is not supported yet)"
            )
        if seg.replicas > GROUP_SIZE:
            raise PlanError(
                f"segment at iteration {first}: d={seg.replicas} > {GROUP_SIZE} runs its phases in groups, "
                "not supported with a replica schedule yet"
            )
        _check_shards(plan, first, seg)


def _check_shards(plan: Plan, first: int, seg: Plan) -> None:
    """Every stage keeps its K: the stored parameters and optimizer state are cut the same way."""
    for s in range(seg.stages):
        if seg.replicas > 1 and seg.sync[s] not in SCHEDULED_SYNC:
            raise PlanError(
                f"segment at iteration {first}, stage {s}: sync {seg.sync[s]!r} cuts the state into d shards, which change with d; "
                f"with a replica schedule use sync='k_reduce' (or 'all_reduce'): re-cutting the shards is not supported yet"
            )
        ks = {p.grad_shards(s) for _, p in plan.segments}
        if len(ks) > 1:
            smallest = min(p.replicas for _, p in plan.segments)
            raise PlanError(
                f"stage {s}: K (its shards of parameters and optimizer state) would be {sorted(ks)} across the schedule; "
                f"it must stay fixed: aggregators <= the smallest d ({smallest}), e.g. aggregators={smallest} "
                "(re-cutting the shards when K changes is not supported yet)"
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
