"""The objective every planner minimises: a1 * cost + a2 * time, cost in nano-dollars, and the
stage slots a plan may use. One definition for the MILP, the brute force and the seed papers'
baselines (docs/planner.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from stagecoach.planner.limits import LAMBDA_ACCOUNT_CONCURRENCY, max_stages_at

if TYPE_CHECKING:  # pragma: no cover
    from stagecoach.planner.model.platforms import Platform

COST_UNIT = 1e-9  # objective: a1 * cost / COST_UNIT + a2 * seconds (nano-dollars; see docs/planner.md)
# relative tolerance of the cutoff and of the bound test: keep anything within 1e-7 of the incumbent
REL_TOL = 1e-7


def objective_weights(a1: float, a2: float) -> tuple[float, float]:
    """(weight per USD, weight per second) of the objective, with a tiny tie-break so that a pure
    cost objective prefers the faster of equally cheap plans (and vice versa)."""
    if a1 < 0 or a2 < 0 or a1 + a2 == 0:
        raise ValueError(f"weights ({a1}, {a2}) must be non-negative and not both zero")
    wc = a1 / COST_UNIT if a1 else 1e-9 / COST_UNIT * 1e-9
    wt = a2 if a2 else 1e-3
    return wc, wt


def weighted_objective(cost: Any, time_s: Any, wc: float, wt: float) -> Any:
    """wc * cost + wt * time: the objective for weights from :func:`objective_weights`; ``cost`` and
    ``time_s`` may be numbers, numpy arrays or pulp expressions (the MILP's own objective)."""
    return wc * cost + wt * time_s


def objective_value(cost: float, time_s: float, a1: float, a2: float) -> float:
    """The objective the MILP minimises, for an evaluated plan."""
    wc, wt = objective_weights(a1, a2)
    return float(weighted_objective(cost, time_s, wc, wt))


def max_stages_for(d: int, layers: int, max_stages: int, plat: Platform | None = None) -> int:
    """Stage slots: at most one stage per layer, and the stages x d workers the account's
    concurrency leaves room for (planner/limits.py max_stages_at, ``plat.concurrency``; the
    default quota without a platform). At least 1: a d no stage count fits is refused by the
    performance model (perfmodel._violations), and the sweep does not try it (sweep.replica_candidates)."""
    concurrency = plat.concurrency if plat is not None else LAMBDA_ACCOUNT_CONCURRENCY
    inline_only = plat.inline_map_only if plat is not None else False
    return max(1, min(layers, max_stages, max_stages_at(d, concurrency, inline_only)))
