"""Issue 25 item 4, sixth pass: the speed-ups keep the solve exact.

- milp._Model.add builds a row from (column, coefficient) pairs into flat lists: the very
  columns, coefficients and row bounds that ``prob += _lin(pairs) <= rhs`` gives (repeated
  columns summed in the same order), so HiGHS is handed the same model;
- a bound sweep with context also sweeps the weights without it and is kept for the same band
  pairs: the group bounds without context and the pair bounds that follow are, bit for bit, a
  fresh sweep's;
- a band whose LP ends below the cutoff waits for its MILP by that LP's optimum (best first):
  the search still proves brute force's optimum.
No timing here (benchmarks/planner.py measures the solve times)."""

import copy
import random

import numpy as np
import pytest
from test_milp import CASES
from test_milp_bounds import random_instance
from test_milp_speed_decomposition import assert_bruteforce_optimum

from stagecoach.planner.model.platforms import aws_platform
from stagecoach.planner.solve import search
from stagecoach.planner.solve.milp import _lin, _Model, _Var


def _rows(prob: _Model) -> tuple:
    return [v.name for v in prob._vars], prob._coefs, prob._nnz, prob._lo, prob._hi


@pytest.mark.parametrize("seed", range(10))
def test_a_row_added_from_pairs_is_the_row_of_lin(seed):
    """Random rows (repeated columns, zero and signed coefficients, int and float right-hand
    sides, every sense) added both ways: the same flat entries and bounds to the last bit."""
    rng = random.Random(seed)
    xs = [_Var(f"v{k}", 0, None) for k in range(5)]
    fast, ref = _Model(), _Model()
    for _ in range(30):
        pairs = [
            (xs[rng.randrange(5)], rng.choice([0.0, 1.0, -1.0, rng.uniform(-1e3, 1e3) * 10 ** rng.randint(-6, 6)]))
            for _ in range(rng.randint(1, 7))
        ]
        rhs = rng.choice([0, 2, rng.uniform(-50, 50)])
        sense = rng.choice(["<=", ">=", "=="])
        fast.add(pairs, sense, rhs)
        e = _lin(pairs)
        ref += (e <= rhs) if sense == "<=" else (e >= rhs) if sense == ">=" else (e == rhs), "name"
    got, want = _rows(fast), _rows(ref)
    assert got[:3] == want[:3]
    for a, b in zip(got[3:], want[3:]):  # bounds, signed zeros included
        assert [(x, np.copysign(1.0, x)) for x in a] == [(x, np.copysign(1.0, x)) for x in b]
    assert fast.nrows == 30


@pytest.mark.parametrize("seed", range(8))
def test_the_sweep_kept_from_a_context_sweep_equals_fresh_sweeps(seed):
    """group_bounds with context, then without and pair_bounds on the same pairs (as a split or
    the final MILPs ask them, over all groups and over the alive ones): each equals a fresh
    object's sweep, bit for bit; other pairs sweep anew."""
    inst = random_instance(random.Random(600 + seed))
    bounds, objs = inst.bounds, inst.objs
    cutoff = sorted(objs)[len(objs) // 4] * (1 + 1e-9) + 1e-6
    pairs = bounds.refine(bounds.grid(3), cutoff)
    alive = bounds.group_bounds(pairs, ctx=True, per_pair=True).min(axis=0) <= cutoff
    for mask in (None, alive):
        fresh = copy.copy(bounds)
        fresh._view, fresh._memo = None, None
        with_ctx = bounds.group_bounds(pairs, ctx=True, per_pair=True, alive=mask)
        without = bounds.group_bounds(pairs, ctx=False, per_pair=True, alive=mask)
        plb = bounds.pair_bounds(pairs, mask)
        fresh_without = fresh.group_bounds(pairs, ctx=False, per_pair=True, alive=mask)
        fresh_plb = copy.copy(fresh).pair_bounds(pairs, mask)
        fresh_ctx = fresh.group_bounds(pairs, ctx=True, per_pair=True, alive=mask)
        assert np.array_equal(with_ctx, fresh_ctx)
        assert np.array_equal(without, fresh_without)
        assert np.array_equal(plb, fresh_plb)
    other = bounds.grid(2)
    clean = copy.copy(bounds)
    clean._view, clean._memo = None, None
    assert np.array_equal(bounds.pair_bounds(other), clean.pair_bounds(other))


BAND_CASES = [c for c in CASES if c[3] >= search.BANDS_FROM_M][:8]
_lp_refutes = search._Search.lp_refutes


def _no_lp_plans(self, *args):
    """lp_refutes that leaves to the MILP what the LP's heaviest path would decide: on these
    small instances the LPs are often integral, and then no MILP would wait for its turn."""
    out = _lp_refutes(self, *args)
    return out and self.milps[-1]["status"] != "lp-plan"


def _patch(mp) -> None:
    mp.setattr(search, "BAND_SPLIT_GROUPS", 4)
    mp.setattr(search, "BANDS_ALL_MAX", 0)
    mp.setattr(search, "PAIR_BUDGET", 0)
    mp.setattr(search._Search, "lp_refutes", _no_lp_plans)


@pytest.mark.parametrize("case", BAND_CASES, ids=lambda c: f"L{len(c[0].layers)}-d{c[1]}-m{c[3]}-w{c[5][1]}")
def test_band_milps_ordered_by_their_lps_equal_bruteforce(case, monkeypatch):
    """Every band split down to small MILPs, and every band LP below the cutoff left to its MILP,
    which waits by the LP's optimum: the optimum is brute force's."""
    _patch(monkeypatch)
    assert_bruteforce_optimum(case)


def test_some_band_milp_waits_for_its_lp_bound():
    """On those cases some band's LP ends below the cutoff and its MILP runs after it (else the
    test above proves nothing about the ordering)."""
    waited = 0
    with pytest.MonkeyPatch.context() as mp:
        _patch(mp)
        for prof, d, b, m, tiers, (a1, a2), smax, algos in BAND_CASES:
            r = search.solve_fixed(prof, aws_platform(), d, b, m, a1, a2, tiers=tiers, max_stages=smax, sync_algos=algos, first_groups=2)
            tags = [x["tag"] for x in r.info.get("milps", [])]
            lp_ok = [x["tag"][: -len("-lp")] for x in r.info.get("milps", []) if x["tag"].endswith("-lp") and x["status"] != "refuted"]
            waited += sum(1 for t in lp_ok if t in tags)
    assert waited > 0
