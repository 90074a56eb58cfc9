"""Performance and cost model of Stagecoach's own runtime (docs/runtime.md "States"; formulas in docs/performance-model.md).

One iteration = Forward phase (a Parallel with one branch per stage 0..S-2, each a Map of its d
forward tasks; the last stage's forward runs inside its backward) followed by Backward+Sync (a
Parallel with one branch per stage: a Map of backward tasks over the d replicas, then, for the
sync algorithms that have one, a Map of K sync tasks). A Map of more than GROUP_SIZE tasks runs
them in groups of child executions (planner/limits.py map_groups; §3.5). Workers exchange micro-batch tensors through S3, so the stages of a phase form a flow
shop: a stage starts micro-batch j when its predecessor wrote j and it finished j-1. The
derivation of every formula is in docs/performance-model.md; the section names below match it.

Everything a stage contributes depends only on the stage itself (its layers, tier, sync choice)
and on (d, b, m): ``stage_terms`` computes it. ``evaluate`` composes the stages (flow-shop maxima
and sums, billing, requests); the MILP (milp.py) precomputes ``stage_terms`` for every candidate
stage and composes them linearly, so the two cannot drift apart.

The sync algorithm is a seam: each algorithm is a ``SyncAlgorithm`` whose ``stage`` returns a
``StageSync`` (time it adds to the backward task, duration of one sync task, task count, requests,
memory). Names equal the runtime contract's (planner/plan.py ``SYNC_ALGORITHMS``); "none" is the
d = 1 case (Plan: scatter_reduce with K = 1, no sync Map). Adding an algorithm = one class +
registering it in ``SYNC_ALGORITHMS``.

All times in seconds, sizes in bytes, money in USD.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from stagecoach.planner.limits import GROUP_SIZE, LAMBDA_MAX_TIMEOUT_S, concurrency_refusal, map_groups, map_transitions, scaling_ramp_s
from stagecoach.planner.model.calibration import optimizer_seconds
from stagecoach.planner.model.syncmodel import ALL_SYNC, SYNC_ALGORITHMS, StageSync, SyncAlgorithm, SyncChoice, sync_choices  # noqa: F401 (re-exported)
from stagecoach.planner.plan import data_resident, timeouts_from
from stagecoach.planner.profile.layers import LayerProfile, ModelProfile

if TYPE_CHECKING:  # pragma: no cover
    from stagecoach.planner.model.platforms import Platform

# Step Functions state transitions of the emitted ASL (planner/emit/asl.py is the authority; these
# mirror its shape: a Map costs its own state plus one Task per iteration, a Parallel its state).
TRANSITIONS_PER_ITERATION = 3  # the window's per-iteration bookkeeping states (Gate Task, Go? Choice, Advance Pass)
TRANSITIONS_PER_MAP = 1
TRANSITIONS_PER_PARALLEL = 1
TRANSITIONS_PER_TASK = 1
# A Map's own: its state, a Task per task, and in groups each group's (limits.map_transitions).


# -- configurations ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Config:
    """One candidate plan over a (possibly merged) profile's layers."""

    balance: tuple[int, ...]
    tiers_mb: tuple[int, ...]
    replicas: int
    micro_batch: int  # samples per micro-batch
    micro_batches: int  # micro-batches per replica per iteration
    sync: tuple[SyncChoice, ...]

    @property
    def stages(self) -> int:
        return len(self.balance)

    @property
    def global_batch(self) -> int:
        return self.replicas * self.micro_batch * self.micro_batches


@dataclass
class Estimate:
    """Everything the model predicts for one iteration of a Config."""

    config: Config
    time_s: float
    cost: float
    forward_s: float
    backward_sync_s: float
    stage_forward_s: list[float]  # forward task durations (billed), 0 for the last stage
    stage_backward_s: list[float]  # backward task durations (a fused sync included)
    stage_sync_s: list[float]  # one sync task's duration (0 without a sync Map)
    stage_memory_bytes: list[float]
    cost_lambda_duration: float
    cost_lambda_requests: float
    cost_transitions: float
    cost_s3: float
    transitions: float
    invocations: float
    s3_puts: float
    s3_gets: float
    feasible: bool
    violations: list[str] = field(default_factory=list)
    cold_ramp_s: float = 0.0  # §3.5: what a cold iteration adds while Lambda scales the functions

    @property
    def orchestration_share(self) -> float:
        """Share of the cost that is not Lambda compute time: Step Functions, invocations, S3."""
        return (self.cost_transitions + self.cost_lambda_requests + self.cost_s3) / self.cost if self.cost else 0.0

    def task_seconds(self) -> list[dict[str, float]]:
        """Per stage, per phase predicted task seconds (Plan.prediction.task_s)."""
        return [{"forward": f, "backward": b, "sync": s} for f, b, s in zip(self.stage_forward_s, self.stage_backward_s, self.stage_sync_s)]


# -- §2 memory, §3 per-stage terms ---------------------------------------------------------------
def param_copies(replicas: int, plat: Platform) -> float:
    """Parameter-sized buffers every backward task holds: weights, gradients, the flat gradient
    copy (the sync algorithm adds its own buffers: ``StageSync.backward_extra_bytes``)."""
    return 3.0


@dataclass(frozen=True)
class StageTerms:
    """Everything one stage contributes, independent of the other stages (docs §2-§5)."""

    p_bytes: float
    load_s: float  # GET the stage's parameter shards: t_lat + P/w (0 if the sync left them cached)
    fwd_step_s: float  # a_s: how long one micro-batch occupies the forward task (0 for the last stage)
    bwd_step_s: float  # bb_s: ... the backward task
    fwd_hop_s: float  # h_s: from the stage's last compute of a micro-batch to the next stage noticing it
    fwd_hop_own_s: float  # ... to the PUT's end (what ends the stage's own task)
    bwd_hop_s: float  # the backward counterpart (input-gradient to stage s-1)
    bwd_hop_own_s: float
    fwd_compute_s: float  # f_s (one micro-batch)
    bwd_compute_s: float  # f_s + g_s (recompute + backward, one micro-batch)
    sync: StageSync
    memory_bytes: float
    gets: float  # S3 requests of all the stage's tasks
    puts: float
    invocations: float
    transitions: float  # the stage's own states (forward tasks, backward Map, sync Map)
    backward_memory_bytes: float = 0.0  # the backward task's peak alone (memory_bytes: the stage's largest)
    get_in_s: float = 0.0  # one micro-batch's input GET, t_lat + in/w (stage 0: 0 unless the data set streams)


@dataclass(frozen=True)
class _MicroBatchIo:
    """What one micro-batch of a stage moves (bytes of a micro-batch) and waits for: the forward
    and backward steps and the request counts all read these, so each is computed once."""

    in_b: float  # its input
    out_b: float  # its output
    ig_b: float  # its input's gradient (sent back)
    og_b: float  # its output's gradient (received)
    get_in: float  # the input's GET: t_lat + in/w (stage 0: 0 unless the data set streams)
    get_labels: float  # the last stage's targets, read by ranged GETs when the data set streams
    prefetch: bool  # the stage downloads its next input while it computes


def _micro_batch_io(
    in_ps: float,
    out_ps: float,
    ingrad_ps: float,
    outgrad_ps: float | None,
    label_ps: float,
    first: bool,
    last: bool,
    b: int,
    data_streamed: bool,
    plat: Platform,
) -> _MicroBatchIo:
    """A stage's per-micro-batch transfers (per-sample bytes times b; see ``stage_terms``)."""
    w, lat = plat.bandwidth_Bps, plat.storage_latency_s
    in_b, out_b, ig_b = b * in_ps, b * out_ps, b * ingrad_ps
    # a first stage reading its samples from a streamed data set pays a GET round and their bytes
    get_in = (lat + in_b / w if data_streamed else 0.0) if first else lat + in_b / w
    get_labels = lat + b * label_ps / w if (last and data_streamed) else 0.0
    # our runtime's stages that read their input from S3 download the next micro-batch's while
    # this one computes (lambdas/phases.py; docs/performance-model.md §3.1-§3.2)
    prefetch = plat.recompute_forward and not first
    og_b = out_b if outgrad_ps is None else b * outgrad_ps  # ids and masks get no gradient back
    return _MicroBatchIo(in_b, out_b, ig_b, og_b, get_in, get_labels, prefetch)


def _forward_step(io: _MicroBatchIo, fwd_s: float, last: bool, plat: Platform) -> tuple[float, float, float]:
    """§3.1: (a_s, h_s, h_s up to the PUT's end) of a forward task; the last stage has none (0).

    A prefetching step occupies the task for the longer of its compute, its input's GET and its
    output's PUT, and the first micro-batch's GET, which nothing hides, is paid once, folded into
    the stage's hop (so the flow-shop sums and the MILP's linear composition stay as they were)."""
    w, lat, poll = plat.bandwidth_Bps, plat.storage_latency_s, plat.poll_delay_s
    a_first = 0.0 if last else max(io.get_in + fwd_s, io.out_b / w)
    a = max(fwd_s, io.get_in, io.out_b / w) if (io.prefetch and not last) else a_first
    ha_own = 0.0 if last else lat + io.out_b / w + (a_first - a)
    ha = 0.0 if last else ha_own + poll
    return a, ha, ha_own


def _backward_step(io: _MicroBatchIo, fwd_s: float, bwd_s: float, first: bool, last: bool, plat: Platform) -> tuple[float, float, float]:
    """§3.2: (bb_s, hb_s, hb_s up to the PUT's end) of a backward task. It re-reads its input and
    recomputes the forward (GPipe); the last stage runs its only forward here; a runtime that
    keeps activations (recompute_forward=False) does neither."""
    w, lat, poll = plat.bandwidth_Bps, plat.storage_latency_s, plat.poll_delay_s
    get_in, get_labels, in_b, og_b, ig_b = io.get_in, io.get_labels, io.in_b, io.og_b, io.ig_b
    get_out = 0.0 if last else lat + og_b / w
    if io.prefetch and not last:
        # a middle stage downloads the next micro-batch's input while this one waits for its
        # output's gradient and computes (lambdas/phases.py backward): the re-read adds no request
        # latency, only its bytes on the download link beside the gradient's
        bb = max(get_out + fwd_s + bwd_s, get_in, (in_b + og_b) / w, ig_b / w)
    elif io.prefetch:
        # the last stage's inputs are in S3 since the forward phase: the next one downloads while
        # this one computes; the first one's GET is paid once (folded into the stage's hop)
        bb = max(get_labels + fwd_s + bwd_s, get_in, ig_b / w)
    else:
        redo = get_in + get_labels + fwd_s if (last or plat.recompute_forward) else get_labels
        bb = max(get_out + redo + bwd_s, 0.0 if first else ig_b / w)
    hb_own = 0.0 if first else lat + ig_b / w
    if io.prefetch and last:  # the first micro-batch's input: its GET starts after the parameter load
        hb_own += max(get_in + get_labels + fwd_s + bwd_s, ig_b / w) - bb
    hb = 0.0 if first else hb_own + poll
    return bb, hb, hb_own


def _parameter_load(sy: StageSync, p_bytes: float, master_ratio: float, plat: Platform) -> tuple[float, int]:
    """(l_s, the shard GETs of a task that loads the parameters). A sync that leaves version t+1
    in the backward task's container (d = 1, pipelined scatter-reduce) spares the next phase's
    task of the stage its parameter load and GETs."""
    cached = bool(getattr(sy, "params_cached", False))
    load = 0.0 if cached else plat.storage_latency_s + master_ratio * p_bytes / plat.bandwidth_Bps
    return load, 0 if cached else sy.shards


def _stage_memory(
    p_bytes: float,
    saved_ps: float,
    in_ps: float,
    out_ps: float,
    buffer_bytes: float,
    build_bytes: float,
    master_ratio: float,
    last: bool,
    d: int,
    b: int,
    m: int,
    sy: StageSync,
    plat: Platform,
) -> tuple[float, float]:
    """§2: (the backward task's peak, the stage's peak). What a container holds: only its stage,
    built on the meta device; a sync task runs in a warm container of the stage's function, which
    still holds the stage's parameters and the gradients its backward task left (2 P) beside the
    sync's buffers."""
    # one micro-batch's recomputed activations (GPipe); all m micro-batches' without recompute
    act = b * (saved_ps * (1 if (last or plat.recompute_forward) else m) + 2 * in_ps + 2 * out_ps)
    backward = (param_copies(d, plat) + master_ratio - 1) * p_bytes + buffer_bytes + act + sy.backward_extra_bytes
    sync = 2 * p_bytes + buffer_bytes + sy.task_bytes if sy.tasks else 0.0
    return backward, max(backward, sync, build_bytes)


def _stage_requests(
    io: _MicroBatchIo,
    fwd_s: float,
    first: bool,
    last: bool,
    d: int,
    b: int,
    m: int,
    shard_gets: int,
    sy: StageSync,
    data_streamed: bool,
    plat: Platform,
) -> tuple[float, float, float, float]:
    """§4.2-§4.4: (S3 GETs, S3 PUTs, invocations, transitions) of all the stage's tasks."""
    w, lat, poll = plat.bandwidth_Bps, plat.storage_latency_s, plat.poll_delay_s
    # while a micro-batch's input (or its output's gradient) is on its way from the neighbour, the
    # waiter polls for it: the neighbour's PUT latency and bytes, and the poll that notices it
    # (prefetching, a forward task asks for the next input a compute earlier)
    # (a hand-off's wait recurs every iteration: the runtime's warm workers sleep most of it, learnt)
    poll_in = plat.polls_while_waiting(lat + io.in_b / w + poll + (fwd_s if io.prefetch else 0.0), learnt=True)
    poll_back = plat.polls_while_waiting(lat + io.og_b / w + poll, learnt=True)
    gets = puts = 0.0
    # the first stage's inputs are its rows of the data set, in the container (or streamed: below),
    # not GETs; the last stage's targets likewise; every other input is a GET per micro-batch
    inputs = 0 if first else m
    if not last:  # forward task per replica: parameter shards, m inputs (+ waits), m outputs
        gets += d * (shard_gets + inputs + (0 if first else m * poll_in))
        puts += d * m
    # backward task per replica: its inputs again, its output's gradients (+ waits)
    gets += d * (inputs + (0 if last else m + m * poll_back) + (shard_gets if last else 0) + sy.tail_gets)
    puts += d * ((0 if first else m) + sy.tail_puts)
    gets += sy.tasks * sy.task_gets
    if data_streamed:  # one ranged GET per sample: inputs in the first stage's tasks, targets in the last's
        samples = d * m * b
        gets += samples * (((0 if last else 1) + 1 if first else 0) + (1 if last else 0))
    puts += sy.tasks * sy.task_puts
    inv = (0 if last else d) + d + sy.tasks
    # the stage's forward Map (a branch of Forward's Parallel), its backward Map, its sync Map
    tr = (0 if last else map_transitions(d)) + map_transitions(d) + (map_transitions(sy.tasks) if sy.tasks else 0)
    return gets, puts, inv, tr


def stage_terms(
    p_bytes: float,
    fwd_s: float,
    bwd_s: float,
    saved_ps: float,
    in_ps: float,
    out_ps: float,
    ingrad_ps: float,
    label_ps: float,
    first: bool,
    last: bool,
    tier_mb: int,
    choice: SyncChoice,
    d: int,
    b: int,
    m: int,
    plat: Platform,
    buffer_bytes: float = 0.0,
    build_bytes: float = 0.0,
    outgrad_ps: float | None = None,
    data_streamed: bool = False,
    master_ratio: float = 1.0,
) -> StageTerms:
    """One stage's terms from its aggregated layer facts (sums over its layers; in/ingrad of its
    first layer, out of its last; per-sample bytes; ``fwd_s``/``bwd_s`` one micro-batch at the tier).
    ``p_bytes``: the stage's parameters that train — synced, updated, loaded per version, given
    optimizer state; ``buffer_bytes``: what it holds and never trains, its buffers and frozen
    parameters (LayerProfile.buffer_bytes: no sync, no state, one copy); ``build_bytes``: what any container of the job allocates
    to build its stage (ModelProfile.build_bytes: the whole model under the full build, else 0).
    ``outgrad_ps``: the bytes of the output's gradient per sample (its floating leaves; default all
    of the output). ``data_streamed``: the training set is too large to keep (planner/plan.py
    data_resident), so the first stage reads each micro-batch's inputs and the last its targets by
    ranged GETs, one per sample, all of a micro-batch's at once (else they read the set once per
    container, which this model does not charge). ``master_ratio``: stored parameter bytes per
    computed parameter byte (2 under bfloat16: fp32 master weights), for the parameter loads and
    the master copy a container holds.

    Per micro-batch a task GETs what it needs (waiting for it), computes, and PUTs its result in
    the background while the next micro-batch computes (docs/performance-model.md §3): a step
    occupies the task for its GETs and compute, or for its PUT if the upload is the longer; the
    result reaches the neighbour stage a hop later (PUT latency and bytes, and a poll).
    Stage 0 reads its rows of the data set locally, the last stage computes its loss locally.
    """
    io = _micro_batch_io(in_ps, out_ps, ingrad_ps, outgrad_ps, label_ps, first, last, b, data_streamed, plat)
    a, ha, ha_own = _forward_step(io, fwd_s, last, plat)
    bb, hb, hb_own = _backward_step(io, fwd_s, bwd_s, first, last, plat)
    # the optimizer-state prefetch runs from the task's start: it hides behind the task's own
    # micro-batch steps (compute and the reads it waits on)
    opt_s = optimizer_seconds(master_ratio * p_bytes, tier_mb, plat)
    sy = choice.algorithm.stage(d, choice.k, p_bytes, opt_s, m * bb, plat, last_backward_s=bwd_s, master_ratio=master_ratio)
    load, shard_gets = _parameter_load(sy, p_bytes, master_ratio, plat)
    backward, mem = _stage_memory(p_bytes, saved_ps, in_ps, out_ps, buffer_bytes, build_bytes, master_ratio, last, d, b, m, sy, plat)
    gets, puts, inv, tr = _stage_requests(io, fwd_s, first, last, d, b, m, shard_gets, sy, data_streamed, plat)
    bwd_c = (fwd_s if (last or plat.recompute_forward) else 0.0) + bwd_s
    return StageTerms(p_bytes, load, a, bb, ha, ha_own, hb, hb_own, fwd_s, bwd_c, sy, mem, gets, puts, inv, tr, backward, io.get_in)


def global_transitions(stages: int) -> int:
    """Transitions not owned by a stage: bookkeeping, BackwardSync's Parallel, Forward's (S > 1)."""
    return TRANSITIONS_PER_ITERATION + TRANSITIONS_PER_PARALLEL + (TRANSITIONS_PER_PARALLEL if stages > 1 else 0)


def layer_terms(
    profile: ModelProfile,
    lo: int,
    hi: int,
    first: bool,
    last: bool,
    tier: int,
    choice: SyncChoice,
    d: int,
    b: int,
    m: int,
    plat: Platform,
) -> StageTerms:
    """``stage_terms`` for the stage holding ``profile``'s layers [lo, hi) (sums them; the bytes it
    receives and sends from ModelProfile.stage_io)."""
    layers = profile.layers[lo:hi]
    f = g = 0.0
    for l in layers:
        lf, lg = l.times(tier, b, plat)
        f += lf
        g += lg
    io = profile.stage_io(lo, hi)
    return stage_terms(
        sum(l.param_bytes for l in layers),
        f,
        g,
        sum(l.saved_bytes_per_sample for l in layers),
        io.in_ps,
        io.out_ps,
        io.ingrad_ps,
        profile.label_bytes_per_sample,
        first,
        last,
        tier,
        choice,
        d,
        b,
        m,
        plat,
        buffer_bytes=sum(l.buffer_bytes for l in layers),
        build_bytes=profile.build_bytes,
        outgrad_ps=io.outgrad_ps,
        data_streamed=not data_resident(profile.data_bytes, tier),
        master_ratio=profile.master_ratio,
    )


def stage_memory_bytes(
    layers: Sequence[LayerProfile],
    micro_batch: int,
    replicas: int,
    platform: Platform,
    sync: SyncChoice | None = None,
    task: str = "peak",
) -> float:
    """Peak bytes of a stage's worker (beyond the runtime base): the backward task's, or a sync
    task's if larger (``task="backward"``: the backward task's alone). Backward holds one
    micro-batch's recomputed activations (GPipe)."""
    choice = sync or (SyncChoice("none", 1) if replicas == 1 else SyncChoice("scatter_reduce", replicas))
    prof = ModelProfile("stage", tuple(layers), layers[0].in_bytes_per_sample)
    terms = layer_terms(prof, 0, len(prof.layers), True, False, platform.tiers_mb[-1], choice, replicas, micro_batch, 1, platform)
    return terms.backward_memory_bytes if task == "backward" else terms.memory_bytes


# -- §3-4 evaluation -----------------------------------------------------------------------------
def evaluate(profile: ModelProfile, cfg: Config, plat: Platform) -> Estimate:
    """Predict time, cost and feasibility of one iteration of ``cfg`` (docs/performance-model.md)."""
    L = len(profile.layers)
    if sum(cfg.balance) != L or min(cfg.balance) < 1:
        raise ValueError(f"balance {cfg.balance} must split all {L} layers into non-empty stages")
    if len(cfg.tiers_mb) != cfg.stages or len(cfg.sync) != cfg.stages:
        raise ValueError("tiers_mb and sync need one entry per stage")
    return compose(cfg, config_terms(profile, cfg, plat), plat, clip=profile.clip_grad_norm)


def config_terms(profile: ModelProfile, cfg: Config, plat: Platform, micro_batches: int | None = None) -> list[StageTerms]:
    """Every stage's terms of ``cfg`` (``micro_batches``: walked per task, if not the plan's: an
    evaluation's, planner/model/passes.py)."""
    S, m = cfg.stages, cfg.micro_batches if micro_batches is None else micro_batches
    terms, lo = [], 0
    for s, n in enumerate(cfg.balance):
        terms.append(
            layer_terms(profile, lo, lo + n, s == 0, s == S - 1, cfg.tiers_mb[s], cfg.sync[s], cfg.replicas, cfg.micro_batch, m, plat)
        )
        lo += n
    return terms


def phase_overhead(plat: Platform, tasks: int) -> float:
    """o: a Map of ``tasks`` on the phase's critical path — the state transitions into it and a
    warm invocation, plus its last task starting ``dispatch_s`` per task after its first. A Map of
    more than GROUP_SIZE tasks (§3.5) starts its groups one by one, each group's child execution
    its own tasks one by one, and adds the child execution's start and its completion reaching
    the parent (group_start_s, group_finish_s)."""
    groups = map_groups(tasks)
    if not groups:
        return plat.invoke_overhead_s + plat.dispatch_s * (tasks - 1)
    last = tasks - GROUP_SIZE * (groups - 1)  # the last group's tasks
    latest = max(groups - 2 + GROUP_SIZE - 1, groups - 1 + last - 1)  # the latest task start, in dispatches
    return plat.invoke_overhead_s + plat.group_start_s + plat.dispatch_s * latest + plat.group_finish_s


def cold_ramp_s(plat: Platform, d: int) -> float:
    """§3.5: what a cold iteration (a job's first, a restarted window's) adds while Lambda scales
    each function to the execution environments it runs at once (limits.scaling_ramp_s): one per
    function with warm state and d > 1 (a function per worker), else a stage's d replicas."""
    per_function = 1 if (plat.warm_checkpoint_every > 0 and d > 1) else d
    return scaling_ramp_s(per_function)


def _forward_finish(terms: Sequence[StageTerms], o: float, m: int) -> list[float]:
    """§3.1 F_s, the forward flow shop over stages 0..S-2 (F_{S-1} = 0: the last stage's forward
    runs in its backward): a micro-batch crosses every stage (steps and hops), the others follow
    at the pace of the slowest step."""
    S = len(terms)
    F = [0.0] * S
    lmax = amax = acc = 0.0
    for s in range(S - 1):
        t = terms[s]
        lmax, amax = max(lmax, t.load_s), max(amax, t.fwd_step_s)
        F[s] = o + lmax + acc + t.fwd_step_s + t.fwd_hop_own_s + (m - 1) * amax
        acc += t.fwd_step_s + t.fwd_hop_s
    return F


def _backward_finish(terms: Sequence[StageTerms], o: float, m: int) -> list[float]:
    """§3.2 BT_s, the backward flow shop in reverse order, after the last stage loads its
    parameters; each stage's sync tail ends its backward tasks."""
    S = len(terms)
    BT = [0.0] * S
    bmax = acc = 0.0
    for s in range(S - 1, -1, -1):
        t = terms[s]
        bmax = max(bmax, t.bwd_step_s)
        BT[s] = o + terms[S - 1].load_s + acc + t.bwd_step_s + t.bwd_hop_own_s + (m - 1) * bmax + t.sync.tail_s
        acc += t.bwd_step_s + t.bwd_hop_s
    return BT


def _request_counts(terms: Sequence[StageTerms], clip: bool, updaters: Sequence[int]) -> tuple[float, float, float, float]:
    """§4.2-§4.4 and §3.3: (invocations, transitions, S3 PUTs, S3 GETs) of the iteration: the
    stages' own, the states no stage owns, and the clipping exchange among the updating tasks."""
    invocations = sum(t.invocations for t in terms)
    transitions = float(global_transitions(len(terms)) + sum(t.transitions for t in terms))
    puts, gets = sum(t.puts for t in terms), sum(t.gets for t in terms)
    if clip:
        u = sum(updaters)
        puts, gets = puts + u, gets + u * (u - 1)
    return invocations, transitions, puts, gets


def _violations(
    cfg: Config, mem: Sequence[float], task_s: Sequence[Sequence[float]], plat: Platform, sync_tasks: Sequence[int]
) -> list[str]:
    """Why a Config cannot run: a stage over its tier's usable memory, a task over Lambda's
    timeout (``task_s``: forward, backward and sync task seconds per stage), more invocations at
    once than the account's concurrency leaves room for, or more tasks in one Map than it runs
    (limits.concurrency_refusal; ``sync_tasks``: each stage's sync Map)."""
    S, d = cfg.stages, cfg.replicas
    viol = []
    cap_top = plat.max_predicted_task_s
    for s in range(S):
        cap = plat.usable_bytes(cfg.tiers_mb[s])
        if mem[s] > cap:
            viol.append(f"stage {s} needs {mem[s] / 2**20:.0f} MB but {cfg.tiers_mb[s]} MB leaves {cap / 2**20:.0f} MB")
        for what, secs in zip(("forward", "backward", "sync"), (task_s[0][s], task_s[1][s], task_s[2][s])):
            if secs > cap_top:
                viol.append(
                    f"stage {s} {what} task takes {secs:.0f} s > {cap_top:.0f} s (Lambda's {LAMBDA_MAX_TIMEOUT_S} s over the timeout safety factor)"
                )
    refusal = concurrency_refusal(S, d, plat.concurrency, plat.inline_map_only, sync_tasks)
    if refusal:
        viol.append(refusal)
    return viol


def compose(cfg: Config, terms: Sequence[StageTerms], plat: Platform, clip: bool = False) -> Estimate:
    """Compose per-stage terms into the iteration's time, cost and feasibility (§3-§4). ``clip``:
    the job clips the global gradient norm (§3.3)."""
    S, d = cfg.stages, cfg.replicas
    o = phase_overhead(plat, d)
    F = _forward_finish(terms, o, cfg.micro_batches)
    t_fwd = F[S - 2] if S > 1 else 0.0
    BT = _backward_finish(terms, o, cfg.micro_batches)
    t_bs = max(
        BT[s] + ((phase_overhead(plat, terms[s].sync.tasks) + terms[s].sync.task_s) if terms[s].sync.tasks else 0.0) for s in range(S)
    )
    # §3.3 clipping: every updating task PUTs its shard's squared norm and GETs the others' before
    # updating: a PUT and a GET round (and a poll) on the iteration's end, spent waiting by each
    updaters = [t.sync.tasks if t.sync.tasks else d for t in terms]
    clip_s = 2 * plat.storage_latency_s + plat.poll_delay_s if clip else 0.0
    t_bs += clip_s
    # billing (§4): per task, from the handler's start (invoke overhead not billed)
    fwd_task = [F[s] - o if s < S - 1 else 0.0 for s in range(S)]
    bwd_task = [BT[s] - o for s in range(S)]
    sync_task = [t.sync.task_s for t in terms]
    gbs = sum(
        plat.price_per_s(cfg.tiers_mb[s]) * (d * (fwd_task[s] + bwd_task[s]) + terms[s].sync.tasks * sync_task[s] + updaters[s] * clip_s)
        for s in range(S)
    )
    invocations, transitions, puts, gets = _request_counts(terms, clip, updaters)
    c_req = plat.price_request * invocations
    c_tr = plat.price_transition * transitions
    c_s3 = plat.price_put * puts + plat.price_get * gets
    mem = [t.memory_bytes for t in terms]
    viol = _violations(cfg, mem, (fwd_task, bwd_task, sync_task), plat, [t.sync.tasks for t in terms])
    return Estimate(
        config=cfg,
        time_s=t_fwd + t_bs + plat.iteration_overhead_s,
        cost=gbs + c_req + c_tr + c_s3,
        forward_s=t_fwd,
        backward_sync_s=t_bs,
        stage_forward_s=fwd_task,
        stage_backward_s=bwd_task,
        stage_sync_s=sync_task,
        stage_memory_bytes=mem,
        cost_lambda_duration=gbs,
        cost_lambda_requests=c_req,
        cost_transitions=c_tr,
        cost_s3=c_s3,
        transitions=transitions,
        invocations=invocations,
        s3_puts=puts,
        s3_gets=gets,
        feasible=not viol,
        violations=viol,
        cold_ramp_s=cold_ramp_s(plat, d),
    )


def timeouts(est: Estimate) -> tuple[dict[str, int], ...]:
    """Per stage, per phase TimeoutSeconds from the predicted task seconds, by the runtime
    contract's own rule (plan.timeouts_from): raises PlanError if a phase cannot fit 15 minutes."""

    return timeouts_from(est.task_seconds())
