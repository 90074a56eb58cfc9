"""The planner's entry point: ``plan_model(profile, global_batch) -> PlanningResult``.

For every data-parallel degree d and micro-batch size b that divide the global batch, and every
Pareto weight, solve the exact MILP (milp.py) seeded with a quick heuristic incumbent, keep the
better of the two (so a time-limited solve can never return something worse than the heuristic),
then take the Pareto front over everything found and recommend with FuncPipe's delta rule.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from .milp import max_stages_for, objective_value, solve_fixed
from .pareto import FUNCPIPE_WEIGHTS, pareto_front, recommend
from .perfmodel import Config, Estimate, evaluate, sync_choices, timeouts
from .platforms import Platform, aws_platform
from .profile import ModelProfile, balanced_partition, check_fits

DEFAULT_REPLICAS = (1, 2, 4, 8, 16, 32)


@dataclass
class PlannedConfig:
    """One candidate plan with its prediction and how it was found."""

    estimate: Estimate
    weights: tuple[float, float]
    method: str  # "milp", "milp(time_limit)" or "heuristic"
    solve_s: float
    profile: ModelProfile
    platform: Platform

    @property
    def time_s(self) -> float:
        return self.estimate.time_s

    @property
    def cost(self) -> float:
        return self.estimate.cost

    @property
    def config(self) -> Config:
        return self.estimate.config

    def original_balance(self) -> tuple[int, ...]:
        """Stage sizes in the user's nn.Sequential children (undoing layer merging)."""
        out, i = [], 0
        for n in self.config.balance:
            out.append(sum(l.count for l in self.profile.layers[i : i + n]))
            i += n
        return tuple(out)

    def to_plan(self) -> Any:
        """The runtime contract (stagecoach.planner.plan.Plan): per stage the sync algorithm and K,
        the model's predicted task seconds per phase (extras["predicted_task_s"], what the
        runtime's timeout manager starts from) and TimeoutSeconds by plan.timeouts_from. Raises
        PlanError if a phase is predicted not to fit Lambda's 15 minutes."""
        from .plan import Plan

        c, e = self.config, self.estimate
        fields = [s.plan_fields() for s in c.sync]
        task_s = [{p: round(v, 3) for p, v in row.items()} for row in e.task_seconds()]
        return Plan(
            balance=self.original_balance(),
            replicas=c.replicas,
            micro_batches=c.micro_batches,
            global_batch=c.global_batch,
            sync=tuple(f[0] for f in fields),
            aggregators=tuple(f[1] for f in fields),
            memory_mb=tuple(c.tiers_mb),
            timeouts_s=timeouts(e),  # plan.timeouts_from: refuses a phase that cannot fit 15 minutes
            extras={
                "predicted_task_s": task_s,
                "sync_algorithms": [s.label() for s in c.sync],
                "predicted_s_per_iteration": round(e.time_s, 4),
                "predicted_usd_per_iteration": e.cost,
                "predicted_phase_s": {"forward": round(e.forward_s, 4), "backward_sync": round(e.backward_sync_s, 4)},
                "platform": self.platform.name,
                "planner_method": self.method,
            },
        )


@dataclass
class PlanningResult:
    profile: ModelProfile
    global_batch: int
    platform: Platform
    candidates: list[PlannedConfig]
    pareto: list[PlannedConfig]
    recommended: PlannedConfig
    solve_s: float
    notes: list[str] = field(default_factory=list)


def heuristic_estimates(profile: ModelProfile, plat: Platform, d: int, b: int, m: int, sync_algos: Sequence[str] | None, max_stages: int) -> list[Estimate]:
    """Cheap feasible candidates: balanced partitions x uniform tiers (an incumbent for the MILP)."""
    L = len(profile.layers)
    ref = plat.tiers_mb[len(plat.tiers_mb) // 2]
    wts = [sum(l.times(ref, b, plat)) for l in profile.layers]
    out = []
    for S in range(1, max_stages_for(d, L, max_stages) + 1):
        bal = tuple(balanced_partition(wts, S))
        for t in plat.tiers_mb:
            for c in sync_choices(d, sync_algos):
                e = evaluate(profile, Config(bal, (t,) * S, d, b, m, (c,) * S), plat)
                if e.feasible:
                    out.append(e)
    return out


def plan_model(
    profile: ModelProfile,
    global_batch: int,
    platform: Platform | None = None,
    weights: Sequence[tuple[float, float]] = FUNCPIPE_WEIGHTS,
    replicas: Sequence[int] = DEFAULT_REPLICAS,
    micro_batch_sizes: Sequence[int] = (4,),
    max_stages: int = 8,
    max_layers: int = 12,
    sync_algos: Sequence[str] | None = ("scatter_reduce",),
    time_limit: float = 5.0,
    use_milp: bool = True,
) -> PlanningResult:
    """Plan a model: the Pareto set over (d, b, weights) and FuncPipe's recommendation.

    ``max_layers``: layers are merged to at most this many groups of balanced compute time before
    the MILP (docs/planner.md, "layer merging"). ``sync_algos``: the runtime runs scatter_reduce;
    add "pipelined_scatter_reduce", "k_reduce", "all_reduce" to see what they would give.
    """
    t0 = time.perf_counter()
    plat = platform or aws_platform()
    if global_batch < 1:
        raise ValueError(f"global_batch={global_batch}: must be a positive number of samples")
    check_fits(profile, plat, micro_batch=1)
    prof = profile.merged(max_layers, plat, micro_batch=max(micro_batch_sizes))
    cands: list[PlannedConfig] = []
    notes: list[str] = []
    for d in replicas:
        for b in micro_batch_sizes:
            if global_batch % (d * b):
                continue
            m = global_batch // (d * b)
            heur = heuristic_estimates(prof, plat, d, b, m, sync_algos, max_stages)
            for a1, a2 in weights:
                inc = min(heur, key=lambda e: objective_value(e.cost, e.time_s, a1, a2), default=None)
                inc_obj = objective_value(inc.cost, inc.time_s, a1, a2) if inc else None
                best, how, ss = inc, "heuristic", 0.0
                if use_milp:
                    r = solve_fixed(prof, plat, d, b, m, a1, a2, max_stages=max_stages, sync_algos=sync_algos, time_limit=time_limit, incumbent_objective=inc_obj)
                    ss = r.solve_s
                    if r.config is not None:
                        e = evaluate(prof, r.config, plat)
                        if e.feasible and (inc_obj is None or objective_value(e.cost, e.time_s, a1, a2) <= inc_obj * (1 + 1e-9)):
                            best, how = e, "milp" if r.status == "optimal" else "milp(time_limit)"
                if best is not None:
                    cands.append(PlannedConfig(best, (a1, a2), how, ss, prof, plat))
    if not cands:
        raise ValueError(
            f"no feasible plan for {profile.name!r} at global batch {global_batch}: every combination of "
            f"replicas {list(replicas)} and micro-batch sizes {list(micro_batch_sizes)} either does not divide the "
            "batch, exceeds Lambda memory or the 900 s task limit; try more stages (max_stages), smaller micro-batches "
            "or another global batch"
        )
    front = pareto_front(cands)
    rec = recommend(front)
    return PlanningResult(prof, global_batch, plat, cands, front, rec, time.perf_counter() - t0, notes)
