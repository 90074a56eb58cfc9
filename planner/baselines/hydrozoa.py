"""Hydrozoa's planner (Guo et al., MLSys 2022): DP model partitioner + hybrid strategy selection.

Hydrozoa estimates the runtime of a GPipe-style pipeline of n stages over M micro-batches as

    T_pipe = sum_i (f_i + b_i) + 2 sum_i c_i + (M - 1)(t_k + r_1)

(f_i, b_i: forward/backward compute of stage i for one micro-batch; c_i: sending one boundary
tensor from stage i to i+1 — paid twice, activations forward and gradients backward; t_k: the
bottleneck stage's f + b; r_1: per-micro-batch overhead of the first stage, here reading its
input). sum(f + b) does not depend on the partition, so a partition only moves sum(c) and t_k:
for a bound V on t_k, a dynamic programme finds the partition with the least communication whose
stages all take <= V; minimising over V gives the best partition. Hydrozoa discretises V into
1000 levels; we also offer the exact candidate set (every contiguous sum), which makes the
partitioner exact (tests compare it with brute force).

Hybrid strategy selection: for a cluster of N workers and every model-parallel degree mp, the
data-parallel degree is dp = floor(N / mp); Hydrozoa picks the (dp, mp) with the highest
estimated throughput. Its workers are serverless containers that talk to each other directly; on
Lambda they talk through S3, so c_i is an upload plus a download (2 t_lat + 2 bytes / w), and the
data-parallel gradient all-reduce is a storage collective (see docs/planner-baselines.md).
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from stagecoach.planner.model.perfmodel import Config, evaluate, stage_memory_bytes
from stagecoach.planner.model.syncmodel import SyncChoice
from stagecoach.planner.profile.layers import ModelProfile, balanced_partition, merge_layers
from stagecoach.planner.solve.pareto import pareto_front, recommend

if TYPE_CHECKING:  # pragma: no cover
    from stagecoach.planner.model.perfmodel import Estimate
    from stagecoach.planner.model.platforms import Platform

Fits = Callable[[int, int], bool]  # fits(i, j): may layers [i, j) form one stage (memory)?


def pipeline_runtime(stage_work: Sequence[float], boundary_comm: Sequence[float], micro_batches: int, r1: float) -> float:
    """Hydrozoa's T_pipe from per-stage f + b and per-boundary c (len(stage_work) - 1 entries)."""
    if len(boundary_comm) != len(stage_work) - 1:
        raise ValueError(f"{len(stage_work)} stages have {len(stage_work) - 1} boundaries, got {len(boundary_comm)} communication times")
    return sum(stage_work) + 2 * sum(boundary_comm) + (micro_batches - 1) * (max(stage_work) + r1)


@dataclass(frozen=True)
class Partition:
    balance: tuple[int, ...]
    bottleneck: float  # t_k
    comm: float  # sum of c over the boundaries


def _bounds(work: Sequence[float], stages: int, bounds: int | None) -> list[float]:
    pre = [0.0, *itertools.accumulate(work)]
    L = len(work)
    if bounds is None:  # exact: every contiguous sum is a possible bottleneck
        return sorted({pre[j] - pre[i] for i in range(L) for j in range(i + 1, L + 1)})
    lo, hi = max(max(work), pre[-1] / max(1, stages)), pre[-1]
    if bounds <= 1 or hi <= lo:
        return [hi]
    return [lo + (hi - lo) * q / (bounds - 1) for q in range(bounds)]


def _bound_dp(
    pre: Sequence[float], ok: Sequence[Sequence[bool]], boundary_comm: Sequence[float], nmax: int, V: float
) -> tuple[list[list[float]], list[list[int]]]:
    """Hydrozoa's DP for one bound V: best[n][j], the least sum(c) cutting layers [0, j) into n
    stages of at most V each (inf if none), and arg[n][j], the last stage's start, to back-track."""
    L = len(pre) - 1
    best = [[math.inf] * (L + 1) for _ in range(nmax + 1)]
    arg = [[-1] * (L + 1) for _ in range(nmax + 1)]
    best[0][0] = 0.0
    for n in range(1, nmax + 1):
        for j in range(n, L + 1):
            # stages [i, j) within the bound: i >= the first prefix reaching pre[j] - V
            for i in range(max(n - 1, bisect.bisect_left(pre, pre[j] - V - 1e-12)), j):
                if best[n - 1][i] == math.inf or not ok[i][j]:
                    continue
                v = best[n - 1][i] + (boundary_comm[i - 1] if i > 0 else 0.0)
                if v < best[n][j]:
                    best[n][j], arg[n][j] = v, i
    return best, arg


def _cut_sizes(arg: Sequence[Sequence[int]], n: int, L: int) -> tuple[int, ...]:
    """The stage sizes of the DP's partition of all L layers into n stages, back-tracked from ``arg``."""
    sizes, j = [], L
    for q in range(n, 0, -1):
        i = arg[q][j]
        sizes.append(j - i)
        j = i
    return tuple(reversed(sizes))


def frontier(
    work: Sequence[float], boundary_comm: Sequence[float], max_stages: int, fits: Fits | None = None, bounds: int | None = None
) -> dict[int, list[Partition]]:
    """Per stage count n <= max_stages, the partitions the bound-DP finds: for every bound V, the
    least-communication partition into n stages of at most V each. Runtime is increasing in both
    t_k and sum(c), so the best partition for ANY (M, r_1) is among them."""
    L = len(work)
    if len(boundary_comm) != L - 1:
        raise ValueError(f"{L} layers have {L - 1} boundaries, got {len(boundary_comm)} communication times")
    pre = [0.0, *itertools.accumulate(work)]
    ok = [[j > i and (fits is None or fits(i, j)) for j in range(L + 1)] for i in range(L + 1)]
    nmax = min(max_stages, L)
    found: dict[int, dict[tuple[int, ...], Partition]] = {n: {} for n in range(1, nmax + 1)}
    for V in _bounds(work, nmax, bounds):
        best, arg = _bound_dp(pre, ok, boundary_comm, nmax, V)
        for n in range(1, nmax + 1):
            if best[n][L] < math.inf:
                bal = _cut_sizes(arg, n, L)
                if bal not in found[n]:
                    edges = [0, *itertools.accumulate(bal)]
                    t_k = max(pre[edges[q + 1]] - pre[edges[q]] for q in range(n))
                    found[n][bal] = Partition(bal, t_k, best[n][L])
    return {n: list(v.values()) for n, v in found.items()}


def partition_dp(
    work: Sequence[float],
    boundary_comm: Sequence[float],
    stages: int,
    micro_batches: int,
    r1: float,
    fits: Fits | None = None,
    bounds: int | None = None,
) -> tuple[Partition, float] | None:
    """Hydrozoa's partitioner: the partition of ``work`` (per-layer f + b) into exactly ``stages``
    stages minimising T_pipe, and that runtime. ``bounds``: None = exact candidate set, or the
    number of evenly spaced bounds V (Hydrozoa: 1000). None if no partition fits."""
    parts = frontier(work, boundary_comm, stages, fits, bounds).get(stages, [])
    if not parts:
        return None
    tot = sum(work)
    best = min(parts, key=lambda p: tot + 2 * p.comm + (micro_batches - 1) * (p.bottleneck + r1))
    return best, tot + 2 * best.comm + (micro_batches - 1) * (best.bottleneck + r1)


def brute_force_partition(
    work: Sequence[float], boundary_comm: Sequence[float], stages: int, micro_batches: int, r1: float, fits: Fits | None = None
) -> tuple[tuple[int, ...], float] | None:
    """Every partition into exactly ``stages`` stages, evaluated with ``pipeline_runtime`` (tests)."""
    L = len(work)
    best: tuple[tuple[int, ...], float] | None = None
    for cuts in itertools.combinations(range(1, L), stages - 1):
        edges = (0, *cuts, L)
        if fits is not None and not all(fits(edges[q], edges[q + 1]) for q in range(stages)):
            continue
        sw = [sum(work[edges[q] : edges[q + 1]]) for q in range(stages)]
        rt = pipeline_runtime(sw, [boundary_comm[c - 1] for c in cuts], micro_batches, r1)
        if best is None or rt < best[1]:
            best = (tuple(edges[q + 1] - edges[q] for q in range(stages)), rt)
    return best


# -- hybrid strategy selection on our platform ---------------------------------------------------
@dataclass
class HydrozoaChoice:
    """The (dp, mp) Hydrozoa selects for a cluster of workers at one memory tier."""

    tier_mb: int
    cluster: int
    dp: int
    mp: int
    micro_batch: int
    micro_batches: int
    balance: tuple[int, ...]
    pipeline_s: float
    sync_s: float

    @property
    def time_s(self) -> float:
        return self.pipeline_s + self.sync_s

    def throughput(self, global_batch: int) -> float:
        return global_batch / self.time_s


def storage_allreduce_s(p_bytes: float, dp: int, plat: Platform) -> float:
    """Hydrozoa's data-parallel all-reduce, bandwidth-optimal: 2(dp-1)/dp * P / w, plus the
    latency of 2(dp-1) steps (through storage here, directly between containers in Hydrozoa)."""
    if dp <= 1:
        return 0.0
    return 2 * (dp - 1) / dp * p_bytes / plat.bandwidth_Bps + 2 * (dp - 1) * plat.storage_latency_s


def hybrid_select(
    profile: ModelProfile,
    global_batch: int,
    plat: Platform,
    cluster: int,
    tier_mb: int,
    micro_batch: int = 4,
    max_stages: int = 8,
    bounds: int | None = None,
    cache: dict[tuple[object, ...], Any] | None = None,
) -> HydrozoaChoice | None:
    """Hydrozoa's strategy selection for ``cluster`` workers of ``tier_mb``: every mp with
    dp = floor(cluster / mp) (dp must split the batch into whole micro-batches), the DP partition
    for each, the highest estimated throughput wins (fewer workers on ties). ``cache`` (a dict
    shared across calls on the same profile) keeps stage memories and DP frontiers."""

    lay = profile.layers
    L = len(lay)
    w, lat = plat.bandwidth_Bps, plat.storage_latency_s
    times = [l.times(tier_mb, micro_batch, plat) for l in lay]
    work = [f + g for f, g in times]
    comm = [2 * lat + 2 * micro_batch * lay[i].out_bytes_per_sample / w for i in range(L - 1)]
    r1 = lat + micro_batch * lay[0].in_bytes_per_sample / w
    cap = plat.usable_bytes(tier_mb)
    cache = {} if cache is None else cache
    best: HydrozoaChoice | None = None
    for mp in range(1, min(cluster, L, max_stages) + 1):
        dp = cluster // mp
        if global_batch % (dp * micro_batch):
            continue
        m = global_batch // (dp * micro_batch)
        cls = min(dp, 3)  # stage memory depends on dp only through 1, 2 or >= 3 replicas
        fkey = ("frontier", tier_mb, micro_batch, cls, max_stages, bounds)
        if fkey not in cache:

            def fits(i: int, j: int, dp: int = dp, cls: int = cls) -> bool:
                mkey = ("memory", i, j, micro_batch, cls)
                if mkey not in cache:
                    cache[mkey] = stage_memory_bytes(lay[i:j], micro_batch, dp, plat)
                return bool(cache[mkey] <= cap)

            cache[fkey] = frontier(work, comm, min(L, max_stages), fits, bounds)
        parts = cache[fkey].get(mp, [])
        if not parts:
            continue
        tot = sum(work)
        part = min(parts, key=lambda p: tot + 2 * p.comm + (m - 1) * (p.bottleneck + r1))
        t_pipe = tot + 2 * part.comm + (m - 1) * (part.bottleneck + r1)
        edges = [0, *itertools.accumulate(part.balance)]
        sync = max(storage_allreduce_s(sum(l.param_bytes for l in lay[edges[q] : edges[q + 1]]), dp, plat) for q in range(mp))
        ch = HydrozoaChoice(tier_mb, cluster, dp, mp, micro_batch, m, part.balance, t_pipe, sync)
        if (
            best is None
            or ch.time_s < best.time_s * (1 - 1e-12)
            or (ch.time_s <= best.time_s * (1 + 1e-12) and ch.dp * ch.mp < best.dp * best.mp)
        ):
            best = ch
    return best


def hydrozoa_plan(
    profile: ModelProfile,
    global_batch: int,
    platform: Platform,
    clusters: Sequence[int] = (1, 2, 4, 8, 16, 32),
    micro_batch: int = 4,
    max_layers: int = 16,
) -> Estimate | None:
    """BASELINES entry "Hydrozoa": Hydrozoa's (dp, mp, partition) for every cluster size and
    uniform tier, evaluated with our model (scatter-reduce sync), then the same Pareto + delta
    recommendation as every baseline. Profiles with more than ``max_layers`` layers are merged
    first (balanced compute) to bound the DP's work."""

    prof = profile
    groups: tuple[int, ...] = (1,) * len(profile.layers)
    if len(profile.layers) > max_layers:
        ref = platform.tiers_mb[len(platform.tiers_mb) // 2]
        groups = tuple(balanced_partition([sum(l.times(ref, micro_batch, platform)) for l in profile.layers], max_layers))
        edges = [0, *itertools.accumulate(groups)]
        prof = ModelProfile(
            profile.name,
            tuple(merge_layers(profile.layers[edges[q] : edges[q + 1]]) for q in range(len(groups))),
            profile.input_bytes_per_sample,
            profile.label_bytes_per_sample,
            profile.source,
        )
    out: list[Any] = []
    cache: dict[tuple[object, ...], Any] = {}
    for tier in platform.tiers_mb:
        for n in clusters:
            ch = hybrid_select(prof, global_batch, platform, n, tier, micro_batch, cache=cache)
            if ch is None:
                continue
            gedges = [0, *itertools.accumulate(ch.balance)]
            bal = tuple(sum(groups[gedges[q] : gedges[q + 1]]) for q in range(ch.mp))
            sync = SyncChoice("none", 1) if ch.dp == 1 else SyncChoice("scatter_reduce", ch.dp)
            e = evaluate(profile, Config(bal, (tier,) * ch.mp, ch.dp, micro_batch, ch.micro_batches, (sync,) * ch.mp), platform)
            if e.feasible:
                out.append(e)
    return recommend(pareto_front(out)) if out else None
