"""Pareto sweep and FuncPipe's recommendation rule.

Weights (a1, a2) of a1*cost + a2*time are FuncPipe's: (1, 0), (1, 2^16), (1, 2^19), (1, 2^22),
with cost in nano-dollars (COST_UNIT in milp.py; see docs/planner.md for why that unit). The
recommendation is the fastest Pareto plan p whose speed-up pays for its extra cost relative to
the cheapest plan mc: delta = (t_mc/t_p - 1) / (c_p/c_mc - 1) >= 0.8 (``recommend``, the
baselines'). The planner's own (``recommend_within_accuracy``) leaves out speed-ups within the
performance model's accuracy and takes the cheapest plan within it (docs/planner.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

FUNCPIPE_WEIGHTS: tuple[tuple[float, float], ...] = ((1, 0), (1, 2**16), (1, 2**19), (1, 2**22))
DELTA_THRESHOLD = 0.8
# The performance model's stated accuracy on an iteration's seconds: the largest error it may make,
# issue 14's target "none above 8%", which held in every accuracy run since (docs/performance-model.md
# §6). Two predicted times closer than this are equally fast as far as the model can tell.
MODEL_TIME_ACCURACY = 0.08

T = TypeVar("T")


def _time_s(x: Any) -> float:
    return float(x.time_s)


def _cost(x: Any) -> float:
    return float(x.cost)


def pareto_front(items: Sequence[T], time_of: Callable[[T], float] = _time_s, cost_of: Callable[[T], float] = _cost) -> list[T]:
    """Items not dominated in (time, cost), sorted by cost ascending (= time descending)."""
    out: list[T] = []
    for it in sorted(items, key=lambda x: (cost_of(x), time_of(x))):
        if not out or time_of(it) < time_of(out[-1]) - 1e-12:
            out.append(it)
    return out


def delta(t_mc: float, c_mc: float, t_p: float, c_p: float) -> float:
    """FuncPipe's delta: relative speed-up per relative extra cost (inf if p is not dearer)."""
    if c_p <= c_mc:
        return float("inf")
    return (t_mc / t_p - 1.0) / (c_p / c_mc - 1.0)


def recommend(
    front: Sequence[T],
    threshold: float = DELTA_THRESHOLD,
    time_of: Callable[[T], float] = _time_s,
    cost_of: Callable[[T], float] = _cost,
) -> T:
    """The fastest plan with delta >= threshold against the cheapest plan (the cheapest itself
    qualifies trivially)."""
    if not front:
        raise ValueError("no feasible plan to recommend")
    mc = min(front, key=lambda x: (cost_of(x), time_of(x)))
    ok = [p for p in front if p is mc or delta(time_of(mc), cost_of(mc), time_of(p), cost_of(p)) >= threshold]
    return min(ok, key=lambda x: (time_of(x), cost_of(x)))


def recommend_within_accuracy(
    front: Sequence[T],
    accuracy: float = MODEL_TIME_ACCURACY,
    threshold: float = DELTA_THRESHOLD,
    time_of: Callable[[T], float] = _time_s,
    cost_of: Callable[[T], float] = _cost,
) -> T:
    """The planner's recommendation: FuncPipe's delta rule with speed-ups the model cannot resolve
    left out. A plan p is worth its extra cost over the cheapest plan mc only if it is faster by more
    than ``accuracy`` (t_p (1 + accuracy) < t_mc) and delta >= ``threshold``; of those the fastest
    is p*, and the recommendation is the cheapest plan of ``front`` predicted within ``accuracy`` of
    p* (t <= (1 + accuracy) t_p*): where a cheaper tier is as fast within the model's accuracy, the
    cheaper one (a tiny MLP's 10,240 MB plan, 1% faster than its 512 MB one by the tier curve, is
    not recommended). ``accuracy`` = 0 is FuncPipe's rule (:func:`recommend`)."""
    if not front:
        raise ValueError("no feasible plan to recommend")
    mc = min(front, key=lambda x: (cost_of(x), time_of(x)))
    t_mc, c_mc = time_of(mc), cost_of(mc)
    ok = [p for p in front if p is mc or (time_of(p) * (1 + accuracy) < t_mc and delta(t_mc, c_mc, time_of(p), cost_of(p)) >= threshold)]
    fastest = min(ok, key=lambda x: (time_of(x), cost_of(x)))
    band = [p for p in front if time_of(p) <= (1 + accuracy) * time_of(fastest)]
    return min(band, key=lambda x: (cost_of(x), time_of(x)))
