"""Plain single-process PyTorch training of a Job: the correctness anchor for pipelined runs.

Same initial parameters (the factory under the job's seed), same data order, same global batch, one
optimizer over the whole model. Given ``replicas`` and ``micro_batches`` it accumulates the global
batch's gradient over the same micro-batches the pipelined run uses, so that dropout draws the same
masks (randomness is seeded per layer, iteration, replica and micro-batch); with the defaults it is
ordinary full-batch training.
"""

from __future__ import annotations

from torch import nn

from stagecoach.job import Job
from stagecoach.lambdas.training import batch_indices, micro_batch, run_layers


def train_reference(job: Job, replicas: int = 1, micro_batches: int = 1) -> nn.Sequential:
    model = job.build_model().train()
    layers = list(model)
    optimizer = job.optimizer(list(model.parameters()))
    x, y = job.train
    x = x.to(job.dtype) if x.is_floating_point() else x
    per = replicas * micro_batches
    for t in range(job.iterations):
        batch = batch_indices(job.seed, t, x.shape[0], job.global_batch)
        optimizer.zero_grad()
        for r in range(replicas):
            for j in range(micro_batches):
                idx = micro_batch(batch, replicas, micro_batches, r, j)
                out = run_layers(layers, 0, x[idx], job.seed, t, r, j)
                (job.loss(out, y[idx]) / per).backward()
        optimizer.step()
    return model
