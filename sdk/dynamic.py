"""Dynamic workers on the SDK's side (issue 27 item 1, docs/runtime.md "Dynamic workers"): a
replica schedule ``Job.run(replicas={0: 1, 300: 2})`` as one plan with segments
(planner/segments.py), and what a job must be for it to run exactly today.

A growing global batch with a learning-rate rule (``global_batch=``, ``lr_scale=``: Hydrozoa's
AdaBatch policy) runs too; with it ``Job(epochs=)`` is refused (an epoch is no fixed number of
iterations), and so is a learning-rate scheduler (its steps and the multiplier are not composed yet).

Refused up front, with the fix: warm state (a new replica or a shrinking d would need the state a
container holds), evaluation (its Map's replicas belong to one segment), Express or "auto" windows
(a window's length is priced from one iteration's prediction), deferred batch norm (not covered by a
test yet), and a stage whose chunk layout changes with d (the stored state would need re-cutting).

Predicted (``predict_schedule``; the cost: Job.predict_cost, sdk/cost.py predict_schedule): each
segment as an ordinary plan for its iterations, summed, in joined windows (docs/runtime.md
"Dynamic workers").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from stagecoach.core.training import master_dtype, ownership, stage_layout
from stagecoach.planner.model.perfmodel import Config, Estimate, evaluate
from stagecoach.planner.model.platforms import Platform
from stagecoach.planner.plan import Plan, PlanError
from stagecoach.planner.profile.layers import ModelProfile
from stagecoach.planner.segments import batch_schedule, check_segments, replica_schedule, scheduled_plan, segment_bounds

if TYPE_CHECKING:
    from stagecoach.job import Job


def is_schedule(replicas: object) -> bool:
    """Whether ``replicas`` asks for dynamic workers (a dict, or a policy, which is refused)."""
    return isinstance(replicas, Mapping) or callable(replicas)


def wants_schedule(manual: Mapping[str, Any]) -> bool:
    """Whether ``Job.run``'s settings ask for a schedule: of replicas, of the global batch, or of
    the learning rate (``global_batch=``, ``lr_scale=``: a growing batch, Hydrozoa's AdaBatch)."""
    return is_schedule(manual.get("replicas")) or manual.get("global_batch") is not None or manual.get("lr_scale") is not None


def adabatch(replicas: Mapping[int, int], global_batch: int, decay: float = 0.75) -> dict[str, Any]:
    """Hydrozoa's evaluated policy (seed 002 §4.3, adapting AdaBatch; Smith et al. 2018) as
    ``Job.run`` settings: the global batch grows with d (``global_batch`` at the first d, each
    replica keeping its share) and at each change the learning rate is multiplied by ``decay`` per
    doubling (Hydrozoa: 0.75 where AdaBatch decays a fixed batch's by 0.375). E.g.
    ``job.run(stages=2, **adabatch({0: 1, 300: 2, 600: 4}, job.global_batch))``. A change that is
    not a doubling, halving or power of two thereof is refused: give ``lr_scale`` yourself."""
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


def manual_scheduled_plan(job: Job, manual: Mapping[str, Any], make: Callable[..., Plan]) -> Plan:
    """The plan of ``Job.run(replicas={first iteration: d}, global_batch={first iteration: G},
    lr_scale={first iteration: factor}, ...)``: each segment a manual plan (``make``:
    Job.manual_plan) with the same settings but d (and G, and its cumulative learning-rate
    factor), each stage's sync K-reduce with K the smallest d unless given (K must stay fixed:
    planner/segments.py). An int ``replicas`` is {0: d}; ``global_batch`` must start at the job's."""
    replicas = manual.get("replicas", 1)
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
    if rest["sync"] == "k_reduce":  # another algorithm's K is its own (planner/segments.py refuses one that changes)
        rest["aggregators"] = rest.get("aggregators") or smallest
    return scheduled_plan(
        dict(pairs), job.iterations, lambda d: make(**rest, replicas=d), global_batch=batches, lr_scale=manual.get("lr_scale")
    )


def check_scheduled(job: Job, plan: Plan) -> None:
    """Refuse a job that a segmented ``plan`` would not train exactly, naming cause and fix."""
    if plan.lr_scale != 1.0 and not plan.segments:
        raise PlanError(
            f"plan.lr_scale={plan.lr_scale}: a learning-rate multiplier belongs to a schedule's segments (Plan.segments); "
            "for one rate throughout set it in the optimizer factory (lr=...)"
        )
    if not plan.segments:
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


def _schedule_text(plan: Plan) -> str:
    return ", ".join(f"d={seg.replicas} from iteration {first}" for first, seg in plan.segments)


def _check_layouts(job: Job, plan: Plan) -> None:
    """Every segment cuts each stage's stored parameters into the same shards and chunks
    (training.stage_layout: the chunk count depends on d for a large stage)."""
    master = job.build_model(master_dtype(job.dtype))
    own = ownership(list(master), [plan.stage_layers(s) for s in range(plan.stages)])
    itemsize = torch.empty(0, dtype=master_dtype(job.dtype)).element_size()
    for s in range(plan.stages):
        numel = sum(p.numel() for p in own.owned[s])
        layouts = {str(stage_layout(numel, itemsize, seg.grad_shards(s), seg.replicas)) for _, seg in plan.segments}
        if len(layouts) > 1:
            raise PlanError(
                f"a replica schedule ({_schedule_text(plan)}): stage {s}'s stored parameters would be cut into different chunks "
                "at different d (a large stage); re-cutting the state is not supported yet: keep d within a range of equal chunking"
            )


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


def check_predictable(job: Job, plan: Plan, workflow: str | None) -> None:
    """Refuse to predict a schedule the run would refuse (``check_scheduled``) where the prediction
    depends on it: evaluation and Express or "auto" windows."""
    if job.eval_versions():
        raise PlanError(f"a replica schedule ({_schedule_text(plan)}): evaluation is not supported yet: leave Job(evaluation=...) out")
    if (workflow or plan.workflow or job.workflow) != "standard":
        raise PlanError(
            f"a replica schedule ({_schedule_text(plan)}): Express and 'auto' windows are not supported yet: use workflow='standard'"
        )
