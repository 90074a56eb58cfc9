"""FuncPipe's OWN performance model, kept apart from ours, and the plan FuncPipe would choose.

Why separate: to compare Stagecoach with FuncPipe fairly we must know what FuncPipe's planner
would pick, which depends on FuncPipe's model of the world (long-lived workers billed for the
whole iteration, GPipe micro-batches whose activations all stay in memory, a model-wide speed
ratio per memory tier, the pipelined scatter-reduce formula), not on ours. ``funcpipe_choice``
optimises FuncPipe's objective under FuncPipe's model over FuncPipe's search space; the chosen plan
is then evaluated with OUR model (``perfmodel.evaluate``) so every baseline is measured with the
same ruler. docs/planner-baselines.md writes every formula down, maps FuncPipe's notation to ours
and lists where the paper had to be interpreted.

Model (one iteration; stage s = layers [i, j) at tier k_s; d replicas; M micro-batches of b):
  compute  f_s(k), g_s(k) = sum_l (alpha_l + beta_l b) / r_k   (per-layer affine in b at the
           reference tier, one speed ratio r_k per tier for the whole model: FuncPipe's profile)
  comm     U_s, D_s = uploads / downloads of one micro-batch (t_lat + bytes/w each object);
           upload and download are separate links and overlap compute (FuncPipe's scheduling)
  pipeline T_pipe = sum_s (f_s + g_s + U_s + D_s) + (M - 1) max_s max(f_s + g_s, U_s, D_s)
  sync     T_sync = max_s (2 P_s/w + (2 + d) t_lat)          (pipelined scatter-reduce; 0 if d = 1)
  time     T = T_pipe + T_sync
  cost     C = price_GB_s * T * d * sum_s k_s/1024           (workers live for the whole iteration)
  memory   base + margin + phi P_s + M b A_s <= k_s           (GPipe keeps M micro-batches' activations)

The search is exact under that model (tested against exhaustive enumeration): every partition of
the (merged) layers into at most ``max_stages`` stages, and for each a dynamic programme over
stages whose state is (bottleneck bound theta, total memory mu); the objective
(a1 c d mu + a2) * T is then minimised over (theta, mu). Lean imports: numpy only, lazily.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import reduce
from typing import TYPE_CHECKING, Any

import numpy as np

from stagecoach.planner.model.perfmodel import Config, evaluate
from stagecoach.planner.model.syncmodel import SyncChoice
from stagecoach.planner.profile.layers import LayerProfile, ModelProfile, balanced_partition, compositions
from stagecoach.planner.solve.objective import objective_weights, weighted_objective
from stagecoach.planner.solve.pareto import FUNCPIPE_WEIGHTS, pareto_front, recommend

if TYPE_CHECKING:  # pragma: no cover
    from stagecoach.planner.model.perfmodel import Config, Estimate
    from stagecoach.planner.model.platforms import Platform


# -- sync formulas (FuncPipe §4.3, quoting LambdaML for the baseline) ------------------------------
def scatter_reduce_s(size_bytes: float, workers: int, bandwidth_Bps: float, latency_s: float) -> float:
    """LambdaML's storage scatter-reduce as FuncPipe writes it: 3s/w - 2s/(nw) + 4 t_lat.

    Each worker uploads n-1 shards, downloads the n-1 shards it owns, uploads its merged shard and
    downloads the n-1 merged shards of the others, one transfer after another."""
    if workers <= 1:
        return 0.0
    s, w = size_bytes, bandwidth_Bps
    return 3 * s / w - 2 * s / (workers * w) + 4 * latency_s


def pipelined_scatter_reduce_s(size_bytes: float, workers: int, bandwidth_Bps: float, latency_s: float) -> float:
    """FuncPipe's pipelined scatter-reduce: 2s/w + (2 + n) t_lat (uploads and downloads overlap)."""
    if workers <= 1:
        return 0.0
    return 2 * size_bytes / bandwidth_Bps + (2 + workers) * latency_s


SYNC_FORMULAS = {"pipelined_scatter_reduce": pipelined_scatter_reduce_s, "scatter_reduce": scatter_reduce_s}


# -- constants of FuncPipe's planner -------------------------------------------------------------
@dataclass(frozen=True)
class FuncPipeConstants:
    """FuncPipe's search space and the constants of its memory model (see docs for sources)."""

    micro_batch: int = 4  # FuncPipe §5: micro-batch size 4
    replicas: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    max_stages: int = 8
    max_workers: int = 32  # stages x replicas; FuncPipe's public harness plans with max_node = 32
    max_layers: int = 10  # layers are merged to this many groups of balanced compute before the search
    memory_margin_mb: float = 200.0  # public code: "(mem_size - base_mem - 200) ... extra 200 to avoid OOM"
    # Parameter-sized buffers a worker holds: weights, gradients, optimizer momentum, and the
    # gradient buffer of the scatter-reduce. Our interpretation (the paper names no factor; the
    # public code has a MODEL_SYC_MEM_FACTOR whose value is not published).
    param_copies: float = 4.0
    sync: str = "pipelined_scatter_reduce"  # FuncPipe's own algorithm; "scatter_reduce" = LambdaML's


# -- FuncPipe's memory-tier speed model ----------------------------------------------------------
@dataclass(frozen=True)
class SpeedModel:
    """Per layer: seconds = (alpha + beta * b) / ratio[tier], forward and backward separately.

    FuncPipe profiles every layer in a function of each memory size; its planner keeps a
    per-layer line in the batch size and one speed ratio per tier for the whole model (public
    code: ``layer_fwd_time = (alpha, beta)``, ``FWD_RATIO[tier]``). We obtain the same numbers
    from our profile's per-tier times.
    """

    ref_tier: int
    fwd_ab: tuple[tuple[float, float], ...]
    bwd_ab: tuple[tuple[float, float], ...]
    fwd_ratio: dict[int, float]
    bwd_ratio: dict[int, float]

    def times(self, layer: int, tier: int, b: int) -> tuple[float, float]:
        (fa, fb), (ga, gb) = self.fwd_ab[layer], self.bwd_ab[layer]
        return (fa + fb * b) / self.fwd_ratio[tier], (ga + gb * b) / self.bwd_ratio[tier]


def fit_speed_model(profile: ModelProfile, plat: Platform, micro_batch: int = 4) -> SpeedModel:
    """Fit FuncPipe's speed model to a profile: lines through b = 1 and b = ``micro_batch`` at the
    largest tier; ratio[tier] = whole-model time at the largest tier / at that tier (b = micro_batch)."""
    ref = max(plat.tiers_mb)
    fwd, bwd = [], []
    for l in profile.layers:
        f1, g1 = l.times(ref, 1, plat)
        if micro_batch > 1:
            fb, gb = l.times(ref, micro_batch, plat)
            bf, bg = (fb - f1) / (micro_batch - 1), (gb - g1) / (micro_batch - 1)
        else:
            bf, bg = f1, g1
        fwd.append((f1 - bf, bf))
        bwd.append((g1 - bg, bg))
    tf_ref = sum(l.times(ref, micro_batch, plat)[0] for l in profile.layers)
    tg_ref = sum(l.times(ref, micro_batch, plat)[1] for l in profile.layers)
    fr, gr = {}, {}
    for t in plat.tiers_mb:
        tf = sum(l.times(t, micro_batch, plat)[0] for l in profile.layers)
        tg = sum(l.times(t, micro_batch, plat)[1] for l in profile.layers)
        fr[t] = tf_ref / tf if tf > 0 else 1.0
        gr[t] = tg_ref / tg if tg > 0 else 1.0
    return SpeedModel(ref, tuple(fwd), tuple(bwd), fr, gr)


# -- evaluation under FuncPipe's model -----------------------------------------------------------
@dataclass
class FuncPipeEstimate:
    """What FuncPipe's model predicts for one configuration (balance in the given profile's layers)."""

    balance: tuple[int, ...]
    tiers_mb: tuple[int, ...]
    replicas: int
    micro_batch: int
    micro_batches: int
    time_s: float
    cost: float
    pipeline_s: float
    sync_s: float
    bottleneck_s: float  # the pipeline's period: max_s max(f_s + g_s, U_s, D_s)
    stage_memory_mb: list[float]
    feasible: bool


@dataclass(frozen=True)
class _Stage:
    """FuncPipe's per-stage facts for an interval of layers, per tier index."""

    latency: tuple[float, ...]  # f + g + U + D of the first micro-batch
    period: tuple[float, ...]  # max(f + g, U, D)
    memory_mb: float
    fits: tuple[bool, ...]
    sync_s: float


def _stage(
    layers: Sequence[LayerProfile],
    idx: Sequence[int],
    first: bool,
    last: bool,
    speed: SpeedModel,
    plat: Platform,
    c: FuncPipeConstants,
    d: int,
    m: int,
) -> _Stage:
    b = c.micro_batch
    w, lat = plat.bandwidth_Bps, plat.storage_latency_s
    p = sum(l.param_bytes for l in layers)
    act = sum(l.saved_bytes_per_sample for l in layers)
    in_b, out_b, ingrad_b = b * layers[0].in_bytes_per_sample, b * layers[-1].out_bytes_per_sample, b * layers[0].ingrad_bytes_per_sample
    up = (0.0 if last else lat + out_b / w) + (0.0 if first else lat + ingrad_b / w)  # activation out, input-gradient back
    down = lat + in_b / w + (0.0 if last else lat + out_b / w)  # input (data for stage 0), output-gradient
    mem = plat.runtime_base_mb + c.memory_margin_mb + (c.param_copies * p + m * b * act) / 2**20
    lats, pers, fits = [], [], []
    for t in plat.tiers_mb:
        f = g = 0.0
        for i in idx:
            lf, lg = speed.times(i, t, b)
            f, g = f + lf, g + lg
        lats.append(f + g + up + down)
        pers.append(max(f + g, up, down))
        fits.append(mem <= t)
    return _Stage(tuple(lats), tuple(pers), mem, tuple(fits), SYNC_FORMULAS[c.sync](p, d, w, lat))


def fp_evaluate(
    profile: ModelProfile,
    balance: Sequence[int],
    tiers_mb: Sequence[int],
    replicas: int,
    global_batch: int,
    plat: Platform,
    consts: FuncPipeConstants = FuncPipeConstants(),
    speed: SpeedModel | None = None,
) -> FuncPipeEstimate:
    """FuncPipe's predicted time, cost and memory feasibility of one configuration."""
    c = consts
    if sum(balance) != len(profile.layers) or min(balance) < 1 or len(tiers_mb) != len(balance):
        raise ValueError(f"balance {tuple(balance)} / tiers {tuple(tiers_mb)} do not describe {len(profile.layers)} layers")
    if global_batch % (replicas * c.micro_batch):
        raise ValueError(f"global batch {global_batch} is not a multiple of {replicas} replicas x micro-batch {c.micro_batch}")
    m = global_batch // (replicas * c.micro_batch)
    speed = speed or fit_speed_model(profile, plat, c.micro_batch)
    S = len(balance)
    i, lat_sum, period, sync, mem, ok = 0, 0.0, 0.0, 0.0, [], True
    for s, n in enumerate(balance):
        st = _stage(profile.layers[i : i + n], range(i, i + n), s == 0, s == S - 1, speed, plat, c, replicas, m)
        k = plat.tiers_mb.index(tiers_mb[s])
        lat_sum += st.latency[k]
        period = max(period, st.period[k])
        sync = max(sync, st.sync_s)
        mem.append(st.memory_mb)
        ok = ok and st.fits[k]
        i += n
    t_pipe = lat_sum + (m - 1) * period
    t = t_pipe + sync
    cost = plat.price_gb_s * t * replicas * sum(tiers_mb) / 1024
    return FuncPipeEstimate(tuple(balance), tuple(tiers_mb), replicas, c.micro_batch, m, t, cost, t_pipe, sync, period, mem, ok)


# -- FuncPipe's search ---------------------------------------------------------------------------
def _tier_dp(stages: Sequence[_Stage], units: Sequence[int], track: bool = False) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """min sum of latencies over tier choices, per (bottleneck bound theta, memory units mu).

    Rows: theta = every candidate period value; a tier is allowed for a stage iff it fits in
    memory and its period <= theta. Columns: total memory in units of gcd(tiers). Exact: the
    optimum's own bottleneck is one of the rows."""
    S, K = len(stages), len(units)
    per = np.array([st.period for st in stages])
    lat = np.array([st.latency for st in stages])
    fits = np.array([st.fits for st in stages])
    thetas = np.unique(per[fits])
    width = S * max(units) + 1
    cur = np.full((len(thetas), width), np.inf)
    cur[:, 0] = 0.0
    choices: list[np.ndarray] = []
    for s in range(S):
        new = np.full_like(cur, np.inf)
        ch = np.full(cur.shape, -1, dtype=np.int16)  # the tier chosen per cell (kept when track)
        for k in range(K):
            if not fits[s, k]:
                continue
            allowed = per[s, k] <= thetas
            if not allowed.any():
                continue
            u = units[k]
            cand = np.full_like(cur, np.inf)
            cand[:, u:] = cur[:, : width - u] + lat[s, k]
            cand[~allowed, :] = np.inf
            better = cand < new
            new = np.where(better, cand, new)
            ch[better] = k
        cur = new
        if track:
            choices.append(ch)
    return thetas, cur, choices


@dataclass
class FuncPipeSearch:
    """FuncPipe's optimum per Pareto weight (None where nothing fits), and how much was searched."""

    per_weight: list[FuncPipeEstimate | None]
    weights: tuple[tuple[float, float], ...]
    partitions: int
    groups: tuple[int, ...]  # merged group sizes, in the given profile's layers


def _merged_groups(profile: ModelProfile, plat: Platform, c: FuncPipeConstants, speed: SpeedModel) -> tuple[int, ...]:
    """FuncPipe's layer groups: more than ``max_layers`` layers are merged into that many groups of
    balanced compute (at the largest tier) before the search, as its public planner does."""
    ref = max(plat.tiers_mb)
    wts = [sum(speed.times(q, ref, c.micro_batch)) for q in range(len(profile.layers))]
    return tuple(balanced_partition(wts, c.max_layers)) if len(profile.layers) > c.max_layers else (1,) * len(profile.layers)


def _partition_stages(
    part: Sequence[int],
    starts: Sequence[int],
    cache: dict[tuple[int, int, bool, bool], _Stage],
    profile: ModelProfile,
    speed: SpeedModel,
    plat: Platform,
    c: FuncPipeConstants,
    d: int,
    m: int,
) -> list[_Stage]:
    """FuncPipe's facts for each stage of a partition of the groups; ``cache`` (one per (d, m))
    keeps them per (group from, group to, first, last), since partitions share their stages."""
    S = len(part)
    edges = [0, *itertools.accumulate(part)]
    sts = []
    for q in range(S):
        key = (edges[q], edges[q + 1], q == 0, q == S - 1)
        if key not in cache:
            lo, hi = starts[key[0]], starts[key[1]]
            cache[key] = _stage(profile.layers[lo:hi], range(lo, hi), key[2], key[3], speed, plat, c, d, m)
        sts.append(cache[key])
    return sts


def _partition_optima(
    sts: Sequence[_Stage], units: Sequence[int], g: int, d: int, m: int, ws: Sequence[tuple[float, float]], plat: Platform
) -> list[tuple[float, float, int]]:
    """Per objective weight, the best tiers for one partition under FuncPipe's model: (objective,
    bottleneck bound theta, memory units mu) of the optimum, the objective inf where nothing fits."""
    if not all(any(st.fits) for st in sts):
        return []
    thetas, tab, _ = _tier_dp(sts, units)
    if len(thetas) == 0:
        return []
    sync = max(st.sync_s for st in sts)
    T = tab + (m - 1) * thetas[:, None] + sync
    mu_gb = np.arange(tab.shape[1]) * g / 1024
    finite = np.isfinite(T)
    T = np.where(finite, T, 0.0)
    cost = plat.price_gb_s * d * mu_gb[None, :] * T
    out = []
    for wc, wt in ws:
        J = np.where(finite, weighted_objective(cost, T, wc, wt), np.inf)
        idx = np.unravel_index(np.argmin(J), J.shape)
        out.append((float(J[idx]), float(thetas[idx[0]]), int(idx[1])))
    return out


def funcpipe_search(
    profile: ModelProfile,
    global_batch: int,
    plat: Platform,
    weights: Sequence[tuple[float, float]] = FUNCPIPE_WEIGHTS,
    consts: FuncPipeConstants = FuncPipeConstants(),
) -> FuncPipeSearch:
    """Minimise a1*cost + a2*time (objective and cost unit as milp.objective_value) under
    FuncPipe's model over partition x tier per stage x d, micro-batch size fixed."""

    c = consts
    speed_full = fit_speed_model(profile, plat, c.micro_batch)
    groups = _merged_groups(profile, plat, c, speed_full)
    starts = [0, *itertools.accumulate(groups)]
    Lm = len(groups)
    g = reduce(math.gcd, plat.tiers_mb)
    units = [t // g for t in plat.tiers_mb]
    ws = [objective_weights(a1, a2) for a1, a2 in weights]
    best: list[tuple[float, tuple[int, int, Any, float, int]] | None] = [None] * len(weights)
    n_parts = 0
    for d in c.replicas:
        if global_batch % (d * c.micro_batch):
            continue
        m = global_batch // (d * c.micro_batch)
        smax = min(c.max_stages, Lm, c.max_workers // d)
        if smax < 1:
            continue
        cache: dict[tuple[int, int, bool, bool], _Stage] = {}
        for part in compositions(Lm, smax):
            n_parts += 1
            sts = _partition_stages(part, starts, cache, profile, speed_full, plat, c, d, m)
            for q, (val, theta, mu) in enumerate(_partition_optima(sts, units, g, d, m, ws, plat)):
                held = best[q]
                if math.isfinite(val) and (held is None or val < held[0]):
                    best[q] = (val, (d, m, part, theta, mu))
    out: list[FuncPipeEstimate | None] = []
    for found in best:
        if found is None:
            out.append(None)
            continue
        d, m, part, theta, mu = found[1]
        out.append(_reconstruct(profile, plat, c, speed_full, groups, starts, units, d, m, part, theta, mu, global_batch))
    return FuncPipeSearch(out, tuple(weights), n_parts, groups)


def _reconstruct(
    profile: ModelProfile,
    plat: Platform,
    c: FuncPipeConstants,
    speed: SpeedModel,
    groups: Sequence[int],
    starts: Sequence[int],
    units: Sequence[int],
    d: int,
    m: int,
    part: Sequence[int],
    theta: float,
    mu: int,
    G: int,
) -> FuncPipeEstimate:
    """Recover the tiers of a DP optimum by running the DP once more with back-pointers."""

    S = len(part)
    edges = [0, *itertools.accumulate(part)]
    sts = [
        _stage(
            profile.layers[starts[edges[q]] : starts[edges[q + 1]]],
            range(starts[edges[q]], starts[edges[q + 1]]),
            q == 0,
            q == S - 1,
            speed,
            plat,
            c,
            d,
            m,
        )
        for q in range(S)
    ]
    thetas, _, choices = _tier_dp(sts, units, track=True)
    row = int(np.searchsorted(thetas, theta))
    ks, col = [], mu
    for s in range(S - 1, -1, -1):
        k = int(choices[s][row, col])
        ks.append(k)
        col -= units[k]
    ks.reverse()
    balance = tuple(sum(groups[edges[q] : edges[q + 1]]) for q in range(S))
    return fp_evaluate(profile, balance, tuple(plat.tiers_mb[k] for k in ks), d, G, plat, c, speed)


# -- the plan FuncPipe would choose, evaluated with our model ------------------------------------
@dataclass
class FuncPipeChoice:
    """FuncPipe's recommended plan under its model, and that plan under OUR model.

    ``estimate``: our model's prediction, after the adaptation our runtime would make by itself
    (a stage that runs out of memory climbs the memory ladder: runtime OOM remediation);
    ``raw_estimate``: our prediction for FuncPipe's plan exactly as chosen.
    """

    funcpipe: FuncPipeEstimate
    candidates: list[FuncPipeEstimate]
    pareto: list[FuncPipeEstimate]
    raw_estimate: Estimate
    estimate: Estimate
    repairs: list[str] = field(default_factory=list)


def to_config(fp: FuncPipeEstimate) -> Config:
    """Our Config for a FuncPipe plan: its pipelined scatter-reduce (none for d = 1)."""

    ch = SyncChoice("none", 1) if fp.replicas == 1 else SyncChoice("pipelined_scatter_reduce", fp.replicas)
    return Config(fp.balance, fp.tiers_mb, fp.replicas, fp.micro_batch, fp.micro_batches, (ch,) * len(fp.balance))


def funcpipe_choice(
    profile: ModelProfile,
    global_batch: int,
    plat: Platform,
    weights: Sequence[tuple[float, float]] = FUNCPIPE_WEIGHTS,
    consts: FuncPipeConstants = FuncPipeConstants(),
) -> FuncPipeChoice | None:
    """FuncPipe's Pareto sweep and delta >= 0.8 recommendation, all under FuncPipe's model; then
    the recommended plan under ours. None if FuncPipe's model finds no plan at all."""

    res = funcpipe_search(profile, global_batch, plat, weights, consts)
    cands = [e for e in res.per_weight if e is not None]
    if not cands:
        return None
    front = pareto_front(cands)
    rec = recommend(front)
    cfg = to_config(rec)
    raw = evaluate(profile, cfg, plat)
    est, repairs = raw, []
    tiers = list(cfg.tiers_mb)
    for s, need in enumerate(raw.stage_memory_bytes):
        if need > plat.usable_bytes(tiers[s]):
            fit = [t for t in plat.tiers_mb if plat.usable_bytes(t) >= need]
            if not fit:
                repairs.append(f"stage {s} needs {need / 2**20:.0f} MB in our runtime: no tier fits")
                continue
            repairs.append(f"stage {s}: {tiers[s]} MB -> {fit[0]} MB (our runtime needs {need / 2**20:.0f} MB beyond its base)")
            tiers[s] = fit[0]
    if repairs:
        est = evaluate(profile, Config(cfg.balance, tuple(tiers), cfg.replicas, cfg.micro_batch, cfg.micro_batches, cfg.sync), plat)
    return FuncPipeChoice(rec, cands, front, raw, est, repairs)


def funcpipe_plan(profile: ModelProfile, global_batch: int, platform: Platform) -> Estimate | None:
    """BASELINES entry "FuncPipe": FuncPipe's own choice, evaluated with our model (None if
    FuncPipe finds nothing or its plan cannot run in our runtime even after memory remediation)."""
    ch = funcpipe_choice(profile, global_batch, platform)
    if ch is None or not ch.estimate.feasible:
        return None
    return ch.estimate
