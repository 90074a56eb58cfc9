"""Tensor helpers shared by the meta-device sizing and the measuring profiler, and the one place
both turn a layer's two runs into its LayerProfile (``layer_profile``)."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree

from stagecoach.planner.profile.layers import LayerProfile


def tensor_bytes(obj: Any) -> int:
    """Bytes of every tensor in a (nested) tensor/tuple/list/dict output."""

    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (tuple, list)):
        return sum(tensor_bytes(o) for o in obj)
    if isinstance(obj, dict):
        return sum(tensor_bytes(o) for o in obj.values())
    return 0


def batch_like(sample: Any, b: int, device: Any = None) -> Any:
    """A batch of ``b`` copies of one sample (tensor or nested), on ``device``."""

    if isinstance(sample, torch.Tensor):
        x = sample.unsqueeze(0).expand(b, *sample.shape)
        x = x.to(device) if device is not None else x
        return x.contiguous() if x.device.type != "meta" else torch.empty(x.shape, dtype=x.dtype, device="meta")
    if isinstance(sample, (tuple, list)):
        return type(sample)(batch_like(s, b, device) for s in sample)
    raise TypeError(f"sample input must be a tensor or a tuple of tensors, got {type(sample).__name__}")


def requires_grad_(obj: Any) -> Any:

    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point():
            obj = obj.detach().requires_grad_(True)
        return obj
    if isinstance(obj, (tuple, list)):
        return type(obj)(requires_grad_(o) for o in obj)
    return obj


def any_requires_grad(obj: Any) -> bool:
    """Whether a block input gets a gradient back: it holds a floating tensor (ids and masks do not)."""
    return any(isinstance(t, torch.Tensor) and t.is_floating_point() for t in pytree.tree_leaves(obj))


def floating_bytes(obj: Any) -> int:
    """Bytes of the floating tensors in a (nested) boundary object: what its gradient weighs (an
    integer or boolean leaf travels forward only, core/boundary.py)."""
    return sum(t.numel() * t.element_size() for t in pytree.tree_leaves(obj) if isinstance(t, torch.Tensor) and t.is_floating_point())


def grad_seed(out: Any) -> tuple[list[Any], list[Any]]:
    """Tensors of an output needing grad and matching ones-like seeds for backward."""

    outs, seeds = [], []
    items = out if isinstance(out, (tuple, list)) else (out,)
    for o in items:
        if isinstance(o, torch.Tensor) and o.requires_grad:
            outs.append(o)
            seeds.append(torch.ones_like(o))
    return outs, seeds


class SavedBytes:
    """Context manager summing bytes of tensors autograd saves for backward (deduplicated).

    Real tensors are deduplicated by storage address (a tensor saved by two ops, or a view of
    one, counts once); meta tensors have no address, so by object identity.
    """

    def __init__(self) -> None:
        self.total = 0
        self._seen: set[Any] = set()
        self._keep: list[Any] = []
        self._ctx: Any = None

    def _pack(self, t: Any) -> Any:
        if t.device.type == "meta":
            key: Any = ("id", id(t))
            self._keep.append(t)
            nbytes = t.numel() * t.element_size()
        else:
            st = t.untyped_storage()
            key = ("ptr", st.data_ptr())
            nbytes = st.nbytes()
        if key not in self._seen:
            self._seen.add(key)
            self.total += nbytes
        return t

    def __enter__(self) -> SavedBytes:

        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._ctx.__exit__(*exc)
        self._keep.clear()


def detach_all(obj: Any) -> Any:

    if isinstance(obj, torch.Tensor):
        return obj.detach()
    if isinstance(obj, (tuple, list)):
        return type(obj)(detach_all(o) for o in obj)
    return obj


def layer_profile(
    index: int, child_name: str, child: torch.nn.Module, x: tuple[Any, Any], y: tuple[Any, Any], saved: tuple[int, int], **timing: Any
) -> LayerProfile:
    """Child ``index`` of an nn.Sequential as the planner sees it, from two runs of it with grad on
    batches of n and n + 1 samples: inputs ``x``, outputs ``y``, bytes saved for backward
    ``saved``. Per-sample sizes are the differences of the two, so what does not grow with the
    batch (weights an op saves) drops out. ``timing``: the profiler's own LayerProfile fields (the
    measured times, or the counted FLOPs). Both profilers build their layers here, so the sizes,
    names and gradient flags they report cannot disagree."""
    (x1, x2), (y1, y2), (s1, s2) = x, y, saved
    trains = float(sum(p.numel() * p.element_size() for p in child.parameters() if p.requires_grad))
    # a frozen parameter (requires_grad=False) is held like a buffer: no gradient, sync or optimizer state
    frozen = float(sum(p.numel() * p.element_size() for p in child.parameters() if not p.requires_grad))
    return LayerProfile(
        # a Sequential built from a list names its children "0", "1", ...: the type says more
        name=f"{index}:{child_name}" if not child_name.isdigit() else f"{index}:{type(child).__name__}",
        param_bytes=trains,
        buffer_bytes=float(sum(b.numel() * b.element_size() for b in child.buffers())) + frozen,
        frozen_bytes=frozen,
        saved_bytes_per_sample=float(max(0, s2 - s1)),
        out_bytes_per_sample=float(tensor_bytes(y2) - tensor_bytes(y1)),
        in_bytes_per_sample=float(tensor_bytes(x2) - tensor_bytes(x1)),
        in_requires_grad=any_requires_grad(x1),
        in_grad_bytes_per_sample=float(floating_bytes(x2) - floating_bytes(x1)),
        out_grad_bytes_per_sample=float(floating_bytes(y2) - floating_bytes(y1)),
        **timing,
    )
