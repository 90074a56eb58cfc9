"""The planner's entry point: ``plan_model(profile, global_batch) -> PlanningResult``.

FuncPipe's sweep: for every Pareto weight (a1, a2), the plan minimising a1*cost + a2*time over
the whole search space (every power-of-two data-parallel degree d the account fits and micro-batch size b that divide the global
batch, and within each, partition, tier and sync algorithm per stage), proven optimal: one exact
solve per (d, b) (milp.solve_fixed; fixing d keeps the MILP linear), each only asked to beat the
best plan found so far, which its lower bounds usually refute at once. The candidate stages of a
(d, b) are built once for all weights. The Pareto front of the weights' optima, and FuncPipe's
delta rule, within the performance model's accuracy, picks the recommendation (pareto.recommend_within_accuracy).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from stagecoach.planner.limits import max_stages_at
from stagecoach.planner.model.chunking import choose_chunks, chosen_chunks
from stagecoach.planner.model.fits import check_plannable
from stagecoach.planner.model.perfmodel import Config, Estimate, evaluate, timeouts
from stagecoach.planner.model.platforms import Platform, aws_platform
from stagecoach.planner.model.syncmodel import ALL_SYNC
from stagecoach.planner.plan import Plan, Prediction
from stagecoach.planner.profile.layers import ModelProfile
from stagecoach.planner.solve.candidates import Candidates, candidate_groups
from stagecoach.planner.solve.objective import max_stages_for, objective_value, objective_weights
from stagecoach.planner.solve.pareto import FUNCPIPE_WEIGHTS, pareto_front, recommend_within_accuracy
from stagecoach.planner.solve.search import heuristic_incumbent, solve_fixed

# Before issue 25, d in (1, 2, 4, 8, 16, 32) (40 workers per inline Map); kept for callers that name it
DEFAULT_REPLICAS = (1, 2, 4, 8, 16, 32)
# The micro-batch sizes planned (and so profiled) unless the caller names others: FuncPipe's 4 with
# the powers of two around it (docs/planner.md "What is searched").
DEFAULT_MICRO_BATCH_SIZES = (1, 2, 4, 8)


def default_micro_batch_sizes(batch_coupled: bool = False) -> tuple[int, ...]:
    """The one rule `Job.plan` and `stagecoach plan` time and plan micro-batches by:
    DEFAULT_MICRO_BATCH_SIZES, without 1 for a model that normalises over the batch (BatchNorm
    cannot run one sample in train mode, and a micro-batch of one has no batch statistics)."""
    return tuple(b for b in DEFAULT_MICRO_BATCH_SIZES if b > 1) if batch_coupled else DEFAULT_MICRO_BATCH_SIZES


def replica_candidates(global_batch: int, micro_batch_sizes: Sequence[int], plat: Platform) -> tuple[int, ...]:
    """The data-parallel degrees searched by default: the powers of two d that some micro-batch
    size splits the global batch for (d b divides G) and that fit at least one stage on the
    account (limits.max_stages_at: S d invocations with a restart's headroom within
    ``plat.concurrency``, d <= MAP_MAX_TASKS). Powers of two keep the count logarithmic in the
    concurrency (at most 9 at the default 1,000: d <= 256) while every other d between two of them
    is left out: the search is exact over these (docs/planner.md "What is searched")."""
    out, d = [], 1
    while max_stages_at(d, plat.concurrency, plat.inline_map_only) >= 1:
        if any(global_batch % (d * b) == 0 for b in micro_batch_sizes):
            out.append(d)
        d *= 2
    return tuple(out)


@dataclass
class PlannedConfig:
    """One candidate plan with its prediction and how it was found."""

    estimate: Estimate
    weights: tuple[float, float]
    method: str  # "milp" (proven optimal for its weights), "milp(time_limit)" or "heuristic"
    solve_s: float  # planning seconds until this weight's optimum was known
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
        """The runtime contract (stagecoach.planner.plan.Plan): per stage the sync algorithm and K
        (Plan.sync, Plan.aggregators), the model's predicted task seconds per phase
        (Plan.prediction.task_s, what the runtime's timeout manager starts from) and
        TimeoutSeconds by plan.timeouts_from. Raises PlanError if a phase is predicted not to fit
        Lambda's 15 minutes."""

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
            chunks=chosen_chunks(c),  # each stage's C, chosen by predicted cost (model/chunking.py)
            memory_mb=tuple(c.tiers_mb),
            timeouts_s=timeouts(e),  # plan.timeouts_from: refuses a phase that cannot fit 15 minutes
            prediction=Prediction(
                task_s=tuple(task_s),
                s_per_iteration=round(e.time_s, 4),
                usd_per_iteration=e.cost,
                phase_s={"forward": round(e.forward_s, 4), "backward_sync": round(e.backward_sync_s, 4)},
                sync_algorithms=tuple(s.label() for s in c.sync),
                platform=self.platform.name,
                planner_method=self.method,
            ),
        )


@dataclass
class PlanningResult:
    profile: ModelProfile  # the (merged) profile the plans refer to
    global_batch: int
    platform: Platform
    candidates: list[PlannedConfig]  # the optimum of every weight (proven, unless method says otherwise)
    pareto: list[PlannedConfig]
    recommended: PlannedConfig
    solve_s: float
    notes: list[str] = field(default_factory=list)

    @property
    def proven(self) -> bool:
        """True if every candidate is proven optimal for its (d, b, weights)."""
        return all(c.method == "milp" for c in self.candidates)


def _check_arguments(global_batch: int, weights: Sequence[tuple[float, float]], sync_algos: Sequence[str] | None) -> None:
    if global_batch < 1:
        raise ValueError(f"global_batch={global_batch}: must be a positive number of samples")
    if not weights:
        raise ValueError("weights is empty: give at least one (a1, a2), e.g. FuncPipe's pareto.FUNCPIPE_WEIGHTS")
    unknown = sorted(set(sync_algos or ()) - set(ALL_SYNC))
    if unknown:
        raise ValueError(f"unknown sync algorithms {unknown}: choose from {list(ALL_SYNC)}")


@dataclass
class _Sweep:
    """The solves of one ``plan_model`` call: the candidate stages of every (d, b), built once
    for all weights, and every weight's optimum so far (free incumbents for the other weights)."""

    prof: ModelProfile
    plat: Platform
    subproblems: list[tuple[int, int, int]]  # (d, b, m)
    max_stages: int
    sync_algos: Sequence[str] | None
    time_limit: float
    groups: dict[tuple[int, int], Candidates] = field(default_factory=dict)
    found: list[Config] = field(default_factory=list)

    def optimum(self, a1: float, a2: float, use_milp: bool) -> tuple[tuple[float, Config] | None, bool]:
        """The optimum over every (d, b) (objective, plan), None if nothing fits; and whether
        every solve proved its part. Each subproblem only has to beat the best found so far (its
        bounds usually show at once that it cannot), so the weights' optima come cheap."""
        best = self._known(a1, a2)
        heur, best = self._heuristics(a1, a2, best)
        if not use_milp:
            return best, True
        return self._solve_all(a1, a2, heur, best)

    def _known(self, a1: float, a2: float) -> tuple[float, Config] | None:
        """The best of the other weights' optima under these weights."""
        best: tuple[float, Config] | None = None
        for cfg in self.found:
            e = evaluate(self.prof, cfg, self.plat)
            v = objective_value(e.cost, e.time_s, a1, a2)
            if e.feasible and (best is None or v < best[0]):
                best = (v, cfg)
        return best

    def _heuristics(
        self, a1: float, a2: float, best: tuple[float, Config] | None
    ) -> tuple[dict[tuple[int, int], tuple[Config | None, float]], tuple[float, Config] | None]:
        """A quick heuristic plan per (d, b): the best of them is the first cutoff, and the most
        promising (d, b) are solved first so that the others face the strongest cutoff."""
        L = len(self.prof.layers)
        heur = {}
        for d, b, m in self.subproblems:
            if (d, b) not in self.groups:
                self.groups[(d, b)] = candidate_groups(self.prof, self.plat, d, b, m, sync_algos=self.sync_algos)
            heur[(d, b)] = heuristic_incumbent(
                self.prof, self.plat, self.groups[(d, b)], a1, a2, max_stages_for(d, L, self.max_stages, self.plat)
            )
            hcfg, obj = heur[(d, b)]
            if hcfg is not None and (best is None or obj < best[0]):
                best = (obj, hcfg)
        return heur, best

    def _solve_all(
        self, a1: float, a2: float, heur: dict[tuple[int, int], tuple[Config | None, float]], best: tuple[float, Config] | None
    ) -> tuple[tuple[float, Config] | None, bool]:
        """The exact solve of every (d, b), most promising first, each against the best so far."""
        proven = True
        for d, b, m in sorted(self.subproblems, key=lambda sp: heur[sp[:2]][1]):
            own = [c for c in self.found if (c.replicas, c.micro_batch) == (d, b)]
            heuristic = heur[(d, b)][0]
            if heuristic is not None:
                own.append(heuristic)
            r = solve_fixed(
                self.prof,
                self.plat,
                d,
                b,
                m,
                a1,
                a2,
                max_stages=self.max_stages,
                time_limit=self.time_limit,
                candidates=self.groups[(d, b)],
                incumbent=own,
                cutoff=best[0] if best else None,
            )
            proven &= r.status == "optimal" or r.status.startswith(("cutoff", "infeasible"))  # the last two: nothing better here
            if r.config is not None and (best is None or r.objective < best[0]):
                best = (r.objective, r.config)
        return best, proven


def _on_account(plat: Platform, concurrency: int | None) -> Platform:
    """The platform with the account's Lambda concurrency (None: the platform's own)."""
    if concurrency is None:
        return plat
    if concurrency < 3:
        raise ValueError(f"concurrency={concurrency}: one worker and its restart need at least 3 concurrent executions")
    return plat.replace(concurrency=concurrency)


def plan_model(
    profile: ModelProfile,
    global_batch: int,
    platform: Platform | None = None,
    weights: Sequence[tuple[float, float]] = FUNCPIPE_WEIGHTS,
    replicas: Sequence[int] | None = None,
    micro_batch_sizes: Sequence[int] = DEFAULT_MICRO_BATCH_SIZES,
    max_stages: int = 8,
    max_layers: int = 12,
    sync_algos: Sequence[str] | None = ALL_SYNC,
    time_limit: float = 60.0,
    use_milp: bool = True,
    concurrency: int | None = None,
) -> PlanningResult:
    """Plan a model: each weight's optimum over every (d, micro-batch size) and plan shape, the
    Pareto set of those, and FuncPipe's recommendation.

    ``max_layers``: layers are merged to at most this many groups of balanced compute time before
    the MILP (docs/planner.md, "layer merging"); plans are optimal over cuts between groups.
    ``sync_algos``: the synchronisation algorithms the planner may choose per stage (default: all
    four the runtime runs). ``micro_batch_sizes``: those dividing G / d are tried (FuncPipe fixes
    4; the runtime runs any). ``time_limit``: seconds per (d, b, weights) solve; a solve that hits
    it keeps its best plan, labelled "milp(time_limit)". ``use_milp=False``: heuristic plans only.
    ``replicas``: the data-parallel degrees to try (default: ``replica_candidates``, the powers of
    two the account's concurrency fits). ``concurrency``: the Lambda concurrent executions of the
    account the job runs on (default: the platform's, AWS's default quota of 1,000): a plan of S
    stages and d replicas runs S d invocations at once and needs 2 S d + 1 (planner/limits.py).
    """
    t0 = time.perf_counter()
    plat = _on_account(platform or aws_platform(), concurrency)
    _check_arguments(global_batch, weights, sync_algos)
    if replicas is None:
        replicas = replica_candidates(global_batch, micro_batch_sizes, plat)
    check_plannable(profile, plat, max_stages)
    prof = profile.merged(max_layers, plat, micro_batch=max(micro_batch_sizes))
    subproblems = [(d, b, global_batch // (d * b)) for d in replicas for b in micro_batch_sizes if global_batch % (d * b) == 0]
    sweep = _Sweep(prof, plat, subproblems, max_stages, sync_algos, time_limit)
    cands: list[PlannedConfig] = []
    for a1, a2 in weights:
        best, proven = sweep.optimum(a1, a2, use_milp)
        if best is None:
            continue
        cfg = best[1]
        sweep.found.append(cfg)  # a free incumbent for the other weights
        e = evaluate(prof, choose_chunks(prof, cfg, plat, *objective_weights(a1, a2)), plat)  # C per stage (model/chunking.py)
        how = "heuristic" if not use_milp else ("milp" if proven else "milp(time_limit)")
        cands.append(PlannedConfig(e, (a1, a2), how, time.perf_counter() - t0, prof, plat))
    if not cands:
        raise ValueError(
            f"no feasible plan for {profile.name!r} at global batch {global_batch}: every combination of "
            f"replicas {list(replicas)} and micro-batch sizes {list(micro_batch_sizes)} either does not divide the "
            f"batch, exceeds Lambda memory, the 900 s task limit or the account's concurrency ({plat.concurrency}); try "
            "more stages (max_stages), smaller micro-batches or another global batch"
        )
    notes: list[str] = []
    if use_milp and any(c.method != "milp" for c in cands):
        notes.append("some solves hit the time limit: their plans are the best found, not proven optimal")
    front = pareto_front(cands)
    rec = recommend_within_accuracy(front)  # FuncPipe's delta rule within the model's accuracy (docs/planner.md)
    return PlanningResult(prof, global_batch, plat, cands, front, rec, time.perf_counter() - t0, notes)
