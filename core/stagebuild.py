"""Building one stage of a model, and only that stage (docs/runtime.md "Building a stage").

A container runs one stage, so it needs that stage's blocks and nothing else. The user's factory
builds the whole model, though, so a container that ran it as it is would allocate (and randomly
initialise) every stage's parameters to keep a few of them: a stage of a model whose whole does
not fit the function's memory could never run. Instead the container runs the factory under
``torch.device("meta")`` — the same modules, shapes and dtypes, no storage — keeps the stage's
blocks, and gives their tensors storage (:func:`materialize`): nothing of another stage is ever
allocated. The values come from S3: parameters at version 0 (sdk/deploy/upload.py, the client's
real build), and the stage's initial buffers, persistent or not, with its frozen parameters
(:func:`stage_buffers`, ``keys.initial_buffers``).

That is exact only for a model whose state is all in its parameters and buffers; the client
checks it on the job's own factory (sdk/exactness.py ``meta_build_refusal``) and otherwise records
the full build in the job's spec (``JobSpec.build``): the container then builds the whole model as
before and keeps its stage.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal, cast

import torch
from torch import fx, nn

from stagecoach.core.training import Ownership, Tied, build_model, install_buffers, ownership

Build = Literal["meta", "full"]


def build_meta(factory: Callable[[], nn.Module], seed: int, dtype: torch.dtype) -> nn.Module:
    """The model as :func:`training.build_model` builds it, but on the meta device: every
    parameter and buffer has its shape and dtype and no storage."""
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = factory()
    if not isinstance(model, nn.Module):
        return model
    _graphs_to_cpu(model)
    return model.to(dtype)


def _graphs_to_cpu(model: nn.Module) -> None:
    """A graph captured while building on the meta device (Job(blocks=...): core/graph_split.py)
    names that device in its ops (``arange(..., device=meta)``, assertions on a tensor's device);
    the built model runs on the CPU, so point them there. Whatever this misses, the client's
    comparison with the real build catches (sdk/exactness.py meta_build_refusal)."""
    meta, cpu = torch.device("meta"), torch.device("cpu")

    def retarget(a: object) -> object:
        return cpu if isinstance(a, torch.device) and a == meta else a

    for m in reachable_modules(model):
        graph = getattr(m, "graph", None)
        if not isinstance(graph, fx.Graph):
            continue
        for node in graph.nodes:
            node.args = tuple(retarget(a) for a in node.args)
            node.kwargs = {k: retarget(v) for k, v in node.kwargs.items()}
    for m in reachable_modules(model):
        if isinstance(m, fx.GraphModule):
            m.recompile()


def materialize(layers: Iterable[nn.Module], device: str = "cpu") -> dict[int, torch.Tensor]:
    """Give the parameters and buffers of ``layers`` storage on ``device`` (uninitialised: the
    caller loads their values), in place. A tensor used in several places (tied weights, a module
    used twice) becomes one new tensor used in all of them. Returns old id -> new tensor.

    Not ``Module.to_empty``: it replaces a parameter per module that holds it, so a tensor shared
    by two modules would become two.
    """
    memo: dict[int, torch.Tensor] = {}
    seen: set[int] = set()
    for layer in layers:
        for m in reachable_modules(layer):
            if id(m) in seen:
                continue
            seen.add(id(m))
            for name, p in m._parameters.items():
                if p is None:
                    continue
                if id(p) not in memo:
                    memo[id(p)] = nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)
                m._parameters[name] = memo[id(p)]  # type: ignore[assignment]
            for name, b in m._buffers.items():
                if b is None:
                    continue
                if id(b) not in memo:
                    memo[id(b)] = torch.empty_like(b, device=device)
                m._buffers[name] = memo[id(b)]
    return memo


_REGISTRIES = ("_parameters", "_buffers", "_modules")


def plain_modules(value: object, depth: int = 3) -> list[nn.Module]:
    """The modules a plain attribute value holds, looking into lists, tuples, sets and dicts."""
    if isinstance(value, nn.Module):
        return [value]
    if depth == 0:
        return []
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple, set, frozenset)) else ()
    return [m for v in items for m in plain_modules(v, depth - 1)]


def reachable_modules(root: nn.Module) -> list[nn.Module]:
    """Every module ``root`` reaches, each once: its registered submodules, and modules kept in
    plain attributes (an exported graph's ``InterpreterModule.graph_module`` is a GraphModule over
    the same tensors), so materialising gives those the same new tensors too."""
    out: list[nn.Module] = []
    seen: set[int] = set()
    stack = [root]
    while stack:
        m = stack.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        out.append(m)
        stack += [c for c in m._modules.values() if c is not None][::-1]
        stack += [c for attr, v in vars(m).items() if attr not in _REGISTRIES for c in plain_modules(v)]
    return out


def stage_buffers(layers: Sequence[nn.Module], first_layer: int) -> dict[str, torch.Tensor]:
    """What of consecutive layers never trains, keyed "<layer>.<path>" by the layer's index in the
    model (as training.running_stats keys them): every buffer, persistent or not, and every frozen
    parameter (``requires_grad=False``: in no flat vector, training.Ownership), each tensor once
    (a frozen weight two layers share is one tensor, stored under its first name).

    The client uploads them once per stage (``keys.initial_buffers``) and a container loads them
    into the stage it built: the values the factory made, or ``Job(init_from=...)`` gave (a
    pretrained backbone)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for i, layer in enumerate(layers):
        frozen = [(name, p) for name, p in layer.named_parameters() if not p.requires_grad]
        for name, t in [*layer.named_buffers(), *frozen]:
            if id(t) not in seen:
                seen.add(id(t))
                out[f"{first_layer + i}.{name}"] = t
    return out


def load_buffers(layers: Sequence[nn.Module], first_layer: int, values: dict[str, torch.Tensor]) -> None:
    """Install the values :func:`stage_buffers` keyed (every one of them)."""
    install_buffers(stage_buffers(layers, first_layer), values, "initial buffers")


@dataclass(frozen=True)
class Stage:
    """One stage as a container holds it."""

    layers: list[nn.Module]  # the stage's blocks, in order
    own: Ownership  # only this stage's tensors (training.Ownership.for_stage)
    param_index: dict[int, int]  # id of an owned parameter -> its position in model.parameters()


def build_stage(
    factory: Callable[[], nn.Module], seed: int, dtype: torch.dtype, stages: Sequence[range], stage: int, build: Build
) -> Stage:
    """Stage ``stage`` of the model cut into ``stages`` (layer ranges).

    ``build="meta"``: built on the meta device, then only the stage's blocks (with the parameters
    of earlier stages they share) get storage, uninitialised — the caller loads the parameters and
    :func:`stage_buffers`. ``build="full"``: the whole model, initialised by the factory; the
    other stages' blocks are dropped.
    """
    model = build_meta(factory, seed, dtype) if build == "meta" else build_model(factory, seed, dtype)
    layers = list(cast(nn.Sequential, model))  # Job.validate accepted nothing else
    own = ownership(layers, stages).for_stage(stage)
    mine = {id(p) for p in own.owned[stage]}
    index = {id(p): i for i, p in enumerate(model.parameters()) if id(p) in mine}
    kept = [layers[i] for i in stages[stage]]
    if build == "meta":
        new = materialize(kept)
        own = Ownership(
            [[_param(new, p) for p in ps] for ps in own.owned],
            [[Tied(_param(new, t.param), t.owner, t.index, t.offset) for t in ts] for ts in own.tied],
            own.numels,
            own.users_of,
        )
        index = {id(new[k]): i for k, i in index.items()}
    return Stage(kept, own, index)


def _param(memo: dict[int, torch.Tensor], p: nn.Parameter) -> nn.Parameter:
    q = memo[id(p)]
    assert isinstance(q, nn.Parameter)
    return q


def held_bytes(modules: Iterable[nn.Module]) -> int:
    """Bytes of the parameters and buffers ``modules`` hold, each storage once."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for module in modules:
        for t in [*module.parameters(), *module.buffers()]:
            if t.device.type == "meta":
                continue
            key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
            if key not in seen:
                seen.add(key)
                total += t.untyped_storage().nbytes()
    return total
