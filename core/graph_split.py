"""Any nn.Module as an nn.Sequential of blocks: graph capture (torch.export) and PyTorch's own
pipeline splitter (torch.distributed.pipelining) cut at the modules the job names.

Why this shape: the runtime, the planner and the exactness checks all work on a chain of blocks
(block i's output is block i+1's input). A model that is not written as such a chain is captured
once as a graph with a dynamic batch dimension, split before every named module, and each piece
becomes a ``Segment`` that takes the values still live at its cut (a tuple: the hidden state, the
mask computed at the start, a skip connection from an earlier block, ...) and returns those live
after it. Within one process (the reference, the checks) values a later block needs pass through
the blocks in between; across stages each goes straight to the stages that read it (``flows``,
lambdas/stageio.py KeyedIO).

The split is a zero-argument factory (``SplitFactory``) wrapping the user's, so the client, every
container and the reference build the same chain from the same code under the same seed; the
pieces hold the model's own Parameter objects under their original names, so a weight tied across
blocks is one tensor (core/training.py ownership) and the trained values load back into the
user's own module (``original_state_dict``).
"""

from __future__ import annotations

import fnmatch
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from types import MethodType
from typing import Any, cast

import torch
from torch import fx, nn
from torch.distributed.pipelining import pipe_split
from torch.distributed.pipelining._IR import MultiUseParameterConfig, Pipe
from torch.export import Dim
from torch.export.unflatten import InterpreterModule
from torch.utils import _pytree as pytree

from stagecoach.errors import StagecoachError
from stagecoach.planner.profile.flows import Flow


class SplitError(StagecoachError, ValueError):
    """The model cannot be cut at the named blocks; the message says why and what to change."""


def match_blocks(model: nn.Module, patterns: Sequence[str]) -> list[str]:
    """The submodules ``patterns`` name, in registration order. A pattern is a dotted path whose
    parts may hold shell wildcards, one part per level ("encoder.layer.*" names encoder.layer.0,
    encoder.layer.1, ... but not encoder.layer.0.attention)."""
    names = [n for n, _ in model.named_modules() if n]
    found: list[str] = []
    for pat in patterns:
        parts = pat.split(".")
        hits = [n for n in names if len(n.split(".")) == len(parts) and all(fnmatch.fnmatchcase(a, b) for a, b in zip(n.split("."), parts))]
        if not hits:
            raise SplitError(f"blocks pattern {pat!r} names no submodule of {type(model).__name__}; {suggest(model)}")
        found += [h for h in hits if h not in found]
    for a in found:
        for b in found:
            if b.startswith(a + "."):
                raise SplitError(f"blocks name both {a!r} and its submodule {b!r}: a block cannot hold another; name one level")
    return found


def suggest(model: nn.Module) -> str:
    """A ``blocks=`` hint: the longest repeated container (ModuleList / Sequential) and the other
    top-level children, which is how most models are written (embedding, layers, head)."""
    best, size = "", 0
    for name, m in model.named_modules():
        if isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m) > size:
            best, size = name, len(m)
    top = [n for n, _ in model.named_children() if n != best.split(".")[0]]
    if not best:
        return f"its top-level children are {top}: e.g. blocks={top!r}"
    return f"e.g. blocks={[*top[:1], best + '.*', *top[1:]]!r} (the submodules whose boundaries may become cuts, in the order they run)"


def _mark(model: nn.Module, names: Sequence[str], calls: dict[str, int]) -> None:
    """A split point before each named module, and a call counter (outside the module: export
    restores attributes a forward assigns): a block must run once per forward."""
    for n in names:
        m = model.get_submodule(n)
        calls[n] = 0

        def before(self: nn.Module, *args: Any, _n: str = n, _fwd: Any = m.forward, **kwargs: Any) -> Any:
            calls[_n] += 1
            pipe_split()  # type: ignore[no-untyped-call]
            return _fwd(*args, **kwargs)

        m.forward = MethodType(before, m)


def _unmark(model: nn.Module, names: Sequence[str]) -> None:
    for n in names:
        del model.get_submodule(n).forward  # the instance attribute; the class's forward shows again


def capture(model: nn.Module, names: Sequence[str], example: torch.Tensor) -> tuple[fx.GraphModule, pytree.TreeSpec]:
    """torch.export the model at a dynamic batch size with a split point before each named module,
    then PyTorch's pipeline splitter: ``split_gm``'s submodules, one per piece, in order."""
    calls: dict[str, int] = {}
    _mark(model, names, calls)
    try:
        batch = Dim("batch", min=1)
        ep = torch.export.export(model, (example,), dynamic_shapes=({0: batch},), strict=False)
    except Exception as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise SplitError(
            f"torch.export could not capture {type(model).__name__} as one graph: {type(e).__name__}: {reason[:400]}. "
            "Stagecoach cuts a model that is not an nn.Sequential from its exported graph: remove data-dependent "
            "Python control flow from forward (e.g. `if x.sum() > 0`; use torch.where / torch.cond), keep the batch "
            "size symbolic (no .item() or fixed view sizes over the batch), or write the model as an nn.Sequential "
            "of blocks (docs/exactness.md)"
        ) from None
    finally:
        _unmark(model, names)
    wrong = {n: c for n, c in calls.items() if c != 1}
    if wrong:
        n, c = next(iter(wrong.items()))
        raise SplitError(
            f"block {n!r} runs {c} times in one forward: a block is cut before once, so name modules that run exactly "
            "once (a module used twice belongs inside a block, or name its callers)"
        )
    pipe = Pipe._from_traced(model, ep, MultiUseParameterConfig.REPLICATE)
    return pipe.split_gm, ep.module_call_graph[0].signature.out_spec


class Segment(nn.Module):
    """One block cut from the graph: runs its pieces on the values live at its start (``takes``,
    by key) and returns those live at its end (``gives``), or the model's output for the last one."""

    def __init__(
        self,
        pieces: list[nn.Module],
        calls: list[tuple[list[str], list[str]]],
        takes: list[str],
        gives: list[str],
        out_spec: pytree.TreeSpec | None,
        ints: frozenset[str],
    ):
        super().__init__()
        self.pieces = nn.ModuleList(pieces)
        self.calls = calls  # per piece: the keys of its arguments, the keys of its outputs
        # the last segment gives the model's output: ``gives`` are its leaves, ``out_spec`` its structure
        self.takes, self.gives, self.out_spec = takes, gives, out_spec
        self.ints = ints  # values that are Python ints (sizes) in the graph; they cross a cut as 0-d tensors

    def step(self, values: dict[str, Any]) -> dict[str, Any]:
        """Run the pieces on named values (sizes as Python ints); the values they compute."""
        env, made = dict(values), {}
        for piece, (args, outs) in zip(self.pieces, self.calls):
            result = piece(*[env[a] for a in args])
            if len(outs) == 1 and not isinstance(result, tuple):
                result = (result,)
            new = dict(zip(outs, result))
            env.update(new)
            made.update(new)
        return made

    def output(self, values: dict[str, Any]) -> Any:
        """The model's output from the named values (the last segment's ``gives``)."""
        assert self.out_spec is not None, "only the last segment gives the model's output"
        return pytree.tree_unflatten([values[k] for k in self.gives], self.out_spec)

    def forward(self, carried: Any) -> Any:
        values = dict(zip(self.takes, carried)) if len(self.takes) > 1 else {self.takes[0]: carried}
        values = {k: (int(v) if k in self.ints else v) for k, v in values.items()}
        values.update(self.step(values))
        if self.out_spec is not None:
            return self.output(values)
        live = [torch.tensor(values[k]) if k in self.ints else values[k] for k in self.gives]
        return live[0] if len(live) == 1 else tuple(live)


class Blocks(nn.Sequential):
    """The chain of segments. ``flows``: every value crossing a block boundary, where it is computed
    and read (planner/profile/flows.py), by which the runtime sends each straight to its readers;
    ``original_state_dict`` gives the state under the user's module names."""

    flows: tuple[Flow, ...] = ()

    def user_module(self, model: Callable[[], nn.Module], seed: int, default_dtype: torch.dtype) -> nn.Module:
        """The user's own module (``model``, the factory before the cut, built under ``seed``)
        holding this chain's parameters and buffers, in their dtype: what a trained run hands back
        (Job.user_model, and run.StoredModel for a Run without its Job)."""
        torch.manual_seed(seed)
        dtype = next((p.dtype for p in self.parameters()), default_dtype)
        module = model().to(dtype)
        state = self.original_state_dict()
        module.load_state_dict({k: state[k] for k in module.state_dict()})
        return module

    def original_state_dict(self, keep_vars: bool = False) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for seg in self:
            assert isinstance(seg, Segment)
            for piece in seg.pieces:
                for k, v in piece.state_dict(keep_vars=keep_vars).items():
                    out.setdefault(k, v)
        return out

    def measure_flows(self, x1: torch.Tensor, x2: torch.Tensor) -> tuple[Flow, ...]:
        """``flows`` with their bytes per sample: the chain run on batches ``x1`` and ``x2`` (one
        sample more; any device, meta included) and each value's size compared."""
        sizes = [_value_bytes(self, x) for x in (x1, x2)]
        out = []
        for f in self.flows:
            (a, ga), (b, gb) = sizes[0][f.key], sizes[1][f.key]
            out.append(replace(f, bytes_per_sample=float(b - a), grad_bytes_per_sample=float(gb - ga)))
        return tuple(out)


def _value_bytes(blocks: Blocks, x: torch.Tensor) -> dict[str, tuple[int, int]]:
    """(bytes, floating bytes) of every named value when ``blocks`` runs on ``x`` (no gradients)."""
    first = blocks[0]
    assert isinstance(first, Segment)
    values: dict[str, Any] = {first.takes[0]: x}
    with torch.no_grad():
        for seg in blocks:
            assert isinstance(seg, Segment)
            values.update(seg.step(values))
    out = {}
    for k, v in values.items():
        if isinstance(v, torch.Tensor):
            n = v.numel() * v.element_size()
            out[k] = (n, n if v.is_floating_point() else 0)
        else:
            out[k] = (8, 0)  # a size, sent as a 0-d int64 tensor
    return out


def _key(node: fx.Node) -> str:
    return node.name


def split(model: nn.Module, patterns: Sequence[str], example: torch.Tensor) -> Blocks:
    """Cut ``model`` before each module ``patterns`` name (match_blocks); one block per named module,
    the code before the first one joining the first block."""
    names = match_blocks(model, patterns)
    gm, out_spec = capture(model, names, example)
    _retie(gm, model)
    _restore_batch_norms(gm, model)
    groups, x = _groups(gm, model, names)
    # what each piece reads and writes, by value key
    values = _Values({_key(x): -1}, {_key(x): example.is_floating_point()})
    calls: list[list[tuple[list[str], list[str]]]] = []
    for b, group in enumerate(groups):
        calls.append([_piece_call(gm, node, b, values) for node, _ in group])
    (output,) = [n for n in gm.graph.nodes if n.op == "output"]
    final = [_key(a) for a in pytree.tree_leaves(output.args[0]) if isinstance(a, fx.Node)]
    live = _live_after(calls, final, values.produced)
    segments: list[Segment] = []
    for b, group in enumerate(groups):
        takes = live[b - 1] if b else [_key(x)]
        last = b == len(groups) - 1
        segments.append(
            Segment([m for _, m in group], calls[b], takes, final if last else live[b], out_spec if last else None, frozenset(values.ints))
        )
    blocks = Blocks(*segments)
    blocks.flows = _flows(calls, final, values.produced, values.floating)
    return blocks


@dataclass
class _Values:
    """The split graph's named values in production order (the model's input, then each piece's
    outputs): the block computing each (-1: the input), whether it is floating, and those that
    are Python ints in the graph (sizes)."""

    produced: dict[str, int]
    floating: dict[str, bool]
    ints: set[str] = field(default_factory=set)


def _groups(gm: fx.GraphModule, model: nn.Module, names: Sequence[str]) -> tuple[list[list[tuple[fx.Node, nn.Module]]], fx.Node]:
    """The split graph's pieces grouped into blocks (the code before the first named module, if it
    makes a piece of its own, joins the first block) and the model's one input."""
    pieces = [(n, gm.get_submodule(str(n.target))) for n in gm.graph.nodes if n.op == "call_module"]
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != 1:
        raise SplitError(
            f"{type(model).__name__}.forward takes {len(placeholders)} tensors: Stagecoach feeds a model one input (a tensor per sample batch)"
        )
    if len(pieces) not in (len(names), len(names) + 1):
        raise SplitError(f"the graph split into {len(pieces)} pieces for {len(names)} blocks: name modules that run in sequence")
    groups = [pieces[:2], *[[p] for p in pieces[2:]]] if len(pieces) == len(names) + 1 else [[p] for p in pieces]
    return groups, placeholders[0]


def _piece_call(gm: fx.GraphModule, node: fx.Node, block: int, values: _Values) -> tuple[list[str], list[str]]:
    """The keys of a piece's arguments and of its outputs (a multi-output piece's are its
    getitems), the outputs recorded in ``values`` as computed by ``block``."""
    args = [_key(a) for a in node.args if isinstance(a, fx.Node)]
    if len(args) != len(node.args):
        raise SplitError("a piece of the split graph takes a constant argument; this model cannot be cut here")
    getitems = sorted((u for u in node.users if u.op == "call_function" and u.target is operator.getitem), key=_getitem_index)
    outs = [_key(u) for u in getitems] if getitems else [_key(node)]
    if getitems and len(getitems) != len(node.users):
        raise SplitError("a piece of the split graph is used whole and by parts; this model cannot be cut here")
    for o, val in zip(outs, _output_values(gm.get_submodule(str(node.target)))):
        values.produced[o] = block
        values.floating[o] = isinstance(val, torch.Tensor) and val.is_floating_point()
        if isinstance(val, (int, torch.SymInt)):
            values.ints.add(o)
    return args, outs


def _getitem_index(node: fx.Node) -> int:
    """The index a getitem node takes (its output's position)."""
    return cast(int, node.args[1])


def _live_after(calls: list[list[tuple[list[str], list[str]]]], final: list[str], produced: dict[str, int]) -> list[list[str]]:
    """Per block b, the values live after it (computed by b or before, read after b or in the
    output), in production order: what crosses the cut after b."""
    last_use: dict[str, int] = {}
    for b, cs in enumerate(calls):
        for args, _ in cs:
            for a in args:
                last_use[a] = max(last_use.get(a, -1), b)
    for k in final:
        last_use[k] = len(calls)
    return [[k for k in produced if produced[k] <= b and last_use.get(k, -1) > b] for b in range(len(calls))]


def _flows(
    calls: list[list[tuple[list[str], list[str]]]], final: list[str], produced: dict[str, int], floating: dict[str, bool]
) -> tuple[Flow, ...]:
    """Every value read by a block other than the one computing it (or in the output, which the
    last block gives), in production order."""
    users: dict[str, set[int]] = {}
    for b, cs in enumerate(calls):
        made: set[str] = set()
        for args, outs in cs:
            for a in args:
                if a not in made:  # computed before the block
                    users.setdefault(a, set()).add(b)
            made.update(outs)
    for k in final:
        users.setdefault(k, set()).add(len(calls) - 1)
    out = []
    for k, p in produced.items():
        readers = tuple(sorted(u for u in users.get(k, ()) if u != max(p, 0)))
        if readers:
            out.append(Flow(k, p, readers, floating[k]))
    return tuple(out)


def _restore_batch_norms(gm: fx.GraphModule, model: nn.Module) -> None:
    """Put the model's own BatchNorm modules back where the unflattened graph calls them: the
    runtime keeps running statistics by module (core/training.py running_stats), and a BatchNorm
    called on one tensor computes what its captured graph does (same tensors, after _retie)."""
    for piece in gm.children():
        for name, m in list(piece.named_modules()):
            if not name or not isinstance(m, InterpreterModule) or m.graph is None:
                continue
            try:
                original = model.get_submodule(name)
            except AttributeError:
                continue
            inputs = [n for n in m.graph.nodes if n.op == "placeholder"]
            if isinstance(original, nn.modules.batchnorm._BatchNorm) and len(inputs) == 1:
                owner, _, attr = name.rpartition(".")
                setattr(piece.get_submodule(owner) if owner else piece, attr, original)


def _output_values(piece: nn.Module) -> list[Any]:
    """The example values (meta "val") of a piece's outputs: a SymInt is a size the piece computed."""
    assert isinstance(piece, fx.GraphModule)
    (out,) = [n for n in piece.graph.nodes if n.op == "output"]
    return [a.meta.get("val") if isinstance(a, fx.Node) else a for a in pytree.tree_leaves(out.args[0])]


def _retie(gm: fx.GraphModule, model: nn.Module) -> None:
    """Point every piece's parameters and buffers at the model's own tensors, by their preserved
    names: the splitter copies a parameter used by two pieces (tied weights), and the runtime
    recognises a shared parameter by identity."""
    for piece in gm.children():
        for name, _ in list(piece.named_parameters(remove_duplicate=False)):
            owner, _, attr = name.rpartition(".")
            setattr(piece.get_submodule(owner) if owner else piece, attr, model.get_parameter(name))
        for name, _ in list(piece.named_buffers(remove_duplicate=False)):
            owner, _, attr = name.rpartition(".")
            mod = piece.get_submodule(owner) if owner else piece
            mod._buffers[attr] = model.get_buffer(name)


@dataclass(frozen=True)
class SplitFactory:
    """The user's factory, its model cut at ``blocks``: what the client, the workers and the
    reference build (a picklable value: the user's factory travels inside it)."""

    factory: Callable[[], nn.Module]
    blocks: tuple[str, ...]
    sample_shape: tuple[int, ...]
    sample_dtype: torch.dtype
    dtype: torch.dtype

    def __call__(self) -> Blocks:
        model = self.factory()
        if not isinstance(model, nn.Module):
            raise SplitError(f"job.model() returned {type(model).__name__}, not an nn.Module")
        model = model.to(self.dtype).train()  # captured in train mode: dropout and batch statistics as trained
        dtype = self.dtype if self.sample_dtype.is_floating_point else self.sample_dtype
        example = torch.zeros((2, *self.sample_shape), dtype=dtype)
        return split(model, self.blocks, example)
