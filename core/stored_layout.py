"""How a stage's versions are stored when K or the chunk layout changes between segments.

Dynamic workers (docs/runtime.md "Dynamic workers"): each segment of a replica schedule cuts a
stage's flat vector into its own K shards of chunks (training.stage_layout: K and the chunk count
depend on the segment's plan). A version written by one segment is read by the next, so every
version is stored in one layout that serves all of them: the **stored layout**, the top plan's
shards cut further at every chunk boundary of every other segment (the common refinement). Each
stored chunk then lies inside one shard of every segment, and an iteration's shard is a run of
whole stored chunks: its sync task reads and writes exactly those objects, the parameters and the
elementwise optimizer state alike (each chunk's state is that chunk's, optim_state.apply_update),
so nothing is ever re-cut and no bit changes (a chunk is a range of a shard: the update is
elementwise). The objects' keys (core/keys.py ``params``/``optim``: shard k, chunk c) name the
stored layout's chunks; an iteration's (shard, chunk) maps to them through ``Cut.names``. Every
version has the same objects, so the resume point's completeness count (core/versions.py) holds.

A plan whose segments all cut a stage alike (or without segments) stores it in that one layout,
with keys exactly as before. A stage with an empty chunk in some segment (fewer elements than
shards) and layouts that differ is refused (``check``): there is no common refinement of empty
ranges.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from stagecoach.core.training import stage_layout
from stagecoach.planner.plan import Plan, PlanError
from stagecoach.planner.segments import choice_plan

Layout = list[list[tuple[int, int]]]  # per shard, its chunks' [start, end) in the stage's flat vector
Names = tuple[tuple[tuple[int, int], ...], ...]  # per shard, per chunk: the stored (shard, chunk) it is


@dataclass(frozen=True)
class Cut:
    """One iteration's view of a stage: ``layout``, its K shards of chunks (the stored chunks that
    lie in each shard), and ``names``, each chunk's stored (shard, chunk); () when the iteration's
    layout is the stored one (every plan without a layout change)."""

    layout: Layout
    names: Names = ()


def layout_plans(plan: Plan) -> list[Plan]:
    """Every plan an iteration of ``plan`` may run, the top plan (whose layout names the stored
    chunks) first: a policy's choices, a schedule's segments, or the plan itself."""
    if plan.choices:
        return [plan, *(choice_plan(plan, d) for d in plan.choices)]
    return [plan, *(seg for _, seg in plan.segments)]


def plan_layout(plan: Plan, stage: int, numel: int, itemsize: int) -> Layout:
    return stage_layout(numel, itemsize, plan.grad_shards(stage), plan.replicas, plan.chunks[stage])


def _pieces(layouts: Sequence[Layout], stage: int) -> list[tuple[int, int]]:
    """The common refinement: the flat vector cut at every chunk boundary of every layout."""
    if any(a == b for layout in layouts for shard in layout for a, b in shard):
        raise PlanError(
            f"stage {stage}: a segment cuts its parameters into more shards than it has elements, and the shards change "
            "across the schedule: keep K (aggregators) fixed for this stage, or at most its element count"
        )
    cuts = sorted({x for layout in layouts for shard in layout for ab in shard for x in ab})
    return list(zip(cuts, cuts[1:]))


def _cut(pieces: Sequence[tuple[int, int]], layout: Layout) -> Layout:
    """``pieces`` grouped into ``layout``'s shards (each piece lies inside exactly one)."""
    out: Layout = []
    for shard in layout:
        lo, hi = shard[0][0], shard[-1][1]
        out.append([(a, b) for a, b in pieces if lo <= a and b <= hi])
    return out


def stored_layout(plan: Plan, stage: int, numel: int, itemsize: int) -> Layout:
    """How every version of ``stage`` is stored (the keys' shard and chunk): the top plan's layout,
    refined at every other segment's chunk boundary when they differ."""
    layouts = [plan_layout(p, stage, numel, itemsize) for p in layout_plans(plan)]
    if all(layout == layouts[0] for layout in layouts):
        return layouts[0]
    return _cut(_pieces(layouts, stage), layouts[0])


def iteration_cut(plan: Plan, at: Plan, stage: int, numel: int, itemsize: int) -> Cut:
    """The layout iteration plan ``at`` (one of ``plan``'s) runs ``stage`` in: its own K shards,
    each the stored chunks inside it, and their stored names."""
    layouts = [plan_layout(p, stage, numel, itemsize) for p in layout_plans(plan)]
    own = plan_layout(at, stage, numel, itemsize)
    if all(layout == own for layout in layouts):
        return Cut(own)
    pieces = _pieces([*layouts, own], stage)
    stored, mine = _cut(pieces, layouts[0]), _cut(pieces, own)
    where = {ab: (k, c) for k, shard in enumerate(stored) for c, ab in enumerate(shard)}
    return Cut(mine, tuple(tuple(where[ab] for ab in shard) for shard in mine))


def check(plan: Plan, numels: Sequence[int], itemsize: int) -> None:
    """Refuse, before anything is deployed, a plan whose stages have no stored layout
    (``_pieces``); ``numels``: each stage's flat parameter count."""
    for s, numel in enumerate(numels):
        stored_layout(plan, s, numel, itemsize)
