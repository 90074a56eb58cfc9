"""The planner's choice of C, the chunks per gradient/parameter shard of each stage (Plan.chunks).

More chunks shorten the pipeline's lag (a consumer waits for one chunk, or a group of them, not a
whole shard: docs/runtime.md "Sync algorithms"), but every chunk is an S3 object each replica PUTs
and its readers GET and poll for. The size rule (planner/plan.py ``chunk_count``) ignores prices;
here each stage's C is the one whose predicted iteration, by the performance model's own formulas
(syncmodel.py prices C's requests, polls and lag; perfmodel.py bills the longer tasks), scores
best under the plan's weights, among 1..the rule's C. Chunking changes no bits (a chunk is a range
of a shard; the element-wise reduction order is the same), so the choice is free to make.
"""

from __future__ import annotations

import dataclasses

from stagecoach.planner.model.perfmodel import Config, Estimate, evaluate
from stagecoach.planner.model.platforms import Platform
from stagecoach.planner.model.syncmodel import SYNC_ALGORITHMS, SyncChoice, rule_chunks
from stagecoach.planner.profile.layers import ModelProfile


def chunk_candidates(profile: ModelProfile, cfg: Config, stage: int) -> range:
    """The C considered for ``stage``: 1..the size rule's C (whose chunks are already at least
    MIN_CHUNK_BYTES; more would only add requests); just the rule where nothing is exchanged."""
    choice = cfg.sync[stage]
    if cfg.replicas == 1 or choice.algo not in SYNC_ALGORITHMS or choice.algo == "none":
        return range(0, 1)
    lo = sum(cfg.balance[:stage])
    p_bytes = sum(layer.param_bytes for layer in profile.layers[lo : lo + cfg.balance[stage]])
    k = choice.k
    return range(1, rule_chunks(cfg.replicas, k, profile.master_ratio * p_bytes) + 1)


def with_stage_chunks(cfg: Config, stage: int, chunks: int) -> Config:
    """``cfg`` with stage ``stage`` synchronised in ``chunks`` chunks per shard."""
    sync = list(cfg.sync)
    sync[stage] = dataclasses.replace(sync[stage], chunks=chunks)
    return dataclasses.replace(cfg, sync=tuple(sync))


def score(e: Estimate, cost_weight: float, time_weight: float) -> float:
    """The plan's objective (solve/objective.py weighted_objective): USD and seconds, weighted."""
    return cost_weight * e.cost + time_weight * e.time_s


def choose_chunks(profile: ModelProfile, cfg: Config, plat: Platform, cost_weight: float = 1.0, time_weight: float = 0.0) -> Config:
    """``cfg`` with every stage's C chosen by the predicted iteration's score (``cost_weight`` per
    USD, ``time_weight`` per second: the plan's weights; the default is the predicted cost alone).

    A stage's terms depend only on its own C (perfmodel: a stage's sync prices its own chunks), so
    one pass over the stages finds the best C of each. Ties keep the larger C (the shorter lag);
    a C that makes the plan infeasible (a task past its timeout) is never chosen. The C chosen is
    written explicitly, also where it equals the rule's, so the plan records what ran."""
    best_cfg = cfg
    for s in range(cfg.stages):
        options = chunk_candidates(profile, best_cfg, s)
        if options == range(0, 1):
            continue
        scored = []
        for c in options:
            trial = with_stage_chunks(best_cfg, s, c)
            e = evaluate(profile, trial, plat)
            if e.feasible:
                scored.append((score(e, cost_weight, time_weight), -c, trial))
        if scored:
            best_cfg = min(scored, key=lambda t: (t[0], t[1]))[2]
    return best_cfg


def chosen_chunks(cfg: Config) -> tuple[int, ...]:
    """Plan.chunks for ``cfg``: each stage's C (0 where it is the size rule's)."""
    return tuple(choice.chunks for choice in cfg.sync)


__all__ = ["SyncChoice", "choose_chunks", "chosen_chunks", "chunk_candidates", "with_stage_chunks"]
