"""The evaluate phase: the parameters after t iterations, forward only, on the validation set.

Each replica takes a contiguous slice of the validation set and walks it in micro-batches of the
plan's micro-batch size through every stage, as the forward phase does (the last stage included),
with the model in eval mode (dropout off, BatchNorm on its running statistics of version t). The
last stage sums the loss and each of Job.metrics over its micro-batches (each a mean, times its
samples) into one record per replica; replicas combine by adding (sdk/run.py Run.evaluations),
so the result is the mean over the validation set whatever the plan. Nothing assumes
classification: the loss and the metrics are the user's functions of (output, target).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from stagecoach.core import keys
from stagecoach.core.events import EvaluateEvent
from stagecoach.core.records import EvalResult
from stagecoach.core.training import shard_bounds
from stagecoach.lambdas.channel import Channel
from stagecoach.lambdas.jobctx import JobContext
from stagecoach.lambdas.stageio import one_ahead

SPACE = "eval/"  # its hand-offs' keys (keys.act), apart from iteration t's training objects


def eval_batches(n: int, replicas: int, replica: int, micro_batch: int) -> list[torch.Tensor]:
    """The validation samples of ``replica``, as micro-batches (the last may be smaller)."""
    a, b = shard_bounds(n, replicas)[replica]
    return [torch.arange(i, min(i + micro_batch, b)) for i in range(a, b, micro_batch)]


def _scalar(value: Any, what: str) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{what} returned a tensor of shape {tuple(value.shape)}: it must be a scalar (a mean over the batch)")
        return float(value.detach())
    return float(value)


def evaluate(ctx: JobContext, ch: Channel, ev: EvaluateEvent, deadline: float) -> dict[str, Any]:
    plan, s, r, v = ctx.plan, ev.stage, ev.replica, ev.t
    # a warm stage's version v is in its replica's container (the evaluate task runs on the
    # replica's function, right after the backward task that made it)
    warm = ctx.warm_attempt(ch, s, ev.window_start, ev.attempt)
    layers = ctx.ensure_params(ch, s, v, deadline, ev.window_start, warm)
    ctx.ensure_running_stats(ch, s, v)  # what eval-mode BatchNorm normalises with
    io = ctx.stage_io(s, SPACE)
    first = plan.stage_layers(s).start
    batches = eval_batches(ctx.eval_spec.dataset.n_train, plan.replicas, r, plan.micro_batch_size)
    loss_sum, sums, samples = 0.0, {name: 0.0 for name in ctx.eval_spec.metrics}, 0
    layers.eval()
    try:
        # as the forward tasks: a later stage downloads the next input while this one computes
        order = range(len(batches))
        inputs: Iterator[tuple[int, Any]]
        if s == 0:
            inputs = ((j, ctx.inputs(ch, 0, batches[j], v, "validation")) for j in order)
        else:
            inputs = one_ahead(order, lambda j: io.receive_later(ch, v, r, j, deadline))
        for j, x in inputs:
            idx = batches[j]
            with torch.no_grad():
                y = io.run(layers, first, x, ctx.seed, v, r, j)
                if not io.last:
                    io.send(ch, v, r, j, y)
                    continue
                target = ctx.targets(ch, s, idx, "validation")
                n = int(idx.numel())
                loss_sum += _scalar(ctx.loss_fn(y, target), "job.loss") * n
                for name in sums:
                    sums[name] += _scalar(ctx.metric_fns[name](y, target), f"job.metrics[{name!r}]") * n
                samples += n
    finally:
        layers.train()
    if not io.last:
        return {}
    record = EvalResult(version=v, replica=r, samples=samples, loss_sum=loss_sum, metric_sums=sums)
    ch.put_bytes(keys.eval_result(ctx.job, v, r), record.model_dump_json().encode())
    # the replica's means, in its task metrics too (Run.metrics(); Run.evaluations() combines replicas)
    n = max(samples, 1)
    return {"loss": loss_sum / n, "eval_metrics": {k: x / n for k, x in sums.items()}} if samples else {}
