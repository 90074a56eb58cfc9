"""Baseline planners of FuncPipe §5.1, each producing configurations our performance model
evaluates (so every comparison is on Stagecoach's runtime model, not on the baselines' systems).

* LambdaML: pure data parallelism, one stage, every worker runs its whole share (G/d samples) at
  once; grid over d and memory tier.
* LambdaML-GA: the same with gradient accumulation (micro-batches of ``micro_batch`` samples).
* HybridPS / HybridPS-GA: data parallelism whose synchronisation goes through one aggregator
  (parameter-server style = all-reduce with K = 1), without / with gradient accumulation.
* TPDMP-style: grid over (stages, uniform tier, d), the throughput-optimal (balanced) partition
  for each.
* Bayes: optuna TPE, 100 trials over (d, stages, tier, micro-batch size) with the performance
  model as the oracle, one study per Pareto weight.
* FuncPipe (funcpipe_model.py): the plan FuncPipe's own planner picks under FuncPipe's own
  performance model (its Pareto sweep and delta rule), then evaluated with ours.
* Hydrozoa (hydrozoa.py): its DP partitioner and (dp, mp) hybrid strategy selection per cluster
  size and uniform tier.
* FasDL (fasdl.py): its two-stage pruning search over (workers, K aggregators, memory) for pure
  data parallelism with K-reduce, under FasDL's model.
Each baseline's own candidates go through the same Pareto + delta >= 0.8 recommendation; the
formulas and our interpretations are in docs/planner-baselines.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from stagecoach.planner.baselines.fasdl import fasdl_plan
from stagecoach.planner.baselines.funcpipe import funcpipe_plan
from stagecoach.planner.baselines.hydrozoa import hydrozoa_plan
from stagecoach.planner.model.perfmodel import Config, Estimate, evaluate
from stagecoach.planner.model.platforms import Platform
from stagecoach.planner.model.syncmodel import SyncChoice
from stagecoach.planner.profile.layers import ModelProfile, balanced_partition
from stagecoach.planner.solve.objective import max_stages_for, objective_value
from stagecoach.planner.solve.pareto import FUNCPIPE_WEIGHTS, pareto_front, recommend


def _sync(d: int, algo: str) -> SyncChoice:
    if d == 1:
        return SyncChoice("none", 1)
    return SyncChoice(algo, 1 if algo == "all_reduce" else d)


def _pick(cands: list[Estimate]) -> Estimate | None:
    feas = [e for e in cands if e.feasible]
    return recommend(pareto_front(feas)) if feas else None


def _dp(profile: ModelProfile, G: int, plat: Platform, replicas: Sequence[int], algo: str, ga_micro: int | None) -> Estimate | None:
    L = len(profile.layers)
    out = []
    for d in replicas:
        if G % d:
            continue
        share = G // d
        if ga_micro:
            if share % ga_micro:
                continue
            b, m = ga_micro, share // ga_micro
        else:
            b, m = share, 1
        for t in plat.tiers_mb:
            out.append(evaluate(profile, Config((L,), (t,), d, b, m, (_sync(d, algo),)), plat))
    return _pick(out)


def lambdaml(profile: ModelProfile, G: int, plat: Platform, replicas: Sequence[int] = (1, 2, 4, 8, 16, 32, 64)) -> Estimate | None:
    return _dp(profile, G, plat, replicas, "scatter_reduce", None)


def lambdaml_ga(
    profile: ModelProfile, G: int, plat: Platform, replicas: Sequence[int] = (1, 2, 4, 8, 16, 32), micro_batch: int = 4
) -> Estimate | None:
    return _dp(profile, G, plat, replicas, "scatter_reduce", micro_batch)


def hybridps(profile: ModelProfile, G: int, plat: Platform, replicas: Sequence[int] = (1, 2, 4, 8, 16, 32, 64)) -> Estimate | None:
    return _dp(profile, G, plat, replicas, "all_reduce", None)


def hybridps_ga(
    profile: ModelProfile, G: int, plat: Platform, replicas: Sequence[int] = (1, 2, 4, 8, 16, 32), micro_batch: int = 4
) -> Estimate | None:
    return _dp(profile, G, plat, replicas, "all_reduce", micro_batch)


def _balanced(profile: ModelProfile, plat: Platform, S: int, b: int) -> tuple[int, ...]:
    ref = plat.tiers_mb[len(plat.tiers_mb) // 2]
    return tuple(balanced_partition([sum(l.times(ref, b, plat)) for l in profile.layers], S))


def tpdmp(
    profile: ModelProfile, G: int, plat: Platform, replicas: Sequence[int] = (1, 2, 4, 8, 16, 32), micro_batch: int = 4, max_stages: int = 8
) -> Estimate | None:
    out = []
    L = len(profile.layers)
    for d in replicas:
        if G % (d * micro_batch):
            continue
        m = G // (d * micro_batch)
        for S in range(1, max_stages_for(d, L, max_stages) + 1):
            bal = _balanced(profile, plat, S, micro_batch)
            for t in plat.tiers_mb:
                out.append(evaluate(profile, Config(bal, (t,) * S, d, micro_batch, m, (_sync(d, "scatter_reduce"),) * S), plat))
    return _pick(out)


def bayes(
    profile: ModelProfile,
    G: int,
    plat: Platform,
    trials: int = 100,
    weights: Sequence[tuple[float, float]] = FUNCPIPE_WEIGHTS,
    replicas: Sequence[int] = (1, 2, 4, 8, 16, 32),
    micro_batch_sizes: Sequence[int] = (1, 2, 4, 8),
    max_stages: int = 8,
    seed: int = 0,
) -> Estimate | None:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    L = len(profile.layers)
    found: list[Estimate] = []
    for a1, a2 in weights:

        def objective(trial: optuna.Trial, a1: float = a1, a2: float = a2) -> float:
            d = trial.suggest_categorical("d", list(replicas))
            b = trial.suggest_categorical("b", list(micro_batch_sizes))
            S = trial.suggest_int("S", 1, max_stages_for(d, L, max_stages))
            t = trial.suggest_categorical("tier", list(plat.tiers_mb))
            if G % (d * b):
                return float("inf")
            e = evaluate(
                profile, Config(_balanced(profile, plat, S, b), (t,) * S, d, b, G // (d * b), (_sync(d, "scatter_reduce"),) * S), plat
            )
            if not e.feasible:
                return float("inf")
            found.append(e)
            return objective_value(e.cost, e.time_s, a1, a2)

        study = optuna.create_study(sampler=optuna.samplers.TPESampler(seed=seed))
        study.optimize(objective, n_trials=trials)
    return _pick(found)


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
}
