"""The three phases of an iteration (DESIGN.md §3), as one function each.

Forward (stage s, replica r): forward without grad, micro-batch by micro-batch, sending outputs on.
Backward (s, r): micro-batches in reverse, recompute with grad (GPipe re-materialisation), send
input-gradients back, accumulate parameter gradients scaled so they average over the global batch,
then write them as d shards (or, with d = 1, apply the optimizer directly).
Sync (s, shard k): sum shard k over replicas in a fixed order, apply the optimizer to shard k.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from stagecoach.lambdas import keys
from stagecoach.lambdas.channel import Channel
from stagecoach.lambdas.events import BackwardEvent, ForwardEvent, SyncEvent
from stagecoach.lambdas.jobctx import JobContext
from stagecoach.lambdas.optim_state import apply_update
from stagecoach.lambdas.training import (
    batch_indices,
    flat_grads,
    micro_batch,
    run_layers,
    shard_bounds,
)


def _rows(ctx: JobContext, ch: Channel, t: int, replica: int, mb: int) -> torch.Tensor:
    data = ctx.dataset(ch)
    plan = ctx.plan
    batch = batch_indices(ctx.seed, t, data["y"].shape[0], plan.global_batch)
    return micro_batch(batch, plan.replicas, plan.micro_batches, replica, mb)


def _stage_input(ctx: JobContext, ch: Channel, t: int, stage: int, replica: int, mb: int, deadline: float) -> torch.Tensor:
    if stage == 0:
        return ctx.dataset(ch)["x"][_rows(ctx, ch, t, replica, mb)]
    return ch.wait_tensors(keys.act(ctx.job, t, stage - 1, replica, mb), deadline)["x"]


def forward(ctx: JobContext, ch: Channel, ev: ForwardEvent, deadline: float) -> dict[str, Any]:
    if ev.stage >= ctx.plan.stages - 1:
        raise ValueError(f"stage {ev.stage} has no forward task: the last stage's forward runs in its backward")
    layers = ctx.ensure_params(ch, ev.stage, ev.t, deadline)
    first = ctx.plan.stage_layers(ev.stage).start
    for j in range(ctx.plan.micro_batches):
        x = _stage_input(ctx, ch, ev.t, ev.stage, ev.replica, j, deadline)
        with torch.no_grad():
            y = run_layers(layers, first, x, ctx.seed, ev.t, ev.replica, j)
        ch.put_tensors(keys.act(ctx.job, ev.t, ev.stage, ev.replica, j), {"x": y})
    return {}


def backward(ctx: JobContext, ch: Channel, ev: BackwardEvent, deadline: float) -> dict[str, Any]:
    plan = ctx.plan
    s, r, t = ev.stage, ev.replica, ev.t
    last = s == plan.stages - 1
    layers = ctx.ensure_params(ch, s, t, deadline)
    params = ctx.stage_params(s)
    for p in params:
        p.grad = None
    first = plan.stage_layers(s).start
    scale = 1.0 / (plan.micro_batches * plan.replicas)
    losses = []
    for j in reversed(range(plan.micro_batches)):
        x = _stage_input(ctx, ch, t, s, r, j, deadline)
        if s > 0:
            x = x.detach().requires_grad_(True)
        y = run_layers(layers, first, x, ctx.seed, t, r, j)
        if last:
            labels = ctx.dataset(ch)["y"][_rows(ctx, ch, t, r, j)]
            loss = ctx.loss_fn(y, labels)
            if loss.dim() != 0:
                raise ValueError("the loss must reduce to a scalar (a mean over the micro-batch)")
            (loss * scale).backward()
            losses.append(float(loss.detach()))
        else:
            g = ch.wait_tensors(keys.grad(ctx.job, t, s + 1, r, j), deadline)["g"]
            y.backward(g)
        if s > 0:
            ch.put_tensors(keys.grad(ctx.job, t, s, r, j), {"g": x.grad})
    flat = flat_grads(params)
    if plan.replicas == 1:
        _update_shard(ctx, ch, s, 0, t, flat, ev.window_start)
    else:
        for k, (a, b) in enumerate(shard_bounds(flat.numel(), plan.replicas)):
            ch.put_tensors(keys.gshard(ctx.job, t, s, r, k), {"g": flat[a:b]})
    _forget_iteration(ctx, ch, t - 2, s, r)
    out: dict[str, Any] = {}
    if last:
        out["loss"] = sum(losses) / len(losses)
    return out


def sync(ctx: JobContext, ch: Channel, ev: SyncEvent, deadline: float) -> dict[str, Any]:
    """Scatter-reduce with a sharded update: this task owns shard k of stage s."""
    plan = ctx.plan
    total = None
    for r in range(plan.replicas):  # fixed order: bit-identical results on every run
        g = ch.wait_tensors(keys.gshard(ctx.job, ev.t, ev.stage, r, ev.shard), deadline)["g"]
        total = g if total is None else total + g
    _update_shard(ctx, ch, ev.stage, ev.shard, ev.t, total, ev.window_start)
    return {}


def _update_shard(ctx: JobContext, ch: Channel, stage: int, shard: int, t: int, grad: torch.Tensor, window_start: int) -> None:
    job = ctx.job
    p_body = ch.get_tensors(keys.params(job, t, stage, shard))
    if p_body is None:
        raise FileNotFoundError(f"parameters {keys.params(job, t, stage, shard)} are missing")
    state = ch.get_bytes(keys.optim(job, t, stage, shard)) if t > 0 else None
    if t > 0 and state is None:
        raise FileNotFoundError(f"optimizer state {keys.optim(job, t, stage, shard)} is missing")
    if grad.numel() != p_body["p"].numel():
        raise ValueError(f"gradient shard has {grad.numel()} elements, parameter shard {p_body['p'].numel()}")
    new_p, new_state = apply_update(ctx.make_optimizer, p_body["p"], grad, state)
    ch.put_tensors(keys.params(job, t + 1, stage, shard), {"p": new_p})
    ch.put_bytes(keys.optim(job, t + 1, stage, shard), new_state)
    if t - 1 >= 0 and t - 1 != window_start:
        # version t-1 is neither the window's checkpoint nor needed by anyone any more
        ch.delete([keys.params(job, t - 1, stage, shard), keys.optim(job, t - 1, stage, shard)])


def _forget_iteration(ctx: JobContext, ch: Channel, t: int, stage: int, replica: int) -> None:
    """Delete what this worker wrote two iterations ago (a bucket lifecycle rule is the safety net)."""
    if t < 0:
        return
    plan, job = ctx.plan, ctx.job
    ks = [keys.act(job, t, stage, replica, j) for j in range(plan.micro_batches)]
    ks += [keys.grad(job, t, stage, replica, j) for j in range(plan.micro_batches)]
    ks += [keys.gshard(job, t, stage, replica, k) for k in range(plan.replicas)]
    ch.delete(ks)


PHASES = {"forward": forward, "backward": backward, "sync": sync}
