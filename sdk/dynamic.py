"""Dynamic workers on the SDK's side (issue 27 item 1, docs/runtime.md "Dynamic workers"): a
replica schedule ``Job.run(replicas={0: 1, 300: 2})`` as one plan with segments
(planner/segments.py), and what a job must be for it to run exactly today.

Refused up front, with the fix: warm state (a new replica or a shrinking d would need the state a
container holds), evaluation (its Map's replicas belong to one segment), Express or "auto" windows
(a window's length is priced from one iteration's prediction), deferred batch norm (not covered by a
test yet), and a stage whose chunk layout changes with d (the stored state would need re-cutting).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from stagecoach.core.training import master_dtype, ownership, stage_layout
from stagecoach.planner.plan import Plan, PlanError
from stagecoach.planner.segments import check_segments, replica_schedule, scheduled_plan

if TYPE_CHECKING:
    from stagecoach.job import Job


def is_schedule(replicas: object) -> bool:
    """Whether ``replicas`` asks for dynamic workers (a dict, or a policy, which is refused)."""
    return isinstance(replicas, Mapping) or callable(replicas)


def manual_scheduled_plan(job: Job, manual: Mapping[str, Any], make: Callable[..., Plan]) -> Plan:
    """The plan of ``Job.run(replicas={first iteration: d}, ...)``: each segment a manual plan
    (``make``: Job.manual_plan) with the same settings but d, each stage's sync K-reduce with K the
    smallest d unless given (K must stay fixed: planner/segments.py)."""
    pairs = replica_schedule(manual["replicas"], job.iterations)
    smallest = min(d for _, d in pairs)
    rest = {k: v for k, v in manual.items() if k != "replicas"}
    rest.setdefault("sync", "k_reduce")
    rest["sync"] = rest["sync"] or "k_reduce"
    if rest["sync"] == "k_reduce":  # another algorithm's K is its own (planner/segments.py refuses one that changes)
        rest["aggregators"] = rest.get("aggregators") or smallest
    return scheduled_plan(dict(pairs), job.iterations, lambda d: make(**rest, replicas=d))


def check_scheduled(job: Job, plan: Plan) -> None:
    """Refuse a job that a segmented ``plan`` would not train exactly, naming cause and fix."""
    if not plan.segments:
        return
    check_segments(plan)
    refusals = [
        (job.warm_state, "warm state (Job(warm_state=True)) is not supported yet: set Job(warm_state=False)"),
        (bool(job.eval_versions()), "evaluation is not supported yet: leave Job(evaluation=...) out"),
        ((plan.workflow or job.workflow) != "standard", "Express and 'auto' windows are not supported yet: use workflow='standard'"),
        (job.deferred_batch_norm, "deferred batch norm is not supported yet: leave Job(deferred_batch_norm=...) off"),
    ]
    for refused, why in refusals:
        if refused:
            raise PlanError(f"a replica schedule ({_schedule_text(plan)}): {why}")
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
