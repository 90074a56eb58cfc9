"""The baselines of FuncPipe §5.1 as the paper defines them, each producing configurations our
performance model evaluates (every comparison uses Stagecoach's model; docs/planner-baselines.md).

As FuncPipe §5.1 defines them (the names FuncPipe uses):
* LambdaML: pure data parallelism, one stage, LambdaML's storage scatter-reduce in the workers
  (the runtime's ``lambdaml_scatter_reduce``: no sync Map, phases one after another);
  "the maximum memory allocation and maximum local batch size within the memory limit for each
  worker": 10,240 MB, the largest local batch b that divides G and fits by LambdaML's memory
  (FuncPipe's eq. 3b for one stage: ``lambdaml_memory_mb``), d = G/b. Evaluated with our model.
* LambdaML-GA: the same d, gradient accumulation with micro-batches of 1, "the minimum memory
  required" (the least tier that fits by the same memory).
* HybridPS / HybridPS-GA: the same workers, synchronising through a parameter server VM (one
  c5.9xlarge, 10 Gbit/s, $1.53/h; FuncPipe §5.1) instead of storage; the VM's price is added.
* TPDMP: a grid over the resource allocation (d, stages, one tier for all), the throughput-optimal
  (balanced) partition for each; per Pareto weight the configuration minimising objective (3);
  FuncPipe's runtime (pipelined scatter-reduce, micro-batch 4).
* Bayes: optuna TPE, 100 trials per Pareto weight over partition and resource allocation jointly
  (d, stages, cut points, one tier per stage; micro-batch 4), our model as the oracle (FuncPipe
  uses its model the same way), minimising objective (3).
* FuncPipe (funcpipe.py): the plan FuncPipe's own planner picks under FuncPipe's own performance
  model (its Pareto sweep and delta rule), then evaluated with ours.
* Hydrozoa (hydrozoa.py), FasDL (fasdl.py): their planners under their own models.
Every baseline with several candidates (one per weight, cluster size...) goes through the same
Pareto + delta >= 0.8 recommendation FuncPipe applies to its own.

Searched variants, named apart: LambdaML-searched and AllReduce-searched search d and the tier
of pure data parallelism on our runtime (its scatter_reduce, its all_reduce through S3).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from stagecoach.planner.baselines.fasdl import fasdl_plan
from stagecoach.planner.baselines.funcpipe import FuncPipeConstants, funcpipe_plan
from stagecoach.planner.baselines.hydrozoa import hydrozoa_plan
from stagecoach.planner.model.perfmodel import Config, Estimate, evaluate
from stagecoach.planner.model.platforms import Platform
from stagecoach.planner.model.syncmodel import SyncChoice
from stagecoach.planner.profile.layers import ModelProfile, balanced_partition
from stagecoach.planner.solve.objective import max_stages_for, objective_value
from stagecoach.planner.solve.pareto import FUNCPIPE_WEIGHTS, pareto_front, recommend

LAMBDAML_SYNC = "lambdaml_scatter_reduce"  # LambdaML's in-worker scatter-reduce, as the runtime runs it
PS_SYNC = "parameter_server"  # model-only (syncmodel.ParameterServer)
FUNCPIPE_RUNTIME_SYNC = "pipelined_scatter_reduce"  # FuncPipe's runtime, which TPDMP and Bayes run on
# HybridPS's server (FuncPipe §5.1): one c5.9xlarge, Linux on-demand in us-east-1,
# https://aws.amazon.com/ec2/pricing/on-demand/ ($0.085/h per 2 vCPUs x 18).
PS_USD_PER_HOUR = 1.53


def _sync(d: int, algo: str) -> SyncChoice:
    if d == 1:
        return SyncChoice("none", 1)
    return SyncChoice(algo, 1 if algo in ("all_reduce", PS_SYNC) else d)


def _pick(cands: list[Estimate]) -> Estimate | None:
    feas = [e for e in cands if e.feasible]
    return recommend(pareto_front(feas)) if feas else None


def _per_weight(cands: Sequence[Estimate], weights: Sequence[tuple[float, float]] = FUNCPIPE_WEIGHTS) -> list[Estimate]:
    """Per Pareto weight the feasible configuration minimising objective (3)."""
    feas = [e for e in cands if e.feasible]
    return [min(feas, key=lambda e: objective_value(e.cost, e.time_s, a1, a2)) for a1, a2 in weights] if feas else []


def lambdaml_memory_mb(profile: ModelProfile, b: int, d: int, plat: Platform) -> float:
    """A LambdaML worker's memory by FuncPipe's own memory model (eq. 3b, one stage): the runtime
    base and FuncPipe's 200 MB margin, (4 - 2 [d = 1]) parameter copies (weights, gradients and, with
    d > 1, the serialised sync data), b samples' activations (saved for backward), and the optimizer
    state (rho P). With it, AmoebaNet-D36's largest local batch at 10,240 MB is 8, as FuncPipe §1
    reports for LambdaML."""
    copies = 4.0 - (2.0 if d == 1 else 0.0) + plat.optimizer_state_ratio
    act = sum(l.saved_bytes_per_sample for l in profile.layers)
    return plat.runtime_base_mb + FuncPipeConstants().memory_margin_mb + (copies * profile.param_bytes + b * act) / 2**20


def max_local_batch(profile: ModelProfile, G: int, plat: Platform, tier: int) -> int | None:
    """LambdaML's rule: the largest local batch b that divides G and fits ``tier`` by LambdaML's memory."""
    for b in sorted((b for b in range(1, G + 1) if G % b == 0), reverse=True):
        if lambdaml_memory_mb(profile, b, G // b, plat) <= tier:
            return b
    return None


def _data_parallel(profile: ModelProfile, G: int, plat: Platform, algo: str, accumulate: bool) -> Estimate | None:
    tier = max(plat.tiers_mb)
    b = max_local_batch(profile, G, plat, tier)
    if b is None:
        return None
    d, L = G // b, len(profile.layers)
    if not accumulate:
        return evaluate(profile, Config((L,), (tier,), d, b, 1, (_sync(d, algo),)), plat)
    # GA: the same workers, micro-batches of 1, the least tier that fits them
    fit = [t for t in sorted(plat.tiers_mb) if lambdaml_memory_mb(profile, 1, d, plat) <= t]
    return evaluate(profile, Config((L,), (fit[0],), d, 1, b, (_sync(d, algo),)), plat) if fit else None


def _with_server(e: Estimate | None) -> Estimate | None:
    """The parameter server VM runs for the whole iteration: its price joins the cost (a single
    worker needs none: FuncPipe §5.3, "on a single worker (no communication time)")."""
    if e is None or e.config.replicas == 1:
        return e
    vm = PS_USD_PER_HOUR / 3600 * e.time_s
    return dataclasses.replace(e, cost=e.cost + vm)


def lambdaml(profile: ModelProfile, G: int, plat: Platform) -> Estimate | None:
    """LambdaML by FuncPipe §5.1's rule: 10,240 MB, the largest local batch that fits, d = G/b."""
    return _data_parallel(profile, G, plat, LAMBDAML_SYNC, accumulate=False)


def lambdaml_ga(profile: ModelProfile, G: int, plat: Platform) -> Estimate | None:
    """LambdaML-GA: LambdaML's d, micro-batches of 1, the least tier that fits."""
    return _data_parallel(profile, G, plat, LAMBDAML_SYNC, accumulate=True)


def hybridps(profile: ModelProfile, G: int, plat: Platform) -> Estimate | None:
    """HybridPS: LambdaML's workers synchronising through a c5.9xlarge parameter server."""
    return _with_server(_data_parallel(profile, G, plat, PS_SYNC, accumulate=False))


def hybridps_ga(profile: ModelProfile, G: int, plat: Platform) -> Estimate | None:
    """HybridPS-GA: LambdaML-GA's workers with the parameter server."""
    return _with_server(_data_parallel(profile, G, plat, PS_SYNC, accumulate=True))


def _searched(profile: ModelProfile, G: int, plat: Platform, replicas: Sequence[int], algo: str) -> Estimate | None:
    L = len(profile.layers)
    out = []
    for d in replicas:
        if G % d:
            continue
        for t in plat.tiers_mb:
            out.append(evaluate(profile, Config((L,), (t,), d, G // d, 1, (_sync(d, algo),)), plat))
    return _pick(out)


def lambdaml_searched(profile: ModelProfile, G: int, plat: Platform, replicas: Sequence[int] = (1, 2, 4, 8, 16, 32, 64)) -> Estimate | None:
    """Not LambdaML's rule: the best (d, tier) of pure data parallelism on our runtime's scatter_reduce."""
    return _searched(profile, G, plat, replicas, "scatter_reduce")


def allreduce_searched(
    profile: ModelProfile, G: int, plat: Platform, replicas: Sequence[int] = (1, 2, 4, 8, 16, 32, 64)
) -> Estimate | None:
    """The best (d, tier) of pure data parallelism with one aggregator through S3 (our all_reduce)."""
    return _searched(profile, G, plat, replicas, "all_reduce")


def _balanced(profile: ModelProfile, plat: Platform, S: int, b: int) -> tuple[int, ...]:
    ref = plat.tiers_mb[len(plat.tiers_mb) // 2]
    return tuple(balanced_partition([sum(l.times(ref, b, plat)) for l in profile.layers], S))


def tpdmp(
    profile: ModelProfile, G: int, plat: Platform, replicas: Sequence[int] = (1, 2, 4, 8, 16, 32), micro_batch: int = 4, max_stages: int = 8
) -> Estimate | None:
    """TPDMP as FuncPipe §5.1 applies it: a grid over the resource allocation (d, stages, tier), the
    throughput-optimal partition for each, and per weight the configuration minimising (3)."""
    out = []
    L = len(profile.layers)
    for d in replicas:
        if G % (d * micro_batch):
            continue
        m = G // (d * micro_batch)
        for S in range(1, max_stages_for(d, L, max_stages, plat) + 1):
            bal = _balanced(profile, plat, S, micro_batch)
            for t in plat.tiers_mb:
                out.append(evaluate(profile, Config(bal, (t,) * S, d, micro_batch, m, (_sync(d, FUNCPIPE_RUNTIME_SYNC),) * S), plat))
    return _pick(_per_weight(out))


def bayes(
    profile: ModelProfile,
    G: int,
    plat: Platform,
    trials: int = 100,
    weights: Sequence[tuple[float, float]] = FUNCPIPE_WEIGHTS,
    replicas: Sequence[int] = (1, 2, 4, 8, 16, 32),
    micro_batch: int = 4,
    max_stages: int = 8,
    seed: int = 0,
) -> Estimate | None:
    """Bayes as FuncPipe §5.1 runs it: per weight, 100 rounds of Bayesian optimisation (optuna's TPE)
    over the partition and the resource allocation jointly — d, the stage count, the cut points and
    every stage's tier — with the performance model as the oracle, minimising (3)."""
    import optuna  # heavy optional dependency (only this baseline uses it): imported when it runs

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    L = len(profile.layers)
    best: list[Estimate] = []
    for a1, a2 in weights:
        found: list[Estimate] = []

        def objective(trial: optuna.Trial, a1: float = a1, a2: float = a2, found: list[Estimate] = found) -> float:
            d = trial.suggest_categorical("d", list(replicas))
            S = trial.suggest_int("S", 1, min(L, max_stages))
            cuts = sorted({trial.suggest_int(f"cut{i}", 1, L - 1) for i in range(S - 1)}) if L > 1 else []
            edges = [0, *cuts, L]
            balance = tuple(edges[i + 1] - edges[i] for i in range(len(edges) - 1))
            tiers = tuple(trial.suggest_categorical(f"tier{i}", list(plat.tiers_mb)) for i in range(len(balance)))
            if G % (d * micro_batch) or len(balance) > max_stages_for(d, L, max_stages, plat):
                return float("inf")
            e = evaluate(
                profile,
                Config(balance, tiers, d, micro_batch, G // (d * micro_batch), (_sync(d, FUNCPIPE_RUNTIME_SYNC),) * len(balance)),
                plat,
            )
            if not e.feasible:
                return float("inf")
            found.append(e)
            return objective_value(e.cost, e.time_s, a1, a2)

        study = optuna.create_study(sampler=optuna.samplers.TPESampler(seed=seed))
        study.optimize(objective, n_trials=trials)
        if found:
            best.append(min(found, key=lambda e: objective_value(e.cost, e.time_s, a1, a2)))
    return _pick(best)


BASELINES: dict[str, Callable[[ModelProfile, int, Platform], Estimate | None]] = {
    "LambdaML": lambdaml,
    "LambdaML-GA": lambdaml_ga,
    "HybridPS": hybridps,
    "HybridPS-GA": hybridps_ga,
    "TPDMP": tpdmp,
    "Bayes": bayes,
    "FuncPipe": funcpipe_plan,
    "Hydrozoa": hydrozoa_plan,
    "FasDL": fasdl_plan,
    "LambdaML-searched": lambdaml_searched,
    "AllReduce-searched": allreduce_searched,
}
