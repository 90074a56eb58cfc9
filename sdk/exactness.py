"""Whether the runtime trains a job exactly as plain PyTorch would, decided before anything is deployed.

The runtime splits an nn.Sequential between its blocks, ships each stage's parameters as one flat
vector, recomputes the forward in the backward phase, averages micro-batch gradients, and applies
the optimizer to flat shards of that vector, each with its own optimizer instance. Each of these
is exact only under assumptions about the user's model, loss and optimizer; a job that breaks one
would train a different model without any error. Every assumption is checked here, on the job's
own objects, by running them on a few samples — not by a list of known classes — and a job that
breaks one is refused with what to change.

Facts that only matter for some plans (whether the model couples the samples of a batch, and
whether only its BatchNorms do; whether the loss is a mean; which block outputs can cross a cut)
are returned as :class:`ModelFacts` and checked against the plan by :func:`check_plan`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from stagecoach.core import boundary, stagebuild
from stagecoach.core.graph_split import Blocks
from stagecoach.core.optim_state import apply_update, chunk_segments, group_runs
from stagecoach.core.training import run_layers, running_stats
from stagecoach.errors import StagecoachError
from stagecoach.planner.profile.flows import Flow

# How a job opts in to splitting the global batch of a model with BatchNorm (docs/exactness.md)
DEFERRED_BATCH_NORM = "Job(..., deferred_batch_norm=True)"

MakeOptimizer = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
Loss = Callable[..., torch.Tensor]  # loss(output, target) -> scalar (Job.loss)
# A tensor's dtype, shape and a hash of its bytes (:func:`_digest`)
Digest = tuple[torch.dtype, tuple[int, ...], str]
# Where a model holds a parameter or buffer (:func:`_signature`): kind, name, shape, dtype, type,
# whether it trains, and the first place the same tensor appears
Placement = tuple[str, str, tuple[int, ...], torch.dtype, str, bool, int]


class NotExact(StagecoachError, ValueError):
    """The job would train something other than plain PyTorch; the message says what to change."""


@dataclass(frozen=True)
class ModelFacts:
    """What the checks learnt about the model that decides which plans are exact."""

    blocks: int
    # per block boundary i (after block i, i < blocks - 1): the dtypes of the tensors that would cross
    # a cut there (one per leaf of a tuple, list or dict: core/boundary.py)
    boundary_dtypes: tuple[tuple[torch.dtype, ...], ...]
    # why one sample's output depends on the other samples of its batch (None: it does not)
    batch_coupling: str | None
    # why the loss of a batch is not the mean of its samples' losses (None: it is)
    loss_not_mean: str | None
    # why samples stay coupled with every BatchNorm taken out, or a BatchNorm runs twice in a
    # forward pass (None: BatchNorm's batch statistics are all that couples them, which deferred
    # batch norm reproduces on a split batch; meaningless when batch_coupling is None)
    coupling_beyond_batch_norm: str | None = None
    # the optimizer's parameter groups (None: one group)
    optimizer_groups: OptimizerGroups | None = None
    # why every container must build the whole model (None: each builds only its own stage on
    # the meta device; :func:`meta_build_refusal`)
    full_build: str | None = None
    # a model cut from its graph: the named values crossing its blocks' boundaries (planner/profile/
    # flows.py), sent straight from the stage computing each to the stages reading it; None for an
    # nn.Sequential, whose blocks pass their whole output on
    flows: tuple[Flow, ...] | None = None
    # parameters another block holds as a buffer (:func:`parameter_buffers`): no cut may separate them
    parameter_buffers: tuple[ParameterBuffer, ...] = ()


@dataclass(frozen=True)
class ParameterBuffer:
    """A block's buffer that is (or views) another block's parameter: blocks ``first`` to ``last``
    must share a stage. ``what`` names both, for the refusal."""

    first: int
    last: int
    what: str


def _tol(dtype: torch.dtype) -> float:
    return 1e-12 if dtype == torch.float64 else 1e-6


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> bool:
    if a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max()) <= _tol(dtype) * max(1.0, float(a.abs().max()))


# -- structure ---------------------------------------------------------------------------------------
def check_structure(blocks: Sequence[nn.Module]) -> None:
    """No buffer is shared between blocks.

    Parameters may be shared (tied weights, a module used twice): the first stage that uses one
    owns it, later stages read its version and send it their gradient, which the owner adds to its
    own before the update (training.ownership) — the sum over every use, as autograd makes it in
    one process. Buffers have no such path: a module with buffers used twice, or a buffer shared by
    two blocks, would be kept as separate copies on different stages.
    """
    owner: dict[int, int] = {}
    for i, block in enumerate(blocks):
        for j in range(i):
            if blocks[j] is block and any(True for _ in block.buffers()):
                raise NotExact(
                    f"blocks {j} and {i} are the same module ({type(block).__name__}), which has buffers: stages in "
                    "different containers would keep two copies of them. Put the uses in one block, or give each "
                    "use its own module (a different model)"
                )
        if any(blocks[j] is block for j in range(i)):
            continue  # the same module again: its parameters are shared (handled), it has no buffers
        for name, t in block.named_buffers():
            key = t.untyped_storage().data_ptr() if t.numel() else id(t)
            if key in owner and owner[key] != i:
                raise NotExact(
                    f"block {i}'s buffer {name!r} is shared with block {owner[key]}: blocks on different stages would "
                    f"keep separate copies. Put the blocks that share it into one block (e.g. nn.Sequential(block{owner[key]}, "
                    f"..., block{i}) as a single child)"
                )
            owner[key] = i


def parameter_buffers(blocks: Sequence[nn.Module]) -> tuple[ParameterBuffer, ...]:
    """Buffers that are another block's parameter (``self.register_buffer("w", other.lin.weight)``)
    or a view of one.

    In one process they are one tensor: the buffer's use adds to the parameter's gradient, and
    the optimizer's update shows in the buffer. On a stage of its own the block would keep the
    buffer's version-0 values and send no gradient back (a tied parameter is different: it
    travels, training.ownership). So only plans that keep both blocks on one stage are exact
    (:func:`check_plan`).
    """
    params: dict[int, tuple[int, str]] = {}
    for j, block in enumerate(blocks):
        for name, p in block.named_parameters():
            if p.numel():
                params.setdefault(p.untyped_storage().data_ptr(), (j, name))
    out = []
    for i, block in enumerate(blocks):
        for name, b in block.named_buffers():
            j, pname = params.get(b.untyped_storage().data_ptr(), (i, "")) if b.numel() else (i, "")
            if j != i and blocks[j] is not block:
                relation = "is" if any(p is b for p in blocks[j].parameters()) else "views"
                what = f"block {i}'s buffer {name!r} {relation} block {j}'s parameter {pname!r}"
                out.append(ParameterBuffer(min(i, j), max(i, j), what))
    return tuple(out)


def check_factory(first: nn.Module, second: nn.Module) -> None:
    """The factory builds a new, identical model each time (workers rebuild it from the same seed)."""
    if first is second:
        raise NotExact(
            "job.model() returned the same module object twice: every container (and every run) must build its "
            "own model, so give a factory that constructs it, e.g. model=lambda: MyNet(), not model=lambda: net"
        )
    a, b = first.state_dict(), second.state_dict()
    for name, t in a.items():
        if not torch.equal(t, b[name]):
            raise NotExact(
                f"job.model() builds different values of {name!r} each time under the same torch seed: the workers "
                "rebuild the model from the factory, so it must be deterministic given torch.manual_seed (draw "
                "random numbers with torch, not numpy or random, or load fixed weights)"
            )


def check_loss(loss: Loss) -> None:
    if isinstance(loss, nn.Module) and any(True for _ in loss.parameters()):
        raise NotExact(
            f"job.loss ({type(loss).__name__}) has parameters, which Stagecoach never trains: move them into the model's last block"
        )


def check_loss_gradient(out: Any, value: Any) -> None:
    """The loss of the model's output carries a gradient back to the parameters: without one,
    nothing trains (the runtime would fail at the first backward pass)."""
    if isinstance(value, torch.Tensor) and value.dim() == 0 and value.requires_grad:
        return
    floating = [t for t in boundary.leaves(out) if t.is_floating_point() or t.is_complex()]
    if not floating:
        dtype = boundary.leaves(out)[0].dtype
        raise NotExact(
            f"the model's output is an integer tensor ({dtype}): no gradient flows through it, so no parameter would "
            "train. The model must return floating values (e.g. logits), which the loss compares with the targets; "
            "take argmax or round in a metric (Job(metrics=...)), not in the model"
        )
    raise NotExact(
        "job.loss(output, target) carries no gradient back to the model (its value does not require grad): it must be "
        "computed from the output with torch operations, without .detach(), .item(), numpy or torch.no_grad()"
    )


# -- running the model ----------------------------------------------------------------------------------
def _forward(blocks: Sequence[nn.Module], x: torch.Tensor, seed: int) -> tuple[Any, list[tuple[torch.dtype, ...]]]:
    """The model as the runtime runs it (per-layer seeding), recording what crosses each boundary."""
    out = x
    dtypes = []
    for i, block in enumerate(blocks):
        out = run_layers([block], i, out, seed, 0, 0, 0)
        dtypes.append(boundary.dtypes(out))
    return out, dtypes[:-1]


def _buffers(blocks: Sequence[nn.Module]) -> list[tuple[int, str, torch.Tensor]]:
    return [(i, name, b.detach().clone()) for i, block in enumerate(blocks) for name, b in block.named_buffers()]


def check_buffers_unchanged(blocks: Sequence[nn.Module], before: list[tuple[int, str, torch.Tensor]]) -> None:
    """Buffers the forward pass changes are not carried between tasks — except BatchNorm's running
    statistics, which the runtime updates in the forward pass only and keeps per stage
    (training.running_stats; exact on plans that keep the global batch together, which
    :func:`batch_coupling` enforces for any model that normalises over the batch, or under
    deferred batch norm, which updates them once per iteration: lambdas/deferred_bn.py)."""
    tracked = {(i, name) for i, block in enumerate(blocks) for name in running_stats([block], 0).keys()}
    for i, name, old in before:
        new = blocks[i].get_buffer(name)
        if not torch.equal(old, new) and (i, f"0.{name}") not in tracked:
            owner = blocks[i].get_submodule(name.rpartition(".")[0]) if "." in name else blocks[i]
            raise NotExact(
                f"block {i}'s buffer {name!r} ({type(owner).__name__}) changes in the forward pass: the runtime keeps "
                "only BatchNorm's running statistics across tasks (and does not repeat their update in the backward "
                "phase's recompute), so the trained model's buffers would differ from PyTorch's. Make it a "
                "BatchNorm, or keep it constant in the forward pass"
            )


def check_something_trains(blocks: Sequence[nn.Module]) -> None:
    """At least one parameter trains: a model whose every parameter is frozen has nothing to train
    (and no gradient for a loss to carry)."""
    if not any(p.requires_grad for block in blocks for p in block.parameters()):
        raise NotExact(
            "no parameter of the model trains (every one is frozen, requires_grad=False, or there are none): "
            "there is nothing to train. Leave at least one parameter with requires_grad=True (e.g. the head on a "
            "frozen backbone); to only evaluate a model, run it in plain PyTorch"
        )


def check_gradients(blocks: Sequence[nn.Module]) -> None:
    """Every parameter that trains gets a dense gradient: the runtime treats a missing one as zero,
    which an optimizer with momentum or weight decay turns into an update PyTorch would not make.

    A frozen parameter (``requires_grad=False``) is exact as it is: it is in no stage's flat
    vector (training.Ownership), so it gets no gradient, no sync, no optimizer state and no
    update, as torch.optim skips a parameter whose ``.grad`` is None; it travels with the stage's
    buffers (:func:`check_something_trains` refuses a model with none that trains)."""
    for i, block in enumerate(blocks):
        for name, p in block.named_parameters():
            if not p.requires_grad:
                continue
            if p.grad is None:
                raise NotExact(
                    f"block {i}'s parameter {name!r} gets no gradient (it is not used in the forward pass): the runtime "
                    "would update it as if its gradient were zero, which momentum or weight decay would change. "
                    "Remove it from the model or register it as a buffer"
                )
            if p.grad.is_sparse:
                raise NotExact(
                    f"block {i}'s parameter {name!r} gets a sparse gradient (e.g. nn.Embedding(sparse=True)): the "
                    "runtime moves dense gradients; use sparse=False"
                )


def batch_coupling(blocks: Sequence[nn.Module], x: torch.Tensor, seed: int) -> str | None:
    """Why a sample's output depends on the other samples of its batch, or None.

    Replacing sample 0 must leave the other samples' outputs unchanged (same seeds, so dropout
    draws the same masks). If it does not (BatchNorm's batch statistics, anything mixing samples),
    micro-batches compute something other than the global batch, and only a plan that keeps the
    global batch together (one replica, one micro-batch) is exact.
    """
    if not _coupled(blocks, x, seed):
        return None
    norms = sorted({type(m).__name__ for m in _norms(blocks)})
    return f"its {', '.join(norms)} normalise over the batch" if norms else _COUPLED


_COUPLED = "one sample's output depends on the other samples of its batch"


def _norms(blocks: Sequence[nn.Module]) -> list[nn.modules.batchnorm._BatchNorm]:
    return [m for blk in blocks for m in blk.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def _rows(x: Any) -> int:
    """The batch size of a model input (a tensor, or a structure of tensors batched alike)."""
    return min(int(t.shape[0]) if t.dim() else 0 for t in boundary.leaves(x))


def _same_sample(x: Any, i: int, j: int) -> bool:
    return all(torch.equal(t[i], t[j]) for t in boundary.leaves(x))


def _coupled(blocks: Sequence[nn.Module], x: torch.Tensor, seed: int) -> bool:
    """Whether replacing sample 0 changes the other samples' outputs (same seeds)."""
    n = _rows(x)
    if n < 2:
        return False
    other = next((k for k in range(1, n) if not _same_sample(x, k, 0)), None)
    if other is None:
        return False
    x2 = boundary.map_leaves(torch.clone, x)
    for a, b in zip(boundary.leaves(x2), boundary.leaves(x)):
        a[0] = b[other]
    with torch.no_grad():
        a, _ = _forward(blocks, x, seed)
        b, _ = _forward(blocks, x2, seed)
    return not all(
        u.dim() == 0 or u.shape[0] != n or _close(u[1:], v[1:], u.dtype if u.is_floating_point() else torch.float64)
        for u, v in zip(boundary.leaves(a), boundary.leaves(b))
    )


def coupling_beyond_batch_norm(blocks: Sequence[nn.Module], x: torch.Tensor, seed: int) -> str | None:
    """For a batch-coupled model: why deferred batch norm would not reproduce it on a split batch,
    or None.

    Deferred batch norm (lambdas/deferred_bn.py) normalises each micro-batch with its own
    statistics and updates the running statistics once per iteration from one input per
    micro-batch. That is all a split batch changes only if the BatchNorms are the only coupling
    (checked by taking them out: every BatchNorm returns its input, and then replacing one sample
    must leave the others' outputs unchanged) and each runs once per forward pass (a BatchNorm
    applied twice would update its running statistics twice in plain PyTorch).
    """
    norms = _norms(blocks)
    if not norms:
        return _COUPLED
    calls: dict[int, int] = {}

    def count(m: nn.Module, args: tuple[object, ...]) -> None:
        calls[id(m)] = calls.get(id(m), 0) + 1

    def identity(m: nn.Module, args: tuple[object, ...], out: object) -> object:
        return args[0]

    handles = [m.register_forward_pre_hook(count) for m in norms]
    try:
        with torch.no_grad():
            _forward(blocks, x, seed)
    finally:
        for h in handles:
            h.remove()
    twice = next((m for m in norms if calls.get(id(m), 0) > 1), None)
    if twice is not None:
        return (
            f"a {type(twice).__name__} runs {calls[id(twice)]} times in one forward pass (plain PyTorch updates its running "
            "statistics at each)"
        )
    handles = [m.register_forward_hook(identity) for m in norms]
    try:
        if _coupled(blocks, x, seed):
            return f"{_COUPLED} even without its BatchNorms"
    finally:
        for h in handles:
            h.remove()
    return None


def _sample(out: Any, i: int) -> Any:
    """Sample i of a batch output (every leaf of a tuple, list or dict)."""
    return boundary.map_leaves(lambda t: t[i : i + 1], out)


def loss_not_mean(loss: Loss, out: Any, y: torch.Tensor) -> str | None:
    """Why the loss of a batch is not the mean of its samples' losses, or None.

    The runtime averages the losses of equal micro-batches; that equals the global batch's loss
    only for a mean over samples (not reduction='sum', class weights, or ignore_index).
    """
    first = boundary.leaves(out)[0]
    n = first.shape[0] if first.dim() else 0
    if n < 2 or y.shape[0] != n:
        return None
    if first.dtype == torch.bfloat16:  # a question of the loss's form: asked in float32, not at bf16's 3 digits
        out = boundary.map_leaves(lambda t: t.float() if t.dtype == torch.bfloat16 else t, out)
        first = boundary.leaves(out)[0]
    with torch.no_grad():
        whole = loss(out, y).double()
        singles = torch.stack([loss(_sample(out, i), y[i : i + 1]).double() for i in range(n)]).mean()
    if _close(whole, singles, first.dtype if first.is_floating_point() else torch.float64):
        return None
    return (
        f"the loss of {n} samples is {float(whole):.6g} but the mean of their own losses is {float(singles):.6g} "
        "(reduction='sum', class weights or ignore_index weigh a micro-batch differently from the global batch)"
    )


# -- the optimizer ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class OptimizerGroups:
    """The parameter groups of the optimizer over the whole model, as the workers apply them:
    each group's hyperparameters (JSON values) and the group of each parameter, in model order."""

    hparams: tuple[dict[str, Any], ...]
    of_param: tuple[int, ...]


def optimizer_groups(opt: torch.optim.Optimizer, params: Sequence[nn.Parameter]) -> OptimizerGroups | None:
    """The groups of ``opt`` over ``params`` (None for one group, which the workers rebuild from
    the factory itself); refuses groups that do not cover exactly ``params`` or whose
    hyperparameters cannot travel as JSON. A frozen parameter may be left out (PyTorch's
    ``filter(lambda p: p.requires_grad, params)``: torch.optim skips it either way, and the
    workers never give the optimizer one); its group is then -1."""
    index = {id(p): i for i, p in enumerate(params)}
    of = [-1] * len(params)
    given = [p for g in opt.param_groups for p in g["params"]]
    for g, group in enumerate(opt.param_groups):
        for p in group["params"]:
            if id(p) in index:
                of[index[id(p)]] = g
    foreign = any(id(p) not in index for p in given)
    missing = any(g == -1 and p.requires_grad for g, p in zip(of, params))
    if foreign or missing or len({id(p) for p in given}) != len(given):
        raise NotExact(
            "job.optimizer(params) does not optimise exactly the parameters it is given: it must build the "
            "optimizer over `params` (e.g. lambda params: torch.optim.SGD(params, lr=0.1)), not over other tensors"
        )
    if len(opt.param_groups) == 1:
        return None
    hparams = []
    for g, group in enumerate(opt.param_groups):
        hp = {k: v for k, v in group.items() if k != "params"}
        try:
            hparams.append(json.loads(json.dumps(hp)))
        except (TypeError, ValueError):
            bad = next(k for k, v in hp.items() if not _jsonable(v))
            raise NotExact(
                f"parameter group {g}'s {bad!r} is a {type(hp[bad]).__name__}: the workers rebuild each group from its "
                "hyperparameters, which must be numbers, booleans, strings or lists of them"
            ) from None
    return OptimizerGroups(tuple(hparams), tuple(of))


def _jsonable(v: object) -> bool:
    try:
        json.dumps(v)
    except (TypeError, ValueError):
        return False
    return True


def check_optimizer(make_optimizer: MakeOptimizer, params: list[nn.Parameter], dtype: torch.dtype) -> OptimizerGroups | None:
    """Every element updated on its own, within its parameter group: the sync tasks apply the
    optimizer to flat shards of a stage's parameters (cut across tensor boundaries), each with its
    own optimizer instance whose state travels through S3, with one group per run of elements of
    the same group. That equals one optimizer over the model only if the update is elementwise:
    tested by running the optimizer both ways on the same gradients. Returns the groups.
    """
    try:
        opt = make_optimizer(params)
    except Exception as e:
        raise NotExact(f"job.optimizer(params) fails: {e}") from None
    if not isinstance(opt, torch.optim.Optimizer):
        raise NotExact(f"job.optimizer(params) returned {type(opt).__name__}, not a torch.optim.Optimizer")
    groups = optimizer_groups(opt, params)
    name = type(opt).__name__
    g = torch.Generator().manual_seed(0)
    # the model's parameters in order (so a factory that groups by position or by dimensions groups
    # them as it does the model's), each shrunk to a few elements; one group: four fixed shapes
    shapes = [tuple(min(d, 3) for d in p.shape) for p in params] if groups is not None else [(3, 4), (5,), (2, 3, 2), (4, 4)]
    init = [torch.randn(s, generator=g, dtype=dtype) for s in shapes]
    steps = [[torch.randn(s, generator=g, dtype=dtype) for s in shapes] for _ in range(3)]
    whole, sim_groups = _whole_tensor_steps(make_optimizer, init, steps, name)
    flat = _flat_shard_steps(make_optimizer, init, steps, sim_groups, name)
    if not _close(whole, flat, dtype):
        diff = float((whole - flat).abs().max())
        raise NotExact(
            f"job.optimizer ({name}) does not update each element on its own: on flat shards it gives other parameters "
            f"than on whole tensors (max |diff| {diff:.2g} after 3 steps), e.g. Adafactor's factored moments, Muon's "
            "orthogonalisation or LAMB's per-tensor trust ratio. The sync tasks shard the optimizer across "
            "tensors: use an elementwise optimizer (SGD, Adam, AdamW, RMSprop, Adagrad, ...)"
        )
    return groups


def _whole_tensor_steps(
    make_optimizer: MakeOptimizer, init: list[torch.Tensor], steps: list[list[torch.Tensor]], name: str
) -> tuple[torch.Tensor, OptimizerGroups | None]:
    """One optimizer over whole tensors, stepped as plain PyTorch steps it: what the flat shards
    must reproduce. Returns the parameters after the steps (flattened) and the groups it made."""
    try:
        whole_params = [nn.Parameter(t.clone()) for t in init]
        whole_opt = make_optimizer(whole_params)
        sim_groups = optimizer_groups(whole_opt, whole_params)
        for grads in steps:
            for p, gr in zip(whole_params, grads):
                p.grad = gr.clone()
            whole_opt.step()
    except NotExact:
        raise
    except Exception as e:
        raise NotExact(f"job.optimizer ({name}) cannot take a plain step on its parameters: {e}") from None
    return torch.cat([p.detach().reshape(-1) for p in whole_params]), sim_groups


def _flat_shard_steps(
    make_optimizer: MakeOptimizer,
    init: list[torch.Tensor],
    steps: list[list[torch.Tensor]],
    sim_groups: OptimizerGroups | None,
    name: str,
) -> torch.Tensor:
    """The same steps as the sync tasks take them: the parameters as one flat vector, cut into
    shards across tensor boundaries, each updated by an optimizer of its own whose state goes
    through bytes between steps (core/optim_state.py). Returns the flat parameters after them."""
    flat = torch.cat([t.reshape(-1) for t in init])
    n = flat.numel()
    cuts = sorted({0, *(min(n, max(1, n * k // 7 + 1)) for k in (2, 3, 5)), n})
    bounds = list(zip(cuts[:-1], cuts[1:]))  # shards that cut across tensors, as the runtime's do
    runs = group_runs(sim_groups.of_param, [t.numel() for t in init]) if sim_groups is not None else ()
    hparams = sim_groups.hparams if sim_groups is not None else ()
    states: list[bytes | None] = [None] * len(bounds)
    try:
        for grads in steps:
            gflat = torch.cat([gr.reshape(-1) for gr in grads])
            parts = []
            for k, (a, b) in enumerate(bounds):
                segments = chunk_segments(runs, hparams, a, b)
                new, states[k] = apply_update(make_optimizer, flat[a:b], gflat[a:b], states[k], segments)
                parts.append(new)
            flat = torch.cat(parts)
    except Exception as e:
        raise NotExact(
            f"job.optimizer ({name}) fails on a flat shard of parameters, as the sync tasks apply it ({e}): use an "
            "optimizer that needs no closure and keeps elementwise state (SGD, Adam, AdamW, RMSprop, Adagrad, ...)"
        ) from None
    return flat


# -- building a stage on the meta device ------------------------------------------------------------------
def meta_build_refusal(
    factory: Callable[[], nn.Module], build: Callable[[], nn.Sequential], x: Any, seed: int, dtype: torch.dtype
) -> str | None:
    """Why a container could not build only its stage — the factory run on the meta device, the
    stage's tensors given storage and loaded with the values the client uploads
    (core/stagebuild.py) — and get the model the factory builds; None if it can.

    That reproduces a model whose state is all in its registered parameters and buffers. Checked
    on the job's own factory (``build``: the model as the client builds it, from ``factory``): it
    builds on the meta device, to the same parameters and buffers (names, shapes, dtypes, which
    of them are one tensor, which buffers are saved); no module keeps a tensor in a plain
    attribute, nor a module whose tensors are not the model's (a meta build leaves them without
    values); no two of its tensors share storage (views of one another; loaded separately they
    would no longer be); and the meta-built model, given the real one's values, computes the same
    outputs, gradients and buffers, bit for bit, on two samples of ``x``. A job refused here is
    not refused: its containers build the whole model and keep their stage (``JobSpec.build``),
    as exact but holding every stage's parameters while they build. At most two copies of the
    model are alive at once (a paper-scale model is checked on the client too).
    """
    try:
        meta = stagebuild.build_meta(factory, seed, dtype)
    except Exception as e:
        return f"job.model() fails on the meta device ({type(e).__name__}: {e})"
    try:
        return _meta_build_refusal(meta, build, boundary.map_leaves(lambda t: t[:2], x), seed)
    except Exception as e:  # a check that cannot decide keeps the full build, which is always exact
        return f"the build on the meta device could not be compared with the factory's ({type(e).__name__}: {e})"


def _meta_build_refusal(meta: nn.Module, build: Callable[[], nn.Sequential], x: Any, seed: int) -> str | None:
    real = build()
    if not isinstance(meta, nn.Sequential) or len(meta) != len(real):
        return "job.model() builds another model on the meta device than on the CPU"
    why = _same_tensors(real, meta) or _plain_attributes(real) or _aliased(real)
    if why:
        return why
    want = _digest_run(list(real), x, seed)
    del real  # its buffers moved and it holds gradients now: a fresh one gives the values
    stagebuild.materialize([meta])
    real = build()
    with torch.no_grad():
        for a, b in zip(_state(meta), _state(real)):
            a.copy_(b)
    del real
    got = _digest_run(list(meta), x, seed)
    if isinstance(want, str):
        return want
    if isinstance(got, str):
        return f"the model built on the meta device fails on a sample batch ({got})"
    for what, u, v in zip(("outputs", "gradients", "buffers"), want, got):
        if u != v:
            return f"the model built on the meta device and given the factory's values computes other {what} than the factory's model"
    return None


def _digest(t: torch.Tensor | None) -> Digest | None:
    """A tensor's dtype, shape and bytes, as a digest: equal digests are equal tensors, bit for bit."""
    if t is None:
        return None
    raw = t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
    return (t.dtype, tuple(t.shape), hashlib.blake2b(raw, digest_size=16).hexdigest())


def _digest_run(
    blocks: Sequence[nn.Module], x: Any, seed: int
) -> tuple[list[Digest | None], list[Digest | None], list[Digest | None]] | str:
    """Train mode, the runtime's seeding, forward and backward (the sum of the floating outputs):
    digests of the outputs, of every parameter's gradient and of every buffer afterwards."""
    for b in blocks:
        b.train()
    try:
        out, _ = _forward(blocks, x, seed)
        floating = [t for t in boundary.leaves(out) if t.is_floating_point() and t.requires_grad]
        if floating:
            torch.autograd.backward([t.sum() for t in floating])
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return (
        [_digest(t) for t in boundary.leaves(out)],
        [_digest(p.grad) for blk in blocks for p in blk.parameters()],
        [_digest(b) for blk in blocks for b in blk.buffers()],
    )


def _state(model: nn.Module) -> list[torch.Tensor]:
    return [*model.parameters(), *model.buffers()]


def _signature(model: nn.Module) -> list[Placement]:
    """Every parameter and buffer where the model holds it: name, shape, dtype, type, whether it
    trains, and the first place the same tensor appears (tied weights, a module used twice)."""
    out: list[Placement] = []
    first: dict[int, int] = {}
    for kind, named in (
        ("parameter", model.named_parameters(remove_duplicate=False)),
        ("buffer", model.named_buffers(remove_duplicate=False)),
    ):
        for name, t in named:
            out.append((kind, name, tuple(t.shape), t.dtype, type(t).__name__, t.requires_grad, first.setdefault(id(t), len(out))))
    return out


def _same_tensors(real: nn.Module, meta: nn.Module) -> str | None:
    a, b = _signature(real), _signature(meta)
    for u, v in zip(a, b):
        if u != v:
            return f"job.model() builds {u[0]} {u[1]!r} otherwise on the meta device: (shape, dtype, type, trains) {v[2:6]} there, {u[2:6]} on the CPU"
    if len(a) != len(b):
        return "job.model() builds other parameters or buffers on the meta device than on the CPU"
    if list(real.state_dict()) != list(meta.state_dict()):
        return "job.model() saves other buffers on the meta device than on the CPU"
    return None


def _plain_tensor(value: object, depth: int = 3) -> bool:
    """Whether a plain attribute value holds a tensor, looking into lists, tuples, sets and dicts."""
    if isinstance(value, torch.Tensor):
        return True
    if depth == 0:
        return False
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple, set, frozenset)) else ()
    return any(_plain_tensor(v, depth - 1) for v in items)


def _plain_attributes(model: nn.Module) -> str | None:
    """A tensor in a plain attribute of any module the model reaches, or a module in a plain
    attribute holding tensors that are not the model's own (a GraphModule over the model's
    tensors, as an exported graph keeps, is given the same new tensors: stagebuild.materialize)."""
    registered = {id(t) for t in _state(model)}
    plain = {id(m) for m in stagebuild.reachable_modules(model)} - {id(m) for m in model.modules()}
    for m in stagebuild.reachable_modules(model):
        for attr, value in vars(m).items():
            if attr in ("_parameters", "_buffers", "_modules"):
                continue
            if _plain_tensor(value):
                what = "a tensor"
            elif any(id(t) not in registered for held in stagebuild.plain_modules(value) for t in _state(held)):
                what = "a module with tensors of its own"
            else:
                continue
            where = "" if id(m) not in plain else ", itself kept in a plain attribute"
            return (
                f"module {type(m).__name__}{where} keeps {what} in its attribute {attr!r}, neither a parameter nor a "
                "buffer of the model: a build on the meta device would leave it without values. register_buffer / "
                "nn.ModuleList would let each container build only its own stage"
            )
    return None


def _aliased(model: nn.Module) -> str | None:
    seen: dict[int, tuple[str, torch.Tensor]] = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t.numel() == 0:
            continue
        key = t.untyped_storage().data_ptr()
        if key in seen and seen[key][1] is not t:
            return f"{name!r} shares storage with {seen[key][0]!r} (a view of it): loaded separately they would no longer"
        seen.setdefault(key, (name, t))
    return None


# -- everything, in order ----------------------------------------------------------------------------------
def check_split(
    user: nn.Module, chain: nn.Sequential, originals: dict[str, torch.Tensor], loss: Loss, x: Any, y: torch.Tensor, dtype: torch.dtype
) -> None:
    """The chain cut from a model's graph (``Job(blocks=...)``, core/graph_split.py) computes
    what the model itself does: on a sample batch, the same output, the same gradient of every
    parameter (by the model's own names, ``originals``: the chain's tensors) and the same buffers
    after the forward pass. Both run under one seed with no reseeding between blocks, so dropout
    draws the same masks (the capture keeps the model's order of random draws).

    Why: what torch.export captures is the model's ATen graph; Python side effects in ``forward``
    (a counter, a list appended to, a value read once) are not in it, and a job must not accept a
    chain that trains something else than the module the user wrote.
    """
    user.train()

    def run(seed: int) -> tuple[Any, Any, str | None]:
        torch.manual_seed(seed)
        want = user(x)
        torch.manual_seed(seed)
        got = x
        for block in chain:
            got = block(got)
        pairs = list(zip(boundary.leaves(want), boundary.leaves(got)))
        same = len(pairs) == len(boundary.leaves(want)) == len(boundary.leaves(got))
        same = same and all(isinstance(u, torch.Tensor) and isinstance(v, torch.Tensor) and _close(u, v, dtype) for u, v in pairs)
        return want, got, None if same else "output"

    want, got, why = run(0)
    if why is None:
        torch.autograd.backward(loss(want, y))
        torch.autograd.backward(loss(got, y))
        for name, p in user.named_parameters():
            a, b = p.grad, originals[name].grad
            if (a is None) != (b is None) or (a is not None and b is not None and not _close(a, b, dtype)):
                why = f"gradient of {name}"
                break
    if why is None:
        for name, buf in user.named_buffers():
            if name in originals and not _close(buf, originals[name], dtype):
                why = f"buffer {name} after the forward pass"
                break
    if why is None:  # a second call: what forward keeps between calls shows here
        with torch.no_grad():
            why = run(1)[2] and "output on a second call"
    if why is not None:
        raise NotExact(
            f"the graph torch.export captured from job.model computes another {why} than the model itself on a sample "
            "batch, so its pieces would train something else: forward has an effect outside the graph (a Python "
            "counter, a value kept between calls, a random draw outside torch). Keep forward to tensor operations, or "
            "write the model as an nn.Sequential of blocks (docs/exactness.md)"
        )


def examine(
    build: Callable[[], nn.Sequential],
    loss: Loss,
    make_optimizer: MakeOptimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    seed: int,
    dtype: torch.dtype,
    factory: Callable[[], nn.Module] | None = None,
) -> ModelFacts:
    """Run every check on the job's own model, loss and optimizer, with a few samples ``x``, ``y``.
    ``factory``: the job's model factory itself, whose meta-device build is checked (without it
    the containers build the whole model).

    Raises NotExact for what no plan can train exactly; returns what decides the rest per plan.
    """
    model = build()
    flows = model.flows if isinstance(model, Blocks) else None
    blocks = list(model)
    check_structure(blocks)
    check_something_trains(blocks)
    ties = parameter_buffers(blocks)
    check_factory(model, build())
    check_loss(loss)
    model.train()
    before = _buffers(blocks)
    out, crossing = _forward(blocks, x, seed)
    check_buffers_unchanged(blocks, before)
    value = loss(out, y)
    check_loss_gradient(out, value)
    torch.autograd.backward(value)
    check_gradients(blocks)
    coupling = batch_coupling(blocks, x, seed)
    beyond = coupling_beyond_batch_norm(blocks, x, seed) if coupling is not None else None
    not_mean = loss_not_mean(loss, boundary.map_leaves(torch.Tensor.detach, out), y)
    n_blocks = len(blocks)
    del model, blocks, out, value  # a paper-scale model: hold one copy at a time from here on
    groups = check_optimizer(make_optimizer, [p for p in build().parameters()], dtype)
    full_build = meta_build_refusal(factory, build, x, seed, dtype) if factory is not None else "the factory was not examined"
    return ModelFacts(
        blocks=n_blocks,
        boundary_dtypes=tuple(crossing),
        batch_coupling=coupling,
        loss_not_mean=not_mean,
        coupling_beyond_batch_norm=beyond,
        optimizer_groups=groups,
        full_build=full_build,
        flows=flows,
        parameter_buffers=ties,
    )


def split_batch_refusal(facts: ModelFacts, deferred_batch_norm: bool) -> str | None:
    """Why a plan that splits the global batch into replicas and micro-batches would not train the
    job exactly, and what to change (None: it would).

    The parts' gradients add up to the global batch's only if the loss is a mean over samples and
    no sample depends on the others. The exception is BatchNorm under ``deferred_batch_norm``:
    each micro-batch is then normalised with its own statistics — the documented semantics the
    single-process reference follows too — and the running statistics are updated once per
    iteration from the whole global batch (lambdas/deferred_bn.py).
    """
    parts = "gradients of the parts would not add up to the global batch's"
    whole = "Use one replica and one micro-batch (stages only)"
    if facts.loss_not_mean:
        return f"{facts.loss_not_mean}: {parts}. {whole}, or a loss that is a mean over the batch"
    if facts.batch_coupling is None:
        return None
    beyond = facts.coupling_beyond_batch_norm
    if beyond is not None and beyond == facts.batch_coupling:  # no BatchNorm at all
        return f"{facts.batch_coupling}: {parts}. {whole}, or change the model"
    if beyond is not None:
        return f"{facts.batch_coupling}, and {beyond}, which deferred batch norm cannot reproduce. {whole}, or change the model"
    if deferred_batch_norm:
        return None
    return (
        f"{facts.batch_coupling}: {parts}. {whole}, or opt in to "
        f"deferred batch norm with {DEFERRED_BATCH_NORM}: each micro-batch is then normalised with its own statistics "
        "(as data-parallel training without SyncBatchNorm does), and the running statistics are updated once per "
        "iteration with the mean and unbiased variance of the whole global batch (torchgpipe's deferred batch norm; "
        "docs/exactness.md)"
    )


def check_plan(
    facts: ModelFacts,
    balance: Sequence[int],
    replicas: int,
    micro_batches: int,
    deferred_batch_norm: bool = False,
    micro_batch_size: int | None = None,
) -> None:
    """What a particular plan adds: its cuts, and whether it splits the global batch (which a
    model with BatchNorm may under ``deferred_batch_norm``: :func:`split_batch_refusal`)."""
    cut = 0
    for b in balance[:-1]:
        cut += b
        # floating tensors cross with their gradient; integer and boolean ones (ids, masks) forward only
        complex_ = [d for d in facts.boundary_dtypes[cut - 1] if d.is_complex]
        if complex_:
            raise NotExact(
                f"the plan cuts after block {cut - 1}, whose output holds a {str(complex_[0]).removeprefix('torch.')} tensor: "
                "complex tensors cannot cross a stage boundary. Choose a balance that keeps that block and the next on one stage"
            )
        for tie in facts.parameter_buffers:
            if tie.first <= cut - 1 < tie.last:
                raise NotExact(
                    f"the plan cuts after block {cut - 1}, between two uses of one tensor: {tie.what}. On different stages "
                    "the buffer would stay a copy of the initial values and its use would send the parameter no gradient. "
                    f"Choose a balance that keeps blocks {tie.first} to {tie.last} on one stage, or make it a parameter of "
                    "both blocks (assign it, self.w = other.lin.weight, instead of register_buffer: tied weights train "
                    "exactly across stages)"
                )
    if replicas * micro_batches > 1:
        why = split_batch_refusal(facts, deferred_batch_norm)
        if why:
            raise NotExact(f"the plan splits each global batch into {replicas} replicas x {micro_batches} micro-batches, but {why}")
        if facts.batch_coupling is not None and micro_batch_size == 1:
            raise NotExact(
                f"the plan splits each global batch into micro-batches of one sample, and {facts.batch_coupling}: under "
                "deferred batch norm each sample would be normalised with its own statistics alone (BatchNorm1d cannot "
                "train on one sample at all). Use micro-batches of at least two samples"
            )
