"""Gradient synchronisation through S3: the four algorithms of the seed papers (docs/runtime.md).

A stage's flat parameter vector is cut into K shards, each shard into chunks (training.stage_layout);
shard k's chunks are reduced and updated by one owner, ZeRO-1 style (its optimizer state lives
only there). Every algorithm sums the replicas' gradients in plain PyTorch's order, the left fold
g_0 + g_1 + ... + g_{d-1} (``left_fold``: what d ``loss.backward()`` calls accumulate into
``.grad``), at every d and whatever the plan's fan-in, and updates chunk by chunk with an
elementwise optimizer, so they all produce the bits of single-process PyTorch
(tests/test_collectives.py, tests/test_hierarchical.py). Float addition is not associative: any
other grouping (blocks summed apart, then their sums) would differ in the last bits.

- ``scatter_reduce`` (LambdaML), ``k_reduce`` (FasDL, 1 <= K <= d), ``all_reduce`` (K = 1): the
  backward task writes its gradient as K shards (``write_gradient``); a sync Map of K tasks
  reduces one shard each (``reduce_shard``); the next phase gathers the K updated shards.
- ``hierarchical`` (DiSDeL's aggregation service, as a chain): the same K shards; the sync Map
  adds, per block b of f = fan_in consecutive replicas and shard, a level-1 aggregator
  (``reduce_block``) that extends the running prefix P_b = P_{b-1} + g_{bf} + ... + g_{bf+f-1}
  (left to right) chunk by chunk, and each shard's root (``reduce_shard`` over
  ``partial_inputs``) reads the last prefix, the whole left fold, and updates the shard.
  ``sync_role`` says which a sync task is. A left fold is sequential, so the blocks form a chain,
  not a tree: each aggregator still reads at most f + 1 objects per chunk (DiSDeL's fan-in bound on
  its memory and requests in flight), and the latency grows by one hop per block, pipelined over
  chunks (link b folds chunk c while link b-1 folds chunk c+1).
- ``pipelined_scatter_reduce`` (FuncPipe), fused into the backward task (``PipelinedExchange``):
  replica r owns shard r. It uploads the d-1 shards the others own while it downloads its own
  shard from them, in the paper's staggered order (in round c, replica r sends chunk c of shard
  r+i to the replica that fetches it at step i), reduces and updates each chunk as soon as the d-1
  copies have arrived, uploads it, and meanwhile downloads the others' updated chunks, so the
  container ends the task holding version t+1 and the next phase reads nothing. The chunks for
  the peers travel in objects of 4 consecutive chunks (``send_groups``), each read by a ranged GET.
- ``lambdaml_scatter_reduce`` (LambdaML), fused into the backward task too (``LambdaMLExchange``):
  the same shards, objects and reduction, in LambdaML's four phases one after another, each
  starting when the previous has ended in this worker: after the whole backward pass, upload the
  d-1 shards the others own; download shard r from the d-1 others, reduce and update it; upload
  it; download the others' updated shards. No overlap with compute or between phases: what the
  pipelined algorithm improves on, kept so that comparisons are against LambdaML's schedule.

Overlap: ``GradStream`` hands a chunk to the uploader as soon as the last backward pass has
produced every parameter gradient in it, so uploads run while lower layers still compute.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from stagecoach.core import keys
from stagecoach.core.optim_state import apply_update, chunk_segments
from stagecoach.core.versions import optimizer_keeps_state
from stagecoach.lambdas.channel import Channel, flat_safetensors, results
from stagecoach.lambdas.clipping import Clip
from stagecoach.planner.model.syncmodel import exchange_group_chunks
from stagecoach.planner.plan import reduction_blocks

Layout = Sequence[Sequence[tuple[int, int]]]  # per shard, its chunks' [start, end) in the flat vector
MakeOptimizer = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


@dataclass(frozen=True)
class SyncSpec:
    """Everything a collective needs to know about one stage at one iteration."""

    job: str
    stage: int
    t: int
    replicas: int
    layout: Layout  # len(layout) = K shards
    make_optimizer: MakeOptimizer
    window_start: int
    deadline: float
    # parameter groups: the stage's flat vector as (start, end, group) runs, and each group's
    # hyperparameters; empty for an optimizer of one group (optim_state.chunk_segments)
    groups: tuple[tuple[int, int, int], ...] = ()
    group_hparams: tuple[dict[str, Any], ...] = ()
    clip: Clip | None = None  # clip the global gradient norm before updating (lambdas/clipping.py)
    norms: list[float] = field(default_factory=list)  # the global norm this task computed (metrics)
    fan_in: int = 0  # a hierarchical stage's block (plan.fan_in[stage]); 0: one block. Changes no bits.
    # the gradient's dtype when each replica writes it as one object (keys.gradient, one shard of
    # one chunk after the other: syncmodel.one_gradient_object); None: one object per chunk (keys.gshard)
    one_object: torch.dtype | None = None
    # FasDL's HAP (planner/hap.py): non-aggregators compute iteration t on version t-1, so a shard's
    # stored parameters are kept one version longer (``forget_old_version``)
    stale_readers: bool = False
    # per shard, per chunk: the stored (shard, chunk) whose keys hold it, when K or the chunks
    # change between segments (core/stored_layout.py); (): the layout is the stored one
    names: tuple[tuple[tuple[int, int], ...], ...] = ()

    def stored(self, shard: int, chunk: int) -> tuple[int, int]:
        """The (shard, chunk) of the stored version's keys (``keys.params``, ``keys.optim``)."""
        return self.names[shard][chunk] if self.names else (shard, chunk)

    @property
    def shards(self) -> int:
        return len(self.layout)

    @property
    def blocks(self) -> int:
        """B: the hierarchical chain's blocks of fan_in replicas (1: d <= fan_in, or fan_in 0)."""
        return reduction_blocks(self.replicas, self.fan_in) if self.fan_in > 0 else 1

    def block_replicas(self, block: int) -> range:
        """The consecutive replicas of ``block`` (the last block may be shorter)."""
        f = self.fan_in if self.blocks > 1 else self.replicas
        return range(block * f, min(self.replicas, (block + 1) * f))

    def chunks(self, shard: int) -> range:
        return range(len(self.layout[shard]))


@functools.lru_cache(maxsize=8)
def _stateful(make_optimizer: MakeOptimizer) -> bool:
    return optimizer_keeps_state(make_optimizer)


def stateful(make_optimizer: MakeOptimizer) -> bool:
    """Whether the optimizer keeps per-parameter state (plain SGD does not: nothing to store)."""
    try:
        return _stateful(make_optimizer)
    except TypeError:  # an unhashable factory: ask every time
        return _stateful.__wrapped__(make_optimizer)


def left_fold(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """g_0 + g_1 + ... in this order: the one reduction order of every algorithm, at every d, as
    plain PyTorch accumulates ``.grad`` over d ``loss.backward()`` calls. A left fold may be
    continued but not regrouped: left_fold([left_fold(g[:i]), *g[i:]]) has its bits (the
    hierarchical chain), (g_0 + g_1) + (g_2 + g_3) does not. bfloat16 gradients (mixed precision)
    are summed in float32, the master weights' dtype."""
    total = parts[0].float() if parts[0].dtype == torch.bfloat16 else parts[0].clone()
    for g in parts[1:]:
        total += g
    return total


# -- the optimizer update of one chunk --------------------------------------------------------------
@dataclass
class Warm:
    """A shard whose optimizer state stays in this container's memory between iterations
    (docs/runtime.md "State that stays warm"): the worker that owns the shard updates it from the
    state it holds and stores the new state in S3 only as a checkpoint.

    state: each chunk's state at version t — held here (bytes), downloading because t is a
           checkpoint (futures), or None (t = 0, or an optimizer without state).
    store: whether version t+1 of the state goes to S3 (the window's checkpoint).
    kept:  each chunk's state at version t+1 as the update made it, for the container to hold.
    """

    state: Sequence[bytes] | Sequence[Future[bytes | None]] | None
    store: bool
    kept: dict[int, bytes] = field(default_factory=dict)


def clipped(ch: Channel, spec: SyncSpec, shard: int, totals: list[torch.Tensor]) -> list[torch.Tensor]:
    """A reduced shard's chunks scaled by the global clipping coefficient, which waits for every
    updating task's shard norm (lambdas/clipping.py); unchanged without clipping."""
    if spec.clip is None:
        return totals
    norm, coef = spec.clip.coefficient(ch, spec.job, spec.t, spec.stage, shard, totals, spec.deadline)
    spec.norms.append(norm)
    return [g * coef for g in totals]


def prefetch_state(ch: Channel, spec: SyncSpec, shard: int) -> list[Future[bytes | None]] | None:
    """Start downloading the optimizer state of ``shard`` at version t (None: nothing to fetch)."""
    if spec.t == 0 or not stateful(spec.make_optimizer):
        return None
    return [ch.submit_get_bytes(keys.optim(spec.job, spec.t, spec.stage, *spec.stored(shard, c))) for c in spec.chunks(shard)]


def update_chunk(
    ch: Channel,
    spec: SyncSpec,
    shard: int,
    c: int,
    param: torch.Tensor,
    grad: torch.Tensor,
    state: Mapping[int, Future[bytes | None]] | Sequence[Future[bytes | None]] | None,
    uploads: list[Future[None]] | None = None,
    warm: Warm | None = None,
    copy: bool = False,
) -> torch.Tensor:
    """Apply the optimizer to one chunk, upload the new parameters and state (their futures are
    added to ``uploads`` if given, for a caller that waits on them); returns the parameters.
    ``warm``: the state comes from it instead of ``state``, and is stored only if it says so.
    ``copy``: also store the parameters' read copy (``reads_copies``)."""
    source = warm.state if warm is not None else state
    body = None
    if source is not None:
        got = source[c]
        body = got if isinstance(got, bytes) else got.result()
        if body is None:
            raise FileNotFoundError(f"optimizer state {keys.optim(spec.job, spec.t, spec.stage, *spec.stored(shard, c))} is missing")
    new_p, new_state = step_chunk(spec, shard, c, param, grad, body)
    sent = store_chunk(ch, spec, shard, c, new_p, new_state, params=True, optim=warm is None or warm.store, copy=copy)
    if warm is not None:
        warm.kept[c] = new_state
    if uploads is not None:
        uploads += sent
    return new_p


def step_chunk(
    spec: SyncSpec, shard: int, c: int, param: torch.Tensor, grad: torch.Tensor, body: bytes | None
) -> tuple[torch.Tensor, bytes]:
    """One optimizer step on chunk c of ``shard`` from its state ``body`` (None: no state yet)."""
    a, b = spec.layout[shard][c]
    return apply_update(spec.make_optimizer, param, grad, body, chunk_segments(spec.groups, spec.group_hparams, a, b))


def store_chunk(
    ch: Channel, spec: SyncSpec, shard: int, c: int, p: torch.Tensor, state: bytes, *, params: bool, optim: bool, copy: bool = False
) -> list[Future[None]]:
    """Upload version t+1 of a chunk's parameters (if ``params``; with ``copy`` its read copy too)
    and optimizer state (if ``optim``)."""
    out = []
    if params:
        out.append(ch.submit_put(keys.params(spec.job, spec.t + 1, spec.stage, *spec.stored(shard, c)), {"p": p}))
    if params and copy:
        out.append(ch.submit_put(keys.params_copy(spec.job, spec.t + 1, spec.stage, *spec.stored(shard, c)), {"p": p}))
    if optim and stateful(spec.make_optimizer):
        out.append(ch.submit_put_bytes(keys.optim(spec.job, spec.t + 1, spec.stage, *spec.stored(shard, c)), state))
    return out


def forget_old_version(ch: Channel, spec: SyncSpec, shard: int) -> None:
    """Version t-1 of a shard is no longer read by anyone, unless it is the window's checkpoint
    (whose read copies go all the same: a restart reads the stored version).

    Under HAP (``spec.stale_readers``, planner/hap.py) a non-aggregator computes iteration v on
    version v-1, so a window attempt that starts at v (a restart at its checkpoint, or at the
    latest complete version: lambdas/resumepoint.py; a resumed job) reads version v-1 too. The
    stored parameters are therefore kept one iteration longer: this task deletes those of t-2 (by
    now neither iteration t+1's tasks nor an attempt starting at t or t+1 reads them), never the
    window's first version w nor w-1. The optimizer state of t-1 goes as always."""
    v = spec.t - 1
    if v < 0:
        return
    ks = [keys.params_copy(spec.job, v, spec.stage, *spec.stored(shard, c)) for c in spec.chunks(shard)] if reads_copies(spec) else []
    if v != spec.window_start:
        ks += [keys.optim(spec.job, v, spec.stage, *spec.stored(shard, c)) for c in spec.chunks(shard)]
    old, kept = (v - 1, (spec.window_start, spec.window_start - 1)) if spec.stale_readers else (v, (spec.window_start,))
    if old >= 0 and old not in kept:
        ks += [keys.params(spec.job, old, spec.stage, *spec.stored(shard, c)) for c in spec.chunks(shard)]
    if ks:
        ch.submit_delete(ks)


def reads_copies(spec: SyncSpec) -> bool:
    """Whether the stage's parameters are read through spread read copies (core/keys.py
    ``READ_COPIES_MIN_REPLICAS``; docs/runtime.md "Request rates")."""
    return spec.replicas >= keys.READ_COPIES_MIN_REPLICAS


def _copy_or_stored(ch: Channel, spec: SyncSpec, version: int, k: int, c: int) -> dict[str, torch.Tensor]:
    """A chunk's parameters at ``version`` from its read copy, or, where there is none (version 0,
    a restart's checkpoint, a shard updated in the backward tasks), from the stored version."""
    got = ch.get_tensors(keys.params_copy(spec.job, version, spec.stage, *spec.stored(k, c)))
    return got if got is not None else ch.wait_tensors(keys.params(spec.job, version, spec.stage, *spec.stored(k, c)), spec.deadline)


def gather(ch: Channel, spec: SyncSpec, version: int, have: dict[tuple[int, int], torch.Tensor] | None = None) -> torch.Tensor:
    """The stage's flat parameters at ``version``: every chunk not in ``have``, downloaded in order
    (from the read copies at d >= READ_COPIES_MIN_REPLICAS)."""
    have = have or {}
    copies = reads_copies(spec) and version > 0
    futures = {
        (k, c): ch._submit("down", _copy_or_stored, ch, spec, version, k, c)
        if copies
        else ch.submit_wait(keys.params(spec.job, version, spec.stage, *spec.stored(k, c)), spec.deadline)
        for k in range(spec.shards)
        for c in spec.chunks(k)
        if (k, c) not in have
    }
    parts = []
    for k in range(spec.shards):
        for c in spec.chunks(k):
            parts.append(have[k, c] if (k, c) in have else futures[k, c].result()["p"])
    return torch.cat(parts) if parts else torch.zeros(0)


def read_range(ch: Channel, job: str, stage: int, layout: Layout, version: int, lo: int, hi: int, deadline: float) -> torch.Tensor:
    """Elements [lo, hi) of a stage's flat parameters at ``version``: only the chunks that hold them."""
    parts = []
    for k, chunks in enumerate(layout):
        for c, (a, b) in enumerate(chunks):
            if a < hi and lo < b:
                p = ch.wait_tensors(keys.params(job, version, stage, k, c), deadline)["p"]
                parts.append(p[max(lo, a) - a : min(hi, b) - a])
    return torch.cat(parts) if parts else torch.zeros(0)


# -- streaming the gradient out of the last backward pass -----------------------------------------------
class GradStream:
    """Emits chunks of a stage's flat gradient as soon as the final backward pass has produced them.

    Backward visits layers top-down, so the chunks at the end of the flat vector are final first:
    ``arm`` before the last micro-batch's backward registers post-accumulate-grad hooks, and each
    chunk whose parameters have all been accumulated is emitted at once (to an upload) while the
    lower layers still compute. ``finish`` emits the rest (parameters without a gradient count as
    zero, like ``training.flat_grads``) in the order given.
    """

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        layout: Layout,
        order: Sequence[tuple[int, int]],
        emit: Callable[[int, int, torch.Tensor], None],
        on_arm: Callable[[], None] | None = None,
    ) -> None:
        self.params = list(params)
        self.on_arm = on_arm
        self.layout = layout
        self.order = list(order)
        self.emit = emit
        offs, o = [], 0
        for p in self.params:
            offs.append((o, o + p.numel()))
            o += p.numel()
        self.offsets = offs
        self.pending: dict[tuple[int, int], set[int]] = {}
        self.by_param: dict[int, list[tuple[int, int]]] = {}
        for key in self.order:
            a, b = layout[key[0]][key[1]]
            ps = {i for i, (x, y) in enumerate(offs) if x < b and y > a}
            self.pending[key] = ps
            for i in ps:
                self.by_param.setdefault(i, []).append(key)
        self.emitted: set[tuple[int, int]] = set()
        self.handles: list[torch.utils.hooks.RemovableHandle] = []
        self.armed = False

    def arm(self) -> None:
        self.armed = True
        if self.on_arm is not None:
            self.on_arm()
        for i, p in enumerate(self.params):
            if p.requires_grad:
                hook = functools.partial(self._accumulated, i)
                self.handles.append(p.register_post_accumulate_grad_hook(hook))  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        for key in self.order:  # chunks of no parameter at all (a stage smaller than K)
            if not self.pending[key]:
                self._emit(key)

    def _accumulated(self, i: int, _p: torch.Tensor) -> None:
        for key in self.by_param.get(i, ()):
            pend = self.pending[key]
            pend.discard(i)
            if not pend:
                self._emit(key)

    def chunk(self, key: tuple[int, int]) -> torch.Tensor:
        a, b = self.layout[key[0]][key[1]]
        parts = []
        for i, (x, y) in enumerate(self.offsets):
            if x < b and y > a:
                p = self.params[i]
                g = p.grad.detach().reshape(-1) if p.grad is not None else torch.zeros(p.numel(), dtype=p.dtype)
                parts.append(g[max(a, x) - x : min(b, y) - x])
        if not parts:
            return torch.zeros(0, dtype=self.params[0].dtype if self.params else torch.float32)
        # a view is enough: the gradient stays as it is until the task ends (uploads copy it)
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def _emit(self, key: tuple[int, int]) -> None:
        if key not in self.emitted:
            self.emitted.add(key)
            self.emit(key[0], key[1], self.chunk(key))

    def finish(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
        if not self.armed:  # finished without a backward pass to watch: everything is final now
            self.arm()
        for h in self.handles:
            h.remove()
        self.handles = []
        for key in self.order:
            self._emit(key)


# -- scatter_reduce, k_reduce, all_reduce: backward writes K shards, K sync tasks reduce them -----------
def write_order(spec: SyncSpec) -> list[tuple[int, int]]:
    """Chunks in round order (chunk c of every shard before chunk c+1), as the sync tasks read them."""
    rounds = max(len(spec.layout[k]) for k in range(spec.shards))
    return [(k, c) for c in range(rounds) for k in range(spec.shards) if c < len(spec.layout[k])]


def gradient_writer(ch: Channel, spec: SyncSpec, replica: int) -> Callable[[int, int, torch.Tensor], None]:
    """Where the stream's final chunks go: each to its own object, or (``spec.one_object``) kept
    until the last is final, then all in one object (``one_object_range`` says where each is)."""
    if spec.one_object is not None:
        return _OneObject(ch, spec, replica).emit

    def emit(k: int, c: int, g: torch.Tensor) -> None:
        ch.submit_put(keys.gshard(spec.job, spec.t, spec.stage, replica, k, c), {"g": g})

    return emit


class _OneObject:
    """A replica's gradient as one object: one flat tensor, the shards in shard order (the stage's
    flat order), PUT once the last chunk is final (the stream emits every chunk exactly once)."""

    def __init__(self, ch: Channel, spec: SyncSpec, replica: int) -> None:
        self.ch, self.spec, self.replica = ch, spec, replica
        self.kept: dict[int, torch.Tensor] = {}

    def emit(self, k: int, c: int, g: torch.Tensor) -> None:
        assert c == 0 and g.dtype == self.spec.one_object, "one object: one chunk per shard, of the gradient's dtype"
        self.kept[k] = g
        if len(self.kept) == self.spec.shards:
            flat = torch.cat([self.kept[i].reshape(-1) for i in range(self.spec.shards)])
            body = flat_safetensors("g", flat, ONE_OBJECT_HEADER)
            self.ch.submit_put_bytes(keys.gradient(self.spec.job, self.spec.t, self.spec.stage, self.replica), body)


# A one-object gradient is a safetensors file of one flat tensor whose header is padded to this
# many bytes (``flat_safetensors``): its shard k starts at a known offset, for one ranged GET.
ONE_OBJECT_HEADER = 120


def one_object_range(spec: SyncSpec, shard: int) -> tuple[int, int]:
    """Shard ``shard``'s bytes [start, end) in a replica's one-object gradient (``_OneObject``)."""
    assert spec.one_object is not None
    size = torch.empty(0, dtype=spec.one_object).element_size()
    a, b = spec.layout[shard][0]
    base = 8 + ONE_OBJECT_HEADER
    return base + a * size, base + b * size


WINDOW_EXTRA = 1


@dataclass(frozen=True)
class ShardInputs:
    """What a reducing task sums for each chunk of its shard, and in which order: ``keys(c)`` the
    objects (each ``{"g": tensor}``), ``total`` their sum in the reduction order."""

    keys: Callable[[int], list[str]]
    total: Callable[[Sequence[torch.Tensor]], torch.Tensor]
    count: int  # objects per chunk
    producer: str | None = None  # the metrics key of the one task that writes them (Channel.wait_bytes)
    byte_range: tuple[int, int] | None = None  # each object's part to read (one-object gradients)


def replica_inputs(spec: SyncSpec, shard: int) -> ShardInputs:
    """The d replicas' chunks of ``shard``, summed left to right (``left_fold``); from their
    one-object gradients by ranged GETs when they write one (``spec.one_object``)."""
    if spec.one_object is not None:
        return ShardInputs(
            lambda c: [keys.gradient(spec.job, spec.t, spec.stage, r) for r in range(spec.replicas)],
            left_fold,
            spec.replicas,
            byte_range=one_object_range(spec, shard),
        )
    return ShardInputs(
        lambda c: [keys.gshard(spec.job, spec.t, spec.stage, r, shard, c) for r in range(spec.replicas)],
        left_fold,
        spec.replicas,
    )


def partial_inputs(spec: SyncSpec, shard: int) -> ShardInputs:
    """A hierarchical root's one input per chunk: the chain's last prefix P_{B-1}, already the whole
    left fold g_0 + ... + g_{d-1} of ``shard`` (``reduce_block``)."""
    last = spec.blocks - 1
    return ShardInputs(
        lambda c: [keys.partial(spec.job, spec.t, spec.stage, last, shard, c)],
        left_fold,
        1,
        producer=keys.metrics(spec.job, spec.t, "sync", spec.stage, level1_task(spec, last, shard)),
    )


def reduce_shard(
    ch: Channel,
    spec: SyncSpec,
    shard: int,
    cached: torch.Tensor | None = None,
    held: Sequence[torch.Tensor] | None = None,
    warm: Warm | None = None,
    inputs: ShardInputs | None = None,
) -> list[torch.Tensor]:
    """Sync task (the shard's owner): sum shard ``shard`` chunk by chunk, update it, write version t+1.

    ``inputs``: what it sums — the d replicas' gradients (default), or a hierarchical root's one
    prefix, the chain's last (``partial_inputs``). Chunk c+1 downloads while chunk c is reduced,
    updated and uploaded. The requests go out in
    chunk order with only a chunk's worth (plus one) in flight (``Channel.submit_window``):
    parallel transfers share the link, so requesting everything at once would have every chunk
    (and the optimizer state) arrive together near the end and leave the upload link idle. ``cached``: the stage's flat parameters at version t if this
    container holds them; ``held``: else shard ``shard``'s chunks at version t if it does (a sync
    task's own function updated them last iteration); else they are downloaded. ``warm``: the
    shard's optimizer state is held in this container (none is downloaded). Returns the shard's
    chunks at version t+1.
    """
    inputs = inputs or replica_inputs(spec, shard)
    n = inputs.count
    stateful_opt = spec.t > 0 and stateful(spec.make_optimizer) and warm is None
    params, base = _params_at_t(spec, shard, cached, held)
    per_chunk = n + int(stateful_opt) + int(params is None)
    calls = _shard_requests(ch, spec, shard, inputs, stateful_opt, params is None)
    futures = ch.submit_window(calls, window=per_chunk + WINDOW_EXTRA)
    per = [futures[c * per_chunk : (c + 1) * per_chunk] for c in spec.chunks(shard)]

    def total(c: int) -> torch.Tensor:
        return inputs.total([f.result()["g"] for f in per[c][:n]])

    # clipping needs the whole shard reduced before any chunk updates; else each updates as it comes
    totals = clipped(ch, spec, shard, [total(c) for c in spec.chunks(shard)]) if spec.clip else None
    out = []
    for c, (a, b) in enumerate(spec.layout[shard]):
        got = per[c]
        g = totals[c] if totals is not None else total(c)
        state = {c: got[n]} if stateful_opt else None
        p = params[a - base : b - base] if params is not None else got[-1].result()["p"]
        out.append(update_chunk(ch, spec, shard, c, p, g, state, warm=warm, copy=reads_copies(spec)))
    forget_old_version(ch, spec, shard)
    return out


def _params_at_t(
    spec: SyncSpec, shard: int, cached: torch.Tensor | None, held: Sequence[torch.Tensor] | None
) -> tuple[torch.Tensor | None, int]:
    """Shard ``shard``'s parameters at version t as a vector and where it starts in the stage's
    flat vector: the whole stage's (from 0) if cached, else the held chunks joined (from the
    shard's start); None when they are to be downloaded."""
    if held is None or cached is not None:
        return cached, 0
    joined = torch.cat(list(held)) if held else torch.zeros(0)
    return joined, (spec.layout[shard][0][0] if spec.layout[shard] else 0)


def _shard_requests(
    ch: Channel, spec: SyncSpec, shard: int, inputs: ShardInputs, stateful_opt: bool, download_params: bool
) -> list[Callable[[], Future[Any]]]:
    """A sync task's downloads in chunk order, per chunk: its inputs (the d replicas' gradients or
    the chain's last prefix), then the optimizer state (if one is read from S3), then the
    parameters (if not in this container)."""
    calls: list[Callable[[], Future[Any]]] = []
    for c in spec.chunks(shard):
        if inputs.byte_range is not None and spec.one_object is not None:
            part = inputs.byte_range
            calls += [functools.partial(ch.submit_wait_range, key, part, spec.one_object, spec.deadline) for key in inputs.keys(c)]
        else:
            calls += [functools.partial(ch.submit_wait, key, spec.deadline, inputs.producer) for key in inputs.keys(c)]
        if stateful_opt:
            calls.append(functools.partial(ch.submit_get_bytes, keys.optim(spec.job, spec.t, spec.stage, *spec.stored(shard, c))))
        if download_params:
            calls.append(
                functools.partial(ch.submit_wait, keys.params(spec.job, spec.t, spec.stage, *spec.stored(shard, c)), spec.deadline)
            )
    return calls


# -- hierarchical: a chain of level-1 aggregators per shard, then its root, all in one sync Map ----------
def level1_task(spec: SyncSpec, block: int, shard: int) -> int:
    """The sync task index of the level-1 aggregator of (``block``, ``shard``): after the K roots,
    block by block (``sync_role``)."""
    return spec.shards * (1 + block) + shard


def reduce_block(ch: Channel, spec: SyncSpec, block: int, shard: int) -> None:
    """Level-1 aggregator (block b = ``block``, shard ``shard``), link b of the shard's chain: store
    the running prefix P_b = left_fold([P_{b-1}, g_{bf}, ..., g_{bf+f-1}]) (block 0: the left fold
    of its own f gradients) chunk by chunk, so P_b = g_0 + g_1 + ... + g_{(b+1)f-1} left to right,
    bit for bit the sum plain PyTorch accumulates. Why a chain: a left fold is sequential, so
    blocks summed apart and then added (a tree) would round differently; the chain keeps each
    aggregator at f + 1 inputs per chunk (DiSDeL's fan-in bound on memory and requests in flight)
    and costs one hop per block, pipelined over chunks: the block's gradients download as they
    come (a chunk's worth in flight) while it waits for P_{b-1}'s chunk c (one wait at a time, in
    chunk order, as link b-1 stores them), folds and PUTs P_b's chunk c, then waits for c+1.
    Deletes its partials of iteration t-2 first: nobody reads them now."""
    ranks = spec.block_replicas(block)
    if spec.t >= 2:
        ch.submit_delete([keys.partial(spec.job, spec.t - 2, spec.stage, block, shard, c) for c in spec.chunks(shard)])
    calls = [
        functools.partial(ch.submit_wait, keys.gshard(spec.job, spec.t, spec.stage, r, shard, c), spec.deadline)
        for c in spec.chunks(shard)
        for r in ranks
    ]
    futures = ch.submit_window(calls, window=len(ranks) + WINDOW_EXTRA)
    prefix = _PrefixWaits(ch, spec, block - 1, shard) if block > 0 else None
    for c in spec.chunks(shard):
        parts = [f.result()["g"] for f in futures[c * len(ranks) : (c + 1) * len(ranks)]]
        if prefix is not None:
            parts.insert(0, prefix.take(c))
        ch.submit_put(keys.partial(spec.job, spec.t, spec.stage, block, shard, c), {"g": left_fold(parts)})


class _PrefixWaits:
    """The previous link's prefix P_{block}, chunk by chunk: one wait in flight at a time, for the
    next chunk as soon as the last one arrived (its producer stores them in chunk order), so a
    link polls for one object at a time however many chunks the shard has."""

    def __init__(self, ch: Channel, spec: SyncSpec, block: int, shard: int) -> None:
        self.ch, self.spec, self.block, self.shard = ch, spec, block, shard
        self.producer = keys.metrics(spec.job, spec.t, "sync", spec.stage, level1_task(spec, block, shard))
        self.pending = self._wait(0)

    def _wait(self, c: int) -> Future[dict[str, torch.Tensor]] | None:
        if c >= len(self.spec.layout[self.shard]):
            return None
        key = keys.partial(self.spec.job, self.spec.t, self.spec.stage, self.block, self.shard, c)
        return self.ch.submit_wait(key, self.spec.deadline, self.producer)

    def take(self, c: int) -> torch.Tensor:
        """P_{block}'s chunk c (called for c = 0, 1, ... in order)."""
        if self.pending is None:
            raise ValueError(f"chunk {c} of the prefix was taken out of order or does not exist")
        got = self.pending.result()["g"]
        self.pending = self._wait(c + 1)
        return got


@dataclass(frozen=True)
class ShardOwner:
    """A sync task that reduces shard ``shard`` from ``inputs`` and updates it (``reduce_shard``):
    every sync task of scatter_reduce, k_reduce and all_reduce, and a hierarchical shard's root."""

    shard: int
    inputs: ShardInputs


@dataclass(frozen=True)
class BlockSum:
    """A hierarchical level-1 aggregator: extends the chain's prefix of ``shard`` by ``block``'s
    replicas (``reduce_block``)."""

    block: int
    shard: int


def sync_role(algo: str, spec: SyncSpec, index: int) -> ShardOwner | BlockSum:
    """What sync task ``index`` of a stage's sync Map does (planner/plan.py ``sync_tasks`` counts
    them). Hierarchical with B > 1 blocks: tasks 0..K-1 are the shards' roots (so a root's index is
    its shard, as every owner's is: its warm function, its clipping norm), then the level-1
    aggregators, block by block: task K + b K + k (``level1_task``) is link b of shard k's chain.
    Else task k owns shard k."""
    k = spec.shards
    if algo != "hierarchical" or spec.blocks == 1:
        return ShardOwner(index, replica_inputs(spec, index))
    if index < k:
        return ShardOwner(index, partial_inputs(spec, index))
    block, shard = divmod(index - k, k)
    if block >= spec.blocks:
        raise ValueError(f"sync task {index} does not exist: {k} roots and {k} x {spec.blocks} level-1 aggregators")
    return BlockSum(block, shard)


# -- pipelined_scatter_reduce: fused into backward --------------------------------------------------------
def exchange_order(spec: SyncSpec, replica: int) -> list[tuple[int, int]]:
    """Replica r's uploads: round by round, chunk c of shard r+1, r+2, ... (mod d), then its own."""
    d = spec.replicas
    rounds = max(len(spec.layout[k]) for k in range(spec.shards))
    out = [((replica + i) % d, c) for c in range(rounds) for i in range(1, d) if c < len(spec.layout[(replica + i) % d])]
    return out + [(replica, c) for c in spec.chunks(replica)]


def send_groups(algo: str, replicas: int, layout: Layout, replica: int) -> list[list[tuple[int, int]]]:
    """The objects replica ``replica`` sends its peers in a fused exchange: the chunks of the d-1
    shards the others own, in the stage's flat order, cut into groups of
    ``syncmodel.exchange_group_chunks`` consecutive chunks (one object each, ``keys.gsend``). A
    group is PUT once its last chunk is final; the backward pass finalises the flat vector from
    its end, so each group's chunks become final together, as they would land together as
    separate objects in the uploader's lanes. The groups are cut from the end: the first, final
    last (the first layers' gradients), holds the remainder, so the least waits on it after the pass."""
    sent = [(k, c) for k in range(replicas) if k != replica for c in range(len(layout[k]))]
    size = exchange_group_chunks(algo, replicas, max((len(x) for x in layout), default=1))
    first = len(sent) % size or size
    return [sent[:first]] + [sent[i : i + size] for i in range(first, len(sent), size)] if sent else []


def group_ranges(spec: SyncSpec, group: Sequence[tuple[int, int]], dtype: torch.dtype) -> dict[tuple[int, int], tuple[int, int]]:
    """Each chunk's bytes [start, end) in a group object (``flat_safetensors``, its header padded to
    ``ONE_OBJECT_HEADER``: the data starts at a known offset, no look at the header first)."""
    size, at, out = torch.empty(0, dtype=dtype).element_size(), 8 + ONE_OBJECT_HEADER, {}
    for k, c in group:
        a, b = spec.layout[k][c]
        out[k, c] = (at, at + (b - a) * size)
        at += (b - a) * size
    return out


def sent_keys(algo: str, job: str, t: int, stage: int, replicas: int, layout: Layout, replica: int) -> list[str]:
    """The exchange objects replica ``replica`` wrote at iteration ``t`` (for their deletion)."""
    return [keys.gsend(job, t, stage, replica, g) for g in range(len(send_groups(algo, replicas, layout, replica)))]


class PipelinedExchange:
    """FuncPipe's pipelined scatter-reduce for replica r (K = d, shard r is r's own).

    Use: ``start`` at the beginning of the backward task (prefetches r's optimizer state while the
    task computes), ``stream`` around the final backward pass (uploads chunks as they are final),
    then ``finish`` (reduce, update, upload, gather) returns the flat parameters at version t+1.
    """

    gather_early = True  # queue the gather while reducing (LambdaML's phases: after its own upload)
    algo = "pipelined_scatter_reduce"  # how its chunks are grouped into objects (``send_groups``)

    def __init__(self, ch: Channel, spec: SyncSpec, replica: int, warm: Warm | None = None) -> None:
        if spec.shards != spec.replicas:
            raise ValueError(f"a scatter-reduce in the workers needs K = d shards, got K={spec.shards}, d={spec.replicas}")
        self.ch, self.spec, self.r = ch, spec, replica
        # the objects this replica sends: which group each chunk goes in, and the chunks kept till it is whole
        self.groups = send_groups(self.algo, spec.replicas, spec.layout, replica)
        self.group_of = {key: g for g, keys_ in enumerate(self.groups) for key in keys_}
        self.filling: dict[int, dict[tuple[int, int], torch.Tensor]] = {}
        self.dtype = torch.float32  # the gradient's (the parameters'), set by ``stream``
        self.own: dict[int, torch.Tensor] = {}
        # shard r's optimizer state: held in this container (warm), else prefetched from S3
        self.warm = warm
        self.state = None if warm is not None else prefetch_state(ch, spec, replica)
        self.incoming: dict[tuple[int, int], Future[Any]] = {}
        self.gathered: dict[tuple[int, int], Future[Any]] = {}

    def _download_own(self) -> None:
        """Queue the downloads of chunk c of shard r from every other replica: in the staggered
        order, at step i of a round r reads from the replica r-i."""
        spec, r, d = self.spec, self.r, self.spec.replicas
        sources = [(r - i) % d for i in range(1, d)]
        groups = {src: send_groups(self.algo, d, spec.layout, src) for src in sources}
        self.incoming = {(c, src): self._fetch(src, groups[src], c) for c in spec.chunks(r) for src in sources}

    def _fetch(self, src: int, groups: Sequence[Sequence[tuple[int, int]]], c: int) -> Future[dict[str, torch.Tensor]]:
        """Chunk c of shard r from replica ``src``'s exchange object that holds it (``groups``:
        src's ``send_groups``): one ranged GET, polling until the object exists; an empty chunk
        needs no request."""
        spec = self.spec
        g = next(i for i, group in enumerate(groups) if (self.r, c) in group)
        a, b = group_ranges(spec, groups[g], self.dtype)[self.r, c]
        if a == b:
            done: Future[dict[str, torch.Tensor]] = Future()
            done.set_result({"g": torch.zeros(0, dtype=self.dtype)})
            return done
        return self.ch.submit_wait_range(keys.gsend(spec.job, spec.t, spec.stage, src, g), (a, b), self.dtype, spec.deadline)

    def _download_gathered(self) -> None:
        """Queue the downloads of the other shards' updated chunks (version t+1), round by round."""
        spec, ch, r, d = self.spec, self.ch, self.r, self.spec.replicas
        others = [
            (k, c) for c in range(max(len(x) for x in spec.layout)) for k in ((r + i) % d for i in range(1, d)) if c < len(spec.layout[k])
        ]
        self.gathered = {
            key: ch.submit_wait(keys.params(spec.job, spec.t + 1, spec.stage, *spec.stored(*key)), spec.deadline) for key in others
        }

    def _start_downloads(self) -> None:
        """Queue the exchange's downloads once the last backward pass begins (the peers are at the
        same point): their requests are then in flight as the first chunks land. The gather is
        queued when this replica has updated its first chunk (``_reduce_own``): the peers, at the
        same point, cannot have stored theirs earlier, and a wait started sooner only polls (each
        poll a GET, which the job pays for and a shared S3 endpoint serves)."""
        self._download_own()

    def _send(self, k: int, c: int, g: torch.Tensor) -> Future[None] | None:
        """Chunk c of shard k of this replica's gradient, for k's owner: kept until the rest of its
        group is final, then the group uploaded as one object (its future; None while it fills)."""
        gi = self.group_of[k, c]
        filling = self.filling.setdefault(gi, {})
        filling[k, c] = g
        if len(filling) < len(self.groups[gi]):
            return None
        del self.filling[gi]
        flat = torch.cat([filling[key].reshape(-1) for key in self.groups[gi]])
        if flat.dtype != self.dtype:  # its readers' ranges assume the parameters' dtype
            raise ValueError(f"stage {self.spec.stage}'s gradient is {flat.dtype}, its parameters {self.dtype}: mixed dtypes in one stage")
        key = keys.gsend(self.spec.job, self.spec.t, self.spec.stage, self.r, gi)
        return self.ch.submit_put_bytes(key, flat_safetensors("g", flat, ONE_OBJECT_HEADER))

    def _gradient_dtype(self, params: Sequence[nn.Parameter]) -> None:
        """The exchanged chunks' dtype: the parameters' (``GradStream.chunk``), for the ranged reads."""
        self.dtype = params[0].dtype if params else torch.float32

    def stream(self, params: Sequence[nn.Parameter]) -> GradStream:
        self._gradient_dtype(params)

        def emit(k: int, c: int, g: torch.Tensor) -> None:
            if k == self.r:
                self.own[c] = g
            else:
                self._send(k, c, g)

        return GradStream(params, self.spec.layout, exchange_order(self.spec, self.r), emit, on_arm=self._start_downloads)

    def _reduce_own(self, params_t: torch.Tensor, uploads: list[Future[None]] | None = None) -> dict[tuple[int, int], torch.Tensor]:
        """Sum each chunk of shard r over the replicas in replica order (``left_fold``), update it
        and upload it (version t+1, parameters and state), as soon as its d-1 copies have arrived."""
        spec, ch, r, d = self.spec, self.ch, self.r, self.spec.replicas
        mine = {}

        def total(c: int) -> torch.Tensor:
            return left_fold([self.own[c] if src == r else self.incoming[c, src].result()["g"] for src in range(d)])

        totals = clipped(ch, spec, r, [total(c) for c in spec.chunks(r)]) if spec.clip else None
        for c, (a, b) in enumerate(spec.layout[r]):
            g = totals[c] if totals is not None else total(c)
            mine[r, c] = update_chunk(ch, spec, r, c, params_t[a:b], g, self.state, uploads, self.warm)
            if self.gather_early and not self.gathered:
                self._download_gathered()
        forget_old_version(ch, spec, r)
        return mine

    def _assemble(self, mine: dict[tuple[int, int], torch.Tensor]) -> torch.Tensor:
        """The stage's flat parameters at version t+1: shard r's own chunks and the gathered others."""
        parts = []
        for k in range(self.spec.shards):
            for c in self.spec.chunks(k):
                parts.append(mine[k, c] if k == self.r else self.gathered[k, c].result()["p"])
        return torch.cat(parts)

    def finish(self, params_t: torch.Tensor) -> torch.Tensor:
        if not self.incoming and self.spec.replicas > 1:
            self._start_downloads()
        mine = self._reduce_own(params_t)
        if not self.gathered:  # a shard without chunks
            self._download_gathered()
        return self._assemble(mine)


class LambdaMLExchange(PipelinedExchange):
    """LambdaML's scatter-reduce for replica r: the same shards, objects, reduction order and
    update as ``PipelinedExchange`` (so the same bits), in LambdaML's phases one after another.

    The last backward pass only collects the gradient's chunks; ``finish`` then runs, each phase
    waiting for the previous one to end in this worker: (1) upload the d-1 shards the others own;
    (2) download shard r from the d-1 others and (3) reduce, update and upload it; (4) download
    the others' updated shards. The optimizer-state prefetch still overlaps the compute (as any
    of our algorithms does): LambdaML's own workers hold their state in memory.
    """

    gather_early = False
    algo = "lambdaml_scatter_reduce"

    def stream(self, params: Sequence[nn.Parameter]) -> GradStream:
        self._gradient_dtype(params)
        held: dict[tuple[int, int], torch.Tensor] = {}
        self.held = held
        return GradStream(params, self.spec.layout, exchange_order(self.spec, self.r), lambda k, c, g: held.__setitem__((k, c), g))

    def finish(self, params_t: torch.Tensor) -> torch.Tensor:
        r = self.r
        sent = [self._send(k, c, self.held[k, c]) for k, c in exchange_order(self.spec, r) if k != r]
        results([f for f in sent if f is not None])  # phase 1
        self.own = {c: g for (k, c), g in self.held.items() if k == r}
        self._download_own()
        results(list(self.incoming.values()))  # phase 2: the whole shard has arrived
        uploads: list[Future[None]] = []
        mine = self._reduce_own(params_t, uploads)
        results(uploads)  # phase 3: the updated shard (and its state) is stored
        self._download_gathered()  # phase 4
        return self._assemble(mine)


# the sync algorithms fused into the backward task (planner/plan.py FUSED_SYNC), by name
EXCHANGES: dict[str, type[PipelinedExchange]] = {
    "pipelined_scatter_reduce": PipelinedExchange,
    "lambdaml_scatter_reduce": LambdaMLExchange,
}


# -- d = 1: the backward task updates the whole stage itself ----------------------------------------------
def update_alone(
    ch: Channel, spec: SyncSpec, params_t: torch.Tensor, grad: torch.Tensor, state: list[Future[bytes | None]] | None
) -> torch.Tensor:
    """One replica: no exchange; update every chunk of the single shard and write version t+1."""
    out = [update_chunk(ch, spec, 0, c, params_t[a:b], grad[a:b], state) for c, (a, b) in enumerate(spec.layout[0])]
    forget_old_version(ch, spec, 0)
    return torch.cat(out) if out else torch.zeros(0)


def update_warm(
    ch: Channel,
    spec: SyncSpec,
    params_t: torch.Tensor,
    grad: torch.Tensor,
    held: Sequence[bytes] | list[Future[bytes | None]] | None,
    store_params: bool,
    store_state: bool,
) -> tuple[torch.Tensor, list[bytes]]:
    """One replica, state kept warm (docs/runtime.md "State that stays warm"): update every chunk
    from the optimizer state at version t — in this container's memory (bytes) or downloading
    from the checkpoint (futures) — and upload version t+1 only as asked (a checkpoint, or
    parameters later stages read). Returns the new flat parameters and each chunk's new state."""
    out, states = [], []
    for c, (a, b) in enumerate(spec.layout[0]):
        body: bytes | None = None
        if held is not None:
            got = held[c]
            body = got if isinstance(got, bytes) else got.result()
            if body is None:
                raise FileNotFoundError(f"optimizer state {keys.optim(spec.job, spec.t, spec.stage, *spec.stored(0, c))} is missing")
        new_p, new_state = step_chunk(spec, 0, c, params_t[a:b], grad[a:b], body)
        store_chunk(ch, spec, 0, c, new_p, new_state, params=store_params, optim=store_state)
        out.append(new_p)
        states.append(new_state)
    if store_params and spec.t - 1 != spec.window_start:
        forget_old_version(ch, spec, 0)  # version t-1 exists if it was stored (tied weights' owner)
    return (torch.cat(out) if out else torch.zeros(0)), states
