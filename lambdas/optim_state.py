"""Optimizer state of one parameter shard, stored as safetensors (tensors) plus JSON metadata (scalars).

The optimizer is sharded ZeRO-1 style: sync task k owns the state of shard k only. Any torch.optim
optimizer whose update is elementwise (SGD, Adam, AdamW, RMSprop, Adagrad, ...) gives the same
result on a flat shard as on the whole model.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save


def load_with_metadata(body: bytes) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """safetensors' torch loader drops the header metadata; read it from the header directly."""
    (n,) = struct.unpack("<Q", body[:8])
    header = json.loads(body[8 : 8 + n])
    return st_load(body), header.get("__metadata__", {}) or {}


def dump_state(optimizer: torch.optim.Optimizer) -> bytes:
    state = optimizer.state_dict()["state"].get(0, {})
    tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    scalars = {k: v for k, v in state.items() if not isinstance(v, torch.Tensor)}
    return st_save({f"state.{k}": v.contiguous() for k, v in tensors.items()}, metadata={"scalars": json.dumps(scalars)})


def restore_state(optimizer: torch.optim.Optimizer, body: bytes) -> None:
    """Install a shard's state as it was saved, dtypes included.

    Not ``load_state_dict``: that casts floating state to the parameter's dtype (NAdam's float32
    ``mu_product`` would become float64), and one optimizer over the whole model never does that,
    so the shards would round differently from it.
    """
    tensors, meta = load_with_metadata(body)
    state: dict[str, Any] = json.loads(meta.get("scalars", "{}"))
    state.update({k.removeprefix("state."): v for k, v in tensors.items()})
    if state:
        (param,) = optimizer.param_groups[0]["params"]
        optimizer.state[param] = state


def apply_update(
    make_optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
    param: torch.Tensor,
    grad: torch.Tensor,
    state: bytes | None,
) -> tuple[torch.Tensor, bytes]:
    """One optimizer step on a flat parameter shard; returns the new shard and its new state."""
    p = torch.nn.Parameter(param.clone())
    opt = make_optimizer([p])
    if state is not None:
        restore_state(opt, state)
    p.grad = grad.to(p.dtype)
    opt.step()
    return p.detach(), dump_state(opt)


def warm_up() -> None:
    """Take one optimizer step on a scalar: torch imports its optimizer machinery (~2 s) lazily on
    the first step, and that belongs in a container's start, not in the first task's update."""
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.0)
    p.grad = torch.zeros(1)
    opt.step()
