"""The MILP over a set of candidate stages (planner/solve/search.py has the whole method).

3. The MILP over the remaining groups: a *path* formulation, x[g,o] = 1 iff g is a stage with
   option o; the stages form a path 0 -> L through boundary nodes (a network flow: its LP
   relaxation is integral). What couples the stages are the two flow shops: the forward task of
   stage s lasts F_s = maxL_{<=s} + sumA_{<=s} + (m-1) maxA_{<=s} (prefix sums and maxima), the
   backward task BT_s = l_last + sumB_{>=s} + (m-1) maxB_{>=s} + tail_s (suffix ones), and both
   are billed at the stage's own tier: price_s x F_s is the one genuinely bilinear term. It is
   linearised exactly and without big-M by *carrying the flow-shop state along the path*: every
   group has variables for the prefix state it receives (ea: the forward steps before it, em and
   el: their maximum step and parameter load) and for the suffix state flowing backwards from the
   last stage (xb, xm, ll, and xw: the latest branch end after it). At every node the state leaving the stage that ends there equals the
   state entering the stage that starts there (conservation, like the path itself), and a
   group's state is 0 unless the group is chosen (ea <= U y_g with U a longest-path bound). Then
   F_g = ml + ea + a y + (m-1) ma, with ma >= em and ma >= a y, is the stage's forward duration if
   chosen and 0 otherwise, and sum_g price_g d F_g is the exact bill, linear. Maxima are
   variables bounded below; each is billed or timed with a positive weight, so it is tight at an
   optimum. T = T_F + T_BS with T_F the state carried into the last stage and T_BS = o + the
   latest branch end carried to the first stage. HiGHS (highspy, ``_Model``) solves it with the incumbent
   as a cutoff; given the groups' bounds, one more row per group caps the waits it carries
   below that cutoff (``WaitSlack``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import highspy
import numpy as np

from stagecoach.planner.limits import max_peak_invocations
from stagecoach.planner.model.perfmodel import (
    Config,
    global_transitions,
    phase_overhead,
)
from stagecoach.planner.model.platforms import Platform
from stagecoach.planner.solve.candidates import Candidates, Group
from stagecoach.planner.solve.objective import weighted_objective


# -- the MILP over a set of groups ----------------------------------------------------------------
@dataclass
class MilpSolution:
    config: Config | None
    objective: float
    status: str  # "optimal", "time_limit", "infeasible" (nothing below the cutoff), or HiGHS's word
    variables: int
    constraints: int
    path: Config | None = None  # of an LP relaxation: the plan along its heaviest arcs (an LP optimum's, if integral)


# -- the model handed to HiGHS ---------------------------------------------------------------------
class _Var:
    """A column: its name (the columns are ordered by name), bounds, integrality and, after the
    solve, its value."""

    __slots__ = ("name", "lo", "hi", "integer", "val")

    def __init__(self, name: str, lo: float | None = None, hi: float | None = None, integer: bool = False) -> None:
        self.name, self.lo, self.hi, self.integer = name, lo, hi, integer
        self.val: float | None = None

    def value(self) -> float | None:
        return self.val


class _Expr(dict[_Var, float]):
    """A linear expression: coefficients by column in insertion order, and a constant. The same
    arithmetic as pulp.LpAffineExpression, operation for operation (so the same floats reach
    HiGHS as when pulp built the model: identical solves), without pulp's bookkeeping, which took
    two thirds of a band LP's time (AmoebaNet-D36, L = 30, d = 32: 12 of 18 CPU s for 100 LPs)."""

    def __init__(self, items: Any = (), const: float = 0.0) -> None:
        super().__init__(items)
        self.const = const

    def _add(self, other: Any, sign: int) -> _Expr:
        """pulp's addInPlace on a copy: a column adds sign, an expression its terms, a number its value."""
        out = _Expr(self, self.const)
        if isinstance(other, _Var):
            out[other] = out[other] + sign if other in out else sign
        elif isinstance(other, _Expr):
            out.const += other.const * sign
            for v, x in other.items():
                out[v] = out[v] + x * sign if v in out else x * sign
        else:
            out.const += other * sign
        return out

    def __add__(self, other: Any) -> _Expr:
        return self._add(other, 1)

    __radd__ = __add__

    def __sub__(self, other: Any) -> _Expr:
        return self._add(other, -1)

    def __mul__(self, c: float) -> _Expr:
        out = _Expr()
        if c != 0:
            out.const = self.const * c
            for v, x in self.items():
                out[v] = c * x
        return out

    __rmul__ = __mul__

    def __le__(self, rhs: float) -> _Row:
        return _Row(self, None, -(self.const - rhs))

    def __ge__(self, rhs: float) -> _Row:
        return _Row(self, -(self.const - rhs), None)

    def __eq__(self, rhs: float) -> _Row:  # type: ignore[override]
        return _Row(self, -(self.const - rhs), -(self.const - rhs))

    __hash__ = None


@dataclass
class _Row:
    """lo <= sum of the expression's terms <= hi (None: unbounded), as pulp's getLb/getUb."""

    expr: _Expr
    lo: float | None
    hi: float | None


def _lin(pairs: Any, const: float = 0.0) -> _Expr:
    """A linear expression that sums repeated variables (pulp's constructor keeps the last)."""
    acc: dict[Any, float] = {}
    for var, c in pairs:
        acc[var] = acc.get(var, 0.0) + c
    return _Expr(acc, const)


class _Model:
    """Rows in the order they are added, an objective, and the solve: the columns sorted by name
    and the rows in order, handed to HiGHS in one call (as pulp 3.3's HiGHS interface orders
    them, so the simplex sees the same model). The rows' entries are kept in flat lists (columns,
    coefficients, a length per row), not one dict per row: a band LP's model was built and handed
    over in about 40% of its time, mostly per-row Python work (AmoebaNet-D36, L = 30, d = 32)."""

    def __init__(self) -> None:
        self.objective = _Expr()
        self.cols: list[_Var] = []
        self._vars: list[_Var] = []  # every row's columns, row after row
        self._coefs: list[float] = []
        self._nnz: list[int] = []  # entries per row
        self._lo: list[float] = []  # row bounds (-inf / inf: none)
        self._hi: list[float] = []

    @property
    def nrows(self) -> int:
        return len(self._nnz)

    def row(self, expr: dict[_Var, float], lo: float | None, hi: float | None) -> None:
        """lo <= sum of ``expr``'s terms <= hi (None: unbounded)."""
        self._vars.extend(expr)
        self._coefs.extend(expr.values())
        self._nnz.append(len(expr))
        self._lo.append(-highspy.kHighsInf if lo is None else lo)
        self._hi.append(highspy.kHighsInf if hi is None else hi)

    def add(self, pairs: list[tuple[_Var, float]], sense: str, rhs: float) -> None:
        """The row ``_lin(pairs) <sense> rhs`` (sense "<=", ">=" or "=="), with _lin's sums of
        repeated columns and _Expr's row bounds to the last bit, without building either."""
        acc = dict(pairs)
        if len(acc) != len(pairs):  # a repeated column: sum its coefficients in _lin's order
            acc = {}
            for var, c in pairs:
                acc[var] = acc.get(var, 0.0) + c
        b = -(0.0 - rhs)
        self._vars.extend(acc)  # (``row``, inlined: a model has thousands of rows)
        self._coefs.extend(acc.values())
        self._nnz.append(len(acc))
        self._lo.append(-highspy.kHighsInf if sense == "<=" else b)
        self._hi.append(highspy.kHighsInf if sense == ">=" else b)

    def __iadd__(self, item: Any) -> _Model:
        row = item[0] if isinstance(item, tuple) else item
        if isinstance(row, _Row):
            self.row(row.expr, row.lo, row.hi)
        else:
            self.objective = row
        return self

    def solve(self, h: highspy.Highs) -> None:
        """Pass the model to ``h``, run it and read the columns' values."""
        seen: dict[_Var, Any] = dict.fromkeys(self.objective)
        seen.update(dict.fromkeys(self._vars))  # (every column in a row or the objective)
        self.cols = sorted(seen, key=lambda v: v.name)
        index = {v: c for c, v in enumerate(self.cols)}
        ca = np.fromiter(map(index.__getitem__, self._vars), dtype=np.int32, count=len(self._vars))
        ra = np.repeat(np.arange(self.nrows, dtype=np.int32), self._nnz)
        va = np.array(self._coefs, dtype=np.float64)
        nz = va != 0
        order = np.argsort(ca[nz], kind="stable")  # column-wise, each column's rows ascending
        ca, ra, va = ca[nz][order], ra[nz][order], va[nz][order]
        start = np.zeros(len(self.cols) + 1, dtype=np.int32)
        start[1:] = np.cumsum(np.bincount(ca, minlength=len(self.cols)))
        inf = highspy.kHighsInf
        h.passModel(
            len(self.cols),
            self.nrows,
            int(start[-1]),
            1,  # MatrixFormat.kColwise
            1,  # ObjSense.kMinimize
            0.0,
            np.array([self.objective.get(v, 0.0) for v in self.cols], dtype=np.float64),
            np.array([-inf if v.lo is None else v.lo for v in self.cols], dtype=np.float64),
            np.array([inf if v.hi is None else v.hi for v in self.cols], dtype=np.float64),
            np.array(self._lo, dtype=np.float64),
            np.array(self._hi, dtype=np.float64),
            start,
            ra,
            va,
            np.array([1 if v.integer else 0 for v in self.cols], dtype=np.int32),
        )
        h.run()
        for v, val in zip(self.cols, list(h.getSolution().col_value)):
            v.val = val

    def value(self) -> float | None:
        """The objective at the columns' values (constant included), as pulp.value sums it."""
        s = self.objective.const
        for v, x in self.objective.items():
            if v.val is None:
                return None
            s += v.val * x
        return s


@dataclass
class _Caps:
    """Valid upper bounds of the carried state at each node (longest paths over these groups,
    capped by the task limit: F_s >= sumA and >= m maxA, BT_s >= sumB and >= m maxB; and by the
    cutoff: a plan below it has wt * T <= cutoff, so every carried time is <= cutoff / wt)."""

    UA: list[float]  # forward: the sum of steps carried into a node
    UM: list[float]  # ... their largest step
    UL: list[float]  # ... their largest parameter load
    UB: list[float]  # backward: the sum of steps carried into a node from the stages after it
    UX: list[float]  # ... their largest step
    ULL: float  # the last stage's parameter load
    UW: list[float]  # the latest branch end after a node
    fcap: list[float]  # per group from the bill: d * price * (its task's duration) <= cost <= cutoff / wc


@dataclass
class WaitSlack:
    """What a plan below the cutoff may carry into each group beyond its least waits
    (search._Search.slack; docs/performance-model.md §7.3). A group's bound without context bills
    its own waits at their least over every path (before[i] forward, after[j] backward), its own
    load and not the last stage's load in its backward task; the objective bills each excess at
    d x the group's price. So a plan through q below the cutoff has ea + xb + ll + ml <= before[i]
    + after[j] + l_o + slack[q], slack = (cutoff - bound) / (wc d price): a row per group, where
    the LP relaxation otherwise loads the carried waits onto whichever fractional stage bills
    them least."""

    before: Sequence[float]  # per node: the least forward steps and hops of any path 0 -> node
    after: Sequence[float]  # ... the least backward ones node -> L
    slack: dict[int, float]  # per group (by its identity, id(group)): its excess cap in seconds


@dataclass
class _Floors:
    """Valid lower bounds of the carried state at each node (shortest and minimax paths over
    these groups): whatever path a plan takes to a node, the steps it carries there sum to at
    least LA and their largest is at least MA. As rows (ea >= LA y), they stop the LP relaxation
    from handing a fractional stage less waiting than any real path could."""

    LA: list[float]  # forward: the least sum of steps carried into a node
    MA: list[float]  # ... the least largest step
    ML: list[float]  # ... the least largest parameter load
    LB: list[float]  # backward: the least sum of steps carried into a node from after it
    MB: list[float]  # ... the least largest step
    LL: list[float]  # ... the least load of the last stage


class _PathMilp:
    """The path MILP over ``groups`` under construction (module docstring, step 3): each method
    adds one family of variables and constraints to ``prob``. They are called in one fixed order,
    the order HiGHS is given the rows in (solve_milp)."""

    def __init__(self, cands: Candidates, groups: Sequence[Group], plat: Platform, relax: bool) -> None:
        self.groups, self.plat = groups, plat
        self.L, self.d, self.m = cands.layers, cands.replicas, cands.micro_batches
        self.o, self.maxT = phase_overhead(plat, self.d), plat.max_predicted_task_s
        self.start: dict[int, list[int]] = {n: [] for n in range(self.L + 1)}
        self.end: dict[int, list[int]] = {n: [] for n in range(self.L + 1)}
        for q, g in enumerate(groups):
            self.start[g.i].append(q)
            self.end[g.j].append(q)
        self.prob = _Model()
        self.x = [[_Var(f"x_{g.i}_{g.j}_{g.k}_{op.a}", 0, 1, not relax) for op in g.options] for g in groups]
        # the forward state (ea, em, el: into a group; ma, ml: out of it), each stage's F_s - o
        self.ea: dict[int, Any] = {}
        self.em: dict[int, Any] = {}
        self.el: dict[int, Any] = {}
        self.ma: dict[int, Any] = {}
        self.ml: dict[int, Any] = {}
        self.F: dict[int, _Expr] = {}
        # the backward state (xb, xm, ll: into a group from after it; mb: out of it), BT_s - o - tail_s
        self.xb: dict[int, Any] = {}
        self.xm: dict[int, Any] = {}
        self.ll: dict[int, Any] = {}
        self.mb: dict[int, Any] = {}
        self.BT: dict[int, _Expr] = {}
        self.fl = self.floors()

    # -- bounds of the carried state --------------------------------------------------------------
    def caps(self, wc: float, wt: float, cutoff: float | None) -> _Caps:
        """The bounds of every carried variable (``_Caps``): the tighter, the stronger the LP."""
        tcap = cutoff / wt if cutoff is not None and math.isfinite(cutoff) and wt > 0 else math.inf
        ccap = cutoff / wc if cutoff is not None and math.isfinite(cutoff) and wc > 0 else math.inf
        UA, UM, UL = self._prefix_caps(tcap)
        UB, UX = self._suffix_caps(tcap)
        ULL = min(tcap, max((op.load_s for q in self.end[self.L] for op in self.groups[q].options), default=0.0))
        fcap = [ccap / (self.d * g.price) for g in self.groups]
        return _Caps(UA, UM, UL, UB, UX, ULL, self._branch_caps(tcap, ULL, UB, UX), fcap)

    def _prefix_caps(self, tcap: float) -> tuple[list[float], list[float], list[float]]:
        """Longest forward paths 0 -> node: the sum of steps, the largest step and load."""
        L, m, maxT, groups = self.L, self.m, self.maxT, self.groups
        UA, UM, UL = [0.0] * (L + 1), [0.0] * (L + 1), [0.0] * (L + 1)
        for n in range(1, L):
            for q in self.end[n]:
                g = groups[q]
                UA[n] = max(UA[n], UA[g.i] + g.af)
                UM[n] = max(UM[n], UM[g.i], g.a)
                UL[n] = max(UL[n], UL[g.i], max(op.load_s for op in g.options))
            UA[n], UM[n], UL[n] = min(UA[n], maxT, tcap), min(UM[n], maxT / m, tcap / m), min(UL[n], tcap)
        return UA, UM, UL

    def _suffix_caps(self, tcap: float) -> tuple[list[float], list[float]]:
        """Longest backward paths node -> L: the sum of steps and the largest step."""
        L, m, maxT, groups = self.L, self.m, self.maxT, self.groups
        UB, UX = [0.0] * (L + 1), [0.0] * (L + 1)
        for n in range(L - 1, 0, -1):
            for q in self.start[n]:
                g = groups[q]
                UB[n] = max(UB[n], UB[g.j] + g.bf)
                UX[n] = max(UX[n], UX[g.j], g.bb)
            UB[n], UX[n] = min(UB[n], maxT, tcap), min(UX[n], maxT / m, tcap / m)
        return UB, UX

    def _branch_caps(self, tcap: float, ULL: float, UB: list[float], UX: list[float]) -> list[float]:
        """The latest branch end after each node: a stage's backward task can run to the task
        limit, its branch's extra time after that."""
        L, m, groups = self.L, self.m, self.groups
        UW = [0.0] * (L + 1)
        for n in range(L - 1, 0, -1):
            for q in self.start[n]:
                g = groups[q]
                UW[n] = max(UW[n], UW[g.j], ULL + UB[g.j] + g.bo + (m - 1) * max(UX[g.j], g.bb) + max(op.extra_s for op in g.options))
            UW[n] = min(UW[n], tcap, self.maxT + max((op.extra_s for q in self.start[n] for op in groups[q].options), default=0.0))
        return UW

    def floors(self) -> _Floors:
        """The least carried state at each node (``_Floors``)."""
        L, inf, groups = self.L, math.inf, self.groups
        LA, MA, ML = [0.0] + [inf] * L, [0.0] + [inf] * L, [0.0] + [inf] * L
        for n in range(1, L):
            for q in self.end[n]:
                g = groups[q]
                LA[n] = min(LA[n], LA[g.i] + g.af)
                MA[n] = min(MA[n], max(MA[g.i], g.a))
                ML[n] = min(ML[n], max(ML[g.i], min(op.load_s for op in g.options)))
        LB, MB, LL = [inf] * L + [0.0], [inf] * L + [0.0], [inf] * L + [0.0]
        for n in range(L - 1, 0, -1):
            for q in self.start[n]:
                g = groups[q]
                LB[n] = min(LB[n], LB[g.j] + g.bf)
                MB[n] = min(MB[n], max(MB[g.j], g.bb))
                LL[n] = min(LL[n], min(op.load_s for op in g.options) if g.j == L else LL[g.j])
        return _Floors(LA, MA, ML, LB, MB, LL)

    # -- the path -----------------------------------------------------------------------------------
    def path(self, smax: int) -> _Expr:
        """One stage leaves node 0, one enters node L, flow conserved in between; S <= Smax.
        Returns the expression that is 1 iff the plan has a single stage."""
        L, x, start, end = self.L, self.x, self.start, self.end
        for n in range(L + 1):
            rhs = 1 if n == 0 else (-1 if n == L else 0)
            self.prob.add([(v, 1.0) for q in start[n] for v in x[q]] + [(v, -1.0) for q in end[n] for v in x[q]], "==", rhs)
        self.prob.add([(v, 1.0) for xs in x for v in xs], "<=", smax)
        # a stage whose sync Map is wider than d (hierarchical: K roots and their level-1
        # aggregators) adds its width to BackwardSync's peak: sum over stages of max(d, tasks)
        # within the account (limits.peak_invocations; smax covers S d when no option is wider)
        width = [[max(self.d, op.terms.sync.tasks) for op in g.options] for g in self.groups]
        if any(w > self.d for ws in width for w in ws):
            peak = max_peak_invocations(self.plat.concurrency)
            self.prob.add([(v, float(w)) for xs, ws in zip(x, width) for v, w in zip(xs, ws)], "<=", peak)
        return _lin([(v, 1.0) for q in start[0] if self.groups[q].j == L for v in x[q]])

    # -- forward (§3.1) ---------------------------------------------------------------------------
    def forward(self, cap: _Caps, single: _Expr) -> _Expr:
        """The forward tasks: prefix state, durations, conservation at the nodes. Returns T_F."""
        self._prefix_state(cap)
        self._forward_tasks(cap)
        self._prefix_conservation()
        # T_F = F_{S-2}: the sum carried into the last stage holds every forward stage's hop to its
        # successor, and the last forward stage's own task ends at its PUT, one poll earlier
        # (fwd_hop_s - fwd_hop_own_s = poll_delay_s for every stage)
        of, last = self.o - self.plat.poll_delay_s, self.end[self.L]
        return (
            _lin(
                [(self.ea[q], 1.0) for q in last if q in self.ea]
                + [(self.em[q], self.m - 1.0) for q in last if q in self.em]
                + [(self.el[q], 1.0) for q in last if q in self.el],
                of,
            )
            - of * single
        )

    def _prefix_state(self, cap: _Caps) -> None:
        """The prefix state carried into each group but the first (ea, em, el), 0 unless chosen."""
        m, prob, fl = self.m, self.prob, self.fl
        for q, g in enumerate(self.groups):
            if g.i == 0:
                continue
            ua, um, ul = min(cap.UA[g.i], cap.fcap[q]), min(cap.UM[g.i], cap.fcap[q] / m), min(cap.UL[g.i], cap.fcap[q])
            self.ea[q], self.em[q], self.el[q] = (
                _Var(f"ea_{q}", 0, ua),
                _Var(f"em_{q}", 0, um),
                _Var(f"el_{q}", 0, ul),
            )
            for var, u in ((self.ea[q], ua), (self.em[q], um), (self.el[q], ul)):
                prob.add([(var, 1.0)] + [(v, -u) for v in self.x[q]], "<=", 0)
            for var, lo in ((self.ea[q], fl.LA[g.i]), (self.em[q], fl.MA[g.i]), (self.el[q], fl.ML[g.i])):
                if 0 < lo < math.inf:
                    prob.add([(var, 1.0)] + [(v, -lo) for v in self.x[q]], ">=", 0)

    def _forward_tasks(self, cap: _Caps) -> None:
        """Each forward stage's maxima (ma >= em, ml >= el, and its own) and F_s - o, kept
        within the task limit where the bounds do not already imply it."""
        m, maxT, prob, x, ea, em, el, ma, ml = self.m, self.maxT, self.prob, self.x, self.ea, self.em, self.el, self.ma, self.ml
        for q, g in enumerate(self.groups):
            if g.j == self.L:
                continue  # the last stage's forward runs inside its backward task
            ma[q], ml[q] = _Var(f"ma_{q}", 0), _Var(f"ml_{q}", 0)
            prob.add([(ma[q], 1.0)] + [(v, -g.a) for v in x[q]], ">=", 0)
            prob.add([(ml[q], 1.0)] + [(v, -op.load_s) for v, op in zip(x[q], g.options)], ">=", 0)
            if q in em:
                prob.add([(ma[q], 1.0), (em[q], -1.0)], ">=", 0)
                prob.add([(ml[q], 1.0), (el[q], -1.0)], ">=", 0)
            terms = [(ml[q], 1.0), (ma[q], m - 1.0)] + [(v, g.ao) for v in x[q]] + ([(ea[q], 1.0)] if q in ea else [])
            self.F[q] = _lin(terms)  # F_s - o: the forward task's duration
            if cap.UL[g.i] + cap.UA[g.i] + g.ao + (m - 1) * max(cap.UM[g.i], g.a) > maxT:
                prob.add(terms + [(v, -maxT) for v in x[q]], "<=", 0)

    def _prefix_conservation(self) -> None:
        """At every inner node the state leaving the stage that ends there enters the next one."""
        groups, x, ea, em, el = self.groups, self.x, self.ea, self.em, self.el
        for n in range(1, self.L):
            ins, outs = self.end[n], self.start[n]
            self.prob.add(
                [(ea[q], 1.0) for q in ins if q in ea] + [(v, groups[q].af) for q in ins for v in x[q]] + [(ea[q], -1.0) for q in outs],
                "==",
                0,
            )
            self.prob.add([(self.ma[q], 1.0) for q in ins] + [(em[q], -1.0) for q in outs], "==", 0)
            self.prob.add([(self.ml[q], 1.0) for q in ins] + [(el[q], -1.0) for q in outs], "==", 0)

    # -- backward (§3.2) --------------------------------------------------------------------------
    def backward(self, cap: _Caps, floors: tuple[float, float]) -> None:
        """The backward tasks: suffix state carried into each group from the stages after it,
        durations, conservation at the nodes; and the band's floors of the bottlenecks."""
        for q, g in enumerate(self.groups):
            self._backward_task(cap, q, g)
        self._suffix_conservation()
        if floors[0] > 0:  # the band's floor of the forward bottleneck: the max carried into the last stage
            self.prob.add([(self.em[q], 1.0) for q in self.end[self.L] if q in self.em], ">=", floors[0])
        if floors[1] > 0:  # ... and of the backward bottleneck: the suffix max of the first stage
            self.prob.add([(self.mb[q], 1.0) for q in self.start[0]], ">=", floors[1])

    def _backward_task(self, cap: _Caps, q: int, g: Group) -> None:
        """Group q's backward maximum (mb), its suffix state (xb, xm, ll; the last stage loads
        its own parameters) and BT_s - o - tail_s, kept within the task limit where the bounds do
        not already imply it."""
        m, prob, x = self.m, self.prob, self.x[q]
        self.mb[q] = _Var(f"mb_{q}", 0)
        prob.add([(self.mb[q], 1.0)] + [(v, -g.bb) for v in x], ">=", 0)
        terms = [(self.mb[q], m - 1.0)] + [(v, g.bo) for v in x]
        if g.j < self.L:
            ub, ux, ul = min(cap.UB[g.j], cap.fcap[q]), min(cap.UX[g.j], cap.fcap[q] / m), min(cap.ULL, cap.fcap[q])
            xb, xm, ll = _Var(f"xb_{q}", 0, ub), _Var(f"xm_{q}", 0, ux), _Var(f"ll_{q}", 0, ul)
            self.xb[q], self.xm[q], self.ll[q] = xb, xm, ll
            for var, u in ((xb, ub), (xm, ux), (ll, ul)):
                prob.add([(var, 1.0)] + [(v, -u) for v in x], "<=", 0)
            for var, lo in ((xb, self.fl.LB[g.j]), (xm, self.fl.MB[g.j]), (ll, self.fl.LL[g.j])):
                if 0 < lo < math.inf:
                    prob.add([(var, 1.0)] + [(v, -lo) for v in x], ">=", 0)
            prob.add([(self.mb[q], 1.0), (xm, -1.0)], ">=", 0)
            terms += [(xb, 1.0), (ll, 1.0)]
            hi = cap.ULL + cap.UB[g.j] + g.bo + (m - 1) * max(cap.UX[g.j], g.bb)
        else:
            terms += [(v, op.load_s) for v, op in zip(x, g.options)]
            hi = max(op.load_s for op in g.options) + g.bo + (m - 1) * g.bb
        self.BT[q] = _lin(terms)  # BT_s - o - tail_s
        if hi + max(op.tail_s for op in g.options) > self.maxT:
            prob.add(terms + [(v, op.tail_s - self.maxT) for v, op in zip(x, g.options)], "<=", 0)

    def _suffix_conservation(self) -> None:
        """Stages starting at a node pass their suffix state to the stage ending there."""
        groups, x, xb, ll = self.groups, self.x, self.xb, self.ll
        for n in range(1, self.L):
            ins, outs = self.start[n], self.end[n]
            self.prob.add(
                [(xb[q], 1.0) for q in ins if q in xb] + [(v, groups[q].bf) for q in ins for v in x[q]] + [(xb[q], -1.0) for q in outs],
                "==",
                0,
            )
            self.prob.add([(self.mb[q], 1.0) for q in ins] + [(self.xm[q], -1.0) for q in outs], "==", 0)
            self.prob.add(
                [(ll[q], 1.0) for q in ins if q in ll]
                + [(v, op.load_s) for q in ins if groups[q].j == self.L for v, op in zip(x[q], groups[q].options)]
                + [(ll[q], -1.0) for q in outs],
                "==",
                0,
            )

    def wait_caps(self, ws: WaitSlack) -> None:
        """The rows of ``WaitSlack``: every group but a last stage's, where its slack is finite."""
        for q, g in enumerate(self.groups):
            sl = ws.slack.get(id(g), math.inf)
            if g.j == self.L or not math.isfinite(sl):
                continue
            base = ws.before[g.i] + ws.after[g.j] + sl
            terms = [(self.ml[q], 1.0), (self.xb[q], 1.0), (self.ll[q], 1.0)] + ([(self.ea[q], 1.0)] if q in self.ea else [])
            self.prob.add(terms + [(v, -(base + op.load_s)) for v, op in zip(self.x[q], g.options)], "<=", 0)

    # -- backward and sync: the branches (§3.3) -------------------------------------------------
    def branches(self, cap: _Caps) -> Any:
        """T_BS = o + max over stages of (BT_s + its branch's extra): the running maximum is
        carried backwards like the other suffix state (W_q >= xw_q, W_q >= the group's own branch
        end), so the LP relaxation takes the max along each path rather than over diluted node
        sums. Returns the variable T_BS."""
        prob, groups, x = self.prob, self.groups, self.x
        W, xw = {}, {}
        for q, g in enumerate(groups):
            W[q] = _Var(f"w_{q}", 0)
            prob.add([(W[q], 1.0)] + self._minus_branch_end(q), ">=", 0)
            if g.j < self.L:
                xw[q] = _Var(f"xw_{q}", 0, cap.UW[g.j])
                prob.add([(xw[q], 1.0)] + [(v, -cap.UW[g.j]) for v in x[q]], "<=", 0)
                prob.add([(W[q], 1.0), (xw[q], -1.0)], ">=", 0)
        for n in range(1, self.L):
            prob.add([(W[q], 1.0) for q in self.start[n]] + [(xw[q], -1.0) for q in self.end[n]], "==", 0)
        TBS = _Var("T_backward_sync", 0)
        prob.add([(TBS, 1.0)] + [(W[q], -1.0) for q in self.start[0]], ">=", self.o)
        for n in range(1, self.L):  # valid (implied) node rows: cheap, and they help the LP where flows merge
            terms = [(TBS, 1.0)]
            for q in self.start[n]:
                terms += self._minus_branch_end(q)
            prob.add(terms, ">=", self.o)
        return TBS

    def _minus_branch_end(self, q: int) -> list[tuple[Any, float]]:
        """Minus group q's own branch end (BT_s - o - tail_s + its extra time), as terms."""
        return [(var, -c) for var, c in self.BT[q].items()] + [(v, -op.extra_s) for v, op in zip(self.x[q], self.groups[q].options)]

    # -- cost (§4) ----------------------------------------------------------------------------------
    def cost(self, single: _Expr) -> _Expr:
        """Own constants + every task's duration at its tier."""
        d = self.d
        cost_terms: list[tuple[Any, float]] = []
        for q, g in enumerate(self.groups):
            cost_terms += [(v, op.own_cost) for v, op in zip(self.x[q], g.options)]
            cost_terms += [(var, d * g.price * c) for var, c in self.BT[q].items()]
            if q in self.F:
                cost_terms += [(var, d * g.price * c) for var, c in self.F[q].items()]
        pt = self.plat.price_transition
        return _lin(cost_terms, pt * global_transitions(2)) - pt * (global_transitions(2) - global_transitions(1)) * single

    def heaviest_path(self, cands: Candidates) -> Config | None:
        """The plan that follows, from node 0, the (group, option) of largest value at each node:
        of an integral solution its plan, of a fractional one a plan to evaluate (None if the
        values lead nowhere)."""
        out: dict[int, tuple[float, Group, Any]] = {}
        for g, xs in zip(self.groups, self.x):
            for v, op in zip(xs, g.options):
                val = v.value() or 0.0
                if g.i not in out or val > out[g.i][0]:
                    out[g.i] = (val, g, op)
        balance, tier_sel, sync_sel = [], [], []
        n = 0
        while n < self.L:
            if n not in out or out[n][0] <= 0:
                return None
            _, g, op = out[n]
            balance.append(g.j - g.i)
            tier_sel.append(g.tier)
            sync_sel.append(op.choice)
            n = g.j
        return Config(tuple(balance), tuple(tier_sel), self.d, cands.micro_batch, self.m, tuple(sync_sel))

    def plan(self, cands: Candidates) -> Config:
        """The chosen stages, read along the path from node 0."""
        chosen = {}
        for q, g in enumerate(self.groups):
            for v, op in zip(self.x[q], g.options):
                if (v.value() or 0) > 0.5:
                    chosen[g.i] = (g, op)
        balance, tier_sel, sync_sel = [], [], []
        n = 0
        while n < self.L:
            g, op = chosen[n]
            balance.append(g.j - g.i)
            tier_sel.append(g.tier)
            sync_sel.append(op.choice)
            n = g.j
        return Config(tuple(balance), tuple(tier_sel), self.d, cands.micro_batch, self.m, tuple(sync_sel))


class _QuietHighs(highspy.Highs):
    """A HiGHS model that prints nothing, not even HiGHS's banner ("Running HiGHS ...: Copyright
    ..."): highspy.Highs() registers its callback in its constructor, HiGHS's first logging call,
    which prints the banner while output_flag still has its default true, before pulp can turn
    it off. HiGHS's maintainers: output_flag must be false before any other HiGHS method is
    called, the banner cannot be switched off on its own
    (https://github.com/ERGO-Code/HiGHS/issues/1702, https://github.com/ERGO-Code/HiGHS/issues/1932).
    So turn it off first, then register the callback. (highspy 1.16 prints the banner once per
    process, for the first model that logs: measured.)"""

    def enableCallbacks(self) -> None:
        self.silent()
        super().enableCallbacks()  # type: ignore[no-untyped-call]  # highspy's Python layer is unannotated


def _highs(time_limit: float, gap: float, threads: int | None, objective_bound: float | None) -> highspy.Highs:
    """HiGHS as measured fastest on these models: restarts re-presolve the root again and again,
    and the sub-MIP heuristics (RINS, RENS, root reduced cost) take most of the time while the
    incumbent from the heuristic plan is already good; without them the same proofs take 2-10x
    less time. Presolve is off: on these path MILPs it removes little (1.5% of the columns of an
    AmoebaNet-D36 MILP, after 26 s of probing); without it the same MILPs of the slowest solves
    proved the same optima in 0.6-0.75x the CPU time, though not every MILP gains (L = 12, d = 64:
    twice as long; docs/performance-model.md §7.4).
    Quiet: no log and no banner (_QuietHighs). The gaps, threads and time limit as pulp 3.3 set
    them when it built the model (it did until issue 25: ``_Model``)."""
    model = _QuietHighs()  # type: ignore[no-untyped-call]  # (its __init__ is highspy's)
    opts: dict[str, Any] = {
        "mip_rel_gap": gap,
        "mip_abs_gap": 0.0,
        "threads": threads,
        "time_limit": float(time_limit),
        "presolve": "off",
        "mip_allow_restart": False,
        "mip_heuristic_run_rins": False,
        "mip_heuristic_run_rens": False,
        "mip_heuristic_run_root_reduced_cost": False,
    }
    if objective_bound is not None:
        opts["objective_bound"] = objective_bound
    for key, value in opts.items():
        if value is not None:
            model.setOptionValue(key, value)
    return model


# HiGHS's outcomes with a solution to read (pulp 3.3's "Optimal", which the loop below relies on):
# a time or iteration limit only when it found one
_ST = highspy.HighsModelStatus
_SOLVED = {_ST.kOptimal, _ST.kObjectiveBound, _ST.kObjectiveTarget, _ST.kInterrupt, _ST.kTimeLimit, _ST.kIterationLimit}


def solve_milp(
    cands: Candidates,
    groups: Sequence[Group],
    plat: Platform,
    wc: float,
    wt: float,
    smax: int,
    time_limit: float,
    gap: float,
    threads: int | None,
    cutoff: float | None,
    relax: bool = False,
    floors: tuple[float, float] = (0.0, 0.0),
    slack: WaitSlack | None = None,
) -> MilpSolution:
    """Build and solve the path MILP over ``groups`` (module docstring, step 3); ``slack``: valid
    caps of the carried waits for the plans below ``cutoff`` (``WaitSlack``)."""
    if any(not any(g.i <= l < g.j for g in groups) for l in range(cands.layers)):
        return MilpSolution(None, math.inf, "infeasible", 0, 0)
    milp = _PathMilp(cands, groups, plat, relax)
    cap = milp.caps(wc, wt, cutoff)
    single = milp.path(smax)
    TF = milp.forward(cap, single)
    milp.backward(cap, floors)
    if slack is not None:
        milp.wait_caps(slack)
    TBS = milp.branches(cap)
    cost = milp.cost(single)
    prob = milp.prob
    ref = max(1e-12, wc * 1e-4 + wt)  # scale the objective to O(1e4) for HiGHS's tolerances
    prob += weighted_objective(cost, TF + TBS + plat.iteration_overhead_s, wc, wt) * (1.0 / ref)
    bound = None
    if cutoff is not None and math.isfinite(cutoff):
        # an LP only has to show it ends above the cutoff (with the margin lp_refutes allows): the
        # dual simplex stops once its objective, a lower bound of the LP's, passes it
        bound = (cutoff + 1e-9 * abs(cutoff) if relax else cutoff) / ref
    h = _highs(time_limit, gap, threads, bound)
    prob.solve(h)
    nvars, ncons = len(prob.cols), prob.nrows
    st = h.getModelStatus()
    ms = h.modelStatusToString(st).lower()
    value = prob.value()
    if relax:
        if st == _ST.kObjectiveBound:  # the LP's optimum is above the cutoff: nothing at or below it
            return MilpSolution(None, math.inf, "infeasible", nvars, ncons)
        ok = ms == "optimal" and value is not None
        return MilpSolution(
            None, value * ref if ok and value is not None else math.inf, ms, nvars, ncons, milp.heaviest_path(cands) if ok else None
        )
    limited = st in (_ST.kTimeLimit, _ST.kIterationLimit) and h.getObjectiveValue() == math.inf
    if st not in _SOLVED or limited or value is None:
        proven_empty = ms in ("infeasible", "objective bound")  # nothing better than the cutoff exists
        return MilpSolution(None, math.inf, "infeasible" if proven_empty else ms, nvars, ncons)
    return MilpSolution(milp.plan(cands), value * ref, "optimal" if ms == "optimal" else "time_limit", nvars, ncons)
