"""Gradient synchronisation algorithms as the performance model sees them (the seam).

Each algorithm is a ``SyncAlgorithm`` whose ``stage`` returns a ``StageSync``: the time it adds to
the backward task, the duration of one sync task, the task count, requests and memory. Names equal
the runtime contract's (planner/plan.py ``SYNC_ALGORITHMS``, lambdas/collectives.py implements
them); "none" is the d = 1 case (Plan: scatter_reduce with K = 1, no sync Map). Adding an algorithm
= one class + registering it in ``SYNC_ALGORITHMS``. The derivations are in
docs/performance-model.md §5.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:  # pragma: no cover
    from .platforms import Platform

# -- §5 sync algorithms ------------------------------------------------------------------------
@dataclass(frozen=True)
class StageSync:
    """What one stage's synchronisation costs for fixed (d, K) and the stage's parameter bytes.

    tail_s:   seconds the backward task spends after its last micro-batch (writing gradient
              shards; with d = 1 or a fused algorithm also the exchange and the optimizer update).
    task_s:   duration of ONE sync task of the sync Map (0 without a Map).
    tasks:    sync Map tasks (0 = no sync Map: d = 1 or a sync fused into backward).
    shards:   objects the stage's parameters are stored as (the next forward GETs them all).
    tail_puts/tail_gets: S3 requests per backward task for the sync; task_puts/task_gets: per sync task.
    backward_extra_bytes: memory the sync adds to the backward task; task_bytes: a sync task's memory.
    """

    name: str
    k: int
    tail_s: float
    task_s: float
    tasks: int
    shards: int
    tail_puts: float
    tail_gets: float
    task_puts: float
    task_gets: float
    backward_extra_bytes: float = 0.0
    task_bytes: float = 0.0


class SyncAlgorithm:
    """Base of the pluggable sync algorithms."""

    name = "abstract"
    fused = False  # True: no sync Map, the backward tasks synchronise among themselves

    def stage(self, d: int, k: int, p_bytes: float, opt_s: float, backward_compute_s: float, plat: "Platform") -> StageSync:  # pragma: no cover
        """The stage's sync for d replicas and K aggregators. ``opt_s``: optimizer compute over the
        whole stage at its tier; ``backward_compute_s``: the backward task's compute seconds (what
        a prefetch can hide behind)."""
        raise NotImplementedError


class NoSync(SyncAlgorithm):
    """d = 1: the backward task applies the optimizer itself (runtime ``_update_shard`` on shard 0):
    GET parameters and state, update, PUT both, one after another: 4 t_lat + 2(1+rho)P/w + opt."""

    name = "none"

    def stage(self, d: int, k: int, p_bytes: float, opt_s: float, backward_compute_s: float, plat: "Platform") -> StageSync:
        w, lat, rho = plat.bandwidth_Bps, plat.storage_latency_s, plat.optimizer_state_ratio
        return StageSync(self.name, 1, tail_s=4 * lat + 2 * (1 + rho) * p_bytes / w + opt_s, task_s=0.0, tasks=0, shards=1,
                         tail_puts=2, tail_gets=2, task_puts=0, task_gets=0,
                         backward_extra_bytes=(2 + 2 * rho) * p_bytes)


class ScatterReduce(SyncAlgorithm):
    """LambdaML-style storage scatter-reduce with a sharded update, K sync tasks (K = d here).

    Backward tail: PUT the gradient as K shards, concurrently: t_lat + P/w.
    Sync task k: GET shard k of each of the d replicas in a fixed order (d t_lat + d P/(K w)), sum,
    GET its parameter shard and optimizer-state shard, apply the optimizer to 1/K of the stage,
    PUT both (4 t_lat + 2(1+rho) P/(K w) + opt/K). The sync Map starts after every backward task
    ended, so no GET waits (no polls). Memory: sum + incoming shard + parameters old/new + state
    old/new = (4 + 2 rho) P/K.
    """

    name = "scatter_reduce"

    def stage(self, d: int, k: int, p_bytes: float, opt_s: float, backward_compute_s: float, plat: "Platform") -> StageSync:
        w, lat, rho = plat.bandwidth_Bps, plat.storage_latency_s, plat.optimizer_state_ratio
        task = (d + 4) * lat + (d + 2 * (1 + rho)) * p_bytes / (k * w) + opt_s / k
        return StageSync(self.name, k, tail_s=lat + p_bytes / w, task_s=task, tasks=k, shards=k,
                         tail_puts=k, tail_gets=0, task_puts=2, task_gets=d + 2,
                         task_bytes=(4 + 2 * rho) * p_bytes / k)


class KReduce(ScatterReduce):
    """FasDL's K-reduce: K aggregators (1 <= K <= d), each reduces and updates 1/K of the stage."""

    name = "k_reduce"


class AllReduce(ScatterReduce):
    """K = 1: one aggregator reduces and updates the whole stage (parameter-server style)."""

    name = "all_reduce"


class PipelinedScatterReduce(SyncAlgorithm):
    """FuncPipe's pipelined scatter-reduce, fused into the backward task (no sync Map).

    Backward task r, after its gradient: uploads the d-1 shards the other replicas own while it
    downloads shard r from the d-1 others (staggered order; upload and download are separate
    links of w each), reduces, applies the optimizer to shard r (it holds the parameters; its
    optimizer-state shard was prefetched during compute), and uploads parameter shard r + state,
    chunked so those uploads overlap the downloads of the next chunk. Link volumes:
    up U = (d-1)P/d + (1+rho)P/d, down D = (d-1)P/d; the uploads dominate, so
    tail = (d + 2) t_lat + max(U, D)/w + opt/d + the part of the state prefetch (t_lat + rho P/(d w))
    that the backward compute could not hide. FuncPipe: 2s/w + (2+n) t_lat (its gather of the
    parameters is our next forward's load). Memory: incoming shard, sum, state, new shard and state
    = (2 + 2 rho) P/d on top of the backward task.
    """

    name = "pipelined_scatter_reduce"
    fused = True

    def stage(self, d: int, k: int, p_bytes: float, opt_s: float, backward_compute_s: float, plat: "Platform") -> StageSync:
        w, lat, rho = plat.bandwidth_Bps, plat.storage_latency_s, plat.optimizer_state_ratio
        up = (d - 1 + 1 + rho) * p_bytes / d
        down = (d - 1) * p_bytes / d
        prefetch = max(0.0, lat + rho * p_bytes / (d * w) - backward_compute_s)
        tail = (d + 2) * lat + max(up, down) / w + opt_s / d + prefetch
        return StageSync(self.name, d, tail_s=tail, task_s=0.0, tasks=0, shards=d,
                         tail_puts=(d - 1) + 2, tail_gets=(d - 1) * (1 + plat.s3_polls_per_wait) + 1, task_puts=0, task_gets=0,
                         backward_extra_bytes=(2 + 2 * rho) * p_bytes / d)


SYNC_ALGORITHMS: dict[str, SyncAlgorithm] = {
    a.name: a for a in (NoSync(), ScatterReduce(), PipelinedScatterReduce(), KReduce(), AllReduce())
}
ALL_SYNC = ("scatter_reduce", "pipelined_scatter_reduce", "k_reduce", "all_reduce")


@dataclass(frozen=True)
class SyncChoice:
    """An algorithm and its number of aggregators/shards K."""

    algo: str
    k: int

    def label(self) -> str:
        return f"k_reduce(K={self.k})" if self.algo == "k_reduce" else self.algo

    @property
    def algorithm(self) -> SyncAlgorithm:
        if self.algo not in SYNC_ALGORITHMS:
            raise ValueError(f"unknown sync algorithm {self.algo!r}: choose one of {sorted(SYNC_ALGORITHMS)}")
        return SYNC_ALGORITHMS[self.algo]

    def plan_fields(self) -> tuple[str, int]:
        """(Plan.sync, Plan.aggregators) for this choice; "none" (d = 1) is scatter_reduce, K = 1."""
        return ("scatter_reduce", 1) if self.algo == "none" else (self.algo, self.k)


def sync_choices(d: int, algos: Sequence[str] | None = None) -> list[SyncChoice]:
    """The candidate sync choices for d replicas (K-reduce: K a power of two, 2 <= K < d)."""
    if d == 1:
        return [SyncChoice("none", 1)]
    algos = algos or ALL_SYNC
    out: list[SyncChoice] = []
    for a in algos:
        if a in ("scatter_reduce", "pipelined_scatter_reduce"):
            out.append(SyncChoice(a, d))
        elif a == "all_reduce":
            out.append(SyncChoice(a, 1))
        elif a == "k_reduce":
            k = 2
            while k < d:
                out.append(SyncChoice(a, k))
                k *= 2
        else:
            raise ValueError(f"unknown sync algorithm {a!r}: choose from {ALL_SYNC}")
    return out
