"""Plain single-process PyTorch training of a Job: the correctness anchor for pipelined runs.

Same initial parameters (the factory under the job's seed), same data order, same global batch, one
optimizer over the whole model. Given ``replicas`` and ``micro_batches`` it accumulates the global
batch's gradient over the same micro-batches the pipelined run uses, so that dropout draws the same
masks (randomness is seeded per layer, iteration, replica and micro-batch); with the defaults it is
ordinary full-batch training.

A job with ``deferred_batch_norm`` on a split batch follows the documented semantics
(docs/exactness.md "Deferred batch norm") in plain PyTorch terms, independently of the runtime's
bookkeeping (lambdas/deferred_bn.py): every micro-batch runs through the model in train mode as
usual (each BatchNorm normalising it with its own statistics); afterwards the running statistics
are put back as they were before the iteration, and each BatchNorm is run once more, in train mode
and without a gradient, on the concatenation of every input it saw in the iteration — so PyTorch
itself updates them once with the whole global batch's mean and unbiased variance.

It runs one intra-op thread, as every worker does (Lambda gives a function below 1,769 MB one vCPU;
the local stack sets OMP_NUM_THREADS=1): a matmul's reduction split across threads may round
differently (5.6e-17 in float64 with two threads on a 2-core AMD EPYC machine), and the
reference's bits must not depend on the machine's core count.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from stagecoach.core.samples import as_dtype
from stagecoach.core.training import batch_indices, epoch_of, micro_batch, run_layers
from stagecoach.job import Job


def train_reference(job: Job, replicas: int = 1, micro_batches: int = 1) -> nn.Sequential:
    with _one_thread():
        return _train(job, replicas, micro_batches)


@contextmanager
def _one_thread() -> Iterator[None]:
    """torch's intra-op threads at 1 for the block, as a worker runs (see the module's docstring)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _train(job: Job, replicas: int, micro_batches: int) -> nn.Sequential:
    model = job.build_model().train()
    layers = list(model)
    optimizer = job.optimizer(list(model.parameters()))
    scheduler = job.scheduler(optimizer) if job.scheduler is not None else None
    samples, n = job.samples, len(job.samples)
    per = replicas * micro_batches
    deferred = job.deferred_batch_norm and per > 1
    norms = [m for m in model.modules() if isinstance(m, _BatchNorm) and m.track_running_stats] if deferred else []
    for t in range(job.iterations):
        batch = batch_indices(job.seed, t, n, job.global_batch)
        epoch = epoch_of(t, n, job.global_batch)
        optimizer.zero_grad()
        with _global_batch_statistics(norms):
            for r in range(replicas):
                for j in range(micro_batches):
                    idx = micro_batch(batch, replicas, micro_batches, r, j)
                    x, y = samples.batch(idx, job.transform, job.seed, epoch)
                    out = run_layers(layers, 0, as_dtype(x, job.dtype), job.seed, t, r, j)
                    torch.autograd.backward(job.loss(out, y) / per)
        if job.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), job.clip_grad_norm)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
    return model


@contextmanager
def _global_batch_statistics(norms: list[_BatchNorm]) -> Iterator[None]:
    """Within: record what each BatchNorm of ``norms`` sees; then put their running statistics back
    and update them once from the concatenation of those inputs (module docstring)."""
    saved = [{k: v.clone() for k, v in m.named_buffers(recurse=False)} for m in norms]
    seen: dict[int, list[torch.Tensor]] = {id(m): [] for m in norms}

    def record(m: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        seen[id(m)].append(args[0].detach())

    handles = [m.register_forward_pre_hook(record) for m in norms]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
    with torch.no_grad():
        for m, buffers in zip(norms, saved):
            for k, v in m.named_buffers(recurse=False):
                v.copy_(buffers[k])
            if seen[id(m)]:
                m(torch.cat(seen[id(m)]))  # train mode: PyTorch's own update, once, from the global batch


def train_reference_schedule(job: Job, global_batch: Mapping[int, int], lr_scale: Mapping[int, float] | None = None) -> nn.Sequential:
    """Plain single-process PyTorch training of a growing global batch with a learning-rate rule
    (Hydrozoa's AdaBatch policy, docs/runtime.md "Dynamic workers"): iteration t takes the next
    ``global_batch``-at-t samples of the epoch's seeded permutation after iteration t-1's
    (core/training.py batch_position), the whole batch at once, and from each key of ``lr_scale``
    on every parameter group's learning rate is the factory's times the product of the factors so
    far. It knows nothing of replicas, stages or segments: the distributed run must equal it."""
    if job.scheduler is not None or job.deferred_batch_norm:
        raise ValueError("train_reference_schedule: a learning-rate scheduler or deferred batch norm is not covered")
    with _one_thread():
        model = job.build_model().train()
        layers = list(model)
        optimizer = job.optimizer(list(model.parameters()))
        base = [g["lr"] for g in optimizer.param_groups]
        sizes = sorted(global_batch.items())
        samples, n = job.samples, len(job.samples)
        factor = 1.0
        for t in range(job.iterations):
            if lr_scale and t in lr_scale:
                factor *= float(lr_scale[t])
                for g, lr in zip(optimizer.param_groups, base):
                    g["lr"] = lr * factor
            size = [g for first, g in sizes if first <= t][-1]
            batch = batch_indices(job.seed, t, n, size, sizes)
            x, y = samples.batch(batch, job.transform, job.seed, epoch_of(t, n, size, sizes))
            optimizer.zero_grad()
            out = run_layers(layers, 0, as_dtype(x, job.dtype), job.seed, t, 0, 0)
            torch.autograd.backward(job.loss(out, y))
            if job.clip_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), job.clip_grad_norm)
            optimizer.step()
        return model
