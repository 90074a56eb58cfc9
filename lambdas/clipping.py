"""Gradient clipping by the global norm, across every stage and shard, before any update.

``Job(clip_grad_norm=max_norm)`` computes what ``torch.nn.utils.clip_grad_norm_(model.parameters(),
max_norm)`` does on the whole model's summed gradient: the 2-norm over all of it, then every
gradient scaled by ``min(1, max_norm / (norm + 1e-6))``. Here the gradient lives in pieces: each
shard of each stage is reduced over the replicas by exactly one updating task (a sync task, or a
backward task that updates alone or exchanges shards), so the reduction is a barrier among those
tasks, as small as it can be — one float per task:

1. as soon as its shard's gradient is reduced (all its chunks), a task PUTs the shard's squared
   norm (float64) as ``iter/{t}/norm/s{s}/k{k}``;
2. it GETs every other task's (all at once, waiting as for any hand-off), adds them in (stage,
   shard) order — the same sum in every task — and takes the square root;
3. it scales its shard's gradient by the coefficient and updates.

The time it adds is a PUT and a GET round after the last shard of the iteration is reduced (the
others wait for that one), and the updates no longer overlap the reductions of the same task
(docs/runtime.md "Gradient clipping"). The norm is recorded in each updating task's metrics.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from stagecoach.core import keys
from stagecoach.lambdas.channel import Channel

EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s


@dataclass(frozen=True)
class Clip:
    max_norm: float
    updaters: tuple[tuple[int, int], ...]  # (stage, shard) of every task that reduces a shard

    def coefficient(
        self, ch: Channel, job: str, t: int, stage: int, shard: int, grads: Sequence[torch.Tensor], deadline: float
    ) -> tuple[float, float]:
        """(the global gradient norm, the factor to scale this shard's gradient by)."""
        sq = sum(float(torch.sum(g.double() * g.double())) for g in grads)
        ch.put_tensors(keys.grad_norm(job, t, stage, shard), {"sq": torch.tensor([sq], dtype=torch.float64)})
        pending = {(s, k): ch.submit_wait(keys.grad_norm(job, t, s, k), deadline) for s, k in self.updaters if (s, k) != (stage, shard)}
        total = 0.0
        for key in sorted(self.updaters):
            total += sq if key == (stage, shard) else float(pending[key].result()["sq"][0])
        norm = math.sqrt(total)
        return norm, min(1.0, self.max_norm / (norm + EPS))
