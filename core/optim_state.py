"""Optimizer state of one parameter shard, stored as safetensors (tensors) plus JSON metadata (scalars).

The optimizer is sharded ZeRO-1 style: sync task k owns the state of shard k only. Any torch.optim
optimizer whose update is elementwise (SGD, Adam, AdamW, RMSprop, Adagrad, ...) gives the same
result on a flat shard as on the whole model.

Parameter groups (e.g. no weight decay on biases and norms): a shard may span parameters of
several groups. It is then updated as one optimizer with one group per run of elements of the same
group, each with that group's hyperparameters as the whole-model optimizer had them — which for an
elementwise update is exactly what the whole-model optimizer does to those elements.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Sequence
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save


def load_with_metadata(body: bytes) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """safetensors' torch loader drops the header metadata; read it from the header directly."""
    (n,) = struct.unpack("<Q", body[:8])
    header = json.loads(body[8 : 8 + n])
    return st_load(body), header.get("__metadata__", {}) or {}


# One run of a shard's elements in one parameter group: [start, end) within the shard and the
# group's hyperparameters (everything of the group but "params"); None: the factory's own group.
Segment = tuple[int, int, dict[str, Any] | None]


def dump_state(optimizer: torch.optim.Optimizer) -> bytes:
    """Every parameter's state: ``state.<key>`` for the first (a shard of one group, the common
    case), ``state<i>.<key>`` for the i-th run of a shard that spans groups."""
    states = optimizer.state_dict()["state"]
    n = sum(len(g["params"]) for g in optimizer.param_groups)
    tensors: dict[str, torch.Tensor] = {}
    scalars: list[dict[str, Any]] = []
    for i in range(n):
        state = states.get(i, {})
        prefix = "state." if i == 0 else f"state{i}."
        tensors.update({prefix + k: v.contiguous() for k, v in state.items() if isinstance(v, torch.Tensor)})
        scalars.append({k: v for k, v in state.items() if not isinstance(v, torch.Tensor)})
    meta = {"scalars": json.dumps(scalars[0])} if n == 1 else {"scalars": json.dumps(scalars[0]), "runs": json.dumps(scalars)}
    return st_save(tensors, metadata=meta)


def restore_state(optimizer: torch.optim.Optimizer, body: bytes) -> None:
    """Install a shard's state as it was saved, dtypes included.

    Not ``load_state_dict``: that casts floating state to the parameter's dtype (NAdam's float32
    ``mu_product`` would become float64), and one optimizer over the whole model never does that,
    so the shards would round differently from it.
    """
    tensors, meta = load_with_metadata(body)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    runs: list[dict[str, Any]] = json.loads(meta["runs"]) if "runs" in meta else [json.loads(meta.get("scalars", "{}"))]
    for i, param in enumerate(params):
        prefix = "state." if i == 0 else f"state{i}."
        state: dict[str, Any] = dict(runs[i]) if i < len(runs) else {}
        state.update({k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)})
        if state:
            optimizer.state[param] = state


def group_runs(groups: Sequence[int], sizes: Sequence[int]) -> tuple[tuple[int, int, int], ...]:
    """A flat vector of tensors of ``sizes``, tensor i in parameter group ``groups[i]``, as
    (start, end, group) runs: one per stretch of consecutive tensors of one group."""
    runs: list[tuple[int, int, int]] = []
    at = 0
    for g, n in zip(groups, sizes):
        if runs and runs[-1][2] == g:
            runs[-1] = (runs[-1][0], at + n, g)
        else:
            runs.append((at, at + n, g))
        at += n
    return tuple(runs)


def chunk_segments(groups: Sequence[tuple[int, int, int]], hparams: Sequence[dict[str, Any]], a: int, b: int) -> list[Segment]:
    """The runs of elements [a, b) of a stage's flat vector, per parameter group, within the chunk.
    ``groups``: the stage's (start, end, group) runs; empty when the optimizer has one group."""
    if not groups:
        return [(0, b - a, None)]
    out: list[Segment] = []
    for start, end, g in groups:
        lo, hi = max(start, a), min(end, b)
        if lo < hi:
            if out and out[-1][2] is hparams[g] and out[-1][1] == lo - a:
                out[-1] = (out[-1][0], hi - a, hparams[g])
            else:
                out.append((lo - a, hi - a, hparams[g]))
    return out


def apply_update(
    make_optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
    param: torch.Tensor,
    grad: torch.Tensor,
    state: bytes | None,
    segments: Sequence[Segment] | None = None,
) -> tuple[torch.Tensor, bytes]:
    """One optimizer step on a flat parameter shard; returns the new shard and its new state.
    ``segments``: the shard's runs per parameter group (:func:`chunk_segments`); None for one group."""
    # no segments: a shard with nothing to train (a stage whose parameters are all frozen), whose
    # update is an optimizer step over an empty tensor (the per-group path has no first run)
    if not segments or (len(segments) == 1 and segments[0][2] is None):
        p = torch.nn.Parameter(param.clone())
        opt = make_optimizer([p])
        if state is not None:
            restore_state(opt, state)
        p.grad = grad.to(p.dtype)
        opt.step()
        return p.detach(), dump_state(opt)
    runs = [torch.nn.Parameter(param[lo:hi].clone()) for lo, hi, _ in segments]
    opt = make_optimizer([runs[0]])  # the user's optimizer class, defaults and hooks...
    opt.param_groups = []  # ...with one group per run, as the whole-model optimizer's groups are
    for run, (_, _, hp) in zip(runs, segments):
        opt.add_param_group({**(hp or {}), "params": [run]})
    if state is not None:
        restore_state(opt, state)
    for run, (lo, hi, _) in zip(runs, segments):
        run.grad = grad[lo:hi].to(run.dtype)
    opt.step()
    return torch.cat([r.detach() for r in runs]), dump_state(opt)


def warm_up() -> None:
    """Take one optimizer step on a scalar: torch imports its optimizer machinery (~2 s) lazily on
    the first step, and that belongs in a container's start, not in the first task's update."""
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.0)
    p.grad = torch.zeros(1)
    opt.step()
