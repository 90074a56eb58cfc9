"""The passes a job runs beside its iterations: an evaluation and a checkpoint (docs/performance-model.md §4.6).

A job with a validation or test set runs an Evaluate Map after the iterations ``Job.eval_versions``
names, one task per (stage, replica) (lambdas/evaluation.py); a job with ``checkpoint_every`` runs
a Checkpoint Map, one task per stage (lambdas/checkpoint.py). Both are billed like any task, so a
run's predicted cost (sdk/cost.py ``predict``) adds them: without them the prediction of a job
that evaluates missed its evaluation, and the two states every iteration spends asking whether one
is due. The terms are the iteration's (``perfmodel.config_terms``), so a pass costs what the same
stage's forward work costs there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from stagecoach.planner.limits import map_transitions
from stagecoach.planner.model.perfmodel import Config, config_terms
from stagecoach.planner.profile.layers import ModelProfile

if TYPE_CHECKING:  # pragma: no cover
    from stagecoach.planner.model.platforms import Platform


@dataclass(frozen=True)
class PassEstimate:
    """One pass (an Evaluate or a Checkpoint Map): per stage, its tasks and each one's billed
    seconds, and the S3 requests of the whole pass (without each task's PUT of its metrics, which
    sdk/cost.py adds for every task)."""

    task_s: tuple[float, ...]
    tasks: tuple[int, ...]
    puts: float
    gets: float
    # evaluation runs a Map per stage in a Parallel (so a stage reaches past 40 tasks), checkpoint one Map
    per_stage_maps: bool = False

    @property
    def invocations(self) -> int:
        return sum(self.tasks)

    @property
    def transitions(self) -> int:
        """asl.window_definition's ``Evaluate`` (a Parallel of a Map per stage) or ``Checkpoint``
        (one Map of a task per stage): the Parallel or Map state, and each Map's (limits.map_transitions)."""
        if self.per_stage_maps:
            return 1 + sum(map_transitions(n) for n in self.tasks)
        return 1 + sum(self.tasks)


def eval_micro_batches(samples: int, replicas: int, micro_batch: int) -> list[int]:
    """Micro-batches each replica walks: a contiguous, nearly equal share of the set (the first
    ``samples % replicas`` one sample larger), cut at the plan's micro-batch size, the last one
    smaller — as lambdas/evaluation.py ``eval_batches`` cuts it (core/training.py shard_bounds)."""
    q, r = divmod(samples, replicas)
    return [math.ceil((q + (1 if k < r else 0)) / micro_batch) for k in range(replicas)]


def evaluate_pass(profile: ModelProfile, cfg: Config, plat: Platform, samples: int) -> PassEstimate:
    """One evaluation of ``samples`` validation samples: every stage forwards each micro-batch of
    its replica's share and hands it on through S3 as the forward phase does (a flow shop over all
    S stages, the last included: it computes the loss and metrics locally and PUTs one record).
    Stage s's task of a replica with m_r micro-batches ends when its last one is handed on:
    load + sum_{s'<s} (a_s' + h_s') + a_s + h_own_s + (m_r - 1) max_{s'<=s} a_s', with the
    iteration's forward steps and hops (§3.1: the next input downloads while one computes, the
    first one's GET paid once); the last stage's step is max(f, t_lat + in/w), its own end the
    first input's wait and its record's PUT. A stage's ``task_s`` is the mean over its replicas (the billed sum over d).
    The validation set is read once per container, as the training set is (not charged)."""
    S, d = cfg.stages, cfg.replicas
    ms = eval_micro_batches(samples, d, cfg.micro_batch)
    terms = config_terms(profile, cfg, plat, max(max(ms), 1))
    lat = plat.storage_latency_s
    # the forward phase's steps and hops; the last stage's step: its input's GET and its forward,
    # the next input downloading while one computes (as the forward tasks do), the first one's
    # GET paid once beside its record's PUT
    last = terms[-1]
    last_step = max(last.fwd_compute_s, last.get_in_s) if (plat.recompute_forward and S > 1) else last.get_in_s + last.fwd_compute_s
    steps = [t.fwd_step_s for t in terms[:-1]] + [last_step]
    owns = [t.fwd_hop_own_s for t in terms[:-1]] + [lat + last.get_in_s + last.fwd_compute_s - last_step]
    task_s = [0.0] * S
    for m in ms:
        lmax = amax = acc = 0.0
        for s, t in enumerate(terms):
            lmax, amax = max(lmax, t.load_s), max(amax, steps[s])
            task_s[s] += (lmax + acc + steps[s] + owns[s] + (m - 1) * amax if m else t.load_s) / d
            acc += steps[s] + t.fwd_hop_s
    # each stage but the last PUTs its m_r outputs, each but the first GETs them (polling while they
    # travel), the last PUTs one record per replica; the parameters are loaded as the forward phase's
    hand_offs = (S - 1) * sum(ms)
    polls = sum(plat.polls_while_waiting(terms[s - 1].fwd_hop_s, learnt=True) for s in range(1, S)) * sum(ms)
    shard_gets = sum(0 if t.sync.params_cached else t.sync.shards for t in terms)
    return PassEstimate(tuple(task_s), (d,) * S, float(hand_offs + d), hand_offs + polls + d * shard_gets, per_stage_maps=True)


def checkpoint_pass(profile: ModelProfile, cfg: Config, plat: Platform) -> PassEstimate:
    """One checkpoint: a task per stage (its replica 0) loads the stage's parameters as the
    forward phase does and PUTs them with its buffers as one safetensors object: load + t_lat +
    (P_s + buffers_s)/w."""
    terms = config_terms(profile, cfg, plat)
    w, lat = plat.bandwidth_Bps, plat.storage_latency_s
    task_s, lo = [], 0
    for t, n in zip(terms, cfg.balance):
        buffers = sum(layer.buffer_bytes for layer in profile.layers[lo : lo + n])
        task_s.append(t.load_s + lat + (t.p_bytes + buffers) / w)
        lo += n
    gets = sum(0 if t.sync.params_cached else t.sync.shards for t in terms)
    return PassEstimate(tuple(task_s), (1,) * cfg.stages, float(cfg.stages), float(gets))
