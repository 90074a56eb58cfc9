"""Candidate stages of the exact solve (planner/solve/search.py has the whole method).

1. Candidates. Every (interval of layers, tier) is a *group* g = (i, j, k); each of its sync
   choices an *option* o. Every per-stage quantity is a constant of (g, o), computed by
   ``perfmodel.stage_terms`` — the code ``evaluate`` uses, so the MILP cannot drift from the model.
   Groups that break a memory or 15-minute limit are dropped, and so are options no better in any
   respect than another option of the same group.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from stagecoach.planner.limits import concurrency_refusal
from stagecoach.planner.model.perfmodel import (
    Config,
    Estimate,
    StageTerms,
    compose,
    phase_overhead,
    stage_terms,
)
from stagecoach.planner.model.platforms import Platform
from stagecoach.planner.model.syncmodel import SyncChoice, sync_choices
from stagecoach.planner.plan import data_resident
from stagecoach.planner.profile.flows import StageBytes
from stagecoach.planner.profile.layers import ModelProfile


# -- candidate stages -----------------------------------------------------------------------------
@dataclass(frozen=True)
class SyncOption:
    """One sync choice of a group: what it adds beyond the group's flow-shop steps."""

    a: int  # index into the solve's sync choices
    choice: SyncChoice
    own_cost: float  # USD: the tail and the sync tasks billed, requests, transitions, S3
    extra_s: float  # seconds the stage's branch adds after its backward flow shop: tail (+ o + one sync task)
    tail_s: float
    load_s: float  # the stage's parameter load (0 when this sync leaves the parameters cached)
    terms: StageTerms = field(compare=False, repr=False, default=None)  # type: ignore[assignment]


@dataclass(frozen=True)
class Group:
    """A stage's interval and tier: its flow-shop steps (independent of the sync choice)."""

    i: int
    j: int
    k: int  # tier index
    tier: int
    price: float  # USD per second of one worker at this tier
    a: float  # forward step of one micro-batch (0 for the last stage): what the bottleneck maximises
    bb: float  # backward step of one micro-batch
    options: tuple[SyncOption, ...]
    af: float = 0.0  # a + the forward hop to the next stage: what later stages' sums carry
    ao: float = 0.0  # a + the hop's own part (its PUT): what the stage's own task end adds
    bf: float = 0.0  # the backward counterparts
    bo: float = 0.0


@dataclass(frozen=True)
class Candidates:
    """The candidate groups of one (d, b, m): independent of the objective weights, so a caller
    solving several weights computes them once."""

    replicas: int
    micro_batch: int
    micro_batches: int
    tiers: tuple[int, ...]
    choices: tuple[SyncChoice, ...]
    layers: int
    groups: tuple[Group, ...]

    @property
    def size(self) -> int:
        return sum(len(g.options) for g in self.groups)


def _cum(xs: Sequence[float]) -> list[float]:
    return [0.0, *itertools.accumulate(xs)]


def _dominance_key(c: SyncOption) -> tuple[float, float, float, float]:
    return (c.own_cost, c.extra_s, c.tail_s, c.load_s)


def _undominated(opts: list[SyncOption]) -> list[SyncOption]:
    """The options no other option of the group beats or ties in every respect (of ties, the
    first sync choice stays)."""
    key = _dominance_key
    return [
        c
        for c in opts
        if not any(q is not c and all(u <= v for u, v in zip(key(q), key(c))) and (key(q), q.a) < (key(c), c.a) for q in opts)
    ]


@dataclass(frozen=True)
class _Tier:
    """One tier's per-layer prefix sums of the step times, and its limits and price."""

    k: int
    tier: int
    F: list[float]  # forward seconds of one micro-batch, prefix sums over the layers
    G: list[float]  # backward ones
    cap: float  # usable bytes
    price: float  # USD per second of one worker


class _Intervals:
    """The candidate groups of one (d, b, m): per (interval, tier) the terms of every sync
    choice from prefix sums over the layers, the options that fit the limits."""

    def __init__(self, profile: ModelProfile, plat: Platform, d: int, b: int, m: int, choices: tuple[SyncChoice, ...]) -> None:
        self.profile, self.plat, self.d, self.b, self.m, self.choices = profile, plat, d, b, m, choices
        lay = profile.layers
        self.L = len(lay)
        self.o, self.maxT = phase_overhead(plat, d), plat.max_predicted_task_s
        self.P = _cum([l.param_bytes for l in lay])
        self.BUF = _cum([l.buffer_bytes for l in lay])
        self.SV = _cum([l.saved_bytes_per_sample for l in lay])

    def tier_groups(self, k: int, tier: int) -> list[Group]:
        """Every interval's group at this tier, where at least one sync choice fits."""
        tm = [l.times(tier, self.b, self.plat) for l in self.profile.layers]
        t = _Tier(k, tier, _cum([x[0] for x in tm]), _cum([x[1] for x in tm]), self.plat.usable_bytes(tier), self.plat.price_per_s(tier))
        out: list[Group] = []
        for i in range(self.L):
            for j in range(i + 1, self.L + 1):
                g = self._group(t, i, j)
                if g is not None:
                    out.append(g)
        return out

    def _group(self, t: _Tier, i: int, j: int) -> Group | None:
        """Layers [i, j) at tier t: its steps (the same for every sync choice) and options."""
        opts: list[SyncOption] = []
        st0 = None
        io = self.profile.stage_io(i, j)
        for a, ch in enumerate(self.choices):
            st = self._terms(t, i, j, io, ch)
            op = self._option(t, a, ch, st, j == self.L)
            if op is not None:
                opts.append(op)
                st0 = st
        if st0 is None:
            return None
        return Group(
            i,
            j,
            t.k,
            t.tier,
            t.price,
            st0.fwd_step_s,
            st0.bwd_step_s,
            tuple(_undominated(opts)),
            af=st0.fwd_step_s + st0.fwd_hop_s,
            ao=st0.fwd_step_s + st0.fwd_hop_own_s,
            bf=st0.bwd_step_s + st0.bwd_hop_s,
            bo=st0.bwd_step_s + st0.bwd_hop_own_s,
        )

    def _terms(self, t: _Tier, i: int, j: int, io: StageBytes, ch: SyncChoice) -> StageTerms:
        """``perfmodel.stage_terms`` of layers [i, j) at tier t with sync choice ch."""
        profile = self.profile
        return stage_terms(
            self.P[j] - self.P[i],
            t.F[j] - t.F[i],
            t.G[j] - t.G[i],
            self.SV[j] - self.SV[i],
            io.in_ps,
            io.out_ps,
            io.ingrad_ps,
            profile.label_bytes_per_sample,
            i == 0,
            j == self.L,
            t.tier,
            ch,
            self.d,
            self.b,
            self.m,
            self.plat,
            buffer_bytes=self.BUF[j] - self.BUF[i],
            build_bytes=profile.build_bytes,
            outgrad_ps=io.outgrad_ps,
            data_streamed=not data_resident(profile.data_bytes, t.tier),
            master_ratio=profile.master_ratio,
        )

    def _option(self, t: _Tier, a: int, ch: SyncChoice, st: StageTerms, last: bool) -> SyncOption | None:
        """The option of sync choice ch, or None if the stage breaks memory or a task limit."""
        m, maxT, plat = self.m, self.maxT, self.plat
        if st.memory_bytes > t.cap or st.sync.task_s > maxT:
            return None
        if concurrency_refusal(1, self.d, plat.concurrency, plat.inline_map_only, [st.sync.tasks]):
            return None  # a sync Map wider than a Map runs, or than the account has room for
        if not last and st.load_s + m * st.fwd_step_s + st.fwd_hop_own_s > maxT:
            return None
        if m * st.bwd_step_s + st.bwd_hop_own_s + (st.load_s if last else 0.0) + st.sync.tail_s > maxT:
            return None
        own = (
            t.price * (self.d * st.sync.tail_s + st.sync.tasks * st.sync.task_s)
            + plat.price_request * st.invocations
            + plat.price_transition * st.transitions
            + plat.price_put * st.puts
            + plat.price_get * st.gets
        )
        extra = st.sync.tail_s + ((phase_overhead(self.plat, st.sync.tasks) + st.sync.task_s) if st.sync.tasks else 0.0)
        return SyncOption(a, ch, own, extra, st.sync.tail_s, st.load_s, st)


def candidate_groups(
    profile: ModelProfile,
    plat: Platform,
    d: int,
    b: int,
    m: int,
    tiers: Sequence[int] | None = None,
    sync_algos: Sequence[str] | None = None,
    choices: Sequence[SyncChoice] | None = None,
) -> Candidates:
    """Every (interval, tier) that fits memory and the task limits with at least one sync choice,
    with its constants; sync options no better in any respect than another are dropped."""
    tiers = tuple(tiers or plat.tiers_mb)
    choices = tuple(choices if choices is not None else sync_choices(d, sync_algos))
    iv = _Intervals(profile, plat, d, b, m, choices)
    out: list[Group] = []
    for k, tier in enumerate(tiers):
        out += iv.tier_groups(k, tier)
    return Candidates(d, b, m, tiers, choices, iv.L, tuple(out))


# -- a heuristic incumbent -------------------------------------------------------------------------
def path_estimate(cands: Candidates, path: Sequence[tuple[Group, SyncOption]], plat: Platform) -> Estimate:
    """``perfmodel.compose`` of a path of (group, option): the model's exact prediction."""
    cfg = Config(
        tuple(g.j - g.i for g, _ in path),
        tuple(g.tier for g, _ in path),
        cands.replicas,
        cands.micro_batch,
        cands.micro_batches,
        tuple(op.choice for _, op in path),
    )
    return compose(cfg, [op.terms for _, op in path], plat)
