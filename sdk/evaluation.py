"""Evaluation results as a user reads them, and the metrics most jobs want.

The evaluate tasks (lambdas/evaluation.py) leave one record per replica with sums over its slice
of the validation set; the mean over the whole set is their sum divided by the samples, whatever
the plan (docs/runtime.md "Evaluation").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from stagecoach.core.records import EvalResult


def accuracy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Top-1 accuracy of class scores ``output`` (batch, classes) against class indices: a mean
    over the batch, as Job.metrics functions are."""
    return (output.argmax(dim=-1) == target).float().mean()


@dataclass(frozen=True)
class Evaluation:
    """The validation set's mean loss and metrics for the parameters after ``version`` iterations."""

    version: int
    samples: int
    loss: float
    metrics: dict[str, float]

    def describe(self, what: str = "validation") -> str:
        parts = [f"{what} loss {self.loss:.4f}", *(f"{what} {k} {v:.4f}" for k, v in self.metrics.items())]
        return ", ".join(parts)


def combine(results: Sequence[EvalResult]) -> Evaluation:
    """The replicas' records of one version as means over all their samples."""
    n = sum(r.samples for r in results)
    if not results or n == 0:
        raise ValueError("no evaluated samples to combine")
    names = list(results[0].metric_sums)
    return Evaluation(
        version=results[0].version,
        samples=n,
        loss=sum(r.loss_sum for r in results) / n,
        metrics={k: sum(r.metric_sums[k] for r in results) / n for k in names},
    )
