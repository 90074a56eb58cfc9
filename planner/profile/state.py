"""What a model holds before it computes anything, read off a build on the meta device.

A model too large for Lambda must be refused before anything allocates it: building a 40 GB
nn.Linear on a laptop fails in the allocator (or swaps for minutes) long before the planner could
say that no Lambda function holds it. Built under ``torch.device("meta")`` every parameter and
buffer has its shape and dtype and no storage, so the bytes each child of the nn.Sequential holds
are known at once (planner/model/fits.py turns them into a refusal or the smallest stage count).
No forward pass runs: activations are left at zero, so every size here is a lower bound.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from stagecoach.planner.profile.layers import LayerProfile, ModelProfile


def _bytes(tensors: Iterable[torch.Tensor]) -> float:
    return float(sum(t.numel() * t.element_size() for t in tensors))


def state_layer(index: int, child_name: str, child: nn.Module) -> LayerProfile:
    """Child ``index`` with its trainable, frozen and buffer bytes, named as the profilers name it
    (planner/profile/tensors.py layer_profile) and without activations."""
    frozen = _bytes(p for p in child.parameters() if not p.requires_grad)
    return LayerProfile(
        name=f"{index}:{child_name}" if not child_name.isdigit() else f"{index}:{type(child).__name__}",
        param_bytes=_bytes(p for p in child.parameters() if p.requires_grad),
        saved_bytes_per_sample=0.0,
        out_bytes_per_sample=0.0,
        in_bytes_per_sample=0.0,
        buffer_bytes=_bytes(child.buffers()) + frozen,
        frozen_bytes=frozen,
    )


def state_profile(model: nn.Sequential, name: str = "model") -> ModelProfile:
    """Every child's held bytes (``model`` on any device; on the meta device nothing was allocated)."""
    return ModelProfile(name, tuple(state_layer(i, n, c) for i, (n, c) in enumerate(model._modules.items())), 0.0)


def optimizer_state_ratio(make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer]) -> float | None:
    """The optimizer's per-parameter state bytes over the parameter's bytes (SGD 0, SGD with
    momentum 1, Adam 2), from one step on a stand-in parameter of a few elements: what the job's
    optimizer keeps per parameter, without building the model. Scalars (Adam's ``step``) do not
    grow with the model and are left out. None if the factory cannot step a stand-in."""
    p = nn.Parameter(torch.zeros(64))
    try:
        opt = make_optimizer([p])
        p.grad = torch.ones_like(p)
        opt.step()
    except Exception:  # the job's checks name what is wrong with the optimizer; here it is a bound
        return None
    per = sum(
        v.numel() * v.element_size() for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor) and v.numel() > 1
    )
    return per / (p.numel() * p.element_size())
