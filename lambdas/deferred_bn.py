"""Deferred batch norm: BatchNorm's running statistics updated once per iteration, from the whole
global batch, on a plan that splits it into replicas and micro-batches (``Job(...,
deferred_batch_norm=True)``; docs/exactness.md "Deferred batch norm").

torchgpipe's ``DeferredBatchNorm`` does this inside one process: each micro-batch is normalised
with its own statistics, the running statistics are left alone per micro-batch, and the per-channel
sums over the mini-batch's micro-batches update them once. Here the parts of a global batch are
spread over the replicas' tasks, and a stage's forward pass runs in another task than its recompute,
so the rule is spelt out over tasks:

1. Every forward pass of a stage that counts (its forward task; the last stage's backward task,
   whose forward pass is its only one) runs the stage's BatchNorms with their running statistics
   suspended (:func:`suspended`): each micro-batch is normalised with its own batch statistics,
   exactly as in train mode, but ``running_mean``, ``running_var`` and ``num_batches_tracked``
   stay as they are. Meanwhile :class:`BatchStats` records, per BatchNorm and micro-batch, the
   number of values per channel, their per-channel mean and their per-channel sum of squared
   deviations from that mean; the task stores its replica's record (``keys.bn_stats``).
2. The backward phase's recompute runs with them suspended too (and the phase restores the
   statistics around itself besides), so it changes nothing.
3. Replica 0's backward task of the stage reads the d records in replica order, combines every
   part (:func:`combine`: the global batch's mean, and its unbiased variance, by the exact
   pairwise rule of Chan, Golub and LeVeque — the sum and sum of squares in a form that does not
   cancel in float32), and updates each BatchNorm once (:func:`commit`), as PyTorch's train-mode
   forward would on the global batch: ``num_batches_tracked += 1``, then
   ``running = (1 - f) * running + f * statistic`` with ``f = momentum``, or ``1 /
   num_batches_tracked`` for ``momentum=None``. It stores the result as the next version.

With one replica and one micro-batch nothing is deferred: the stage's BatchNorms update their
statistics themselves, as plain PyTorch does.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm


@contextmanager
def suspended(norms: Iterable[_BatchNorm]) -> Iterator[None]:
    """Within: every BatchNorm of ``norms`` normalises with its batch's own statistics (they are in
    train mode) and leaves its running statistics and ``num_batches_tracked`` unchanged.

    A BatchNorm in train mode that does not track running statistics is exactly that (PyTorch
    passes it no running buffers), so tracking is switched off for the duration.
    """
    norms = list(norms)
    for m in norms:
        m.track_running_stats = False
    try:
        yield
    finally:
        for m in norms:
            m.track_running_stats = True


def _moments(x: torch.Tensor) -> tuple[float, torch.Tensor, torch.Tensor]:
    """Values per channel of a BatchNorm input (N, C, ...), their per-channel mean and sum of
    squared deviations from it, in float64.

    The mean is summed in float64 (a float32 mean is off by up to half a unit in its last place,
    which the combination multiplies by the spread of the micro-batches' means), a few samples at
    a time so no float64 copy of a large input is made. The variance is accurate as it is
    (PyTorch's Welford: deviations from its running mean, not from the rounded result).
    """
    dims = [0, *range(2, x.dim())]
    n = x.numel() // x.shape[1]
    with torch.no_grad():
        x = x.detach()
        var, mean = torch.var_mean(x, dim=dims, correction=0)
        if x.dtype == torch.float64:
            return float(n), mean, var * n
        rows = max(1, (1 << 23) // max(1, x[0].numel() * 8))  # float64 temporaries of at most 8 MiB
        total = torch.zeros(x.shape[1], dtype=torch.float64)
        for part in torch.split(x, rows):
            total += part.sum(dim=dims, dtype=torch.float64)
        exact = total / n
    return float(n), exact, var.double() * n


class BatchStats:
    """One task's record of what its BatchNorms saw: per BatchNorm and micro-batch, the count,
    mean and sum of squared deviations of the input per channel (rule 1 of the module docstring)."""

    def __init__(self, norms: dict[str, _BatchNorm]) -> None:
        self.norms = norms
        self._parts: dict[str, dict[int, tuple[float, torch.Tensor, torch.Tensor]]] = {k: {} for k in norms}

    @contextmanager
    def recording(self, mb: int) -> Iterator[None]:
        """Within: the BatchNorms' running statistics are suspended and micro-batch ``mb``'s inputs
        recorded (the last stage runs its micro-batches in reverse; the record is kept in order)."""
        handles = []
        for key, m in self.norms.items():

            def hook(module: nn.Module, args: tuple[torch.Tensor, ...], key: str = key) -> None:
                if mb in self._parts[key]:
                    # Job.validate refuses this up front (exactness.coupling_beyond_batch_norm)
                    raise RuntimeError(
                        f"BatchNorm {key} ran twice on micro-batch {mb}: deferred batch norm records one input per micro-batch"
                    )
                self._parts[key][mb] = _moments(args[0])

            handles.append(m.register_forward_pre_hook(hook))
        try:
            with suspended(self.norms.values()):
                yield
        finally:
            for h in handles:
                h.remove()

    def tensors(self) -> dict[str, torch.Tensor]:
        """The record as tensors ("<key>.count" (k,), "<key>.mean" and "<key>.m2" (k, C)), its k
        parts in micro-batch order; a BatchNorm that ran on nothing has none."""
        out: dict[str, torch.Tensor] = {}
        for key, parts in self._parts.items():
            if not parts:
                continue
            ordered = [parts[j] for j in sorted(parts)]
            out[f"{key}.count"] = torch.tensor([n for n, _, _ in ordered], dtype=torch.float64)
            out[f"{key}.mean"] = torch.stack([mean for _, mean, _ in ordered])
            out[f"{key}.m2"] = torch.stack([m2 for _, _, m2 in ordered])
        return out


def combine(records: Sequence[dict[str, torch.Tensor]]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per BatchNorm: the mean and the unbiased variance (float64) of every value it saw over all
    parts of all ``records`` (the replicas' :meth:`BatchStats.tensors`, in replica order).

    With n_i values of mean m_i and squared deviations M_i per part, N = sum n_i:
    mean = sum n_i m_i / N, and the sum of squared deviations from it is
    sum M_i + sum n_i (m_i - mean)^2 (Chan, Golub and LeVeque), divided by N - 1 as PyTorch's
    running variance is.
    """
    keys = list(dict.fromkeys(k.rsplit(".", 1)[0] for rec in records for k in rec))
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for key in keys:
        parts = [rec for rec in records if f"{key}.count" in rec]
        count = torch.cat([rec[f"{key}.count"] for rec in parts]).unsqueeze(1)
        means = torch.cat([rec[f"{key}.mean"] for rec in parts])
        m2 = torch.cat([rec[f"{key}.m2"] for rec in parts])
        n = float(count.sum())
        mean = (count * means).sum(0) / n
        squares = m2.sum(0) + (count * (means - mean) ** 2).sum(0)
        out[key] = (mean, squares / max(n - 1.0, 1.0))
    return out


def commit(norms: dict[str, _BatchNorm], combined: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Update each BatchNorm's running statistics once with its combined mean and variance, as its
    train-mode forward would on the whole global batch (a BatchNorm that ran on no sample is left
    alone, as it would be)."""
    with torch.no_grad():
        for key, m in norms.items():
            if key not in combined:
                continue
            mean, var = combined[key]
            factor = 0.0 if m.momentum is None else m.momentum
            if m.num_batches_tracked is not None:
                m.num_batches_tracked.add_(1)
                if m.momentum is None:  # cumulative moving average
                    factor = 1.0 / float(m.num_batches_tracked)
            for buf, stat in ((m.running_mean, mean), (m.running_var, var)):
                assert buf is not None  # tracked_norms (training.py) holds only BatchNorms with running statistics
                buf.copy_(factor * stat + (1.0 - factor) * buf.double())
