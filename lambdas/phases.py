"""The five phases a worker runs (docs/runtime.md "Phases"): an iteration's forward, backward and
sync, here as one function each, and evaluate and checkpoint (lambdas/evaluation.py,
lambdas/checkpoint.py). ``PHASES`` names all five; ``run_phase`` runs an event's own.

Forward (stage s, replica r): forward without grad, micro-batch by micro-batch, sending outputs on.
Backward (s, r): micro-batches in reverse, recompute with grad (GPipe re-materialisation), send
input-gradients back, accumulate parameter gradients scaled so they average over the global batch.
The gradient then leaves by the stage's sync algorithm (lambdas/collectives.py), one ``_Update``
class per case: written as K shards for a sync Map, exchanged among the backward tasks themselves
(pipelined or LambdaML's scatter-reduce), or, with d = 1, applied by the task directly.
Sync (s, task k): sum shard k over replicas in a fixed order, apply the optimizer to shard k; or,
hierarchical, a level-1 aggregator summing a block of replicas for the shard's root.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Protocol, TypeVar, assert_never

import torch

from stagecoach.core import boundary, keys
from stagecoach.core.events import AnyTaskEvent, BackwardEvent, CheckpointEvent, EvaluateEvent, ForwardEvent, SyncEvent
from stagecoach.core.training import batch_indices, micro_batch, tracked_norms, trains_up_to
from stagecoach.lambdas import collectives, deferred_bn
from stagecoach.lambdas.channel import Channel
from stagecoach.lambdas.checkpoint import checkpoint
from stagecoach.lambdas.evaluation import evaluate
from stagecoach.lambdas.jobctx import JobContext
from stagecoach.lambdas.stageio import StageIO, one_ahead
from stagecoach.planner.plan import FUSED_SYNC


def _rows(ctx: JobContext, t: int, replica: int, mb: int) -> torch.Tensor:
    plan = ctx.plan
    batch = batch_indices(ctx.seed, t, ctx.spec.dataset.n_train, plan.global_batch, ctx.batch_sizes)
    split = ctx.hap_split
    if split is not None:  # FasDL's unequal cut: aggregators' B^a samples first, then B^n each
        return split.rows(batch, replica, mb)
    return micro_batch(batch, plan.replicas, plan.micro_batches, replica, mb)


def _param_version(ctx: JobContext, t: int, replica: int) -> int:
    """The parameter version replica r computes iteration t's gradient on: t, or under HAP
    (planner/hap.py) max(t - 1, 0) for a non-aggregator, which reads the version before the one
    iteration t - 1's sync Map made (its sync task keeps it: collectives.forget_old_version)."""
    split = ctx.hap_split
    return t if split is None else split.param_version(t, replica)


def _loss_scale(ctx: JobContext, replica: int) -> float:
    """The factor on a micro-batch's mean loss so the gradients sum to the global batch's mean:
    1 / (d m), or under HAP the micro-batch's share of the global batch (HapSplit.weight)."""
    split = ctx.hap_split
    return 1.0 / (ctx.plan.micro_batches * ctx.plan.replicas) if split is None else split.weight(replica)


def _inputs(
    ctx: JobContext, ch: Channel, io: StageIO, t: int, replica: int, order: Sequence[int], deadline: float
) -> Iterator[tuple[int, Any]]:
    """The micro-batches ``order`` and their inputs. Stage 0: its samples' inputs from the data
    set; else what the earlier stages sent (lambdas/stageio.py), one download ahead."""
    if io.stage == 0:
        return ((j, ctx.inputs(ch, 0, _rows(ctx, t, replica, j), t)) for j in order)
    return one_ahead(order, lambda j: io.receive_later(ch, t, replica, j, deadline))


def _copy(x: Any) -> Any:
    """A copy of a stage input: the downloaded tensors view read-only bytes, and a first layer may
    work in place."""
    return boundary.map_leaves(torch.clone, x)


def forward(ctx: JobContext, ch: Channel, ev: ForwardEvent, deadline: float) -> dict[str, Any]:
    if ev.stage >= ctx.plan.stages - 1:
        raise ValueError(f"stage {ev.stage} has no forward task: the last stage's forward runs in its backward")
    warm = ctx.warm_attempt(ch, ev.stage, ev.window_start, ev.attempt)
    layers = ctx.ensure_params(ch, ev.stage, ev.t, deadline, ev.window_start, warm)
    first = ctx.plan.stage_layers(ev.stage).start
    io = ctx.stage_io(ev.stage)
    record = _batch_stats(ctx, layers, first)
    if record is None:
        ctx.ensure_running_stats(ch, ev.stage, ev.t)  # this forward pass updates them (BatchNorm)
    # a stage after the first waits for micro-batch j+1's input (and downloads it as it lands)
    # while j computes: its GET's latency leaves the step (docs/performance-model.md §3.1)
    for j, x in _inputs(ctx, ch, io, ev.t, ev.replica, range(ctx.plan.micro_batches), deadline):
        with torch.no_grad(), _recording(record, j):
            y = io.run(layers, first, _copy(x) if ev.stage > 0 else x, ctx.seed, ev.t, ev.replica, j)
        io.send(ch, ev.t, ev.replica, j, y)  # in the background, while j+1 computes
    if record is None:
        ctx.save_running_stats(ch, ev.stage, ev.t + 1, ev.window_start)
    else:  # deferred: replica 0's backward task combines every replica's record into one update
        ch.submit_handoff(keys.bn_stats(ctx.job, ev.t, ev.stage, ev.replica), record.tensors())
    return {}


def _batch_stats(ctx: JobContext, layers: torch.nn.ModuleList, first: int) -> deferred_bn.BatchStats | None:
    """A record of the stage's BatchNorm inputs when they defer their running statistics
    (lambdas/deferred_bn.py); None when they update them themselves (or there are none)."""
    norms = tracked_norms(layers, first) if ctx.deferred_batch_norm else {}
    return deferred_bn.BatchStats(norms) if norms else None


def _recording(record: deferred_bn.BatchStats | None, mb: int) -> AbstractContextManager[None]:
    return record.recording(mb) if record is not None else nullcontext()


def _suspended(record: deferred_bn.BatchStats | None) -> AbstractContextManager[None]:
    return deferred_bn.suspended(record.norms.values()) if record is not None else nullcontext()


def _commit_batch_stats(ctx: JobContext, ch: Channel, ev: BackwardEvent, record: deferred_bn.BatchStats, deadline: float) -> None:
    """Replica 0: the stage's running statistics after iteration t, from version t and every
    replica's record, updated once and stored as version t+1 (lambdas/deferred_bn.py, rule 3)."""
    s, t = ev.stage, ev.t
    records = [ch.wait_tensors(keys.bn_stats(ctx.job, t, s, q), deadline) for q in range(ctx.plan.replicas)]
    ctx.ensure_running_stats(ch, s, t)
    deferred_bn.commit(record.norms, deferred_bn.combine(records))
    ctx.save_running_stats(ch, s, t + 1, ev.window_start)


def backward(ctx: JobContext, ch: Channel, ev: BackwardEvent, deadline: float) -> dict[str, Any]:
    s, r, t = ev.stage, ev.replica, ev.t
    warm = ctx.warm_attempt(ch, s, ev.window_start, ev.attempt)
    layers = ctx.ensure_params(ch, s, _param_version(ctx, t, r), deadline, ev.window_start, warm)
    # what this worker wrote two iterations ago, deleted while it computes: a request's latency
    # at the task's end would be on the iteration's critical path
    _forget_iteration(ctx, ch, t - 2, s, r)
    for p in layers.parameters():  # the stage's own and those it shares with an earlier stage
        p.grad = None
    spec = ctx.sync_spec(s, t, ev.window_start, deadline)
    update = _update_for(ctx, ch, ev, spec, warm)
    record = _batch_stats(ctx, layers, ctx.plan.stage_layers(s).start)
    with _running_stats_kept(ctx, ch, ev, record):
        losses = _backward_passes(ctx, ch, ev, layers, update.stream, record, deadline)
        update.stream.finish()
        _send_tied_grads(ctx, ch, s, t, r)
    update.apply(ctx, ch, ev, spec)
    if record is not None and r == 0:  # after the exchange, which the other replicas wait on
        _commit_batch_stats(ctx, ch, ev, record, deadline)
    out: dict[str, Any] = {"grad_norm": spec.norms[-1]} if spec.norms else {}
    if s == ctx.plan.stages - 1:
        out["loss"] = _replica_loss(ctx, r, losses)
        if ctx.schedule is not None:  # the learning rate this iteration trained with, per parameter group
            out["lr"] = ctx.schedule.lrs(t)
    return out


def _replica_loss(ctx: JobContext, replica: int, losses: list[float]) -> float:
    """The loss the task reports, whose plain mean over the d replicas is the global batch's mean
    (stagecoach.metrics mean_loss): its micro-batches' mean; under HAP's unequal cut, d times its
    weighted share, d * sum_j weight(r) * loss_j (equal to the mean when every replica has G / d
    samples), so the run's loss is the reference's (stagecoach.reference_hap)."""
    split = ctx.hap_split
    if split is None:
        return sum(losses) / len(losses)
    return split.replicas * sum(loss * split.weight(replica) for loss in losses)


@contextmanager
def _running_stats_kept(ctx: JobContext, ch: Channel, ev: BackwardEvent, record: deferred_bn.BatchStats | None) -> Iterator[None]:
    """Running statistics (BatchNorm) around the backward passes: the last stage's only forward
    pass is among them, which updates them (version t in, t+1 stored after); any other stage's
    forward task did, and the recompute must not again, so they are put back as they were.
    Deferred (lambdas/deferred_bn.py), every pass runs with them suspended, the last stage's
    recording what its BatchNorms see, and replica 0 updates them once at the end."""
    s, t = ev.stage, ev.t
    last = s == ctx.plan.stages - 1
    if last and record is None:
        ctx.ensure_running_stats(ch, s, t)
    held = {k: v.clone() for k, v in ctx.running_stats(s).items()} if not last else {}
    yield
    if last and record is None:
        ctx.save_running_stats(ch, s, t + 1, ev.window_start)
    elif held:
        with torch.no_grad():
            for k, v in ctx.running_stats(s).items():
                v.copy_(held[k])


def _backward_passes(
    ctx: JobContext,
    ch: Channel,
    ev: BackwardEvent,
    layers: torch.nn.ModuleList,
    stream: collectives.GradStream,
    record: deferred_bn.BatchStats | None,
    deadline: float,
) -> list[float]:
    """The micro-batches in reverse: recompute with grad, backward from the loss (the last stage)
    or the output's gradient, input gradients sent back; the stream armed before the last pass.
    Returns the last stage's micro-batch losses (none for another stage).

    Frozen parameters (training.Ownership) get no gradient, as in PyTorch: a stage with nothing
    that trains at or before it (a frozen backbone) has no backward pass to run and waits for no
    gradient, and the stage after it sends none (its input needs none)."""
    plan = ctx.plan
    s, r, t = ev.stage, ev.replica, ev.t
    last = s == plan.stages - 1
    if not last and not trains_up_to(ctx.ownership(s), s):
        return []
    upstream_trains = trains_up_to(ctx.ownership(s), s - 1)
    first = plan.stage_layers(s).start
    io = ctx.stage_io(s)
    scale = _loss_scale(ctx, r)
    losses = []
    # A later stage's inputs have been in S3 since the forward phase: the next micro-batch's
    # downloads while this one waits for its output's gradient (a middle stage) and computes, so
    # the re-read costs no request latency of its own (docs/performance-model.md §3.2). One ahead:
    # two inputs held.
    for j, x in _inputs(ctx, ch, io, t, r, list(reversed(range(plan.micro_batches))), deadline):
        # a floating input's gradient is sent back; integer and boolean ones (ids, masks) travel
        # forward only. The layers get a copy, which a first layer may change in place.
        sends_grad = upstream_trains and io.sends_grads(x)
        if sends_grad:
            x = boundary.with_grad(x)
        with _recording(record, j) if last else _suspended(record):
            y = io.run(layers, first, _copy(x) if s > 0 else x, ctx.seed, t, r, j)
        if last:
            losses.append(_loss_backward(ctx, ch, ev, j, y, stream, record, scale, deadline))
        else:
            outs, out_grads = io.output_grads(ch, t, r, j, y, deadline)
            if j == 0:
                _arm(ctx, ch, ev, stream, deadline)
            if outs:  # else nothing upstream needs a gradient from this output
                torch.autograd.backward(outs, out_grads)
        if sends_grad:
            # zero where no gradient reached a floating input leaf (through an integer output
            # nothing upstream has parameters to train, which Job.validate checks)
            io.send_input_grads(ch, t, r, j, x)
    return losses


def _loss_backward(
    ctx: JobContext,
    ch: Channel,
    ev: BackwardEvent,
    j: int,
    y: Any,
    stream: collectives.GradStream,
    record: deferred_bn.BatchStats | None,
    scale: float,
    deadline: float,
) -> float:
    """The last stage's backward pass of micro-batch j from its loss, scaled so the gradients
    average over the global batch; returns the loss."""
    s, r, t = ev.stage, ev.replica, ev.t
    if record is not None and j == 0:  # the last forward pass: the record is complete
        ch.submit_handoff(keys.bn_stats(ctx.job, t, s, r), record.tensors())
    labels = ctx.targets(ch, s, _rows(ctx, t, r, j))
    loss = ctx.loss_fn(y, labels)
    if loss.dim() != 0:
        raise ValueError("the loss must reduce to a scalar (a mean over the micro-batch)")
    if j == 0:
        _arm(ctx, ch, ev, stream, deadline)
    torch.autograd.backward(loss * scale)
    return float(loss.detach())


def _arm(ctx: JobContext, ch: Channel, ev: BackwardEvent, stream: collectives.GradStream, deadline: float) -> None:
    """Before the last backward pass: the tied weights' gradients from later stages added, and the
    stream watching for chunks that pass makes final."""
    _add_tied_grads(ctx, ch, ev.stage, ev.t, ev.replica, deadline)
    stream.arm()


# -- how the stage's gradient leaves the backward task: one class per sync case -------------------------
class _Update(ABC):
    """What happens to each chunk of the stage's gradient once the last backward pass has produced
    it (``stream``), and after the passes (``apply``). ``_update_for`` picks the case once: a sync
    Map, an exchange among the backward tasks (FUSED_SYNC), or d = 1, the task updating alone
    (with its state warm or from S3)."""

    stream: collectives.GradStream

    @abstractmethod
    def apply(self, ctx: JobContext, ch: Channel, ev: BackwardEvent, spec: collectives.SyncSpec) -> None:
        """After the backward passes: the stage's version t+1, where this task makes it."""


class _ToSyncMap(_Update):
    """d > 1 with a sync Map (scatter_reduce, k_reduce, all_reduce): the chunks are written as K
    shards as they are final; the sync tasks reduce and update them."""

    def __init__(self, ch: Channel, ev: BackwardEvent, spec: collectives.SyncSpec, params: Sequence[torch.nn.Parameter]) -> None:
        emit = collectives.gradient_writer(ch, spec, ev.replica)
        self.stream = collectives.GradStream(params, spec.layout, collectives.write_order(spec), emit)

    def apply(self, ctx: JobContext, ch: Channel, ev: BackwardEvent, spec: collectives.SyncSpec) -> None:
        """Nothing: the sync Map makes version t+1."""


class _Exchanged(_Update):
    """d > 1 fused into the backward tasks (pipelined or LambdaML's scatter-reduce): replica r
    owns shard r; with warm state, its optimizer state stays in this container."""

    def __init__(
        self, ctx: JobContext, ch: Channel, ev: BackwardEvent, spec: collectives.SyncSpec, params: Sequence[torch.nn.Parameter], warm: bool
    ) -> None:
        r, t = ev.replica, ev.t
        own = (
            collectives.Warm(_optimizer_state(ctx, ch, spec, ev.window_start, r), ctx.checkpoint(t + 1, ev.window_start, ev.stage))
            if warm
            else None
        )
        self.exchange = collectives.EXCHANGES[ctx.plan.sync[ev.stage]](ch, spec, r, own)
        self.stream = self.exchange.stream(params)

    def apply(self, ctx: JobContext, ch: Channel, ev: BackwardEvent, spec: collectives.SyncSpec) -> None:
        s, r, t = ev.stage, ev.replica, ev.t
        ctx.set_params(s, t + 1, self.exchange.finish(ctx.master_params(s)))
        if self.exchange.warm is not None:
            ctx.optim_held[s, r] = (t + 1, [self.exchange.warm.kept[c] for c in spec.chunks(r)])


class _Alone(_Update):
    """d = 1: no exchange; the task collects the gradient's chunks (the state downloads, or is in
    memory, meanwhile) and updates the stage's one shard itself."""

    def __init__(self, spec: collectives.SyncSpec, params: Sequence[torch.nn.Parameter]) -> None:
        self.grads: dict[tuple[int, int], torch.Tensor] = {}
        self.stream = collectives.GradStream(params, spec.layout, collectives.write_order(spec), self._keep)

    def _keep(self, k: int, c: int, g: torch.Tensor) -> None:
        self.grads[k, c] = g

    def _flat(self, ch: Channel, spec: collectives.SyncSpec) -> torch.Tensor:
        """The stage's one shard, reduced: clipped by the global norm if asked, as one vector."""
        return torch.cat(collectives.clipped(ch, spec, 0, [self.grads[0, c] for c in spec.chunks(0)]))


class _AloneFromS3(_Alone):
    """d = 1, the optimizer state at version t downloading from S3 while the task computes."""

    def __init__(self, ch: Channel, spec: collectives.SyncSpec, params: Sequence[torch.nn.Parameter]) -> None:
        self.state = collectives.prefetch_state(ch, spec, 0)
        super().__init__(spec, params)

    def apply(self, ctx: JobContext, ch: Channel, ev: BackwardEvent, spec: collectives.SyncSpec) -> None:
        flat = self._flat(ch, spec)
        new = collectives.update_alone(ch, spec, ctx.master_params(ev.stage), flat, self.state)
        ctx.set_params(ev.stage, ev.t + 1, new)


class _AloneWarm(_Alone):
    """d = 1 with warm state: the optimizer state in this container's memory (or downloading from
    the checkpoint); version t+1 goes to S3 only as a checkpoint, or for later stages that read it."""

    def __init__(
        self, ctx: JobContext, ch: Channel, ev: BackwardEvent, spec: collectives.SyncSpec, params: Sequence[torch.nn.Parameter]
    ) -> None:
        self.state = _optimizer_state(ctx, ch, spec, ev.window_start)
        super().__init__(spec, params)

    def apply(self, ctx: JobContext, ch: Channel, ev: BackwardEvent, spec: collectives.SyncSpec) -> None:
        s, t = ev.stage, ev.t
        flat = self._flat(ch, spec)
        store = ctx.checkpoint(t + 1, ev.window_start, s)
        new, states = collectives.update_warm(
            ch, spec, ctx.master_params(s), flat, self.state, store_params=store or ctx.publishes_params(s), store_state=store
        )
        ctx.set_params(s, t + 1, new)
        ctx.optim_held[s, 0] = (t + 1, states)


def _update_for(ctx: JobContext, ch: Channel, ev: BackwardEvent, spec: collectives.SyncSpec, warm: bool) -> _Update:
    """The stage's sync case. Made before the backward passes: a state it needs downloads (or is
    checked to be in memory) while they compute."""
    params = ctx.stage_params(ev.stage)
    if ctx.plan.replicas == 1:
        return _AloneWarm(ctx, ch, ev, spec, params) if warm else _AloneFromS3(ch, spec, params)
    if ctx.plan.sync[ev.stage] in FUSED_SYNC:  # the exchange reduces (the plain left fold: fan-in plays no part)
        return _Exchanged(ctx, ch, ev, spec, params, warm)
    return _ToSyncMap(ch, ev, spec, params)


def _optimizer_state(
    ctx: JobContext, ch: Channel, spec: collectives.SyncSpec, window_start: int, shard: int = 0
) -> list[bytes] | list[Future[bytes | None]] | None:
    """The optimizer state at version t of a warm ``shard`` this container owns: in its memory,
    else downloading from the checkpoint if t is one; else the version check fails and the window
    restarts."""
    if spec.t == 0 or not collectives.stateful(spec.make_optimizer):
        return None
    held = ctx.optim_held.get((spec.stage, shard))
    if held is not None and held[0] == spec.t:
        return held[1]
    ctx.require_warm(spec.stage, spec.t, window_start, held[0] if held else None)
    return collectives.prefetch_state(ch, spec, shard)


def _add_tied_grads(ctx: JobContext, ch: Channel, s: int, t: int, r: int, deadline: float) -> None:
    """Before the last backward pass: add the later stages' gradients of the parameters this stage
    owns and they share (tied weights), so the update sees the sum over every use, as in PyTorch."""
    params = ctx.stage_params(s)
    for b in ctx.ownership(s).users(s):
        for name, g in ch.wait_tensors(keys.tied_grad(ctx.job, t, s, b, r), deadline).items():
            p = params[int(name)]
            if p.grad is None:
                p.grad = g.to(p.dtype).clone()
            else:
                p.grad.add_(g)


def _send_tied_grads(ctx: JobContext, ch: Channel, s: int, t: int, r: int) -> None:
    """This stage's gradients of the parameters it shares with earlier stages, to their owners."""
    by_owner: dict[int, dict[str, torch.Tensor]] = {}
    for tied in ctx.tied(s):
        g = tied.param.grad if tied.param.grad is not None else torch.zeros_like(tied.param)
        by_owner.setdefault(tied.owner, {})[str(tied.index)] = g.detach().contiguous()
    for owner, grads in by_owner.items():
        ch.put_tensors(keys.tied_grad(ctx.job, t, owner, s, r), grads)


def sync(ctx: JobContext, ch: Channel, ev: SyncEvent, deadline: float) -> dict[str, Any]:
    """Sync task ``ev.shard`` of stage s: its role (``collectives.sync_role``) — a shard's owner,
    which reduces and updates it (scatter_reduce, k_reduce, all_reduce, a hierarchical root), or a
    hierarchical level-1 aggregator, which sums its block into a partial."""
    plan = ctx.plan
    if plan.sync_tasks(ev.stage) == 0 or ev.shard >= plan.sync_tasks(ev.stage):
        raise ValueError(
            f"stage {ev.stage} has {plan.sync_tasks(ev.stage)} sync tasks ({plan.sync[ev.stage]}, "
            f"{plan.replicas} replicas): there is no sync task for shard {ev.shard}"
        )
    spec = _sync_spec(ctx, ev.stage, ev.t, ev.window_start, deadline)
    role = collectives.sync_role(plan.sync[ev.stage], spec, ev.shard)
    if isinstance(role, collectives.BlockSum):
        collectives.reduce_block(ch, spec, role.block, role.shard)
        return {}
    return _own_shard(ctx, ch, ev, spec, role)


def _sync_spec(ctx: JobContext, s: int, t: int, window_start: int, deadline: float) -> collectives.SyncSpec:
    """The stage's SyncSpec with the plan's fan-in: a hierarchical stage's block of replicas per
    level-1 aggregator (its chain's links); it changes no bits (collectives.left_fold)."""
    return dataclasses.replace(ctx.sync_spec(s, t, window_start, deadline), fan_in=ctx.plan.fan_in[s])


def _own_shard(ctx: JobContext, ch: Channel, ev: SyncEvent, spec: collectives.SyncSpec, role: collectives.ShardOwner) -> dict[str, Any]:
    """Reduce the shard the task owns from the role's inputs and update it: from S3, or, in a warm
    window attempt, with the shard's state and parameters kept in this task's own function."""
    s, k, t = ev.stage, role.shard, ev.t
    out: dict[str, Any] = {}
    if not ctx.warm_attempt(ch, s, ev.window_start, ev.attempt):
        collectives.reduce_shard(ch, spec, k, cached=ctx.cached_params(s, t), inputs=role.inputs)
        return {"grad_norm": spec.norms[-1]} if spec.norms else out
    # the sync task's own function: shard k's state and parameters stay here (docs/runtime.md)
    warm = collectives.Warm(_optimizer_state(ctx, ch, spec, ev.window_start, k), ctx.checkpoint(t + 1, ev.window_start, s))
    mine = ctx.shard_held.get((s, k))
    held = mine[1] if mine is not None and mine[0] == t else None
    cached = None if held is not None else ctx.cached_params(s, t)
    new = collectives.reduce_shard(ch, spec, k, cached=cached, held=held, warm=warm, inputs=role.inputs)
    ctx.optim_held[s, k] = (t + 1, [warm.kept[c] for c in spec.chunks(k)])
    ctx.shard_held[s, k] = (t + 1, new)
    return {"grad_norm": spec.norms[-1]} if spec.norms else out


def _forget_iteration(ctx: JobContext, ch: Channel, t: int, stage: int, replica: int) -> None:
    """Delete what this worker wrote two iterations ago (a bucket lifecycle rule is the safety net)."""
    if t < 0:
        return
    job = ctx.job
    plan = ctx.spec.to_plan(t) if ctx.spec.plan.get("segments") else ctx.plan  # iteration t's (dynamic workers)
    io = ctx.stage_io(stage)
    ks = [k for j in range(plan.micro_batches) for k in io.written(t, replica, j)]
    ks += [keys.tied_grad(job, t, owner, stage, replica) for owner in {tied.owner for tied in ctx.tied(stage)}]
    if ctx.deferred_batch_norm and ctx.running_stats(stage):
        ks.append(keys.bn_stats(job, t, stage, replica))
    layout = ctx.layout(stage, at=t)  # as iteration t cut it: K and the chunks may change with d
    if ctx.one_gradient_object(stage) is not None:
        ks.append(keys.gradient(job, t, stage, replica))
    elif plan.sync[stage] in collectives.EXCHANGES:  # its exchange objects
        ks += collectives.sent_keys(plan.sync[stage], job, t, stage, plan.replicas, layout, replica)
    else:
        ks += [keys.gshard(job, t, stage, replica, k, c) for k in range(len(layout)) for c in range(len(layout[k]))]
    ch.submit_delete(ks)


E = TypeVar("E", ForwardEvent, BackwardEvent, SyncEvent, EvaluateEvent, CheckpointEvent, contravariant=True)


class Phase(Protocol[E]):
    """A phase: the task's work for its event (``E``, one of core/events.py's), returning the
    fields it adds to the task's metrics (core/records.py TaskMetrics)."""

    def __call__(self, ctx: JobContext, ch: Channel, ev: E, deadline: float) -> dict[str, Any]: ...


PHASES: dict[str, Phase[ForwardEvent] | Phase[BackwardEvent] | Phase[SyncEvent] | Phase[EvaluateEvent] | Phase[CheckpointEvent]] = {
    "forward": forward,
    "backward": backward,
    "sync": sync,
    "evaluate": evaluate,
    "checkpoint": checkpoint,
}


def run_phase(ctx: JobContext, ch: Channel, ev: AnyTaskEvent, deadline: float) -> dict[str, Any]:
    """The event's phase (the handler's dispatch): matching the event's class narrows its type, so
    each phase is checked to get the event it takes, and an event class without a phase fails the
    type check (assert_never)."""
    match ev:
        case ForwardEvent():
            return forward(ctx, ch, ev, deadline)
        case BackwardEvent():
            return backward(ctx, ch, ev, deadline)
        case SyncEvent():
            return sync(ctx, ch, ev, deadline)
        case EvaluateEvent():
            return evaluate(ctx, ch, ev, deadline)
        case CheckpointEvent():
            return checkpoint(ctx, ch, ev, deadline)
        case _:
            assert_never(ev)
