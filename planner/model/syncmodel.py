"""Gradient synchronisation algorithms as the performance model sees them (the seam).

Each algorithm is a ``SyncAlgorithm`` whose ``stage`` returns a ``StageSync``: the time it adds to
the backward task, the duration of one sync task, the task count, requests and memory. Names equal
the runtime contract's (planner/plan.py ``SYNC_ALGORITHMS``, lambdas/collectives.py implements
them); "none" is the d = 1 case (Plan: scatter_reduce with K = 1, no sync Map). Adding an algorithm
= one class + registering it in ``SYNC_ALGORITHMS``. The derivations are in
docs/performance-model.md §5.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from stagecoach.planner.limits import UPLOADS_IN_FLIGHT
from stagecoach.planner.model.calibration import optimizer_passes
from stagecoach.planner.plan import DEFAULT_FAN_IN, chunk_count, reduction_blocks, stage_chunks, writes_through
from stagecoach.planner.plan import SYNC_ALGORITHMS as RUNTIME_SYNC

if TYPE_CHECKING:  # pragma: no cover
    from stagecoach.planner.model.platforms import Platform


# -- §5 sync algorithms ------------------------------------------------------------------------
@dataclass(frozen=True)
class StageSync:
    """What one stage's synchronisation costs for fixed (d, K) and the stage's parameter bytes.

    tail_s:   seconds the backward task spends after its last micro-batch (writing gradient
              shards; with d = 1 or a fused algorithm also the exchange and the optimizer update).
    task_s:   duration of ONE sync task of the sync Map (0 without a Map).
    tasks:    sync Map tasks (0 = no sync Map: d = 1 or a sync fused into backward).
    shards:   objects the stage's parameters are stored as, K shards x C chunks (a task that must
              load the parameters GETs them all).
    tail_puts/tail_gets: S3 requests per backward task for the sync; task_puts/task_gets: per sync task.
    backward_extra_bytes: memory the sync adds to the backward task; task_bytes: a sync task's memory.
    params_cached: the backward task ends holding version t+1 (d = 1, pipelined scatter-reduce),
              so the next phase's task on that container loads nothing.
    """

    name: str
    k: int
    tail_s: float
    task_s: float
    tasks: int
    shards: int
    tail_puts: float
    tail_gets: float
    task_puts: float
    task_gets: float
    backward_extra_bytes: float = 0.0
    task_bytes: float = 0.0
    params_cached: bool = False

    @classmethod
    def in_backward(
        cls, name: str, k: int, tail_s: float, shards: int, tail_puts: float, tail_gets: float, backward_extra_bytes: float
    ) -> StageSync:
        """A sync the backward tasks run themselves (d = 1's own update, the exchanges fused into
        backward, a parameter server): no sync Map, so no sync task, its time, requests or memory;
        and each backward task ends holding version t+1 (``params_cached``)."""
        return cls(
            name,
            k,
            tail_s=tail_s,
            task_s=0.0,
            tasks=0,
            shards=shards,
            tail_puts=tail_puts,
            tail_gets=tail_gets,
            task_puts=0,
            task_gets=0,
            backward_extra_bytes=backward_extra_bytes,
            params_cached=True,
        )


class SyncAlgorithm:
    """Base of the pluggable sync algorithms."""

    name = "abstract"
    fused = False  # True: no sync Map, the backward tasks synchronise among themselves
    chunks = 0  # the plan's C per shard (Plan.chunks); 0: the size rule (plan.chunk_count)

    def with_chunks(self, chunks: int) -> SyncAlgorithm:
        """This algorithm priced with ``chunks`` per shard (0: the size rule), as a plan naming them runs."""
        if chunks == self.chunks:
            return self
        out = copy.copy(self)
        out.chunks = chunks
        return out

    def chunks_per_shard(self, d: int, k: int, stored_bytes: float) -> int:
        """C of the runtime's layout for this algorithm's chosen ``chunks`` (plan.stage_chunks)."""
        return chunks_per_shard(d, k, stored_bytes, self.chunks)

    def stage(
        self,
        d: int,
        k: int,
        p_bytes: float,
        opt_s: float,
        backward_compute_s: float,
        plat: Platform,
        last_backward_s: float = 0.0,
        master_ratio: float = 1.0,
    ) -> StageSync:  # pragma: no cover
        """The stage's sync for d replicas and K aggregators. ``opt_s``: optimizer compute over the
        whole stage at its tier; ``backward_compute_s``: the backward task's compute seconds (what
        the optimizer-state prefetch hides behind); ``last_backward_s``: the last micro-batch's
        backward pass (what the gradient upload overlaps). ``master_ratio``: stored bytes per
        computed byte (2 under bfloat16): ``p_bytes`` is what the gradients move, the parameters
        and the optimizer state are stored, moved and held as fp32 master copies (``pm`` below)."""
        raise NotImplementedError


# core/keys.py READ_COPIES_MIN_REPLICAS (the planner imports nothing of the core; a test checks they agree)
READ_COPIES_MIN_REPLICAS = 64


# A fold's add, total += g, reads the total and g and writes the total: 3 passes over a chunk, in the
# unit of calibration.py's PASSES_* (our runtime's code, collectives.left_fold).
PASSES_FOLD_ADD = 3


def read_copies(d: int) -> int:
    """1 when an updated chunk is also stored as a read copy for the d replicas to read (d >= 64)."""
    return 1 if d >= READ_COPIES_MIN_REPLICAS else 0


def chunks_per_shard(d: int, k: int, stored_bytes: float, chosen: int = 0) -> int:
    """C of the runtime's layout (plan.stage_chunks), from the stage's stored (fp32) parameter
    bytes and the plan's chosen C (0: the size rule, plan.chunk_count)."""
    return stage_chunks(chosen, stored_bytes / (4 * k), 4, d)


def rule_chunks(d: int, k: int, stored_bytes: float) -> int:
    """C by the size rule alone (plan.chunk_count): the most chunks the planner considers
    (planner/model/chunking.py), each at least MIN_CHUNK_BYTES."""
    return chunk_count(stored_bytes / (4 * k), 4, d)


# A replica's gradient of a small stage goes to S3 as one object, not K shards (docs/runtime.md
# "S3 requests"): every sync task reads its shard of it with one ranged GET
# (https://docs.aws.amazon.com/AmazonS3/latest/API/API_GetObject.html, "Range"), so a backward task
# makes one PUT instead of K. Only where each shard is one chunk and the whole gradient is at most
# this many bytes: the upload then waits for the last backward pass's last chunk (at ~80 MB/s a
# MiB is ~13 ms), where K objects could leave as each shard became final.
ONE_OBJECT_GRADIENT_BYTES = 1 << 20
ONE_OBJECT_SYNC = ("scatter_reduce", "k_reduce", "all_reduce", "hierarchical")


def one_gradient_object(algo: str, k: int, chunks: int, grad_bytes: float, blocks: int = 1) -> bool:
    """Whether each replica writes its gradient of a stage as one object (``ONE_OBJECT_GRADIENT_BYTES``):
    a sync Map whose K > 1 owners read the replicas' gradients themselves (hierarchical: one
    block), one chunk per shard, a small gradient. The runtime (lambdas/jobctx.py) and this model
    decide it by this one function."""
    return algo in ONE_OBJECT_SYNC and blocks == 1 and k > 1 and chunks == 1 and grad_bytes <= ONE_OBJECT_GRADIENT_BYTES


# The fused exchanges (``collectives.PipelinedExchange``) send a peer's chunks not one object each but
# merged, consecutive chunks of the flat gradient (the own shard left out) in one object, which each
# owner reads its chunk of by a ranged GET: the pipelined exchange merges UPLOADS_IN_FLIGHT chunks,
# the group its uploader lands together anyway (its lag in ``PipelinedScatterReduce``), so an object
# is complete as soon as its chunks would have landed; LambdaML's, which uploads only after the
# backward pass, merges them all. The same PUT bytes in fewer PUTs; GETs and the bits unchanged.
def exchange_group_chunks(algo: str, d: int, chunks: int) -> int:
    """How many peer chunks (of the (d-1) C a backward task sends) go in one exchange object. The
    runtime (lambdas/collectives.py ``send_groups``) and this model decide it by this one function."""
    return max(1, (d - 1) * chunks) if algo == "lambdaml_scatter_reduce" else UPLOADS_IN_FLIGHT


def exchange_objects(algo: str, d: int, chunks: int) -> int:
    """The exchange objects a backward task PUTs per iteration (``exchange_group_chunks``)."""
    sent = (d - 1) * chunks
    return -(-sent // exchange_group_chunks(algo, d, chunks))


def _stateful(plat: Platform) -> int:
    return 1 if plat.optimizer_state_ratio > 0 else 0


def _state_share(plat: Platform, shard_bytes: float) -> float:
    """The share of iterations whose optimizer state crosses S3 (docs/runtime.md "State that stays
    warm"): with warm state (``plat.warm_checkpoint_every`` = N > 0) the worker that owns a shard
    holds its state between iterations and loads and stores it once per window checkpoint, 1/N;
    without, every iteration; and every iteration for a shard of at most
    ``WRITE_THROUGH_BYTES`` stored parameter bytes (planner/plan.py ``writes_through``): the
    runtime stores it at every version, and the model charges it as a stored shard; its download,
    which a container that keeps the state skips, is ``_state_reads``'s (until issue 26 charged
    every iteration: one GET per shard too many)."""
    n = plat.warm_checkpoint_every
    return 1.0 / n if n > 0 and not writes_through(shard_bytes) else 1.0


def _state_reads(plat: Platform) -> float:
    """The share of iterations whose optimizer state an updating task GETs: with warm state, only
    a container that does not hold it (a window's checkpoint reloaded), 1/N like its checkpoint,
    also for a shard written through (``_state_share``: it is stored every iteration, and its
    container keeps it, so nothing reads it back); without warm state, every iteration."""
    n = plat.warm_checkpoint_every
    return _stateful(plat) * (1.0 / n if n > 0 else 1.0)


class NoSync(SyncAlgorithm):
    """d = 1: the backward task updates the stage itself (``collectives.update_alone``).

    Its parameters are in memory; the state (rho P) is prefetched while it computes. After the
    backward pass: the update, then PUT parameters and state: opt + t_lat + (1+rho) P/w, plus
    whatever of the prefetch the compute did not hide. The container keeps version t+1.

    With warm state (``plat.warm_checkpoint_every`` = N > 0; ``collectives.update_warm``) the state
    is in memory too and both go to S3 once per N iterations (the window's checkpoint): per
    iteration opt + (t_lat + (1+rho) P/w) / N, and (2 + sf) / N requests (the restart's reload of
    the checkpoint is a fault's cost, not an iteration's). A stage of at most ``WRITE_THROUGH_BYTES``
    stored parameter bytes is written every iteration (``_state_share``): charged as without,
    but for the state's GET, which its container, holding the state, skips (``_state_reads``).
    """

    name = "none"

    def stage(
        self,
        d: int,
        k: int,
        p_bytes: float,
        opt_s: float,
        backward_compute_s: float,
        plat: Platform,
        last_backward_s: float = 0.0,
        master_ratio: float = 1.0,
    ) -> StageSync:
        w, lat, rho = plat.bandwidth_Bps, plat.storage_latency_s, plat.optimizer_state_ratio
        pm = master_ratio * p_bytes
        sf = _stateful(plat)
        store = lat + (1 + rho) * pm / w
        n = plat.warm_checkpoint_every
        if n > 0 and not writes_through(pm):
            return StageSync.in_backward(
                self.name,
                1,
                tail_s=opt_s + store / n,
                shards=1,
                tail_puts=(1 + sf) / n,
                tail_gets=sf / n,
                backward_extra_bytes=p_bytes + 2 * rho * pm,
            )
        prefetch = max(0.0, lat + rho * pm / w - backward_compute_s) if sf else 0.0
        return StageSync.in_backward(
            self.name,
            1,
            tail_s=prefetch + opt_s + store,
            shards=1,
            tail_puts=1 + sf,
            tail_gets=_state_reads(plat),
            backward_extra_bytes=p_bytes + 2 * rho * pm,
        )


class ScatterReduce(SyncAlgorithm):
    """LambdaML's storage scatter-reduce with a sharded update: K = d sync tasks.

    Backward tail: the gradient leaves as K*C chunks while the last backward pass runs, so after it
    max(chunk/w, P/w - g_last) + t_lat remain. Sync task k (``collectives.reduce_shard``): GET its
    state (rho P/K) and chunk c of shard k from each of the d replicas (d P/K in all) while chunk
    c-1 is reduced, updated and PUT, so the download link sets the pace:
    2 t_lat + (d + rho) P/(K w) + the last chunk's update (opt/(KC)) and the uploads left when the
    downloads end: two chunks' (2 (1+rho) chunk/w, one if C = 1) — requests in flight share the
    link, so the last two chunks arrive almost together (the state object of chunk C-2, twice a
    gradient chunk's size under Adam, still shares the link with chunk C-1's).
    Its container holds version t (it ran a backward task), so it does not load the parameters;
    the next phase's tasks do: t_lat + P/w. From d = READ_COPIES_MIN_REPLICAS on, each updated
    chunk is also stored as a read copy (core/keys.py ``params_copy``): one more PUT and chunk up. Memory: incoming chunks (up to d P/K), state and new
    parameters and state: (d + 1 + 2 rho) P/K.
    """

    name = "scatter_reduce"

    def blocks(self, d: int) -> int:
        """The reduction's blocks of replicas: one, but for the hierarchical chain."""
        return 1

    def stage(
        self,
        d: int,
        k: int,
        p_bytes: float,
        opt_s: float,
        backward_compute_s: float,
        plat: Platform,
        last_backward_s: float = 0.0,
        master_ratio: float = 1.0,
    ) -> StageSync:
        w, lat, rho = plat.bandwidth_Bps, plat.storage_latency_s, plat.optimizer_state_ratio
        pm = master_ratio * p_bytes
        c = self.chunks_per_shard(d, k, pm)
        chunk = p_bytes / (k * c)  # a gradient chunk; a parameter chunk is master_ratio times it
        sf = _stateful(plat) * _state_share(plat, pm / k)
        rho_io = rho * _state_share(plat, pm / k)  # the state's bytes that cross S3 per iteration
        one = one_gradient_object(self.name, k, c, p_bytes, self.blocks(d))
        # one object: it leaves after the last backward pass, whole; else chunks leave as they are final
        tail = lat + (p_bytes / w if one else max(chunk / w, p_bytes / w - last_backward_s))
        up = 1 + rho_io + read_copies(d)  # per updated chunk: its parameters, state, read copy
        task = 2 * lat + (d * p_bytes + rho_io * pm) / (k * w) + opt_s / (k * c) + min(2, c) * up * pm / (k * c * w)
        return StageSync(
            self.name,
            k,
            tail_s=tail,
            task_s=task,
            tasks=k,
            shards=k * c,
            tail_puts=1 if one else k * c,
            tail_gets=0,
            task_puts=c * (1 + sf + read_copies(d)),
            task_gets=c * (d + _state_reads(plat)),
            task_bytes=(d * p_bytes + (1 + 2 * rho) * pm) / k,
        )


class KReduce(ScatterReduce):
    """FasDL's K-reduce: K aggregators (1 <= K <= d), each reduces and updates 1/K of the stage."""

    name = "k_reduce"


class AllReduce(ScatterReduce):
    """K = 1: one aggregator reduces and updates the whole stage (parameter-server style)."""

    name = "all_reduce"


class Hierarchical(ScatterReduce):
    """DiSDeL's aggregation service in one sync Map, as a chain per shard (``collectives.reduce_block``,
    ``reduce_shard`` over ``partial_inputs``): K shards, B = ceil(d/f) blocks of f = fan-in replicas.

    With B = 1 it is k_reduce (K roots read the d replicas). Else, per shard k, level-1 link b GETs
    its block's f gradient chunks and (b > 0) the previous link's prefix, folds them left to right
    and PUTs the new prefix (master dtype): every algorithm sums as plain PyTorch does, one left
    fold, which is sequential, so the links form a chain (a tree would round differently). A link
    that is never kept waiting ends, link 0 and link b > 0 (the prefix's chunks come down too), at
        E0 = 2 t_lat + f P/(K w) + min(2, C) chunk_m/w,   E = E0 + P_m/(K w)
    (chunk_m = P_m/(KC), P_m the master bytes). A hop hands a chunk to the next link: the next
    link notices it (a poll, q), GETs it, folds its f gradients into it (f adds of 3 passes over a
    chunk, priced per pass as the optimizer's, whose opt/(KC) is ``optimizer_passes`` passes) and
    PUTs the result:
        hop  = q + 2 (t_lat + chunk_m/w) + 3 f opt/(KC passes)
    Pipelined over chunks (link b folds chunk c while link b-1 folds chunk c+1), only the last
    chunk's hops add, not whole shards': the last link's last PUT is at
        L1   = max(E0 + (B-1) hop, E + (B-2) hop)
    and the root GETs that one prefix (and its state), updates and PUTs:
        root = max(2 t_lat + (1 + rho) P_m/(K w), L1 + q + t_lat + chunk_m/w) + opt/(KC) + min(2, C)(1+rho+copy) chunk_m/w
    The Map runs K (B+1) tasks; each is charged the root's duration (``task_s``: an upper bound for
    the level-1 tasks, which end by L1). Requests (``levels``): replicas PUT d K C, level-1 GET
    (d + B - 1) K C and PUT B K C, roots GET K C (+ state) and PUT K C (+ state, + read copies);
    the next phase GETs the K C updated chunks per replica, as k_reduce's.
    Memory: a level-1 task holds f incoming gradient chunks, the incoming prefix and its own,
    (f P + 2 P_m)/K; a root the prefix, its state and the new parameters and state, (2 + 2 rho) P_m/K.
    """

    name = "hierarchical"

    def __init__(self, fan_in: int = DEFAULT_FAN_IN) -> None:
        self.fan_in = fan_in

    def blocks(self, d: int) -> int:
        return reduction_blocks(d, self.fan_in)

    def stage(
        self,
        d: int,
        k: int,
        p_bytes: float,
        opt_s: float,
        backward_compute_s: float,
        plat: Platform,
        last_backward_s: float = 0.0,
        master_ratio: float = 1.0,
    ) -> StageSync:
        flat = super().stage(d, k, p_bytes, opt_s, backward_compute_s, plat, last_backward_s, master_ratio)
        blocks = reduction_blocks(d, self.fan_in)
        if blocks == 1:
            return flat
        w, lat, rho, q = plat.bandwidth_Bps, plat.storage_latency_s, plat.optimizer_state_ratio, plat.poll_delay_s
        pm = master_ratio * p_bytes
        c = flat.shards // k
        chunk_m = pm / (k * c)
        f = min(self.fan_in, d)
        share = _state_share(plat, pm / k)
        sf, rho_io = _stateful(plat) * share, rho * share
        first = 2 * lat + f * p_bytes / (k * w) + min(2, c) * chunk_m / w  # link 0, never waiting
        later = first + pm / (k * w)  # a link b > 0 downloads the previous prefix too
        fold = PASSES_FOLD_ADD * f * opt_s / (k * c * optimizer_passes(rho))
        hop = q + 2 * (lat + chunk_m / w) + fold
        level1 = max(first + (blocks - 1) * hop, later + (blocks - 2) * hop)
        root = max(2 * lat + (1 + rho_io) * pm / (k * w), level1 + q + lat + chunk_m / w)
        root += opt_s / (k * c) + min(2, c) * (1 + rho_io + read_copies(d)) * chunk_m / w
        tasks = k * (blocks + 1)
        return dataclasses.replace(
            flat,
            task_s=root,
            tasks=tasks,
            task_puts=(blocks * k * c + k * c * (1 + sf + read_copies(d))) / tasks,
            task_gets=((d + blocks - 1) * k * c + k * c * (1 + _state_reads(plat))) / tasks,
            task_bytes=max((f * p_bytes + 2 * pm) / k, (2 + 2 * rho) * pm / k),
        )


class PipelinedScatterReduce(SyncAlgorithm):
    """FuncPipe's pipelined scatter-reduce, fused into the backward task (no sync Map).

    Replica r (``collectives.PipelinedExchange``) uploads the chunks of the d-1 shards the others
    own, E = (d-1) P/(d w) on its upload link, as the last backward pass produces them, and
    downloads its own shard's chunks from the others (E on its download link, after the state
    prefetch that is still running) in the staggered order; it reduces, updates and PUTs each
    chunk of shard r ((1+rho) P/d on the upload link, from the first reduced chunk on), and
    downloads the others' updated chunks (E again), each a group and a latency behind its PUT.
    Chunks handed to the uploader together (UPLOADS_IN_FLIGHT = 4) share the link and land
    together, so the pipeline's lag is a group: a = min(4, (d-1) C) chunks, a' = min(4, C); each
    such group travels as one object (``exchange_group_chunks``), read by ranged GETs, so the lag
    is the same and the PUTs are ceil((d-1) C / 4) + C (1 + state), not (d-1) C + C (1 + state).
    After the backward pass, with u = max(a, E - g_last) the exchange uploads left:
        X   = max(max(prefetch left, t_lat + a) + E, u + t_lat + a)   exchange downloaded
        own = max(u, X - E + a) + (1 + rho) P/(d w)                  r's chunks uploaded
        tail = max(own, X + E, own + t_lat + a') + t_lat + opt/(dC)
    The task ends holding version t+1: the next phase loads nothing. FuncPipe's own model:
    2s/w + (2+n) t_lat. Memory on top of the backward task: the exchanged chunks and the gathered
    vector, (d-1)/d P each, and r's new parameters and state: (2(d-1) + 1 + 2 rho) P/d.
    """

    name = "pipelined_scatter_reduce"
    fused = True

    def stage(
        self,
        d: int,
        k: int,
        p_bytes: float,
        opt_s: float,
        backward_compute_s: float,
        plat: Platform,
        last_backward_s: float = 0.0,
        master_ratio: float = 1.0,
    ) -> StageSync:
        w, lat, rho = plat.bandwidth_Bps, plat.storage_latency_s, plat.optimizer_state_ratio
        pm = master_ratio * p_bytes
        c = self.chunks_per_shard(d, d, pm)
        chunk = p_bytes / (d * c) / w  # seconds of one gradient chunk on a link
        share = _state_share(plat, pm / d)  # warm: the state crosses S3 once per checkpoint
        sf = _stateful(plat) * share
        rho_io = rho * share
        e = (d - 1) * p_bytes / (d * w)  # the gradient exchange, each way
        e_p = master_ratio * e  # the gather of the others' updated (master) parameters
        # the state prefetch (from the task's start) still on the download link
        pf = share * max(0.0, lat + rho * pm / (d * w) - backward_compute_s) if sf else 0.0
        # chunks handed to the uploader together (UPLOADS_IN_FLIGHT of them) share the link and
        # land together: the exchange moves in groups, and its lag is a group, not a chunk
        lag = min(UPLOADS_IN_FLIGHT, (d - 1) * c) * chunk
        own_lag = min(UPLOADS_IN_FLIGHT, c) * master_ratio * chunk
        up_left = max(lag, e - last_backward_s)  # exchange uploads after the last backward pass
        # exchange downloads: behind the prefetch, and never before the peers' uploads landed
        x = max(max(pf, lat + lag) + e, up_left + lat + lag)
        own_start = max(up_left, x - e + lag)  # the first group reduced: r's updated chunks go up
        own_end = own_start + (1 + rho_io) * pm / (d * w)
        gather_end = max(x + e_p, own_end + lat + own_lag)  # the others' updated chunks, a group behind theirs
        tail = max(own_end, gather_end) + lat + opt_s / (d * c)
        polls = plat.polls_while_waiting(lat + chunk, learnt=True)  # a peer's chunk: its PUT latency and bytes
        return StageSync.in_backward(
            self.name,
            d,
            tail_s=tail,
            shards=d * c,
            tail_puts=exchange_objects(self.name, d, c) + c * (1 + sf),
            tail_gets=2 * (d - 1) * c * (1 + polls) + c * _state_reads(plat),
            backward_extra_bytes=((d - 1) * p_bytes + (d + 2 * rho) * pm) / d,
        )


class LambdaMLScatterReduce(SyncAlgorithm):
    """LambdaML's storage scatter-reduce in the workers (FuncPipe §3.3, eq. 1), as our runtime runs
    it (``collectives.LambdaMLExchange``): fused into the backward task, K = d, replica r owns shard
    r, every phase starting when the previous one has ended in this worker.

    After the backward pass (nothing was sent while it ran), with E = (d-1) P/(d w):
        1. upload the d-1 shards the others own                      t_lat + E
        2. download shard r from the d-1 others (a poll behind them)  t_lat + E + q, after what is
           left of the optimizer-state prefetch (pf = max(0, t_lat + rho P/(d w) - m bb))
        3. reduce and update shard r chunk by chunk, uploading each with its state:
           t_lat + max(opt/d + u/C, opt/(dC) + u), u = (1+rho) P/(d w)
        4. download the others' updated shards (a poll behind)          t_lat + E + q
    With plain SGD (rho = 0) that is eq. (1), 3P/w - 2P/(dw) + 4 t_lat, plus two polls and the
    update (opt/d: ZeRO-1, each worker updates its own shard; LambdaML's own workers each update
    their whole replica from the merged gradient — the same bytes on the links, the same bits;
    ``LambdaMLPublishedScatterReduce`` prices that, for LambdaML's measured runs).
    Phase 1 PUTs the (d-1) C chunks as one object (``exchange_group_chunks``), read by ranged GETs.
    The task ends holding version t+1: the next phase loads nothing. Memory as the pipelined
    algorithm's: the exchanged chunks and the gathered vector, and r's new parameters and state.
    """

    name = "lambdaml_scatter_reduce"
    fused = True

    def stage(
        self,
        d: int,
        k: int,
        p_bytes: float,
        opt_s: float,
        backward_compute_s: float,
        plat: Platform,
        last_backward_s: float = 0.0,
        master_ratio: float = 1.0,
    ) -> StageSync:
        w, lat, rho, q = plat.bandwidth_Bps, plat.storage_latency_s, plat.optimizer_state_ratio, plat.poll_delay_s
        pm = master_ratio * p_bytes
        c = self.chunks_per_shard(d, d, pm)
        share = _state_share(plat, pm / d)  # warm: the state crosses S3 once per checkpoint
        sf = _stateful(plat) * share
        e = (d - 1) * p_bytes / (d * w)  # gradients
        pf = share * max(0.0, lat + rho * pm / (d * w) - backward_compute_s) if sf else 0.0
        up = lat + e  # phase 1
        down = max(up, pf) + lat + e + q  # phase 2
        u = (1 + rho * share) * pm / (d * w)
        own = lat + max(opt_s / d + u / c, opt_s / (d * c) + u)  # phase 3
        tail = down + own + lat + master_ratio * e + q  # phase 4: the others' master parameters
        polls = plat.polls_while_waiting(q, learnt=True)
        return StageSync.in_backward(
            self.name,
            d,
            tail_s=tail,
            shards=d * c,
            tail_puts=exchange_objects(self.name, d, c) + c * (1 + sf),
            tail_gets=2 * (d - 1) * c * (1 + polls) + c * _state_reads(plat),
            backward_extra_bytes=((d - 1) * p_bytes + (d + 2 * rho) * pm) / d,
        )


# -- the measured systems' algorithms, for the model only (not run by our runtime) ------------------
# They train in fp32 as their papers measured them: ``master_ratio`` does not apply (their merged
# splits are gradients; every worker updates its own replica).
class LambdaMLPublishedScatterReduce(SyncAlgorithm):
    """LambdaML's storage scatter-reduce as LambdaML's own workers run it (FuncPipe §3.3, eq. 1).

    The phases of ``LambdaMLScatterReduce`` with LambdaML's update: every worker updates its whole
    replica from the merged gradient (opt, not opt/d) and keeps its optimizer state in memory
    (LambdaML's workers live through the job). In all 3P/w - 2P/(dw) + 4 t_lat + 2q + opt: eq. (1)
    plus two polls and the update. Prices LambdaML's measured runs (benchmarks/paper_tables.py),
    next to FuncPipe's published schedule, which updates whole replicas too; the LambdaML baseline
    runs the runtime's ``lambdaml_scatter_reduce``.
    """

    name = "lambdaml_published_scatter_reduce"
    fused = True

    def stage(
        self,
        d: int,
        k: int,
        p_bytes: float,
        opt_s: float,
        backward_compute_s: float,
        plat: Platform,
        last_backward_s: float = 0.0,
        master_ratio: float = 1.0,
    ) -> StageSync:
        w, lat, rho, q = plat.bandwidth_Bps, plat.storage_latency_s, plat.optimizer_state_ratio, plat.poll_delay_s
        e = (d - 1) * p_bytes / (d * w)
        tail = (lat + e) + (lat + e + q) + (lat + p_bytes / (d * w)) + (lat + e + q) + opt_s
        polls = plat.polls_while_waiting(q)
        return StageSync.in_backward(
            self.name,
            d,
            tail_s=tail,
            shards=d,
            tail_puts=d,
            tail_gets=2 * (d - 1) * (1 + polls),
            backward_extra_bytes=(2 * (d - 1) + 1) * p_bytes / d + rho * p_bytes,  # the state stays in the worker
        )


class FuncPipePublishedScatterReduce(LambdaMLPublishedScatterReduce):
    """FuncPipe's pipelined scatter-reduce as its paper runs it (§3.3, eq. 2), after the backward pass.

    n = d steps of t_lat + P/(d w) each (step 1 uploads a split, steps 2..n-1 upload one and download
    one at once, step n downloads), the first download a poll behind its peer's upload; the merged
    split is exchanged as in LambdaML's phase 3 (t_lat + P/(d w), then t_lat + E + q) and the
    replica updated (opt). In all 2P/w + (d+2) t_lat + 2q + opt: eq. (2) plus two polls and the update.
    Our runtime's ``pipelined_scatter_reduce`` streams chunks from the last backward pass on and
    overlaps the gather with the reduction: a different schedule of the same bytes.
    """

    name = "funcpipe_scatter_reduce"

    def stage(
        self,
        d: int,
        k: int,
        p_bytes: float,
        opt_s: float,
        backward_compute_s: float,
        plat: Platform,
        last_backward_s: float = 0.0,
        master_ratio: float = 1.0,
    ) -> StageSync:
        base = super().stage(d, k, p_bytes, opt_s, backward_compute_s, plat, last_backward_s)
        w, lat, q = plat.bandwidth_Bps, plat.storage_latency_s, plat.poll_delay_s
        e = (d - 1) * p_bytes / (d * w)
        tail = d * (lat + p_bytes / (d * w)) + q + (lat + p_bytes / (d * w)) + (lat + e + q) + opt_s
        return dataclasses.replace(base, name=self.name, tail_s=tail)


class ParameterServer(SyncAlgorithm):
    """HybridPS (FuncPipe §5.1, after Cirrus): the workers push their gradients to a parameter-server
    VM and pull the updated parameters, over TCP, no S3. Each direction moves P per worker on its own
    link (w) and d P through the server's NIC: t_lat + max(P/w, d P/W_ps), twice; the server's update
    is not on the workers' clock. FuncPipe's server: one c5.9xlarge (36 vCPUs; "10 Gigabit", AWS
    DescribeInstanceTypes). The server's price is the baseline's to add (baselines/classic.py)."""

    name = "parameter_server"
    fused = True
    server_Bps = 10e9 / 8  # c5.9xlarge network performance, 10 Gbit/s

    def stage(
        self,
        d: int,
        k: int,
        p_bytes: float,
        opt_s: float,
        backward_compute_s: float,
        plat: Platform,
        last_backward_s: float = 0.0,
        master_ratio: float = 1.0,
    ) -> StageSync:
        w, lat = plat.bandwidth_Bps, plat.storage_latency_s
        one_way = lat + max(p_bytes / w, d * p_bytes / self.server_Bps)
        return StageSync.in_backward(
            self.name,
            1,
            tail_s=2 * one_way,
            shards=1,
            tail_puts=0,
            tail_gets=0,
            backward_extra_bytes=p_bytes,
        )


# Priced for comparisons with the measured systems, never searched or emitted (not in ALL_SYNC; a
# Plan refuses them): the seam admits them like any other algorithm.
MODEL_ONLY_SYNC: dict[str, SyncAlgorithm] = {
    a.name: a for a in (LambdaMLPublishedScatterReduce(), FuncPipePublishedScatterReduce(), ParameterServer())
}


SYNC_ALGORITHMS: dict[str, SyncAlgorithm] = {
    a.name: a
    for a in (NoSync(), ScatterReduce(), PipelinedScatterReduce(), KReduce(), AllReduce(), LambdaMLScatterReduce(), Hierarchical())
}
# The names come from the runtime contract (planner/plan.py); this model prices exactly those, plus
# "none" (d = 1). Listed in the search's order, which breaks ties between equal-cost plans.
ALL_SYNC: tuple[str, ...] = tuple(name for name in SYNC_ALGORITHMS if name != "none")
if set(ALL_SYNC) != set(RUNTIME_SYNC):
    raise ImportError(f"the performance model prices {sorted(ALL_SYNC)} but the runtime runs {sorted(RUNTIME_SYNC)}")


@dataclass(frozen=True)
class SyncChoice:
    """An algorithm, its number of aggregators/shards K and (hierarchical) its fan-in: a plan's
    fan-in other than the default changes the chain the model prices."""

    algo: str
    k: int
    fan_in: int = DEFAULT_FAN_IN
    chunks: int = 0  # Plan.chunks: C per shard; 0 = the size rule (plan.chunk_count)

    def label(self) -> str:
        if self.algo == "hierarchical" and self.fan_in != DEFAULT_FAN_IN:
            return f"{self.algo}(K={self.k}, fan_in={self.fan_in})"
        return f"{self.algo}(K={self.k})" if self.algo in ("k_reduce", "hierarchical") else self.algo

    @property
    def algorithm(self) -> SyncAlgorithm:
        if self.algo == "hierarchical" and self.fan_in != DEFAULT_FAN_IN:
            return Hierarchical(self.fan_in).with_chunks(self.chunks)
        if self.algo in SYNC_ALGORITHMS:
            return SYNC_ALGORITHMS[self.algo].with_chunks(self.chunks)
        if self.algo in MODEL_ONLY_SYNC:
            return MODEL_ONLY_SYNC[self.algo]
        raise ValueError(f"unknown sync algorithm {self.algo!r}: choose one of {sorted(SYNC_ALGORITHMS)}")

    def plan_fields(self) -> tuple[str, int]:
        """(Plan.sync, Plan.aggregators) for this choice; "none" (d = 1) is scatter_reduce, K = 1."""
        if self.algo in MODEL_ONLY_SYNC:
            raise ValueError(f"{self.algo} is priced by the model only; the runtime does not run it")
        return ("scatter_reduce", 1) if self.algo == "none" else (self.algo, self.k)


def sync_choices(d: int, algos: Sequence[str] | None = None) -> list[SyncChoice]:
    """The candidate sync choices for d replicas (K-reduce: K a power of two, 2 <= K < d)."""
    if d == 1:
        return [SyncChoice("none", 1)]
    algos = algos or ALL_SYNC
    out: list[SyncChoice] = []
    for a in algos:
        if a in ("scatter_reduce", "pipelined_scatter_reduce", "lambdaml_scatter_reduce"):
            out.append(SyncChoice(a, d))
        elif a == "all_reduce":
            out.append(SyncChoice(a, 1))
        elif a == "k_reduce":
            k = 2
            while k < d:
                out.append(SyncChoice(a, k))
                k *= 2
        elif a == "hierarchical":
            out += _tree_choices(d)
        else:
            raise ValueError(f"unknown sync algorithm {a!r}: choose from {ALL_SYNC}")
    return out


def _tree_choices(d: int) -> list[SyncChoice]:
    """The hierarchical sync's candidates at the plan's default fan-in (the one the Plan the
    solver writes gets): none while d fits one block (then it is k_reduce, already a candidate),
    else K = f/4, f/2 and f (the plan's default), so a level-1 aggregator moves about 4, 2 or 1
    stage's worth of gradient."""
    f = DEFAULT_FAN_IN
    if reduction_blocks(d, f) == 1:
        return []
    return [SyncChoice("hierarchical", k) for k in sorted({max(1, f // 4), max(1, f // 2), f}) if k <= d]


# -- S3 requests per iteration, by level (benchmarks/sync_requests.py; docs/performance-model.md §5) ----
@dataclass(frozen=True)
class Requests:
    puts: float
    gets: float


@dataclass(frozen=True)
class SyncRequests:
    """One stage's S3 requests of one iteration's sync, by who makes them, and their price.

    levels: "replicas" (the backward tasks' gradient shards), "sync tasks" (a flat sync Map),
    "level-1" and "roots" (the hierarchical chain), "gather" (the next phase's tasks GET the updated
    chunks), "fused" (an exchange among the backward tasks). Polls (GETs of an object not yet there)
    are not counted: the job's waiting workers make at most JOB_POLL_BUDGET_PER_S together."""

    algo: str
    d: int
    k: int
    chunks: int
    levels: dict[str, Requests]
    usd: float

    @property
    def puts(self) -> float:
        return sum(r.puts for r in self.levels.values())

    @property
    def gets(self) -> float:
        return sum(r.gets for r in self.levels.values())


def sync_requests(choice: SyncChoice, d: int, p_bytes: float, plat: Platform, master_ratio: float = 1.0) -> SyncRequests:
    """S3 requests per iteration of one stage of ``p_bytes`` synchronised by ``choice`` at d
    replicas, from the same ``StageSync`` counts the performance model charges, split by level."""
    algo = choice.algorithm
    sy = algo.stage(d, choice.k, p_bytes, 0.0, 0.0, plat, master_ratio=master_ratio)
    c = sy.shards // max(1, sy.k)
    replicas = Requests(d * sy.tail_puts, d * sy.tail_gets)
    if sy.tasks == 0:
        levels = {"fused": replicas}
    elif isinstance(algo, Hierarchical) and reduction_blocks(d, algo.fan_in) > 1:
        b, k = reduction_blocks(d, algo.fan_in), sy.k
        level1 = Requests(b * k * c, (d + b - 1) * k * c)  # its block's gradients and the previous link's prefix
        roots = Requests(sy.tasks * sy.task_puts - level1.puts, sy.tasks * sy.task_gets - level1.gets)
        levels = {"replicas": replicas, "level-1": level1, "roots": roots, "gather": Requests(0, d * sy.shards)}
    else:
        tasks = Requests(sy.tasks * sy.task_puts, sy.tasks * sy.task_gets)
        levels = {"replicas": replicas, "sync tasks": tasks, "gather": Requests(0, d * sy.shards)}
    usd = sum(r.puts * plat.price_put + r.gets * plat.price_get for r in levels.values())
    return SyncRequests(algo.name, d, sy.k, c, levels, usd)
