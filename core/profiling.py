"""The measuring profiler: runs the real layers and returns planner.profile types.

Per layer (child of the nn.Sequential): parameter bytes; bytes saved for backward per sample,
measured exactly with torch.autograd.graph.saved_tensors_hooks (deduplicated by storage, per-sample
= saved(b=2) - saved(b=1) so weights saved by ops are excluded); output and input-gradient bytes per
sample; forward time (no grad, as the forward phase runs it) and backward time (the autograd
backward alone; the backward phase recomputes the forward first, which the performance model adds)
per micro-batch size.

Run locally with ``threads=1`` the times are at ONE vCPU and the planner scales them to tiers with
its vCPU model. Inside Lambda, ``profile_phase`` measures at the function's own vCPU count and
records the times under its memory tier (``LayerProfile.tier_s``); run it once per tier and fold
the results with ``combine_tier_phases``.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch import nn

from stagecoach.core.graph_split import Blocks
from stagecoach.planner.profile.layers import LayerProfile, ModelProfile
from stagecoach.planner.profile.tensors import (
    SavedBytes,
    batch_like,
    grad_seed,
    layer_profile,
    requires_grad_,
    tensor_bytes,
)


def _detach(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach()
    if isinstance(obj, (tuple, list)):
        return type(obj)(_detach(o) for o in obj)
    return obj


def _saved_bytes(layer: torch.nn.Module, x: Any) -> tuple[Any, int]:
    x = requires_grad_(x)
    with torch.enable_grad(), SavedBytes() as sb:
        y = layer(x)
    return y, sb.total


def _time_layer(layer: torch.nn.Module, x: Any, repeats: int) -> tuple[float, float]:
    """Median forward (no grad) and backward-only seconds for input batch x."""
    fwd, bwd = [], []
    for _ in range(repeats + 1):  # first run warms caches and is dropped
        t0 = time.perf_counter()
        with torch.no_grad():
            layer(x)
        t1 = time.perf_counter()
        xg = requires_grad_(x)
        with torch.enable_grad():
            y = layer(xg)
        outs, seeds = grad_seed(y)
        t2 = time.perf_counter()
        if outs:
            torch.autograd.backward(outs, seeds)
        t3 = time.perf_counter()
        fwd.append(t1 - t0)
        bwd.append(t3 - t2)
    return statistics.median(fwd[1:]), statistics.median(bwd[1:])


def _timing_fields(times: dict[int, tuple[float, float]], tier_mb: int | None) -> dict[str, Any]:
    """A layer's measured (forward, backward) seconds per micro-batch size as LayerProfile fields:
    at the one-vCPU reference (``fwd_s``/``bwd_s``), or under the memory tier they were measured at."""
    f = {b: t[0] for b, t in times.items()}
    g = {b: t[1] for b, t in times.items()}
    return {
        "fwd_s": {} if tier_mb else f,
        "bwd_s": {} if tier_mb else g,
        "tier_s": {tier_mb: {b: (f[b], g[b]) for b in f}} if tier_mb else {},
    }


def measure_model(
    model: torch.nn.Sequential,
    sample_input: Any,
    micro_batch_sizes: Sequence[int] = (1, 2, 4),
    repeats: int = 3,
    threads: int | None = 1,
    name: str = "model",
    tier_mb: int | None = None,
) -> ModelProfile:
    """Profile every child of ``model`` by running it.

    ``threads``: torch intra-op threads while timing (1 = one vCPU, the planner's reference);
    None keeps the current setting. ``tier_mb``: if given, times are stored as measured at that
    Lambda memory tier instead of at the one-vCPU reference.
    """
    if not isinstance(model, torch.nn.Sequential):
        raise TypeError(f"{name}: the profiler needs an nn.Sequential of blocks, got {type(model).__name__}")
    if not micro_batch_sizes or min(micro_batch_sizes) < 1:
        raise ValueError(f"micro_batch_sizes={list(micro_batch_sizes)}: give positive sizes, e.g. (1, 2, 4)")
    old_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    was_training = model.training
    model.train()
    try:
        # bytes per sample: the difference between batches of lo and lo + 1 samples (lo = 1 unless
        # the model cannot run one sample in train mode, e.g. BatchNorm1d: then the smallest size given)
        lo = min(micro_batch_sizes)
        xs = {b: batch_like(sample_input, b) for b in sorted(set(micro_batch_sizes) | {lo, lo + 1})}
        in1 = tensor_bytes(xs[lo + 1]) - tensor_bytes(xs[lo])
        flows = model.measure_flows(xs[lo], xs[lo + 1]) if isinstance(model, Blocks) else ()
        layers = []
        for i, (cname, child) in enumerate(model._modules.items()):  # a block used twice counts twice
            y1, s1 = _saved_bytes(child, xs[lo])
            y2, s2 = _saved_bytes(child, xs[lo + 1])
            times = {b: _time_layer(child, xs[b], repeats) for b in micro_batch_sizes}
            layers.append(layer_profile(i, cname, child, (xs[lo], xs[lo + 1]), (y1, y2), (s1, s2), **_timing_fields(times, tier_mb)))
            with torch.no_grad():
                xs = {b: _detach(child(x)) for b, x in xs.items()}
        model.zero_grad(set_to_none=True)
        return ModelProfile(name=name, layers=tuple(layers), input_bytes_per_sample=float(in1), source="measured", flows=flows)
    finally:
        torch.set_num_threads(old_threads)
        model.train(was_training)


def profile_phase(
    model: torch.nn.Sequential | Callable[[], torch.nn.Sequential],
    sample_input: Any,
    micro_batch_sizes: Sequence[int] = (1, 2, 4),
    repeats: int = 2,
) -> dict[str, Any]:
    """The worker handler's "profile" phase: measure this function's tier; return JSON-able data.

    The tier is the function's configured memory (AWS_LAMBDA_FUNCTION_MEMORY_SIZE, set by Lambda
    and by the local runtime); without it (a plain process) times are at the one-vCPU reference.
    Torch uses every vCPU the function has, as training does.
    """
    if callable(model) and not isinstance(model, torch.nn.Module):
        model = model()
    mem = os.environ.get("AWS_LAMBDA_FUNCTION_MEMORY_SIZE")
    tier = int(mem) if mem else None
    t0 = time.perf_counter()
    prof = measure_model(
        cast(nn.Sequential, model), sample_input, micro_batch_sizes, repeats=repeats, threads=None if tier else 1, tier_mb=tier
    )
    return {
        "memory_mb": tier,
        "threads": torch.get_num_threads(),
        "seconds": time.perf_counter() - t0,
        "profile": prof.to_dict(),
    }


def combine_tier_phases(results: Sequence[dict[str, Any]]) -> ModelProfile:
    """Fold the outputs of ``profile_phase`` run at several tiers into one ModelProfile.

    Sizes come from the first result (they do not depend on the tier); times are merged per tier.
    """
    if not results:
        raise ValueError("no profile phase results to combine: run the profile phase at one or more tiers")
    profs = [ModelProfile.from_dict(r["profile"]) for r in results]
    base = profs[0]
    layers = []
    for i, l in enumerate(base.layers):
        tier_s: dict[int, dict[int, tuple[float, float]]] = {}
        fwd, bwd = dict(l.fwd_s), dict(l.bwd_s)
        for p in profs:
            if len(p.layers) != len(base.layers):
                raise ValueError("profile phase results disagree on the layer count: were they run on the same model?")
            tier_s.update({t: dict(v) for t, v in p.layers[i].tier_s.items()})
            if not fwd and p.layers[i].fwd_s:
                fwd, bwd = dict(p.layers[i].fwd_s), dict(p.layers[i].bwd_s)
        layers.append(LayerProfile(**{**l.__dict__, "tier_s": tier_s, "fwd_s": fwd, "bwd_s": bwd}))
    return ModelProfile(name=base.name, layers=tuple(layers), input_bytes_per_sample=base.input_bytes_per_sample, source="measured")
