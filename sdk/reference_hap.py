"""Single-process reference of FasDL's Hybrid Asynchronous Parallel (HAP) with unequal partitioning.

HAP is asynchronous by design: it does not train what plain PyTorch trains, so its correctness
anchor is not stagecoach.reference.train_reference but this function, which computes the semantics
docs/exactness.md "FasDL's HAP" states, in plain PyTorch, from planner/hap.py's HapSplit (who
aggregates, how the global batch is cut, which parameter version each replica computes on):

  theta_0 = the factory's parameters under the job's seed
  g_t     = sum over replicas r = 0..d-1, in that order, of replica r's gradient of
            sum_j weight(r) * loss(micro-batch j of r) at theta_{version(t, r)}
            (version(t, r) = t for aggregators, max(t - 1, 0) for non-aggregators)
  theta_{t+1} = the optimizer's step from theta_t with gradient g_t (after clip_grad_norm)

Two copies of the model hold theta_t and theta_{t-1}; the optimizer and its state belong to the
first, so the update is plain PyTorch's. One intra-op thread, as the workers (reference.py).
"""

from __future__ import annotations

import torch
from torch import nn

from stagecoach.core.samples import as_dtype
from stagecoach.core.training import batch_indices, epoch_of, run_layers, tracked_norms
from stagecoach.errors import StagecoachError
from stagecoach.job import Job
from stagecoach.planner.hap import HapSplit
from stagecoach.reference import _one_thread

Grads = list[torch.Tensor | None]


class HapRefused(StagecoachError, ValueError):
    """A job or split HAP's semantics are not defined for (docs/exactness.md "FasDL's HAP")."""


def train_reference_hap(job: Job, split: HapSplit, losses: list[float] | None = None) -> nn.Sequential:
    """The model HAP trains (module docstring). ``losses``, if given, receives each iteration's
    global-batch mean loss: every micro-batch's mean loss times its weight, summed — each
    replica's loss at the version it computed on."""
    check_hap_job(job, split)
    with _one_thread():
        return _train(job, split, losses)


def check_hap_job(job: Job, split: HapSplit) -> None:
    """Refuse what HAP's semantics leave undefined: a split of another global batch, and running
    statistics (a BatchNorm's buffers would be updated by forwards at two parameter versions)."""
    if split.global_batch != job.global_batch:
        raise HapRefused(f"the HAP split has a global batch of {split.global_batch}, the job {job.global_batch}: give the job's")
    norms = tracked_norms(list(job.build_model()), 0)
    if norms:
        raise HapRefused(
            f"HAP's stale replicas would update running statistics at an older parameter version ({', '.join(sorted(norms))}): "
            "use a model without BatchNorm running statistics (track_running_stats=False, or GroupNorm/LayerNorm), or sync 'k_reduce'"
        )


def _train(job: Job, split: HapSplit, losses: list[float] | None) -> nn.Sequential:
    model = job.build_model().train()
    stale = job.build_model().train()  # theta_{t-1}; overwritten with theta_0 below
    stale.load_state_dict(model.state_dict())
    params = list(model.parameters())
    optimizer = job.optimizer(params)
    scheduler = job.scheduler(optimizer) if job.scheduler is not None else None
    n = len(job.samples)
    for t in range(job.iterations):
        batch = batch_indices(job.seed, t, n, job.global_batch)
        total: Grads = [None] * len(params)
        loss = 0.0
        for r in range(split.replicas):
            net = model if split.param_version(t, r) == t else stale
            g, lr = _replica(job, split, net, batch, epoch_of(t, n, job.global_batch), t, r)
            total = [_add(a, b) for a, b in zip(total, g, strict=True)]
            loss += lr
        with torch.no_grad():  # theta_t becomes the stale version of iteration t+1
            stale.load_state_dict(model.state_dict())
        for p, g_ in zip(params, total, strict=True):
            p.grad = g_
        if job.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, job.clip_grad_norm)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        if losses is not None:
            losses.append(loss)
    return model


def _replica(job: Job, split: HapSplit, net: nn.Sequential, batch: torch.Tensor, epoch: int, t: int, r: int) -> tuple[Grads, float]:
    """Replica r's gradient of iteration t on ``net`` (its micro-batches accumulated in order) and
    its weighted loss."""
    net.zero_grad(set_to_none=True)
    layers = list(net)
    loss = 0.0
    w = split.weight(r)
    for j in range(split.micro_batches):
        x, y = job.samples.batch(split.rows(batch, r, j), job.transform, job.seed, epoch)
        out = run_layers(layers, 0, as_dtype(x, job.dtype), job.seed, t, r, j)
        value = job.loss(out, y)
        torch.autograd.backward(value * w)
        loss += float(value.detach()) * w
    return [None if p.grad is None else p.grad.detach().clone() for p in net.parameters()], loss


def _add(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    """a + b, a parameter's gradient missing from a replica (unused, frozen) counting as none."""
    if a is None:
        return b
    return a if b is None else a + b
