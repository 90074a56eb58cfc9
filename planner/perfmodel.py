"""Performance and cost model of Stagecoach's own runtime (DESIGN.md §3).

One iteration = Forward phase (a Map over every worker of stages 0..S-2; the last stage's forward
runs inside its backward) followed by Backward+Sync (a Parallel with one branch per stage: a Map
of backward tasks over the d replicas, then, if d > 1, a Map of sync tasks). Workers exchange
micro-batch tensors through S3, so the stages of a phase form a flow shop: a stage starts
micro-batch j when its predecessor wrote j and it finished j-1. The derivation of every formula is
in docs/performance-model.md; the section names below match it.

The sync algorithm is a seam: each algorithm is an ``SyncAlgorithm`` that, for a fixed (d, K),
returns *affine in the stage's parameter bytes* coefficients (``SyncCoeffs``). The MILP relies on
that shape (it keeps the model linear), the evaluator here just uses the numbers. Adding an
algorithm = one class + registering it in ``SYNC_ALGORITHMS``.

All times in seconds, sizes in bytes, money in USD.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Mapping, Sequence

from .profile import LayerProfile, ModelProfile

if TYPE_CHECKING:  # pragma: no cover
    from .platforms import Platform

# Step Functions state transitions of the emitted ASL (planner/asl.py is the authority; these
# mirror its shape: a Map costs its own state plus one Task per iteration, a Parallel its state).
TRANSITIONS_PER_ITERATION = 2  # the window's per-iteration bookkeeping states (Pass/Choice)
TRANSITIONS_PER_MAP = 1
TRANSITIONS_PER_PARALLEL = 1
TRANSITIONS_PER_TASK = 1


# -- §5 sync algorithms ------------------------------------------------------------------------
@dataclass(frozen=True)
class SyncCoeffs:
    """What one stage's synchronisation costs, for fixed (d, K), as affine functions of P bytes.

    tail:  time the backward task spends after its last micro-batch (writing gradient shards, or
           with d = 1 applying the optimizer): tail_lat + tail_per_byte * P (+ optimizer compute
           when ``tail_opt``).
    task:  duration of ONE sync task: task_lat + task_per_byte * P + optimizer compute on a 1/K share.
    tasks: number of sync tasks (0 = no sync phase).
    shards: how many objects the stage's parameters are stored as (the next forward GETs them all).
    *_puts/_gets: S3 requests per backward task (tail) and per sync task.
    mem_per_byte: memory of one sync task per parameter byte of the stage.
    """

    name: str
    k: int
    tail_lat: float
    tail_per_byte: float
    task_lat: float
    task_per_byte: float
    tasks: int
    shards: int
    tail_puts: float
    tail_gets: float
    task_puts: float
    task_gets: float
    tail_opt: bool = False
    mem_per_byte: float = 0.0

    def tail_time(self, p_bytes: float, opt_s: float) -> float:
        return self.tail_lat + self.tail_per_byte * p_bytes + (opt_s if self.tail_opt else 0.0)

    def task_time(self, p_bytes: float, opt_s: float) -> float:
        return self.task_lat + self.task_per_byte * p_bytes + (opt_s / self.k if self.tasks else 0.0)


class SyncAlgorithm:
    """Base of the pluggable sync algorithms. ``coeffs`` must be affine in P (see SyncCoeffs)."""

    name = "abstract"

    def coeffs(self, d: int, k: int, plat: "Platform") -> SyncCoeffs:  # pragma: no cover
        raise NotImplementedError


def _update_io(k: int, plat: "Platform") -> tuple[float, float]:
    """Sharded optimizer update of a 1/k share: GET param shard + state shard, PUT both.

    Returns (latency, seconds per stage-parameter byte) = (4 t_lat, 2(1+rho)/(k w))."""
    rho, w = plat.optimizer_state_ratio, plat.bandwidth_Bps
    return 4 * plat.storage_latency_s, 2 * (1 + rho) / (k * w)


class NoSync(SyncAlgorithm):
    """d = 1: the backward task applies the optimizer itself (runtime: _update_shard on shard 0)."""

    name = "none"

    def coeffs(self, d: int, k: int, plat: "Platform") -> SyncCoeffs:
        lat, per = _update_io(1, plat)
        rho = plat.optimizer_state_ratio
        return SyncCoeffs(self.name, 1, lat, per, 0.0, 0.0, 0, 1, 2, 2, 0, 0, tail_opt=True, mem_per_byte=0.0)


class ScatterReduce(SyncAlgorithm):
    """LambdaML-style storage scatter-reduce with a sharded update (what the runtime runs).

    Backward tail: PUT the gradient as K shards (P/w + t_lat). Sync task k: GET shard k from each
    of the d replicas one after another (d t_lat + d P/(K w)), add, update (4 t_lat + 2(1+rho)P/(K w)).
    K = d for scatter-reduce; K < d is FasDL's K-reduce, K = 1 all-reduce (one aggregator).
    """

    name = "scatter_reduce"

    def coeffs(self, d: int, k: int, plat: "Platform") -> SyncCoeffs:
        w, lat, rho = plat.bandwidth_Bps, plat.storage_latency_s, plat.optimizer_state_ratio
        ulat, uper = _update_io(k, plat)
        return SyncCoeffs(
            self.name, k,
            tail_lat=lat, tail_per_byte=1 / w,
            task_lat=d * lat + ulat, task_per_byte=d / (k * w) + uper,
            tasks=k, shards=k, tail_puts=k, tail_gets=0, task_puts=2, task_gets=d + 2,
            mem_per_byte=(4 + 2 * rho) / k,
        )


class PipelinedScatterReduce(ScatterReduce):
    """FuncPipe's pipelined scatter-reduce: the sync task streams its shard in chunks, so the
    uploads of updated chunks (parameters, state) overlap the downloads of the next chunks and the
    d replica downloads are issued back to back: time = (2 + d) t_lat + max(down, up) with
    down = (d + 1 + rho) P/(K w) > up = (1 + rho) P/(K w). FuncPipe: 2s/w + (2+n) t_lat vs
    LambdaML's 3s/w - 2s/(nw) + 4 t_lat."""

    name = "pipelined_scatter_reduce"

    def coeffs(self, d: int, k: int, plat: "Platform") -> SyncCoeffs:
        base = super().coeffs(d, k, plat)
        w, lat, rho = plat.bandwidth_Bps, plat.storage_latency_s, plat.optimizer_state_ratio
        return SyncCoeffs(
            self.name, k, base.tail_lat, base.tail_per_byte,
            task_lat=(2 + d) * lat, task_per_byte=(d + 1 + rho) / (k * w),
            tasks=k, shards=k, tail_puts=k, tail_gets=0, task_puts=2, task_gets=d + 2,
            mem_per_byte=base.mem_per_byte,
        )


class KReduce(ScatterReduce):
    """FasDL's K-reduce: K aggregators (K <= d), each reduces and updates 1/K of the stage."""

    name = "k_reduce"


class AllReduce(ScatterReduce):
    """K = 1: one aggregator reduces and updates everything."""

    name = "all_reduce"


SYNC_ALGORITHMS: dict[str, SyncAlgorithm] = {
    a.name: a for a in (NoSync(), ScatterReduce(), PipelinedScatterReduce(), KReduce(), AllReduce())
}


@dataclass(frozen=True)
class SyncChoice:
    """An algorithm and its number of aggregators/shards K."""

    algo: str
    k: int

    def label(self) -> str:
        return self.algo if self.algo in ("none", "scatter_reduce", "pipelined_scatter_reduce", "all_reduce") else f"{self.algo}(K={self.k})"

    def coeffs(self, d: int, plat: "Platform") -> SyncCoeffs:
        if self.algo not in SYNC_ALGORITHMS:
            raise ValueError(f"unknown sync algorithm {self.algo!r}: choose one of {sorted(SYNC_ALGORITHMS)}")
        return SYNC_ALGORITHMS[self.algo].coeffs(d, self.k, plat)


def sync_choices(d: int, algos: Sequence[str] | None = None) -> list[SyncChoice]:
    """The candidate sync choices for d replicas (K-reduce: K a power of two, 2 <= K < d)."""
    if d == 1:
        return [SyncChoice("none", 1)]
    algos = algos or ("scatter_reduce", "pipelined_scatter_reduce", "k_reduce", "all_reduce")
    out: list[SyncChoice] = []
    for a in algos:
        if a == "scatter_reduce" or a == "pipelined_scatter_reduce":
            out.append(SyncChoice(a, d))
        elif a == "all_reduce":
            out.append(SyncChoice(a, 1))
        elif a == "k_reduce":
            k = 2
            while k < d:
                out.append(SyncChoice(a, k))
                k *= 2
        else:
            raise ValueError(f"unknown sync algorithm {a!r}")
    return out


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
    stage_forward_s: list[float]  # task durations (billed), 0 for the last stage
    stage_backward_s: list[float]
    stage_sync_s: list[float]  # one sync task's duration
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

    @property
    def orchestration_share(self) -> float:
        """Share of the cost that is not Lambda compute time: Step Functions, invocations, S3."""
        return (self.cost_transitions + self.cost_lambda_requests + self.cost_s3) / self.cost if self.cost else 0.0

    def objective(self, a1: float, a2: float, cost_unit: float = 1e-9) -> float:
        return a1 * self.cost / cost_unit + a2 * self.time_s


# -- §2 memory ----------------------------------------------------------------------------------
def param_copies(replicas: int, plat: "Platform") -> float:
    """Parameter-sized buffers a backward task holds: weights, gradients, the flat gradient copy;
    with d = 1 the in-task update adds the loaded parameters, the state and their new versions."""
    rho = plat.optimizer_state_ratio
    return 3.0 + (2.0 + 2.0 * rho if replicas == 1 else 0.0)


def stage_memory_bytes(layers: Sequence[LayerProfile], micro_batch: int, replicas: int, platform: "Platform", sync: SyncChoice | None = None) -> float:
    """Peak bytes of a stage's worker (beyond the runtime base): the backward task's, or a sync
    task's if larger. Backward holds one micro-batch's recomputed activations (GPipe)."""
    p = sum(l.param_bytes for l in layers)
    act = micro_batch * (sum(l.saved_bytes_per_sample for l in layers) + 2 * layers[0].in_bytes_per_sample + 2 * layers[-1].out_bytes_per_sample)
    need = param_copies(replicas, platform) * p + act
    if sync is not None and replicas > 1:
        need = max(need, sync.coeffs(replicas, platform).mem_per_byte * p)
    return need


# -- §3-4 evaluation -----------------------------------------------------------------------------
def optimizer_seconds(p_bytes: float, tier_mb: int, plat: "Platform") -> float:
    """Compute time of the optimizer update over p_bytes of fp32 parameters at a tier."""
    return p_bytes / 4 * plat.optimizer_flops_per_param / (plat.flops_per_vcpu * plat.speedup(tier_mb))


def evaluate(profile: ModelProfile, cfg: Config, plat: "Platform") -> Estimate:
    """Predict time, cost and feasibility of one iteration of ``cfg`` (docs/performance-model.md)."""
    L = len(profile.layers)
    if sum(cfg.balance) != L or min(cfg.balance) < 1:
        raise ValueError(f"balance {cfg.balance} must split all {L} layers into non-empty stages")
    S, d, b, m = cfg.stages, cfg.replicas, cfg.micro_batch, cfg.micro_batches
    if len(cfg.tiers_mb) != S or len(cfg.sync) != S:
        raise ValueError("tiers_mb and sync need one entry per stage")
    w, lat, o = plat.bandwidth_Bps, plat.storage_latency_s, plat.invoke_overhead_s
    bounds = []
    i = 0
    for n in cfg.balance:
        bounds.append((i, i + n))
        i += n
    P, aF, bb, tail, sy, mem, opt = [], [], [], [], [], [], []
    coeffs = [c.coeffs(d, plat) for c in cfg.sync]
    for s, ((i, j), tier, co) in enumerate(zip(bounds, cfg.tiers_mb, coeffs)):
        ls = profile.layers[i:j]
        p = sum(l.param_bytes for l in ls)
        cf = cg = 0.0
        for l in ls:
            f, g = l.times(tier, b, plat)
            cf += f
            cg += g
        in_b = b * ls[0].in_bytes_per_sample
        out_b = b * ls[-1].out_bytes_per_sample
        last = s == S - 1
        aF.append(0.0 if last else 2 * lat + (in_b + out_b) / w + cf)
        read_down = lat + (b * profile.label_bytes_per_sample if last else out_b) / w
        write_up = (lat + b * ls[0].ingrad_bytes_per_sample / w) if s > 0 else 0.0
        bb.append(read_down + lat + in_b / w + cf + cg + write_up)
        ot = optimizer_seconds(p, tier, plat)
        P.append(p)
        opt.append(ot)
        tail.append(co.tail_time(p, ot))
        sy.append(o + co.task_time(p, ot) if co.tasks else 0.0)
        mem.append(stage_memory_bytes(ls, b, d, plat, cfg.sync[s]))
    load = [lat + p / w for p in P]
    # forward flow shop over stages 0..S-2 (§3.1)
    F = [0.0] * S
    lmax = amax = acc = 0.0
    for s in range(S - 1):
        lmax, amax = max(lmax, load[s]), max(amax, aF[s])
        acc += aF[s]
        F[s] = o + lmax + acc + (m - 1) * amax
    t_fwd = F[S - 2] if S > 1 else 0.0
    # backward flow shop in reverse order, after the last stage loads its parameters (§3.2)
    B = [0.0] * S
    bmax = acc = 0.0
    for s in range(S - 1, -1, -1):
        bmax = max(bmax, bb[s])
        acc += bb[s]
        B[s] = o + load[S - 1] + acc + (m - 1) * bmax
    BT = [B[s] + tail[s] for s in range(S)]
    t_bs = max(BT[s] + sy[s] for s in range(S))
    # billing (§4): per task, from the handler's start (invoke overhead not billed)
    fwd_task = [max(0.0, F[s] - o) if s < S - 1 else 0.0 for s in range(S)]
    bwd_task = [BT[s] - o for s in range(S)]
    sync_task = [max(0.0, sy[s] - o) for s in range(S)]
    gbs = 0.0
    for s in range(S):
        gbs += plat.price_per_s(cfg.tiers_mb[s]) * (d * (fwd_task[s] + bwd_task[s]) + coeffs[s].tasks * sync_task[s])
    invocations = (S - 1) * d + S * d + sum(c.tasks for c in coeffs)
    transitions = transitions_per_iteration(S, d, [c.tasks for c in coeffs])
    puts, gets = s3_requests(S, d, m, coeffs, plat)
    c_req = plat.price_request * invocations
    c_tr = plat.price_transition * transitions
    c_s3 = plat.price_put * puts + plat.price_get * gets
    cost = gbs + c_req + c_tr + c_s3
    viol = []
    cap_top = plat.max_predicted_task_s
    for s in range(S):
        cap = plat.usable_bytes(cfg.tiers_mb[s])
        if mem[s] > cap:
            viol.append(f"stage {s} needs {mem[s] / 2**20:.0f} MB but {cfg.tiers_mb[s]} MB leaves {cap / 2**20:.0f} MB")
        for what, t in (("forward", fwd_task[s]), ("backward", bwd_task[s]), ("sync", sync_task[s])):
            if t > cap_top:
                viol.append(f"stage {s} {what} task takes {t:.0f} s > {cap_top:.0f} s (Lambda's 900 s with margin)")
    if (S - 1) * d > 40 or d > 40:
        viol.append(f"{S} stages x {d} replicas exceed the inline Map's 40 concurrent tasks")
    return Estimate(
        config=cfg, time_s=t_fwd + t_bs, cost=cost, forward_s=t_fwd, backward_sync_s=t_bs,
        stage_forward_s=fwd_task, stage_backward_s=bwd_task, stage_sync_s=sync_task, stage_memory_bytes=mem,
        cost_lambda_duration=gbs, cost_lambda_requests=c_req, cost_transitions=c_tr, cost_s3=c_s3,
        transitions=transitions, invocations=invocations, s3_puts=puts, s3_gets=gets,
        feasible=not viol, violations=viol,
    )


def transitions_per_iteration(stages: int, replicas: int, sync_tasks: Sequence[int]) -> float:
    """State transitions of one iteration (§4.3): forward Map (absent with one stage), the
    Parallel, and per branch a backward Map and, with d > 1, a sync Map."""
    t = TRANSITIONS_PER_ITERATION
    if stages > 1:
        t += TRANSITIONS_PER_MAP + TRANSITIONS_PER_TASK * (stages - 1) * replicas
    t += TRANSITIONS_PER_PARALLEL
    for n in sync_tasks:
        t += TRANSITIONS_PER_MAP + TRANSITIONS_PER_TASK * replicas
        if n:
            t += TRANSITIONS_PER_MAP + TRANSITIONS_PER_TASK * n
    return float(t)


def s3_requests(stages: int, d: int, m: int, coeffs: Sequence[SyncCoeffs], plat: "Platform") -> tuple[float, float]:
    """(PUTs, GETs) of one iteration (§4.4). Waiting for an object adds ``s3_polls_per_wait``
    GETs per wait (404s under backoff)."""
    puts = gets = 0.0
    poll = plat.s3_polls_per_wait
    for s in range(stages):
        co = coeffs[s]
        last = s == stages - 1
        if not last:  # forward task per replica: param shards, m inputs, m outputs
            gets += d * (co.shards + m + (m * poll if s > 0 else 0))
            puts += d * m
        # backward task per replica
        gets += d * (2 * m + (0 if last else m * poll) + (co.shards if last else 0) + co.tail_gets)
        puts += d * ((m if s > 0 else 0) + co.tail_puts)
        gets += co.tasks * co.task_gets
        puts += co.tasks * co.task_puts
    return puts, gets


def timeouts(est: Estimate, plat: "Platform") -> tuple[dict[str, int], ...]:
    """Per stage, per phase TimeoutSeconds: margin x predicted + 10 s, within Lambda's limit."""
    out = []

    def t(x: float) -> int:
        return int(min(plat.max_task_s, max(30, math.ceil(plat.timeout_margin * x + 10))))

    for s in range(est.config.stages):
        out.append({"forward": t(est.stage_forward_s[s]), "backward": t(est.stage_backward_s[s]), "sync": t(est.stage_sync_s[s])})
    return tuple(out)
