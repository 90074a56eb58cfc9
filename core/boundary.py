"""What crosses a stage boundary: a tensor, or a tuple, list or dict of tensors (nested).

A block may return several tensors — AmoebaNet's cells pass (state, skip) pairs, an encoder passes
hidden states with an attention mask — and the next block takes the same structure. Across a cut
it travels as one safetensors object: the leaves ``x0, x1, ...`` and, for anything but a plain
tensor, the structure as PyTorch's pytree spec (JSON, in a uint8 tensor ``tree``). Floating leaves
get a gradient back (``g0, g1, ...`` by leaf position); integer and boolean ones (ids, masks) travel
forward only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

TREE = "tree"


def leaves(obj: Any) -> list[Any]:
    return [obj] if isinstance(obj, torch.Tensor) else list(pytree.tree_leaves(obj))


def check(obj: Any, where: str) -> None:
    """Refuse a block output that is not a tensor or a structure of tensors."""
    bad = [type(leaf).__name__ for leaf in leaves(obj) if not isinstance(leaf, torch.Tensor)]
    if bad or not leaves(obj):
        raise TypeError(
            f"{where} returned {type(obj).__name__}" + (f" holding {bad[0]}" if bad else " holding no tensor") + ": "
            "every block must return a tensor, or a tuple, list or dict of tensors, which the next block takes"
        )


def map_leaves(fn: Callable[[torch.Tensor], torch.Tensor], obj: Any) -> Any:
    return fn(obj) if isinstance(obj, torch.Tensor) else pytree.tree_map(fn, obj)


def pack(obj: Any) -> dict[str, torch.Tensor]:
    """The tensors of one boundary object (a plain tensor keeps the single key ``x``)."""
    if isinstance(obj, torch.Tensor):
        return {"x": obj}
    flat, spec = pytree.tree_flatten(obj)
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for i, leaf in enumerate(flat):
        ptr = leaf.untyped_storage().data_ptr() if leaf.numel() else -1 - i
        out[f"x{i}"] = leaf.clone() if ptr in seen else leaf  # the same tensor twice ((h, h)): stored twice
        seen.add(ptr)
    out[TREE] = torch.frombuffer(bytearray(pytree.treespec_dumps(spec).encode()), dtype=torch.uint8)
    return out


def unpack(tensors: dict[str, torch.Tensor]) -> Any:
    if TREE not in tensors:
        return tensors["x"]
    spec = pytree.treespec_loads(bytes(tensors[TREE].tolist()).decode())
    return pytree.tree_unflatten([tensors[f"x{i}"] for i in range(spec.num_leaves)], spec)


def with_grad(obj: Any) -> Any:
    """Floating leaves as detached leaves that require a gradient (the backward phase's input)."""
    return map_leaves(lambda t: t.detach().requires_grad_(True) if t.is_floating_point() else t, obj)


def grads_of(obj: Any) -> dict[str, torch.Tensor]:
    """The gradients to send back for a boundary input: one per floating leaf (zeros if none reached it)."""
    if isinstance(obj, torch.Tensor):
        return {"g": obj.grad if obj.grad is not None else torch.zeros_like(obj)} if obj.is_floating_point() else {}
    return {
        f"g{i}": leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
        for i, leaf in enumerate(leaves(obj))
        if leaf.is_floating_point()
    }


def backward_pairs(output: Any, grads: dict[str, torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The output leaves that need a gradient and the gradients the next stage sent for them."""
    if isinstance(output, torch.Tensor):
        return ([output], [grads["g"]]) if output.requires_grad and "g" in grads else ([], [])
    outs, gs = [], []
    for i, leaf in enumerate(leaves(output)):
        if leaf.requires_grad and f"g{i}" in grads:
            outs.append(leaf)
            gs.append(grads[f"g{i}"])
    return outs, gs


def floating(obj: Any) -> bool:
    return any(leaf.is_floating_point() for leaf in leaves(obj))


def dtypes(obj: Any) -> tuple[torch.dtype, ...]:
    return tuple(leaf.dtype for leaf in leaves(obj))
