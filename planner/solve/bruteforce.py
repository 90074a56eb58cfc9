"""Brute-force enumeration of every configuration, for small instances (verifies the MILP).

Enumerates all 2^(L-1) contiguous partitions (up to ``max_stages`` stages), every tier per stage
and every sync choice per stage, evaluates each with ``perfmodel.evaluate`` and keeps the best
feasible one. Cost grows as (tiers x choices)^S, so keep L <= 8 and few tiers/choices.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence

from stagecoach.planner.model.perfmodel import Config, Estimate, evaluate
from stagecoach.planner.model.platforms import Platform
from stagecoach.planner.model.syncmodel import sync_choices
from stagecoach.planner.profile.layers import ModelProfile, compositions
from stagecoach.planner.solve.objective import max_stages_for, objective_value


def all_plans(
    profile: ModelProfile,
    plat: Platform,
    replicas: int,
    micro_batch: int,
    micro_batches: int,
    tiers: Sequence[int] | None = None,
    max_stages: int = 8,
    sync_algos: Sequence[str] | None = None,
) -> Iterator[Estimate]:
    """Every configuration of (d, b, m), evaluated (feasible or not)."""
    tiers = list(tiers or plat.tiers_mb)
    choices = sync_choices(replicas, sync_algos)
    smax = max_stages_for(replicas, len(profile.layers), max_stages, plat)
    for bal in compositions(len(profile.layers), smax):
        n = len(bal)
        for ts in itertools.product(tiers, repeat=n):
            for sy in itertools.product(choices, repeat=n):
                yield evaluate(profile, Config(bal, ts, replicas, micro_batch, micro_batches, sy), plat)


def solve_bruteforce(
    profile: ModelProfile,
    plat: Platform,
    replicas: int,
    micro_batch: int,
    micro_batches: int,
    a1: float = 1.0,
    a2: float = 0.0,
    tiers: Sequence[int] | None = None,
    max_stages: int = 8,
    sync_algos: Sequence[str] | None = None,
) -> tuple[Estimate | None, float]:
    """(best feasible estimate, its objective); (None, inf) if nothing is feasible. ``sync_algos``:
    None = all of them, as the MILP (slow: choices^stages)."""
    best, best_obj = None, math.inf
    for est in all_plans(profile, plat, replicas, micro_batch, micro_batches, tiers, max_stages, sync_algos):
        if not est.feasible:
            continue
        obj = objective_value(est.cost, est.time_s, a1, a2)
        if obj < best_obj:
            best, best_obj = est, obj
    return best, best_obj
