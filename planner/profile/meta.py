"""Meta-device sizing: a model profiled without allocating it (paper-scale models).

The model is built on ``torch.device("meta")``: sizes are exact, FLOPs are counted with
torch.utils.flop_counter, and times come from the platform's calibrated FLOP rate
(``LayerProfile.times``).
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from stagecoach.planner.profile.layers import ModelProfile
from stagecoach.planner.profile.tensors import (
    SavedBytes,
    batch_like,
    detach_all,
    grad_seed,
    layer_profile,
    requires_grad_,
    tensor_bytes,
)


def _size_layer(layer: Any, x: Any, flops: bool = True) -> tuple[Any, int, float, float]:
    """Run one layer with grad on input x: (output, saved bytes, fwd FLOPs, bwd FLOPs).

    FLOP counting on meta goes through decompositions and is slow, so callers count it once.
    """

    x = requires_grad_(x)
    fwd = bwd = 0.0
    with torch.enable_grad():
        fc = FlopCounterMode(display=False) if flops else contextlib.nullcontext()
        with fc:
            with SavedBytes() as sb:
                y = layer(x)
        if isinstance(fc, FlopCounterMode):
            fwd = fc.get_total_flops()
            outs, seeds = grad_seed(y)
            if outs:
                with FlopCounterMode(display=False) as fb:
                    torch.autograd.backward(outs, seeds)
                bwd = fb.get_total_flops()
    return y, sb.total, float(fwd), float(bwd)


def profile_meta(
    model: Any,
    sample_input: Any,
    name: str = "model",
    label_bytes_per_sample: float = 8.0,
    batch: int = 1,
) -> ModelProfile:
    """Profile an nn.Sequential on the meta device: exact sizes, FLOP-counted compute.

    ``model``: an nn.Sequential, or a zero-argument factory (called under torch.device("meta") so
    nothing is allocated). ``sample_input``: one sample (no batch dimension), any device.
    Per-sample quantities come from batch sizes ``batch`` and ``batch`` + 1 (difference), so
    batch-independent saved tensors (weights) are excluded; FLOPs per sample are those of the
    first batch over its samples. ``batch`` = 2 for a model that cannot run one sample in train
    mode (BatchNorm over a 1 x 1 feature map refuses a batch of one, meta tensors too).
    """
    if batch < 1:
        raise ValueError(f"batch={batch}: the smaller of the two batches sized must hold at least one sample")

    with torch.device("meta"):
        m = model() if callable(model) and not isinstance(model, torch.nn.Module) else model
    if any(p.device.type != "meta" for p in m.parameters()):
        m = copy.deepcopy(m).to("meta")  # never move the caller's model
    if not isinstance(m, torch.nn.Sequential):
        raise TypeError(f"{name}: the planner partitions an nn.Sequential of blocks, got {type(m).__name__}")
    sample = _to_meta(sample_input)
    x1, x2 = batch_like(sample, batch, "meta"), batch_like(sample, batch + 1, "meta")
    in1 = tensor_bytes(x2) - tensor_bytes(x1)
    # a model cut from its graph (core/graph_split.py Blocks) names the values crossing its
    # cuts; their sizes price the direct sends (planner/profile/flows.py)
    measure_flows = getattr(m, "measure_flows", None)
    flows = measure_flows(x1, x2) if callable(measure_flows) else ()
    layers = []
    for i, (child_name, child) in enumerate(m._modules.items()):  # a block used twice counts twice
        y1, s1, f1, b1 = _size_layer(child, x1)
        y2, s2, _, _ = _size_layer(child, x2, flops=False)
        per = {"fwd_flops_per_sample": f1 / batch, "bwd_flops_per_sample": b1 / batch}
        layers.append(layer_profile(i, child_name, child, (x1, x2), (y1, y2), (s1, s2), **per))
        x1, x2 = detach_all(y1), detach_all(y2)
    return ModelProfile(
        name=name,
        layers=tuple(layers),
        input_bytes_per_sample=float(in1),
        label_bytes_per_sample=label_bytes_per_sample,
        source="meta",
        flows=flows,
    )


def _to_meta(obj: Any) -> Any:

    if isinstance(obj, torch.Tensor):
        return torch.empty(obj.shape, dtype=obj.dtype, device="meta")
    if isinstance(obj, (tuple, list)):
        return type(obj)(_to_meta(o) for o in obj)
    raise TypeError(f"sample input must be a tensor or tuple of tensors, got {type(obj).__name__}")
