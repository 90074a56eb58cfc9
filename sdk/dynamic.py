"""Dynamic workers on the SDK's side (issue 27 item 1, docs/runtime.md "Dynamic workers"): a
replica schedule ``Job.run(replicas={0: 1, 300: 2})`` as one plan with segments
(planner/segments.py), and what a job must be for it to run exactly today.

A growing global batch with a learning-rate rule (``global_batch=``, ``lr_scale=``: Hydrozoa's
AdaBatch policy) runs too; with it ``Job(epochs=)`` is refused (an epoch is no fixed number of
iterations), and so is a learning-rate scheduler (its steps and the multiplier are not composed yet).

Keyed by epoch (``by_epoch``), a schedule is converted to the iteration keys it names before
anything else (``iteration_keys``). A policy (``ReplicaPolicy``, planner/segments.py) is the
largest choice's plan with ``Plan.choices``; the gate calls it in the cloud at each window's first
iteration and records its decisions (lambdas/policy.py, core/decisions.py).

Refused up front, with the fix: warm state (a new replica or a shrinking d would need the state a
container holds), evaluation (its Map's replicas belong to one segment), Express or "auto" windows
(a window's length is priced from one iteration's prediction), deferred batch norm (not covered by a
test yet). A stage whose K or chunk layout changes with d is stored in the common refinement of
every segment's chunks (core/stored_layout.py), so nothing is re-cut.

Predicted (``predict_schedule``; the cost: Job.predict_cost, sdk/cost.py predict_schedule): each
segment as an ordinary plan for its iterations, summed, in joined windows (docs/runtime.md
"Dynamic workers").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from stagecoach.core import stored_layout
from stagecoach.core.training import epoch_of, master_dtype, ownership
from stagecoach.planner.model.perfmodel import Config, Estimate, evaluate
from stagecoach.planner.model.platforms import Platform
from stagecoach.planner.plan import Plan, PlanError
from stagecoach.planner.profile.layers import ModelProfile
from stagecoach.planner.segments import PolicyMetrics as PolicyMetrics  # re-exported: how to write a policy
from stagecoach.planner.segments import ReplicaPolicy as ReplicaPolicy
from stagecoach.planner.segments import (
    batch_schedule,
    check_segments,
    policy_plan,
    replica_schedule,
    scheduled_plan,
    segment_bounds,
)

if TYPE_CHECKING:
    from stagecoach.job import Job


@dataclass(frozen=True)
class ByEpoch:
    """A schedule keyed by epoch, ``by_epoch({0: 1, 2: 2})``: Job.run converts it to iteration keys
    (``iteration_keys``) from the job's training set and batch schedule."""

    schedule: Mapping[int, Any]


def by_epoch(schedule: Mapping[int, Any]) -> ByEpoch:
    """A ``replicas``, ``global_batch`` or ``lr_scale`` schedule keyed by epoch instead of by first
    iteration, as Hydrozoa applies its policy at epoch boundaries: ``job.run(stages=2,
    replicas=by_epoch({0: 1, 2: 2, 4: 4}))`` changes d where epochs 2 and 4 start, the first iteration
    whose batch the data order takes from that epoch's permutation (core/training.py batch_position;
    with a fixed batch, epoch e starts at e * (samples // global batch)). A wrapper, not bare keys:
    an int key is an iteration everywhere else, so an epoch key must say so."""
    if not isinstance(schedule, Mapping) or not schedule:
        raise PlanError(f"by_epoch({schedule!r}): give a dict {{first epoch: value}} such as {{0: 1, 2: 2}}")
    return ByEpoch(dict(schedule))


def is_schedule(replicas: object) -> bool:
    """Whether ``replicas`` asks for dynamic workers (a dict, an epoch schedule, a ReplicaPolicy; a
    bare function is refused, naming ReplicaPolicy)."""
    return isinstance(replicas, (Mapping, ByEpoch, ReplicaPolicy)) or callable(replicas)


def wants_schedule(manual: Mapping[str, Any]) -> bool:
    """Whether ``Job.run``'s settings ask for a schedule: of replicas, of the global batch, or of
    the learning rate (``global_batch=``, ``lr_scale=``: a growing batch, Hydrozoa's AdaBatch)."""
    return is_schedule(manual.get("replicas")) or manual.get("global_batch") is not None or manual.get("lr_scale") is not None


def adabatch(replicas: Mapping[int, int] | ByEpoch, global_batch: int, decay: float = 0.75) -> dict[str, Any]:
    """Hydrozoa's evaluated policy (seed 002 §4.3, adapting AdaBatch; Smith et al. 2018) as
    ``Job.run`` settings: the global batch grows with d (``global_batch`` at the first d, each
    replica keeping its share) and at each change the learning rate is multiplied by ``decay`` per
    doubling (Hydrozoa: 0.75 where AdaBatch decays a fixed batch's by 0.375). E.g.
    ``job.run(stages=2, **adabatch({0: 1, 300: 2, 600: 4}, job.global_batch))``. A change that is
    not a doubling, halving or power of two thereof is refused: give ``lr_scale`` yourself. With
    ``by_epoch({0: 1, 2: 2})`` every schedule it returns is keyed by epoch as well."""
    if isinstance(replicas, ByEpoch):  # the same rule keyed by epoch: each of the three schedules by_epoch
        out = adabatch(replicas.schedule, global_batch, decay)
        return {name: by_epoch(value) if value else value for name, value in out.items()}
    pairs = sorted(replicas.items())
    if not pairs or pairs[0][0] != 0:
        raise PlanError(f"adabatch({dict(pairs)}): the schedule must say d from iteration 0 (add a key 0)")
    d0 = pairs[0][1]
    batches, scales = {}, {}
    for i, (first, d) in enumerate(pairs):
        if (global_batch * d) % d0:
            raise PlanError(f"adabatch: d={d} at iteration {first} gives a global batch of {global_batch * d / d0}: not a whole number")
        batches[first] = global_batch * d // d0
        if i and d != pairs[i - 1][1]:
            ratio = max(d, pairs[i - 1][1]) // min(d, pairs[i - 1][1])
            steps = ratio.bit_length() - 1
            if ratio * min(d, pairs[i - 1][1]) != max(d, pairs[i - 1][1]) or ratio != 1 << steps:
                raise PlanError(f"adabatch: d {pairs[i - 1][1]} -> {d} at iteration {first} is no power of two: give lr_scale yourself")
            scales[first] = decay**steps if d > pairs[i - 1][1] else 1.0 / decay**steps
    return {"replicas": dict(pairs), "global_batch": batches, "lr_scale": scales}


_KEYED = ("replicas", "global_batch", "lr_scale")


def iteration_keys(job: Job, manual: Mapping[str, Any]) -> dict[str, Any]:
    """``manual`` with every ``by_epoch`` schedule keyed by first iteration instead: epoch e starts
    at the first iteration whose batch the data order takes from epoch e's permutation, by the
    job's training set and its batch schedule (a by-epoch ``global_batch`` converted first, key by
    key, each size placed where the sizes before it end an epoch). The result runs as the
    iteration-keyed schedule it names; an epoch that starts at or after the job's last iteration
    is refused, not dropped."""
    out = dict(manual)
    if not any(isinstance(out.get(name), ByEpoch) for name in _KEYED):
        return out
    n = len(job.samples)
    batches = out.get("global_batch")
    if isinstance(batches, ByEpoch):
        batches = out["global_batch"] = _batches_by_epoch(batches, n, job.iterations)
    sizes = batch_schedule(batches, job.iterations) if batches is not None else [(0, job.global_batch)]
    starts = epoch_starts(n, sizes, job.iterations)
    for name in ("replicas", "lr_scale"):
        value = out.get(name)
        if isinstance(value, ByEpoch):
            out[name] = {_epoch_start(starts, e, name, job.iterations): v for e, v in _epoch_items(value, name)}
    return out


def epoch_starts(n_samples: int, sizes: Sequence[tuple[int, int]], iterations: int) -> list[int]:
    """The first iteration of each epoch that starts before ``iterations`` (index: the epoch),
    under the batch schedule ``sizes`` (core/training.py epoch_of, the rule the workers use)."""
    starts: list[int] = []
    for t in range(iterations):
        if epoch_of(t, n_samples, sizes[0][1], list(sizes)) == len(starts):
            starts.append(t)
    return starts


def _epoch_items(schedule: ByEpoch, name: str) -> list[tuple[int, Any]]:
    items = sorted(schedule.schedule.items(), key=lambda kv: (not isinstance(kv[0], int), kv[0]))
    for e, _ in items:
        if not isinstance(e, int) or isinstance(e, bool) or e < 0:
            raise PlanError(f"{name}=by_epoch(...) key {e!r}: must be an epoch, an int >= 0")
    return items


def _epoch_start(starts: list[int], epoch: int, name: str, iterations: int) -> int:
    if epoch >= len(starts):
        raise PlanError(
            f"{name}=by_epoch(...) key {epoch}: epoch {epoch} starts at or after the job's last iteration "
            f"({iterations} iterations are {len(starts)} epochs or parts of one): drop the key or train longer"
        )
    return starts[epoch]


def _batches_by_epoch(schedule: ByEpoch, n: int, iterations: int) -> dict[int, int]:
    """A by-epoch global batch as {first iteration: G}: each size from where the sizes before it
    start its epoch (a size changed there starts at the epoch's first sample: batch_position)."""
    sizes: list[tuple[int, int]] = []
    for e, g in _epoch_items(schedule, "global_batch"):
        if isinstance(g, bool) or not isinstance(g, int) or not 0 < g <= n:
            raise PlanError(f"global_batch=by_epoch(...)[{e}]={g!r}: a global batch in [1, {n}] (the training set's size)")
        if not sizes and e != 0:
            raise PlanError(f"global_batch=by_epoch({dict(schedule.schedule)}): it must say the global batch from epoch 0 (add a key 0)")
        sizes.append((_epoch_start(epoch_starts(n, sizes, iterations), e, "global_batch", iterations) if sizes else 0, g))
    return dict(sizes)


def manual_scheduled_plan(job: Job, manual: Mapping[str, Any], make: Callable[..., Plan]) -> Plan:
    """The plan of ``Job.run(replicas={first iteration: d}, global_batch={first iteration: G},
    lr_scale={first iteration: factor}, ...)``: each segment a manual plan (``make``:
    Job.manual_plan) with the same settings but d (and G, and its cumulative learning-rate
    factor), each stage's sync K-reduce with K the smallest d unless given (a K that changes is
    stored in the common refinement: core/stored_layout.py; sync='scatter_reduce' runs K = d). An int ``replicas`` is {0: d}; ``global_batch`` must start at the job's.
    A ``by_epoch`` schedule is first keyed by iteration (``iteration_keys``)."""
    manual = iteration_keys(job, manual)
    replicas = manual.get("replicas", 1)
    if isinstance(replicas, ReplicaPolicy):
        return _manual_policy_plan(manual, replicas, make)
    pairs = replica_schedule({0: replicas} if isinstance(replicas, int) else replicas, job.iterations)
    batches = manual.get("global_batch")
    if batches is not None:
        sizes = batch_schedule(batches, job.iterations)
        if sizes[0][1] != job.global_batch:
            raise PlanError(
                f"global_batch={dict(sizes)} starts at {sizes[0][1]}, the job's global batch is {job.global_batch}: "
                f"give Job(global_batch={sizes[0][1]}) or start the schedule at {{0: {job.global_batch}}}"
            )
    smallest = min(d for _, d in pairs)
    rest = {k: v for k, v in manual.items() if k not in ("replicas", "global_batch", "lr_scale")}
    rest.setdefault("sync", "k_reduce")
    rest["sync"] = rest["sync"] or "k_reduce"
    if rest["sync"] == "k_reduce":  # another algorithm's K is its own, per segment (core/stored_layout.py)
        rest["aggregators"] = rest.get("aggregators") or smallest
    return scheduled_plan(
        dict(pairs), job.iterations, lambda d: make(**rest, replicas=d), global_batch=batches, lr_scale=manual.get("lr_scale")
    )


def _manual_policy_plan(manual: Mapping[str, Any], policy: ReplicaPolicy, make: Callable[..., Plan]) -> Plan:
    """The plan of ``Job.run(replicas=ReplicaPolicy(...))``: its largest choice's manual plan,
    K-reduce with K the smallest choice unless given, every choice checked (planner/segments.py
    policy_plan). A growing batch or a learning-rate rule with it is refused: the policy picks d
    only, the global batch stays the job's."""
    for name in ("global_batch", "lr_scale"):
        if manual.get(name) is not None:
            raise PlanError(
                f"replicas={policy!r} with {name}=: a policy chooses d with a fixed global batch; "
                "a growing batch or a learning-rate rule with a policy is not supported yet: leave it out, or give a fixed schedule"
            )
    rest = {k: v for k, v in manual.items() if k != "replicas"}
    rest["sync"] = rest.get("sync") or "k_reduce"
    if rest["sync"] == "k_reduce":
        rest["aggregators"] = rest.get("aggregators") or min(policy.choices)
    return policy_plan(policy, lambda d: make(**rest, replicas=d))


def check_scheduled(job: Job, plan: Plan) -> None:
    """Refuse a job that a segmented ``plan`` would not train exactly, naming cause and fix."""
    if plan.lr_scale != 1.0 and not plan.segments:
        raise PlanError(
            f"plan.lr_scale={plan.lr_scale}: a learning-rate multiplier belongs to a schedule's segments (Plan.segments); "
            "for one rate throughout set it in the optimizer factory (lr=...)"
        )
    if plan.choices:
        _check_policy(job, plan)
    if not plan.segments and not plan.choices:
        return
    check_segments(plan)
    growing = len(plan.batch_sizes()) > 1
    scaled = any(seg.lr_scale != 1.0 for _, seg in plan.segments)
    refusals = [
        (job.warm_state, "warm state (Job(warm_state=True)) is not supported yet: set Job(warm_state=False)"),
        (bool(job.eval_versions()), "evaluation is not supported yet: leave Job(evaluation=...) out"),
        ((plan.workflow or job.workflow) != "standard", "Express and 'auto' windows are not supported yet: use workflow='standard'"),
        (job.deferred_batch_norm, "deferred batch norm is not supported yet: leave Job(deferred_batch_norm=...) off"),
        (
            growing and job.epochs is not None,
            "with a growing global batch an epoch is not a fixed number of iterations: give Job(iterations=...) instead of epochs=",
        ),
        (
            scaled and job.scheduler is not None,
            "a learning-rate multiplier (lr_scale) with a learning-rate scheduler is not supported yet: leave one of them out",
        ),
    ]
    for refused, why in refusals:
        if refused:
            raise PlanError(f"a replica schedule ({_schedule_text(plan)}): {why}")
    n = len(job.samples)
    for first, size in plan.batch_sizes():
        if size > n:
            raise PlanError(f"global batch {size} from iteration {first} is larger than the training set ({n} samples): use a smaller one")
    _check_layouts(job, plan)


def _check_policy(job: Job, plan: Plan) -> None:
    """A replica policy's plan, before anything is deployed: no decisions yet (they are the run's)."""
    if plan.segments or plan.decided:
        raise PlanError(
            f"plan.choices={list(plan.choices)} with segments or decided={plan.decided}: a replica policy's decisions are made "
            "by its run (jobs/{job}/policy/decisions.json); start it from a plan without them"
        )


def _schedule_text(plan: Plan) -> str:
    if plan.choices and not plan.segments:
        return f"a replica policy choosing d from {list(plan.choices)}"
    return ", ".join(f"d={seg.replicas} from iteration {first}" for first, seg in plan.segments)


def _check_layouts(job: Job, plan: Plan) -> None:
    """Every stage has a stored layout that serves all segments (core/stored_layout.py): where K or
    the chunks change with d, the stored chunks are the common refinement of every segment's, so a
    version written by one segment is read by the next unchanged; refused only where a segment has
    an empty shard (more shards than elements) and the layouts differ."""
    master = job.build_model(master_dtype(job.dtype))
    own = ownership(list(master), [plan.stage_layers(s) for s in range(plan.stages)])
    itemsize = torch.empty(0, dtype=master_dtype(job.dtype)).element_size()
    try:
        stored_layout.check(plan, [sum(p.numel() for p in own.owned[s]) for s in range(plan.stages)], itemsize)
    except PlanError as e:
        raise PlanError(f"a replica schedule ({_schedule_text(plan)}): {e}") from None


# what the performance model evaluates a segment's plan from (Job._model_of for one platform)
ModelOf = Callable[[Plan], tuple[ModelProfile, Config, Platform]]


@dataclass(frozen=True)
class ScheduleSegment:
    """One segment of a replica schedule as the performance model predicts it
    (``Job.predict_schedule``): from iteration ``first``, ``iterations`` of them at d
    ``replicas``, the global batch and each replica's micro-batch size there, the estimate of one
    of its iterations, and ``cold_s``: what its first iteration adds while Lambda scales the
    functions to the new workers (Estimate.cold_ramp_s, 0 up to 1,000 environments a function)
    when d grows; 0 for the first segment, as for a fixed plan's first iteration."""

    first: int
    iterations: int
    replicas: int
    global_batch: int
    micro_batch_size: int
    estimate: Estimate
    cold_s: float = 0.0

    @property
    def time_s(self) -> float:
        """The segment's predicted seconds: its iterations' and its change's."""
        return self.iterations * self.estimate.time_s + self.cold_s


def predict_schedule(plan: Plan, iterations: int, model_of: ModelOf) -> list[ScheduleSegment]:
    """Each segment of ``plan`` that starts before ``iterations``, predicted as an ordinary plan
    is (perfmodel.evaluate on the segment's Config: its d, micro-batch size, and the deployed
    functions' memory)."""
    check_no_policy(plan)
    out: list[ScheduleSegment] = []
    for first, end, seg in segment_bounds(plan, iterations):
        est = evaluate(*model_of(seg))
        grows = bool(out) and seg.replicas > out[-1].replicas
        out.append(
            ScheduleSegment(
                first, end - first, seg.replicas, seg.global_batch, seg.micro_batch_size, est, est.cold_ramp_s if grows else 0.0
            )
        )
    return out


def check_no_policy(plan: Plan) -> None:
    """Refuse to predict a replica policy's plan: its d is decided at run time, and its windows'
    own states (an entry, a switch where the gate chose another d) are not in the schedule's cost."""
    if plan.choices:
        raise PlanError(
            f"{_schedule_text(plan)}: its d is decided at run time, window by window; predict each choice's plan instead: "
            "stagecoach.planner.segments.choice_plan(plan, d)"
        )


def with_policy(job: Job, replicas: object) -> Job:
    """``job`` as ``Job.run(replicas=policy)`` launches it: a copy carrying the policy, which
    deploy/upload.py pickles with the model's code, so the gate (lambdas/gate.py) calls it in the cloud."""
    if not isinstance(replicas, ReplicaPolicy):
        return job
    copy = dataclasses.replace(job)
    copy._replica_policy = replicas
    return copy


def check_policy_run(job: Job, plan: Plan, max_cost: float | None) -> None:
    """A policy plan runs with its policy (``Job.run(replicas=ReplicaPolicy(...))``), whose
    choices are the plan's. A cost cap with a policy is refused: the gate's tally counts each
    iteration's states by its plan, not a policy window's entry and switch (docs/cost.md)."""
    if not plan.choices:
        return
    policy = job._replica_policy
    if policy is None or policy.choices != plan.choices:
        raise PlanError(
            f"plan.choices={list(plan.choices)}: a plan of a replica policy runs with the policy itself, "
            f"Job.run(replicas=ReplicaPolicy(choose=..., choices={tuple(plan.choices)}), ...), which ships it to the gate"
        )
    if max_cost is not None:
        raise PlanError(
            f"max_cost with {_schedule_text(plan)}: the engine's tally does not count a policy window's own states yet; "
            "leave max_cost out, or give a fixed schedule {first iteration: d}"
        )


def check_predictable(job: Job, plan: Plan, workflow: str | None) -> None:
    """Refuse to predict a schedule the run would refuse (``check_scheduled``) where the prediction
    depends on it: evaluation and Express or "auto" windows; and a replica policy's."""
    check_no_policy(plan)
    if job.eval_versions():
        raise PlanError(f"a replica schedule ({_schedule_text(plan)}): evaluation is not supported yet: leave Job(evaluation=...) out")
    if (workflow or plan.workflow or job.workflow) != "standard":
        raise PlanError(
            f"a replica schedule ({_schedule_text(plan)}): Express and 'auto' windows are not supported yet: use workflow='standard'"
        )
