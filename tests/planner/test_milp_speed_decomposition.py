"""The band decomposition of the exact solve stays exact when it splits band pairs and when it
is used however much the bands overlap: equal to brute force (planner/solve/bruteforce.py) on
small instances with many micro-batches, where the bottleneck bands decide. No timing here
(benchmarks/planner.py measures the solve times)."""

import pytest
from test_milp import CASES

from stagecoach.planner.model.perfmodel import evaluate
from stagecoach.planner.model.platforms import aws_platform
from stagecoach.planner.solve import search
from stagecoach.planner.solve.bruteforce import solve_bruteforce
from stagecoach.planner.solve.objective import objective_value
from stagecoach.planner.solve.search import solve_fixed

BAND_CASES = [c for c in CASES if c[3] >= search.BANDS_FROM_M][:10]


def test_there_are_band_cases():
    assert len(BAND_CASES) >= 6


@pytest.mark.parametrize("case", BAND_CASES, ids=lambda c: f"L{len(c[0].layers)}-d{c[1]}-m{c[3]}-w{c[5][1]}")
def test_split_bands_equal_bruteforce(case, monkeypatch):
    """Coarse band pairs (no refinement), every one whose MILP would hold more than 2 groups split
    (as deep as the values allow), bands used whatever their overlap: the optimum is brute force's."""
    monkeypatch.setattr(search, "BAND_SPLIT_GROUPS", 2)
    monkeypatch.setattr(search, "BAND_SPLIT_DEPTH", 50)
    monkeypatch.setattr(search, "BANDS_ALL_MAX", 0)
    monkeypatch.setattr(search, "PAIR_BUDGET", 0)  # coarse bands: the refinement would leave nothing to split
    assert_bruteforce_optimum(case)


def assert_bruteforce_optimum(case) -> None:
    """solve_fixed on ``case`` (with whatever search settings the caller patched) proves brute
    force's optimum."""
    prof, d, b, m, tiers, (a1, a2), smax, algos = case
    plat = aws_platform()
    r = solve_fixed(prof, plat, d, b, m, a1, a2, tiers=tiers, max_stages=smax, sync_algos=algos, first_groups=2)
    best, obj = solve_bruteforce(prof, plat, d, b, m, a1, a2, tiers=tiers, max_stages=smax, sync_algos=algos)
    if best is None:
        assert r.config is None
        return
    assert r.status == "optimal" and r.config is not None, r.status
    est = evaluate(prof, r.config, plat)
    assert est.feasible and objective_value(est.cost, est.time_s, a1, a2) == pytest.approx(obj, rel=2e-6)


def band_case_infos() -> list[dict]:
    """Each band case's solve record, bands split as far as they go (for tests that the cases
    really take a path)."""
    infos = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(search, "BAND_SPLIT_GROUPS", 2)
        mp.setattr(search, "BANDS_ALL_MAX", 0)
        mp.setattr(search, "PAIR_BUDGET", 0)
        for prof, d, b, m, tiers, (a1, a2), smax, algos in BAND_CASES:
            r = solve_fixed(prof, aws_platform(), d, b, m, a1, a2, tiers=tiers, max_stages=smax, sync_algos=algos, first_groups=2)
            infos.append(r.info)
    return infos


def test_the_split_path_is_taken():
    """At least one of the cases above really splits a band pair (else the test proves nothing)."""
    assert sum(info.get("band_splits", 0) for info in band_case_infos()) > 0
