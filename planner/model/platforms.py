"""Platform constants in one dated, overridable place.

Every number the performance model uses about the cloud lives here, with its source, so a price
change or a new measurement is one edit (or one ``platform.replace(...)`` call) and never a hunt
through formulas. ``aws_platform()`` is AWS Lambda + Step Functions + S3 in us-east-1 as published
on ``PRICES_AS_OF``, with compute and bandwidth calibrated from the seed papers' measurements on
Lambda (planner/model/calibration.py cites each; benchmarks/paper_tables.py tests them against the
papers' other measured numbers); ``local_platform()`` is this machine, measured (FLOP rate,
parameter passes) and documented (the local runtime's emulated bandwidth, its CPU count).
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from stagecoach.planner.limits import LAMBDA_ACCOUNT_CONCURRENCY, LAMBDA_MAX_TIMEOUT_S
from stagecoach.planner.model.calibration import optimizer_passes
from stagecoach.planner.plan import TIMEOUT_SAFETY

# us-east-1 list prices on that date: https://aws.amazon.com/lambda/pricing/,
# https://aws.amazon.com/step-functions/pricing/, https://aws.amazon.com/s3/pricing/
PRICES_AS_OF = "2025-01-15"

# FuncPipe's eight memory tiers (MB = MiB, FuncPipe §5.1). Lambda accepts any value 128-10,240 in 1 MB steps.
FUNCPIPE_TIERS_MB: tuple[int, ...] = (512, 1024, 2048, 3072, 4096, 6144, 8192, 10240)

MIB = 2**20
# FuncPipe's measured function bandwidth, "about 70 MB/s" (§1, §3.3), in bytes/s. FuncPipe's "MB" is
# MiB: its Table 1 sizes are the models' parameter bytes in MiB (ResNet-101 169.9 MiB = "170 MB"), and
# read so, its LambdaML sync formula reproduces the measured 35.5 s of Fig. 1(a) (docs/paper-tables.md).
FUNCPIPE_BANDWIDTH_BPS = 70 * MIB
# Lambda's documented network quota per execution environment, 625 Mbps = 78.125e6 bytes/s: an
# upper bound, not what a function achieves.
LAMBDA_NETWORK_QUOTA_BPS = 625e6 / 8


@dataclass(frozen=True)
class Platform:
    """What the performance model needs to know about where the workers run.

    Units: bytes, seconds, US dollars. Memory tiers are in MB as Lambda spells them, which are MiB
    (2^20 bytes): Lambda bills GB-seconds as memory_mb / 1024 (``price_per_s``), and a plan's
    memory need is compared in bytes with tier * 2^20 (``usable_bytes``). Bandwidths are bytes/s.
    Each constant says where it comes from: a published measurement (with its paper and table), an
    AWS page, our own runtime's code, or — said so — an estimate not yet measured on AWS.
    """

    name: str
    tiers_mb: tuple[int, ...] = FUNCPIPE_TIERS_MB
    # -- compute (docs/performance-model.md §1; planner/model/calibration.py derives each) ---------
    # Lambda gives 1 vCPU-equivalent per 1,769 MB, at most 6 (AWS Lambda "Memory and computing power").
    mb_per_vcpu: float = 1769.0
    max_vcpu: float = 6.0
    # A tier's speed relative to one vCPU is (M + m) / (1769 + m), capped at max_vcpu: the form of
    # FasDL's measured fit (Table II, eq. 4), m its four models' median (calibration.tier_offset_mb).
    tier_offset_mb: float = -93.05
    # Sustained fp32 training FLOP/s of one vCPU-equivalent: fitted so the model reproduces FuncPipe's
    # measured 6.0 s of AmoebaNet-D36 compute at 10,240 MB, batch 8 (§1 Fig. 1(a);
    # calibration.calibrate_flops_per_vcpu). local_platform() measures this machine instead.
    flops_per_vcpu: float = 4.271e10
    # Seconds per parameter byte per pass over the parameters, at one vCPU: the part of an iteration
    # that does not grow with the batch (FasDL Table II's a*b/(M+m), 2.7-5.9 ns per parameter byte over
    # an SGD iteration's 7 passes; median; calibration.param_pass_s_per_byte). A layer's forward pays
    # 1 pass, its backward 2, per micro-batch: what makes small micro-batches less efficient per sample.
    param_pass_s_per_byte: float = 7.041e-10
    # -- storage and network -------------------------------------------------------------------
    bandwidth_Bps: float = FUNCPIPE_BANDWIDTH_BPS  # measured (FuncPipe §1, §3.3: 70 MiB/s); the quota is 78.1e6
    storage_latency_s: float = 0.03  # FuncPipe §3.3 measured t_lat < 40 ms; 30 ms is our estimate within it
    # -- orchestration: estimates until measured on AWS (the local stack measures its own: stagecoach.calibrate)
    # Step Functions dispatch + warm Lambda invoke, per phase, on the critical path, not billed.
    invoke_overhead_s: float = 0.08
    # Between the starts of consecutive tasks of one Map state (its iterations start one by one).
    dispatch_s: float = 0.005
    # A Map of more than GROUP_SIZE tasks runs them in groups, each a child execution of the job's
    # group state machine started by states:startExecution.sync:2 (planner/limits.py): on the
    # phase's critical path, StartExecution and the child's Map state before its first task, and
    # the child's completion reaching the parent (.sync:2 learns of it through the Step
    # Functions-managed EventBridge rule, docs/aws.md). Neither AWS nor the seed papers publish a
    # number: both are estimates until measured on AWS (docs/performance-model.md §3.5).
    group_start_s: float = 0.3
    group_finish_s: float = 0.7
    # Per iteration, the window's bookkeeping states (the Gate task, Go? Choice, Advance Pass) on the critical path.
    iteration_overhead_s: float = 0.05
    # A worker waiting for another's object notices it this long after it lands, on average: half
    # a poll cycle (lambdas/channel.py: a 404's round trip plus the pause, a fifth of the wait so
    # far up to 40 ms: 20 ms after a 0.1 s wait; the paper plans' hops average 25-31 ms, §4.4).
    poll_delay_s: float = 0.025
    # -- the account -----------------------------------------------------------------------------
    # Lambda's concurrent executions the plan may use (planner/limits.py: the default quota; plan
    # with yours, e.g. ``stagecoach plan --concurrency``): S d invocations at once, with a
    # restarted window's headroom (limits.max_stages_at).
    concurrency: int = LAMBDA_ACCOUNT_CONCURRENCY
    # True: the rule before groups of child executions, every phase's workers in one inline Map
    # (d <= 40, (S - 1) d <= 40): kept to compare with (benchmarks/planner.py (c)).
    inline_map_only: bool = False
    # -- the runtime ---------------------------------------------------------------------------
    # Our runtime recomputes a stage's forward in its backward task (GPipe rematerialisation,
    # docs/runtime.md). False describes runtimes whose long-lived workers keep the activations
    # (FuncPipe, LambdaML): used to express their measured runs (benchmarks/paper_tables.py).
    recompute_forward: bool = True
    # Memory: the worker process (Python + torch + boto3) before the model is loaded. An estimate:
    # above the ~230 MB measured here for python + torch (tests/planner/test_disdel.py) and DiSDeL's
    # ~280 MB at job submission (§VI), with room for boto3 and the Lambda runtime.
    runtime_base_mb: float = 380.0
    memory_headroom: float = 0.9  # design choice: plan at most this fraction of the configured memory
    max_task_s: float = float(LAMBDA_MAX_TIMEOUT_S)  # planner/limits.py
    # TimeoutSeconds = margin * predicted + 10 s, by the runtime contract's rule (plan.timeouts_from,
    # TIMEOUT_SAFETY); a plan whose task exceeds max_task_s / margin is refused there, so the
    # planner treats it as infeasible.
    timeout_margin: float = TIMEOUT_SAFETY
    optimizer_state_ratio: float = 2.0  # optimizer state bytes / parameter bytes: Adam's m and v (0: SGD)
    # State that stays warm (docs/runtime.md; Job.warm_state, the default): with d = 1 a stage's
    # parameters and optimizer state stay in its worker's memory and reach S3 once per window, as
    # its checkpoint. Iterations per checkpoint: a window's length (planner/emit/asl.py
    # window_length: 19,992 history events / events per iteration, ~270 at d = 1 with 4 stages);
    # 200 is a round lower figure. 0: every iteration (Job(warm_state=False), the earlier runtime).
    warm_checkpoint_every: int = 200
    # A waiting worker's polling (lambdas/channel.py wait_bytes, our runtime's code): after each 404
    # it pauses poll_factor x the time waited so far, at least poll_first_s, at most poll_max_s
    # (WAIT_FIRST_S, WAIT_FACTOR, WAIT_MAX_S; a plan of more than 40 concurrent workers, or a task
    # waiting for several objects at once, pauses up to its budget's cap, ``cap_s``, instead);
    # every poll_look_every_s (ABORT_CHECK_S) it GETs its window's abort marker and the producer's
    # metrics (``polls_while_waiting``).
    poll_first_s: float = 0.005
    poll_factor: float = 0.2
    poll_max_s: float = 0.04
    poll_look_every_s: float = 1.0
    poll_jitter: float = 0.25  # each pause uniform in 1 -/+ this times it (WAIT_JITTER)
    # A wait that recurs every iteration sleeps this share of its last waits before its first GET
    # (WAIT_AHEAD; ``polls_while_waiting(learnt=True)``).
    poll_ahead: float = 0.8
    # -- prices (USD), AWS list prices on PRICES_AS_OF ----------------------------------------------
    price_gb_s: float = 0.0000166667  # Lambda x86 per GB-s (GB = 1,024 MB); arm64 is 0.0000133334
    price_request: float = 0.20 / 1e6  # Lambda invocations
    price_transition: float = 0.025 / 1000  # Step Functions Standard
    # Step Functions Express: per request (each execution started) and per GB-second of duration,
    # rounded up to 100 ms, at memory billed in 64 MB chunks (first tier; planner/emit/workflow.py)
    price_express_request: float = 1.00 / 1e6
    price_express_gb_s: float = 0.00001667
    price_put: float = 0.005 / 1000  # S3 PUT/COPY/POST/LIST
    price_get: float = 0.0004 / 1000  # S3 GET/HEAD
    prices_as_of: str = PRICES_AS_OF
    notes: str = ""

    # -- derived -------------------------------------------------------------------------------
    def vcpu(self, memory_mb: float) -> float:
        """vCPU-equivalents at a memory size: Lambda's proportional CPU share, capped."""
        return min(self.max_vcpu, memory_mb / self.mb_per_vcpu)

    def speedup(self, memory_mb: float) -> float:
        """Compute speed at a tier relative to one vCPU-equivalent (1,769 MB on Lambda).

        FasDL's measured form (Table II, eq. 4): speed grows as (M + m), here normalised to one vCPU,
        (M + m) / (mb_per_vcpu + m), capped at ``max_vcpu``. The fit covers both a CPU-time share
        below one vCPU and extra cores above: its three CNNs scale linearly to 10,240 MB.
        """
        m = self.tier_offset_mb
        return max(1e-3, min(self.max_vcpu, (memory_mb + m) / (self.mb_per_vcpu + m)))

    def param_pass_s(self, param_bytes: float, memory_mb: float) -> float:
        """Seconds of one pass over ``param_bytes`` of parameters at a tier (``param_pass_s_per_byte``)."""
        return self.param_pass_s_per_byte * param_bytes / self.speedup(memory_mb)

    def polls_while_waiting(self, wait_s: float, cap_s: float = 0.0, looks: int = 2, learnt: bool = False) -> float:
        """The extra GETs a worker makes while it waits ``wait_s`` for an object (from its first GET
        to the object's landing), by the channel's loop (lambdas/channel.py ``_wait_bytes``): 404s
        a round trip (``storage_latency_s``) plus a pause apart, and ``looks`` GETs (the abort
        marker, the producer's metrics) about every ``poll_look_every_s``. ``cap_s``: the pause's
        cap when the job's GET budget raises it (channel.poll_cap_s x the task's waiters).
        Expected values over the channel's jitter; docs/performance-model.md §4.4. ``learnt``: a wait
        that recurs every iteration, in a warm process that has made it before (``_learnt_polls``)."""
        if wait_s <= 0:
            return 0.0
        cap = max(self.poll_max_s, cap_s)
        if learnt and self.poll_ahead > 0:
            return self._learnt_polls(wait_s, cap, looks)
        looks_made = looks * math.floor((wait_s + self.storage_latency_s) / self._look_period(wait_s, cap, looks))
        # the looks' round trips delay the polls
        return self._misses(wait_s - looks_made * self.storage_latency_s, cap) + looks_made

    def _learnt_polls(self, wait_s: float, cap: float, looks: int) -> float:
        """The GETs of a recurring wait (lambdas/channel.py WAIT_AHEAD): it sleeps a = poll_ahead x
        wait_s, GETting only for its looks, one every poll_look_every_s (T) exactly, floor(a / T)
        of them; then it polls as a fresh wait for the rest, r = wait_s - a, its next look due
        T (floor(a / T) + 1) - a into it, the later ones ``_look_period`` apart."""
        period, lat = self.poll_look_every_s, self.storage_latency_s
        ahead = self.poll_ahead * wait_s
        rest = wait_s - ahead
        slept = math.floor(ahead / period)
        due = (slept + 1) * period - ahead
        polled = 0 if rest + lat < due else 1 + math.floor((rest + lat - due) / self._look_period(rest, cap, looks))
        return self._misses(rest - looks * polled * lat, cap) + looks * (slept + polled)

    def _look_period(self, wait_s: float, cap: float, looks: int) -> float:
        """The mean time between the channel's looks around ``wait_s``: a look comes with the first
        GET to end ``poll_look_every_s`` after the last one, i.e. the look's own GETs, then the
        first passage of the cycles (a round trip plus a jittered pause, its mean at ``wait_s``)
        past the rest of the period: E[cycles] by a normal approximation of their sum, times the
        mean cycle (Wald). A cycle is a large share of the period, so its lattice matters (the
        usual half a cycle of overshoot is off by up to ten percent)."""
        lat = self.storage_latency_s
        if wait_s + lat < self.poll_look_every_s:
            return self.poll_look_every_s  # no look before the object lands
        pause, a = min(cap, max(self.poll_first_s, self.poll_factor * wait_s)), self.poll_jitter
        mean, sd = lat + pause, pause * a / math.sqrt(3)
        rest = self.poll_look_every_s - looks * lat
        # E[N] = sum over j >= 0 of P(the first j cycles end before the rest): one cycle's pause is
        # uniform in (1 -/+ a) pause, a sum of several about normal
        cycles = 1.0 + min(1.0, max(0.0, (rest - lat - pause * (1 - a)) / (2 * a * pause + 1e-12)))
        j = 2
        while True:
            below = 0.5 * (1 + math.erf((rest - j * mean) / (sd * math.sqrt(2 * j) + 1e-12)))
            if below < 1e-6:
                return looks * lat + cycles * mean
            cycles, j = cycles + below, j + 1

    def _misses(self, wait_s: float, cap: float) -> float:
        """The 404s of the channel's loop for an object landing ``wait_s`` after the first GET
        started, a round trip L apart plus the pause p(t) = min(cap, max(floor, f t)), t the time
        waited when the pause starts. Three phases, in closed form (the planner asks this for
        every candidate stage): pauses of ``poll_first_s`` while f t <= floor; then each GET's
        t grows as t' = (1 + f) t + L, i.e. t + L/f grows by 1 + f a GET; then pauses of ``cap``."""
        if wait_s <= 0:
            return 0.0
        lat, floor, f = self.storage_latency_s, self.poll_first_s, self.poll_factor
        step = lat + floor
        if f <= 0:  # a fixed pause
            return float(math.ceil(wait_s / step))
        n1 = math.floor((floor / f - lat) / step) + 1 if floor / f >= lat else 0  # GETs followed by the floor's pause
        start = n1 * step  # the first GET followed by a proportional pause starts here
        if wait_s <= start:
            return float(math.ceil(wait_s / step))
        a = start + lat + lat / f  # GET n1 + j starts at a (1 + f)^j - L/f - L
        grow = math.log1p(f)
        n2 = max(0, math.ceil(math.log((cap + lat) / (f * a)) / grow))  # GETs followed by a proportional pause
        capped = a * (1 + f) ** n2 - lat / f - lat  # the first GET followed by the cap's pause starts here
        if wait_s <= capped:
            return float(n1 + math.ceil(math.log((wait_s + lat + lat / f) / a) / grow))
        return float(n1 + n2 + math.ceil((wait_s - capped) / (lat + cap)))

    def usable_bytes(self, memory_mb: float) -> float:
        """Bytes a stage may plan to use at this tier, after headroom and the runtime's base."""
        return (memory_mb * self.memory_headroom - self.runtime_base_mb) * 2**20

    def price_per_s(self, memory_mb: float) -> float:
        """Lambda duration price of one second at this memory size."""
        return self.price_gb_s * memory_mb / 1024.0

    @property
    def max_predicted_task_s(self) -> float:
        return self.max_task_s / self.timeout_margin

    def replace(self, **changes: Any) -> Platform:
        """A copy with some constants overridden, e.g. ``aws_platform().replace(bandwidth_Bps=70e6)``."""
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise TypeError(f"unknown platform constants {unknown}; known: {[f.name for f in dataclasses.fields(self)]}")
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def aws_platform(arch: str = "x86_64", **overrides: Any) -> Platform:
    """AWS Lambda (us-east-1) with FuncPipe's eight tiers."""
    if arch not in ("x86_64", "arm64"):
        raise ValueError(f"arch={arch!r}: Lambda supports 'x86_64' or 'arm64'")
    p = Platform(
        name=f"aws-lambda-{arch}",
        price_gb_s=0.0000166667 if arch == "x86_64" else 0.0000133334,
        notes=(
            "prices: AWS list prices; bandwidth: FuncPipe's measured 70 MiB/s; compute: FLOP rate from FuncPipe Fig. 1(a), "
            "tier curve and per-parameter passes from FasDL Table II; orchestration: estimates"
        ),
    )
    return p.replace(**overrides) if overrides else p


def funcpipe_platform(**overrides: Any) -> Platform:
    """AWS as FuncPipe measured it (70 MiB/s, t_lat 30 ms), to compare with its published numbers.
    The same as ``aws_platform()`` now that its bandwidth is FuncPipe's measurement."""
    return aws_platform(name="aws-funcpipe-measured", **overrides)


_LOCAL_CACHE: dict[str, float] = {}


def measure_flop_rate(seconds: float = 0.6) -> float:
    """Sustained single-thread fp32 training FLOP/s on this machine.

    Runs a conv and a GEMM forward+backward (the two kernels that dominate the zoo), counts their
    FLOPs with torch.utils.flop_counter and divides by wall time. One thread = one vCPU.
    """

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        conv = torch.nn.Conv2d(64, 64, 3, padding=1)
        lin = torch.nn.Linear(512, 512)
        xc = torch.randn(4, 64, 28, 28)
        xl = torch.randn(64, 512)

        def step() -> None:
            conv(xc).sum().backward()
            lin(xl).sum().backward()

        with FlopCounterMode(display=False) as fc:
            step()
        flops = fc.get_total_flops()
        step()  # warm-up
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            step()
            n += 1
        return float(flops * n / (time.perf_counter() - t0))
    finally:
        torch.set_num_threads(threads)


def measure_param_pass_rate(numel: int = 1 << 22, repeats: int = 7) -> float:
    """Seconds per parameter byte per pass on this machine, single-threaded: the median time of an
    Adam step over ``numel`` fp32 parameters divided by its passes (calibration.optimizer_passes(2):
    read weights, gradients and both moments, write weights and moments, zero the gradients)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        w = torch.nn.Parameter(torch.zeros(numel))
        opt = torch.optim.Adam([w], lr=1e-3)
        times = []
        for _ in range(repeats + 1):  # the first step allocates the state
            w.grad = torch.ones(numel)
            t0 = time.perf_counter()
            opt.step()
            opt.zero_grad(set_to_none=False)
            times.append(time.perf_counter() - t0)
        return float(statistics.median(times[1:]) / (optimizer_passes(2.0) * numel * 4))
    finally:
        torch.set_num_threads(threads)


def _local_compute(measure: bool) -> tuple[float, float]:
    """(flops_per_vcpu, param_pass_s_per_byte) of this machine, measured once per process."""
    if not measure:
        return Platform.flops_per_vcpu, Platform.param_pass_s_per_byte
    if "rate" not in _LOCAL_CACHE:
        _LOCAL_CACHE["rate"] = measure_flop_rate()
    if "pass" not in _LOCAL_CACHE:
        _LOCAL_CACHE["pass"] = measure_param_pass_rate()
    return _LOCAL_CACHE["rate"], _LOCAL_CACHE["pass"]


def local_platform(measure: bool = True, **overrides: Any) -> Platform:
    """This machine as the local runtime uses it.

    CPU: ``flops_per_vcpu`` and ``param_pass_s_per_byte`` measured single-threaded; tiers map to
    speed by the AWS curve, capped at this machine's core count (a 10 GB local worker still has
    only ``os.cpu_count()`` cores). Bandwidth: AWS's (what the local runtime emulates when asked);
    storage latency of the embedded moto S3 over localhost is a few ms. Prices stay AWS's, so a
    local plan predicts what the same run would cost on AWS.
    """
    rate, per_byte = _local_compute(measure)
    p = Platform(
        name="local",
        max_vcpu=float(min(6, os.cpu_count() or 1)),
        flops_per_vcpu=rate,
        param_pass_s_per_byte=per_byte,
        storage_latency_s=0.005,
        invoke_overhead_s=0.05,
        notes=f"compute {'measured' if measure else 'AWS defaults'} on this machine; bandwidth = runtime's emulated limit",
    )
    return p.replace(**overrides) if overrides else p


def emulated_platform(
    network: Platform, request_s: float, invoke_s: float, dispatch_s: float, iteration_s: float, **overrides: Any
) -> Platform:
    """The embedded local stack with Lambda's network emulated in every worker (core/netem.py).

    Bandwidth and latency are ``network``'s (what the workers emulate; a real request to moto takes
    ``request_s``, which the emulation counts within the latency, core/netem.py); the
    orchestration constants are the stack's, measured once by
    stagecoach.calibrate. Every local worker computes with one thread whatever its memory,
    so every tier has the speed of one vCPU (the profile's reference), and the compute constants
    the profile does not measure (the optimizer's passes over the parameters) are this machine's,
    measured once (``measure_param_pass_rate``). Prices stay AWS's.
    """
    rate, per_byte = _local_compute(measure=True)
    p = network.replace(
        name="local-emulated",
        mb_per_vcpu=1.0,
        max_vcpu=1.0,
        tier_offset_mb=0.0,
        flops_per_vcpu=rate,
        param_pass_s_per_byte=per_byte,
        storage_latency_s=max(network.storage_latency_s, request_s),
        invoke_overhead_s=invoke_s,
        dispatch_s=dispatch_s,
        iteration_overhead_s=iteration_s,
        poll_delay_s=(0.02 + max(network.storage_latency_s, request_s)) / 2,
        notes="local stack with emulated network; orchestration measured by stagecoach.calibrate",
    )
    return p.replace(**overrides) if overrides else p
