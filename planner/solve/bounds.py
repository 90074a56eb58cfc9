"""Lower bounds per candidate stage (planner/solve/search.py has the whole method).

2. Bounds (a presolve that only removes what provably cannot beat the incumbent). A dynamic
   programme over boundary nodes gives, for every group, a lower bound of the objective of every
   plan that uses it (``LowerBounds``): each stage's own billed work and steps exactly, the
   flow-shop bottlenecks (m-1)*max per band of their values, the waits a bottleneck forces on
   the stages around it, the group's own waits on the stages before and after it. Groups whose
   bound exceeds the incumbent's objective are removed. Removing them cannot lose the optimum:
   any plan through such a group is worse than the incumbent.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np

from stagecoach.planner.model.perfmodel import (
    global_transitions,
    phase_overhead,
)
from stagecoach.planner.model.platforms import Platform
from stagecoach.planner.solve.candidates import Candidates

# -- lower bounds per group (docs/performance-model.md §7.2) --------------------------------------
# Flag automaton of the bottleneck bands: (fA, fB) before an arc -> (fA', fB') after it, with the
# condition on the arc ('s': its forward step exceeds the band's low end, 'b': its backward step
# does; 'n..': it does not) and whether it pays the forward / backward imbalance.
_TRANS: list[tuple[int, int, int, int, str | None, str | None, bool, bool]] = []
for _fa in (0, 1):
    for _fb in (0, 1):
        for _fa2, _ca in [(1, None)] if _fa == 1 else [(1, "s"), (0, "ns")]:
            for _fb2, _cb in [(1, "nb")] if _fb == 1 else [(0, None), (1, "b")]:
                _TRANS.append((_fa, _fb, _fa2, _fb2, _ca, _cb, _fa2 == 1, _fb == 0))


def _least_waits(cands: Candidates) -> tuple[list[float], list[float]]:
    """Per node, the least sum of forward steps and hops of the stages before it (any path of
    candidate stages from layer 0) and of backward ones after it (to the last layer): what a
    stage starting (ending) there waits at the least for its first micro-batch."""
    L, inf = cands.layers, float("inf")
    before, after = [0.0] + [inf] * L, [inf] * L + [0.0]
    for g in sorted(cands.groups, key=lambda g: g.j):
        before[g.j] = min(before[g.j], before[g.i] + g.af)
    for g in sorted(cands.groups, key=lambda g: -g.i):
        after[g.i] = min(after[g.i], after[g.j] + g.bf)
    return before, after


def _stage_weights(cands: Candidates, wc: float, wt: float, plat: Platform) -> tuple[np.ndarray, ...]:
    """Per group the least weight of a stage on it over its options (wpre[K]: no context, the
    base); wpre[c] / wsuf[c]: with the waits of a bounded group at tier c on the arc (c = K: a
    last-stage group, which has no forward task); selfw: the bounded group's own weight, with its
    least waits (selfw[0]) or without them (selfw[1]: the arcs around it count them exactly)."""
    groups, K = cands.groups, len(cands.tiers)
    L, d, m = cands.layers, cands.replicas, cands.micro_batches
    o, pt = phase_overhead(plat, d), plat.price_transition
    pk = np.array([plat.price_per_s(t) for t in cands.tiers])
    wpre = np.full((K + 1, len(groups)), np.inf)
    wsuf = np.full((K, len(groups)), np.inf)
    selfw = np.full((2, len(groups)), np.inf)
    first_extra = wt * o + wc * pt * (global_transitions(2) - global_transitions(1))
    before, after = _least_waits(cands)
    for q, g in enumerate(groups):
        # a stage's forward task waits for the steps and hops of every stage before it, its
        # backward task for those after it: at least the least such sum over any path
        waits = (before[g.i] if g.j < L else 0.0) + after[g.j]
        for op in g.options:
            # a stage adds at least its step and its own hop to T_F and to the first branch
            # of T_BS (ao >= a, bo >= bb), and its tasks are billed at least as long
            busy = m * g.a + (g.ao - g.a) + m * g.bb + (g.bo - g.bb) + op.load_s + waits
            v = wc * (op.own_cost + d * g.price * busy) + wt * (g.ao + g.bo)
            if g.j == L:
                v += wt * op.load_s
            if g.i == 0:
                v += wt * op.extra_s + (first_extra if g.j < L else 0.0)
            own = v + (wt * op.load_s if g.j < L else 0.0)
            selfw[:, q] = np.minimum(selfw[:, q], (own, own - wc * d * g.price * waits))
            wpre[K, q] = min(wpre[K, q], v)
            # the bounded group waits for this stage's step and hop (what ea / xb carry)
            wpre[:K, q] = np.minimum(wpre[:K, q], v + wc * d * pk * g.af)
            wsuf[:, q] = np.minimum(wsuf[:, q], v + wc * d * pk * (g.bf + (op.load_s if g.j == L else 0.0)))
    return wpre, wsuf, selfw


class LowerBounds:
    """Valid lower bounds of the objective of every plan that uses a given group.

    A plan's objective is at least the sum over its stages of a per-stage weight (its own cost,
    every task's own billed work, its steps in T_F and T_BS, and for the first / last stage the
    branch's extra time / the last stage's load), plus (m-1)(maxA + maxB) times the time weight,
    plus the imbalance the bottleneck forces on the stages around it: a forward task after the
    stage with the largest step waits (m-1)(maxA - a_s), a backward task before it (m-1)(maxB -
    bb_s), both billed at the stage's own price. Dropped (all >= 0): every wait on the first
    micro-batch of other stages except the bounded group's own, and the parameter-load maxima.

    The maxima are handled by *bands*: (maxA, maxB) lies in one pair of value intervals
    (aLo, aHi] x (bLo, bHi]; inside a pair every arc must have a <= aHi, bb <= bHi, the maxima
    are at least the smallest candidate value above aLo / bLo, and a two-flag automaton marks the
    stages after the first arc above aLo (they pay the forward imbalance) and before the last arc
    above bLo (they pay the backward one). A DP over (node, flags, stage count <= Smax) per pair
    gives prefix and suffix bounds; pairs whose own bound exceeds the incumbent are discarded and
    the others split, so the bands become fine exactly where plans can still compete.
    """

    def __init__(self, cands: Candidates, wc: float, wt: float, plat: Platform, smax: int) -> None:
        groups = cands.groups
        L, d, m = cands.layers, cands.replicas, cands.micro_batches
        o, pt = phase_overhead(plat, d), plat.price_transition
        self.L, self.m, self.wt, self.smax = L, m, wt, smax
        self.I = np.array([g.i for g in groups], dtype=int)
        self.J = np.array([g.j for g in groups], dtype=int)
        self.A = np.array([g.a for g in groups])
        self.B = np.array([g.bb for g in groups])
        price = np.array([g.price for g in groups])
        self.Kg = np.array([g.k for g in groups], dtype=int)
        self.fin = self.J == L
        self.K = K = len(cands.tiers)
        self.wpre, self.wsuf, self.selfw = _stage_weights(cands, wc, wt, plat)
        self.before, self.after = _least_waits(cands)  # what selfw[0] bills a group's waits at
        self.base = self.wpre[K]
        self.cA = wc * d * (m - 1) * price * (~self.fin)
        self.cB = wc * d * (m - 1) * price
        self.const = wt * (o + plat.iteration_overhead_s) + wc * pt * global_transitions(1)
        self.ends = [np.nonzero(self.J == n)[0] for n in range(L + 1)]
        self.starts = [np.nonzero(self.I == n)[0] for n in range(L + 1)]
        self.va = np.unique(self.A[~self.fin])
        self.vb = np.unique(self.B)
        self._view: tuple[bytes, LowerBounds] | None = None  # the last ``_restricted`` view
        self._memo: tuple[bytes, tuple[Any, ...], np.ndarray, np.ndarray] | None = None  # the last sweep with context (``_sweeps``)

    def _restricted(self, alive: np.ndarray) -> LowerBounds:
        """These bounds over the groups ``alive`` only (the same band values va, vb, so the same
        band floors): the sweeps' arrays then span the 100-1,300 groups alive, not all 3,700
        (AmoebaNet-D36, L = 30), and every number is the one the masked sweep over all of them
        computes (the same sums, minima over the same arcs). The last view is kept: the final
        MILPs ask for the same mask several times."""
        key = alive.tobytes()
        if self._view is not None and self._view[0] == key:
            return self._view[1]
        idx = np.nonzero(alive)[0]
        sub = copy.copy(self)
        for name in ("I", "J", "A", "B", "Kg", "fin", "base", "cA", "cB"):
            setattr(sub, name, getattr(self, name)[idx])
        for name in ("wpre", "wsuf", "selfw"):
            setattr(sub, name, getattr(self, name)[:, idx])
        sub.ends = [np.nonzero(sub.J == n)[0] for n in range(self.L + 1)]
        sub.starts = [np.nonzero(sub.I == n)[0] for n in range(self.L + 1)]
        sub._view, sub._memo = None, None
        self._view = (key, sub)
        return sub

    # -- bands ------------------------------------------------------------------------------------
    def grid(self, n: int) -> tuple[np.ndarray, ...]:
        """An n x n grid of band pairs at quantiles of the candidate values (covers everything)."""

        def cuts(vals: np.ndarray) -> np.ndarray:
            if len(vals) == 0:
                return np.array([0.0, 0.0])
            qs = np.quantile(vals, np.linspace(0, 1, n + 1)[1:], method="lower")
            return np.unique(np.concatenate([[0.0], qs, [vals.max()]]))

        ca, cb = cuts(self.va), cuts(self.vb)
        pairs = [(ca[x], ca[x + 1], cb[y], cb[y + 1]) for x in range(len(ca) - 1) for y in range(len(cb) - 1)]
        return tuple(np.array(v) for v in zip(*pairs))

    @staticmethod
    def _low(vals: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The least candidate value in (lo, hi] (0 where lo = 0: the band includes 0), and
        whether the band holds any value at all."""
        pos = np.searchsorted(vals, lo, side="right")
        val = vals[np.minimum(pos, len(vals) - 1)] if len(vals) else np.zeros(len(lo))
        nonempty = (pos < len(vals)) & (val <= hi) if len(vals) else np.zeros(len(lo), bool)
        zero = lo <= 0
        return np.where(zero, 0.0, val), zero | nonempty

    def _setup(self, P: tuple[np.ndarray, ...]) -> None:
        aLo, aHi, bLo, bHi = P
        A, B, fin = self.A, self.B, self.fin
        self.allow = (fin[None, :] | (A[None, :] <= aHi[:, None])) & (B[None, :] <= bHi[:, None])
        self.setsA = (~fin[None, :]) & (A[None, :] > aLo[:, None])
        self.big = B[None, :] > bLo[:, None]
        self.thA, _ = self._low(self.va, aLo, aHi)
        self.thB, _ = self._low(self.vb, bLo, bHi)
        self.payA = self.cA[None, :] * np.maximum(0.0, self.thA[:, None] - A[None, :])
        self.payB = self.cB[None, :] * np.maximum(0.0, self.thB[:, None] - B[None, :])
        self.needA, self.needB = aLo > 0, bLo > 0

    def _setup_arcs(self) -> None:
        """Per transition of the flag automaton, what an arc adds (inf: not allowed), over every
        group: each DP step takes its arcs' columns instead of recomputing them per node."""
        ca: dict[str | None, Any] = {None: True, "s": self.setsA, "ns": ~self.setsA}
        cb: dict[str | None, Any] = {None: True, "b": self.big, "nb": ~self.big}
        pay = {(False, False): 0.0, (True, False): self.payA, (False, True): self.payB, (True, True): self.payA + self.payB}
        self.arc_add = np.stack([np.where(ca[cA] & cb[cB] & self.allow, pay[(pa, pb)], np.inf) for _, _, _, _, cA, cB, pa, pb in _TRANS])

    def _sweeps(self, P: tuple[np.ndarray, ...], ctx: bool, prefix: bool = True) -> tuple[np.ndarray | None, np.ndarray]:
        """pre[c, fA, fB, count, pair, node]: cheapest path 0 -> node; sufc[...]: cheapest
        node -> L using at most ``count`` stages, ending with the flags the band requires."""
        key = b"".join(v.tobytes() for v in P)
        # what a sweep reads, by identity (a copy given other weights, as the tests make, sweeps anew)
        deps = (self.wpre, self.wsuf, self.base, self.I, self.J, self.A, self.B, self.cA, self.cB, self.smax, self.K)
        m = self._memo
        # rows K of it are the sweep without context (its prefix's where base is wpre's row K, as built)
        hit = m is not None and m[0] == key and all(a is b for a, b in zip(m[1], deps))
        if m is not None and hit and (ctx or not prefix or np.array_equal(self.base, self.wpre[self.K])):
            self._setup(P)
            return (m[2], m[3]) if ctx else (m[2][self.K :], m[3][self.K :])
        self._setup(P)
        self._setup_arcs()
        wpre = self.wpre if ctx else self.base[None, :]
        # with context, the suffix sweep also runs the weights without (its last row): every row
        # of a sweep is computed on its own, so row K of both is, bit for bit, the sweep without
        # context, and the group and pair bounds of the same pairs that follow reuse it
        wsuf = np.vstack([self.wsuf, self.base[None, :]]) if ctx else self.base[None, :]
        pre = self._prefix_sweep(wpre, len(P[0])) if prefix or ctx else None
        suf = self._suffix_sweep(wsuf, len(P[0]))
        sufc = np.minimum.accumulate(suf, axis=3)
        if ctx:
            assert pre is not None
            self._memo = (key, deps, pre, sufc)
        return pre, sufc

    def _prefix_sweep(self, wpre: np.ndarray, nP: int) -> np.ndarray:
        """Forward over the nodes: the cheapest paths 0 -> node per flags and stage count."""
        L = self.L
        pre = np.full((wpre.shape[0], 2, 2, self.smax + 1, nP, L + 1), np.inf)
        pre[:, 0, 0, 0, :, 0] = 0.0
        for n in range(1, L):
            qs = self.ends[n]
            if len(qs) == 0:
                continue
            pre[..., n] = self._arcs(pre[..., self.I[qs]], qs, wpre, forward=True)
        return pre

    def _suffix_sweep(self, wsuf: np.ndarray, nP: int) -> np.ndarray:
        """Backward over the nodes: the cheapest paths node -> L per flags and exact stage
        count; at L only the flags the band needs (a flag set where its band's low end is > 0)."""
        L = self.L
        suf = np.full((wsuf.shape[0], 2, 2, self.smax + 1, nP, L + 1), np.inf)
        for fa in (0, 1):
            for fb in (0, 1):
                ok = np.ones(nP, bool)
                if fa == 0:
                    ok &= ~self.needA
                if fb == 0:
                    ok &= ~self.needB
                suf[:, fa, fb, 0, ok, L] = 0.0
        for n in range(L - 1, -1, -1):
            qs = self.starts[n]
            if len(qs) == 0:
                continue
            suf[..., n] = self._arcs(suf[..., self.J[qs]], qs, wsuf, forward=False)
        return suf

    def _arcs(self, D: np.ndarray, qs: np.ndarray, w: np.ndarray, forward: bool) -> np.ndarray:
        """One DP step over the arcs (groups) ``qs`` into a node: D[..., x] is the table at arc
        x's other end; the result the node's table, one more stage, over the flag automaton
        (forward: flags before the arc -> after it; backward the other way round)."""
        wq = w[:, qs][:, None, None, :]
        X = [[D[:, f1, f2, :-1] + wq for f2 in (0, 1)] for f1 in (0, 1)]
        out = np.full(D.shape[:-1], np.inf)
        buf = np.empty_like(X[0][0])  # (the same sums and minima as fresh arrays, without allocating nine)
        v = np.empty(buf.shape[:-1])
        adds = self.arc_add[:, :, qs]
        for t, (fa, fb, fa2, fb2, _, _, _, _) in enumerate(_TRANS):
            add = adds[t]
            (s1, s2), (d1, d2) = ((fa, fb), (fa2, fb2)) if forward else ((fa2, fb2), (fa, fb))
            np.min(np.add(X[s1][s2], add[None, None], out=buf), axis=-1, out=v)
            np.minimum(out[:, d1, d2, 1:], v, out=out[:, d1, d2, 1:])
        return out

    def _band_const(self) -> np.ndarray:
        return np.asarray(self.wt * (self.m - 1) * (self.thA + self.thB) + self.const)

    def pair_bounds(self, P: tuple[np.ndarray, ...], alive: np.ndarray | None = None) -> np.ndarray:
        """A lower bound of every plan whose maxima fall in each band pair (``alive``: of every
        such plan below the cutoff that killed the other groups, ``group_bounds``)."""
        if alive is not None:
            sub = self._restricted(alive)
            out = sub.pair_bounds(P)
            self.thA, self.thB = sub.thA, sub.thB
            return out
        _, sufc = self._sweeps(P, ctx=False, prefix=False)
        return np.asarray(sufc[0, 0, 0, self.smax, :, 0] + self._band_const())

    def _split(self, vals: np.ndarray, lo: float, hi: float) -> list[tuple[float, float]]:
        inside = vals[(vals > lo) & (vals <= hi)]
        if len(inside) <= 1:
            return [(lo, hi)]
        mid = float(inside[(len(inside) - 1) // 2])
        return [(lo, hi)] if mid >= hi else [(lo, mid), (mid, hi)]

    def split_pair(self, pair: tuple[float, float, float, float]) -> tuple[np.ndarray, ...]:
        """A band pair (aLo, aHi, bLo, bHi) cut at the middle candidate value of each band (2 or 4
        pairs; 1 if neither band holds two values): together they cover the pair exactly, so a
        plan of the pair lies in one of them, and each has bounds at least the pair's."""
        al, ah, bl, bh = pair
        new = [(a0, a1, b0, b1) for a0, a1 in self._split(self.va, al, ah) for b0, b1 in self._split(self.vb, bl, bh)]
        return tuple(np.array(v) for v in zip(*new))

    def refine(
        self, P: tuple[np.ndarray, ...], cutoff: float, rounds: int = 8, budget: int = 600, alive: np.ndarray | None = None
    ) -> tuple[np.ndarray, ...]:
        """Discard the band pairs that cannot beat ``cutoff`` and split the others, repeatedly."""
        for _ in range(rounds):
            keep = self.pair_bounds(P, alive) <= cutoff
            P = tuple(v[keep] for v in P)
            new = [
                (al, ah, bl, bh)
                for p in range(len(P[0]))
                for al, ah in self._split(self.va, P[0][p], P[1][p])
                for bl, bh in self._split(self.vb, P[2][p], P[3][p])
            ]
            if len(new) > budget or len(new) == len(P[0]):
                break
            P = tuple(np.array(v) for v in zip(*new)) if new else P
        keep = self.pair_bounds(P, alive) <= cutoff
        return tuple(v[keep] for v in P)

    def group_bounds(
        self, P: tuple[np.ndarray, ...], ctx: bool = True, per_pair: bool = False, alive: np.ndarray | None = None
    ) -> np.ndarray:
        """Per group: a lower bound of the objective of every plan that uses it (inf if none
        falls in the given band pairs); ``per_pair``: one row per pair instead of their minimum.
        ``alive``: the groups whose bounds (in pairs covering these) were at most a cutoff c. A
        plan of objective <= c uses none of the others, so the sweeps leave them out and they
        get inf: then every bound holds for every plan at or below c (all the search asks of
        them: the cutoff only falls), and the sweeps over the 100-350 groups a band keeps take
        a fraction of the time over all of them (AmoebaNet-D36, L = 30: about 3,700)."""
        G = len(self.I)
        if len(P[0]) == 0:
            return np.full((0, G), np.inf) if per_pair else np.full(G, np.inf)
        if alive is not None:
            sub = self._restricted(alive)
            full = np.full((len(P[0]), G), np.inf)
            full[:, alive] = sub.group_bounds(P, ctx, per_pair=True)
            self.thA, self.thB = sub.thA, sub.thB
            return full if per_pair else full.min(axis=0)
        pre, sufc = self._sweeps(P, ctx)
        assert pre is not None  # a prefix sweep was asked for
        cpre = np.where(self.fin, self.K, self.Kg) if ctx else np.zeros(G, int)
        csuf = self.Kg if ctx else np.zeros(G, int)
        Pg = np.moveaxis(pre[cpre, :, :, :, :, self.I], 0, -1)  # (2, 2, S1, pairs, G)
        Sg = np.moveaxis(sufc[csuf, :, :, :, :, self.J], 0, -1)
        ca = {None: True, "s": self.setsA, "ns": ~self.setsA}
        cb = {None: True, "b": self.big, "nb": ~self.big}
        best = np.full((len(P[0]), G), np.inf)
        tmp = np.empty_like(best)  # (the same sums and minima as fresh arrays, in place)
        for fa, fb, fa2, fb2, cA, cB, pa, pb in _TRANS:
            add = np.where(ca[cA] & cb[cB], (self.payA if pa else 0.0) + (self.payB if pb else 0.0), np.inf)
            for cp in range(self.smax):
                np.add(Pg[fa, fb, cp], Sg[fa2, fb2, self.smax - 1 - cp], out=tmp)
                np.minimum(best, np.add(tmp, add, out=tmp), out=best)
        best = np.where(self.allow, best, np.inf) + self.selfw[1 if ctx else 0][None, :]
        a0 = np.where(self.fin, 0.0, self.A)
        bott = self.wt * (self.m - 1) * (np.maximum(self.thA[:, None], a0[None, :]) + np.maximum(self.thB[:, None], self.B[None, :]))
        out = best + bott + self.const
        return np.asarray(out if per_pair else out.min(axis=0))
