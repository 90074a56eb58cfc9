"""FasDL's performance model and its two-stage pruning search for data-parallel K-reduce plans.

FasDL (serverless data-parallel training with K-reduce) predicts one iteration of W workers of
memory M, each computing B = G/W samples, whose gradient (S_m bytes) is cut into K shards that K
aggregators reduce:

  T_train = a (B + b) / (M + m)                                   (fitted per model: Table II)
  tp(M, S_s) = p(M) (1 - exp(-t(M) S_s))                          (throughput of one S_s-byte object)
  T_comm = S_m/tp_up + ((W-1)/tp_down + 1/tp_up) S_m/K + S_m/tp_down     (objects of S_s = S_m/K)
  cost   = price_GB_s * M/1024 * W * (T_train + T_comm) + put * K W + get * 2K (W-1)

and searches (W, K, M). Brute force evaluates every (W, K, M); FasDL prunes first and searches
what is left. Our two stages are exact (tests: same optimum as brute force, fewer evaluations):

  1. prune: per (W, M) a lower bound of the objective over every K, in O(1) — throughput is
     increasing in the object size and at most p(M), and K >= 1 — and drop pairs that cannot
     fit the model in memory or meet the time limit;
  2. search: visit the surviving (W, M) in increasing bound order, evaluate every K of a pair,
     stop as soon as the next bound is no better than the best plan found.

FasDL's public optimizer prunes W by the time limit at the largest memory, takes the first memory
that improves the cost, then lowers K greedily while the time falls — fast, but not always the
optimum; docs/planner-baselines.md compares.

HAP (§IV-B, planner/hap.py): non-aggregators take B^n = B^a + extra samples, extra from Eq. 16
(T_train(B^n) = T_train(B^a) + T_agg), and do not wait for the aggregation (staleness 1), so an
iteration takes the BSP time of W B^a samples and trains K B^a + (W - K) B^n. ``hap_prediction``
puts that beside our model's prediction of the BSP K-reduce plan (the runtime runs HAP's semantics
on one stage, its non-aggregators' next gradient overlapping the aggregation, planner/emit/asl.py
``_hap_backward_sync``; our model does not predict it: docs/exactness.md "FasDL's HAP").
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from stagecoach.planner.model.perfmodel import Config, evaluate, stage_memory_bytes
from stagecoach.planner.model.syncmodel import SyncChoice
from stagecoach.planner.solve.objective import objective_weights, weighted_objective
from stagecoach.planner.solve.pareto import FUNCPIPE_WEIGHTS, pareto_front, recommend

if TYPE_CHECKING:  # pragma: no cover
    from stagecoach.planner.model.perfmodel import Estimate
    from stagecoach.planner.model.platforms import Platform
    from stagecoach.planner.model.syncmodel import SyncChoice
    from stagecoach.planner.profile.layers import ModelProfile


@dataclass(frozen=True)
class FasDLModel:
    """FasDL's coefficients for one model on one platform.

    p(M) = p_inf * M / (M + half_mb) (half_mb = 0: memory-independent bandwidth);
    t(M) = 1 / ramp_bytes: an object of ramp_bytes reaches 63% of p(M).
    """

    model_bytes: float  # S_m
    a: float
    b: float
    m: float
    up_Bps: float
    down_Bps: float
    ramp_bytes: float
    half_mb: float = 0.0
    price_gb_s: float = 0.0000166667
    price_put: float = 0.005 / 1000
    price_get: float = 0.0004 / 1000

    def train_s(self, batch: float, memory_mb: float) -> float:
        return self.a * (batch + self.b) / (memory_mb + self.m)

    def _p(self, p_inf: float, memory_mb: float) -> float:
        return p_inf * memory_mb / (memory_mb + self.half_mb) if self.half_mb else p_inf

    def tp_up(self, memory_mb: float, object_bytes: float) -> float:
        return self._p(self.up_Bps, memory_mb) * (1 - math.exp(-object_bytes / self.ramp_bytes))

    def tp_down(self, memory_mb: float, object_bytes: float) -> float:
        return self._p(self.down_Bps, memory_mb) * (1 - math.exp(-object_bytes / self.ramp_bytes))

    def comm_s(self, workers: int, k: int, memory_mb: float) -> float:
        """FasDL's T_comm; 0 for one worker (nothing to synchronise)."""
        if workers <= 1:
            return 0.0
        s = self.model_bytes
        obj = s / k
        up, down = self.tp_up(memory_mb, obj), self.tp_down(memory_mb, obj)
        return s / up + ((workers - 1) / down + 1 / up) * s / k + s / down

    def requests_cost(self, workers: int, k: int) -> float:
        """S3 requests per iteration: R_up = K W PUTs, R_down = 2K(W-1) GETs."""
        if workers <= 1:
            return 0.0
        return self.price_put * k * workers + self.price_get * 2 * k * (workers - 1)

    def iteration(self, global_batch: int, workers: int, k: int, memory_mb: float) -> tuple[float, float]:
        """(seconds, USD) of one iteration."""
        t = self.train_s(global_batch / workers, memory_mb) + self.comm_s(workers, k, memory_mb)
        return t, self.price_gb_s * memory_mb / 1024 * workers * t + self.requests_cost(workers, k)

    def agg_s(self, workers: int, k: int, memory_mb: float) -> float:
        """FasDL's T_agg (Eq. 1b): an aggregator downloads its shard from the W-1 others and
        uploads the merged one — the time non-aggregators would otherwise wait."""
        if workers <= 1:
            return 0.0
        obj = self.model_bytes / k
        return (workers - 1) * obj / self.tp_down(memory_mb, obj) + obj / self.tp_up(memory_mb, obj)

    def hap_extra(self, workers: int, k: int, memory_mb: float, batch_a: int) -> int:
        """B^n - B^a by FasDL's alignment (Eq. 16), T_train(B^n) = T_train(B^a) + T_agg, rounded
        down so a non-aggregator never makes the aggregators wait: T_agg (M + m) / a samples."""
        if workers <= 1 or k >= workers:
            return 0
        return max(0, math.floor(self.agg_s(workers, k, memory_mb) * (memory_mb + self.m) / self.a))

    def hap_iteration(self, workers: int, k: int, memory_mb: float, batch_a: int, extra: int) -> tuple[float, float, int]:
        """(seconds, USD, global batch) of one HAP iteration (§IV-B): aggregators train B^a, upload,
        aggregate and download (BSP among them); non-aggregators train B^a + extra, upload and
        download the previous iteration's merge without waiting (staleness 1). The iteration is
        the slower role; the global batch K B^a + (W - K)(B^a + extra)."""
        if workers <= 1:
            return *self.iteration(batch_a, 1, 1, memory_mb), batch_a
        comm = self.comm_s(workers, k, memory_mb)
        aggregator = self.train_s(batch_a, memory_mb) + comm
        non = self.train_s(batch_a + extra, memory_mb) + comm - self.agg_s(workers, k, memory_mb) if k < workers else 0.0
        t = max(aggregator, non)
        cost = self.price_gb_s * memory_mb / 1024 * workers * t + self.requests_cost(workers, k)
        return t, cost, k * batch_a + (workers - k) * (batch_a + extra)

    def lower_bound(self, global_batch: int, workers: int, memory_mb: float) -> tuple[float, float]:
        """(seconds, USD) no K in 1..W can beat: tp(S_m/K) <= tp(S_m) and tp <= p(M) bound the
        transfers from below, K = 1 the requests."""
        t = self.train_s(global_batch / workers, memory_mb)
        if workers > 1:
            s = self.model_bytes
            up_max, down_max = self._p(self.up_Bps, memory_mb), self._p(self.down_Bps, memory_mb)
            t += s / self.tp_up(memory_mb, s) + s / self.tp_down(memory_mb, s) + ((workers - 1) / down_max + 1 / up_max) * s / workers
        return t, self.price_gb_s * memory_mb / 1024 * workers * t + self.requests_cost(workers, 1)


@dataclass
class FasDLResult:
    workers: int
    k: int
    memory_mb: int
    time_s: float
    cost: float
    objective: float
    evaluations: int  # iteration-model evaluations (time and cost of one (W, K, M))
    bounds: int = 0  # lower-bound evaluations (stage 1)


Need = Callable[[int, int], float]  # need(W, K): least memory (MB) a configuration needs


def _best_k(
    model: FasDLModel,
    global_batch: int,
    W: int,
    M: int,
    wc: float,
    wt: float,
    need: Need | None,
    time_limit: float,
    best: FasDLResult | None,
) -> tuple[FasDLResult | None, int]:
    """Every K that fits for (W, M), against ``best``; returns the new best and the evaluations."""
    n = 0
    for K in range(1, W + 1):
        if need is not None and M < need(W, K):
            continue
        t, c = model.iteration(global_batch, W, K, M)
        n += 1
        j = weighted_objective(c, t, wc, wt)
        if t <= time_limit and (best is None or j < best.objective):
            best = FasDLResult(W, K, M, t, c, j, 0)
    return best, n


def brute_force(
    model: FasDLModel,
    global_batch: int,
    workers: Sequence[int],
    memories: Sequence[int],
    wc: float,
    wt: float,
    need: Need | None = None,
    time_limit: float = math.inf,
) -> FasDLResult | None:
    """Evaluate every (W, K, M) that fits in memory; the best objective within the time limit."""
    best, n = None, 0
    for W in workers:
        for M in memories:
            best, k = _best_k(model, global_batch, W, M, wc, wt, need, time_limit, best)
            n += k
    if best is not None:
        best.evaluations = n
    return best


def two_stage_search(
    model: FasDLModel,
    global_batch: int,
    workers: Sequence[int],
    memories: Sequence[int],
    wc: float,
    wt: float,
    need: Need | None = None,
    time_limit: float = math.inf,
) -> FasDLResult | None:
    """FasDL's prune-then-search, exact: the same optimum as ``brute_force`` with fewer evaluations."""
    pairs, nb = [], 0
    for W in workers:
        least = min(need(W, K) for K in range(1, W + 1)) if need is not None else -math.inf
        for M in memories:
            if M < least:
                continue  # no K fits: pruned without a bound
            t, c = model.lower_bound(global_batch, W, M)
            nb += 1
            if t > time_limit:
                continue  # even the bound misses the time limit
            pairs.append((weighted_objective(c, t, wc, wt), W, M))
    pairs.sort()
    best, n = None, 0
    for lb, W, M in pairs:
        if best is not None and lb >= best.objective:
            break  # every remaining pair is bounded by at least this
        best, k = _best_k(model, global_batch, W, M, wc, wt, need, time_limit, best)
        n += k
    if best is not None:
        best.evaluations, best.bounds = n, nb
    return best


# -- coefficients from a profile (what FasDL's profiler fits) ------------------------------------
def fit_train_coefficients(samples: Sequence[tuple[float, float, float]]) -> tuple[float, float, float]:
    """Least-squares (relative error) fit of T = a (B + b) / (M + m) to (B, M, T) samples.

    For fixed m the model is linear in (a, a b); m is found by a golden-section search on the
    residual, bracketed by the smallest memory (M + m > 0) and 4x the largest."""

    B = np.array([s[0] for s in samples], dtype=float)
    M = np.array([s[1] for s in samples], dtype=float)
    T = np.array([s[2] for s in samples], dtype=float)

    def solve(m: float) -> tuple[float, float, float]:
        A = np.stack([B / (M + m) / T, 1 / (M + m) / T], axis=1)
        coef, *_ = np.linalg.lstsq(A, np.ones_like(T), rcond=None)
        res = float(np.sum((A @ coef - 1) ** 2))
        return res, float(coef[0]), float(coef[1])

    lo, hi = -0.999 * float(M.min()), 4 * float(M.max())
    grid = np.linspace(lo, hi, 200)
    k = int(np.argmin([solve(x)[0] for x in grid]))
    a_, b_ = grid[max(0, k - 1)], grid[min(len(grid) - 1, k + 1)]
    g = (math.sqrt(5) - 1) / 2
    for _ in range(60):
        c_, d_ = b_ - g * (b_ - a_), a_ + g * (b_ - a_)
        if solve(c_)[0] < solve(d_)[0]:
            b_ = d_
        else:
            a_ = c_
    m = (a_ + b_) / 2
    _, a, ab = solve(m)
    return float(a), float(ab / a) if a else 0.0, float(m)


def fit_fasdl_model(profile: ModelProfile, plat: Platform, batches: Sequence[int] = (1, 2, 4, 8, 16, 32, 64)) -> FasDLModel:
    """FasDL's coefficients for a profile: T_train fitted to one worker's forward + backward
    (our profile's times at every tier and batch size); bandwidth and latency from the platform
    (its bandwidth does not depend on memory, so p(M) is constant; ramp = w * t_lat makes a small
    object cost about one latency)."""
    samples = []
    for t in plat.tiers_mb:
        for mb in batches:
            f = sum(sum(l.times(t, mb, plat)) for l in profile.layers)
            samples.append((mb, t, f))
    a, b, m = fit_train_coefficients(samples)
    w = plat.bandwidth_Bps
    return FasDLModel(profile.param_bytes, a, b, m, w, w, w * plat.storage_latency_s, 0.0, plat.price_gb_s, plat.price_put, plat.price_get)


def memory_need(profile: ModelProfile, global_batch: int, plat: Platform) -> Need:
    """FasDL's memory constraint from the profile: the least Lambda memory (MB) our runtime needs
    for W workers of G/W samples with K aggregators (what FasDL measures by profiling)."""

    memo: dict[tuple[int, int], float] = {}

    def need(W: int, K: int) -> float:
        if (W, K) not in memo:
            by = stage_memory_bytes(profile.layers, global_batch // W, W, plat, sync_choice(W, K))
            memo[(W, K)] = (by / 2**20 + plat.runtime_base_mb) / plat.memory_headroom
        return memo[(W, K)]

    return need


def sync_choice(workers: int, k: int) -> SyncChoice:
    """Our sync algorithm for FasDL's (W, K): all-reduce for K = 1, scatter-reduce for K = W."""

    if workers == 1:
        return SyncChoice("none", 1)
    if k == 1:
        return SyncChoice("all_reduce", 1)
    if k == workers:
        return SyncChoice("scatter_reduce", workers)
    return SyncChoice("k_reduce", k)


def fasdl_plan(
    profile: ModelProfile,
    global_batch: int,
    platform: Platform,
    max_workers: int = 32,
    weights: Sequence[tuple[float, float]] = FUNCPIPE_WEIGHTS,
) -> Estimate | None:
    """BASELINES entry "FasDL": the two-stage search per Pareto weight under FasDL's model
    (workers dividing the batch, K in 1..W, the platform's tiers), each winner evaluated with our
    model, then the same Pareto + delta recommendation as every baseline."""

    model = fit_fasdl_model(profile, platform)
    workers = [W for W in range(1, max_workers + 1) if global_batch % W == 0]
    need = memory_need(profile, global_batch, platform)
    L = len(profile.layers)
    out = []
    for a1, a2 in weights:
        r = two_stage_search(model, global_batch, workers, platform.tiers_mb, *objective_weights(a1, a2), need=need)
        if r is None:
            continue
        cfg = Config((L,), (r.memory_mb,), r.workers, global_batch // r.workers, 1, (sync_choice(r.workers, r.k),))
        e = evaluate(profile, cfg, platform)
        if e.feasible:
            out.append(e)
    return recommend(pareto_front(out)) if out else None


@dataclass(frozen=True)
class HapPrediction:
    """FasDL's HAP iteration (its own model) next to the BSP K-reduce plan of the same W, K, M and
    B^a as FasDL's model and ours (planner/model/perfmodel.py) predict it. Ours predicts only the
    BSP plan: the runtime runs K-reduce, not HAP (planner/hap.py), and the model predicts what runs."""

    workers: int
    k: int
    memory_mb: int
    batch_a: int
    extra: int  # B^n - B^a, Eq. 16
    hap_s: float  # FasDL: one HAP iteration
    hap_cost: float
    hap_batch: int  # K B^a + (W - K) B^n samples per HAP iteration
    bsp_s: float  # FasDL: one BSP K-reduce iteration of W B^a samples
    ours_bsp_s: float  # our model: the same BSP K-reduce iteration
    ours_bsp_cost: float

    @property
    def hap_samples_per_s(self) -> float:
        return self.hap_batch / self.hap_s

    @property
    def bsp_samples_per_s(self) -> float:
        return self.workers * self.batch_a / self.bsp_s

    @property
    def ours_bsp_samples_per_s(self) -> float:
        return self.workers * self.batch_a / self.ours_bsp_s


def hap_prediction(profile: ModelProfile, platform: Platform, workers: int, k: int, memory_mb: int, batch_a: int) -> HapPrediction:
    """FasDL's second search stage for one (W, M, B^a) and K (§VI-B): B^n from Eq. 16, the HAP
    iteration's time, cost and samples under FasDL's model fitted to ``profile``, beside FasDL's
    and our prediction of the BSP K-reduce iteration it replaces."""
    model = fit_fasdl_model(profile, platform)
    extra = model.hap_extra(workers, k, memory_mb, batch_a)
    hap_s, hap_cost, hap_batch = model.hap_iteration(workers, k, memory_mb, batch_a, extra)
    bsp_s, _ = model.iteration(workers * batch_a, workers, k, memory_mb)
    cfg = Config((len(profile.layers),), (memory_mb,), workers, batch_a, 1, (sync_choice(workers, k),))
    ours = evaluate(profile, cfg, platform)
    return HapPrediction(workers, k, memory_mb, batch_a, extra, hap_s, hap_cost, hap_batch, bsp_s, ours.time_s, ours.cost)
