"""Platform constants in one dated, overridable place.

Every number the performance model uses about the cloud lives here, with its source, so a price
change or a new measurement is one edit (or one ``platform.replace(...)`` call) and never a hunt
through formulas. ``aws_platform()`` is AWS Lambda + Step Functions + S3 in us-east-1 as published
on ``PRICES_AS_OF``; ``local_platform()`` is this machine, measured (FLOP rate) and documented
(the local runtime's emulated bandwidth, its CPU count).
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from stagecoach.planner.limits import LAMBDA_MAX_TIMEOUT_S
from stagecoach.planner.plan import TIMEOUT_SAFETY

# us-east-1 list prices on that date: https://aws.amazon.com/lambda/pricing/,
# https://aws.amazon.com/step-functions/pricing/, https://aws.amazon.com/s3/pricing/
PRICES_AS_OF = "2025-01-15"

# FuncPipe's eight memory tiers (MB). Lambda accepts any value 128-10,240 in 1 MB steps.
FUNCPIPE_TIERS_MB: tuple[int, ...] = (512, 1024, 2048, 3072, 4096, 6144, 8192, 10240)


@dataclass(frozen=True)
class Platform:
    """What the performance model needs to know about where the workers run.

    Units: bytes, seconds, US dollars, MB (= MiB, as Lambda and FuncPipe use it).
    """

    name: str
    tiers_mb: tuple[int, ...] = FUNCPIPE_TIERS_MB
    # CPU: Lambda gives 1 vCPU-equivalent per 1,769 MB, at most 6 (Lambda limits page).
    mb_per_vcpu: float = 1769.0
    max_vcpu: float = 6.0
    # Speed-up of PyTorch intra-op parallelism on v > 1 vCPUs is 1 + (v-1)*efficiency: conv and
    # GEMM kernels scale well but not perfectly; 0.85 is an estimate, measure per tier on AWS.
    parallel_efficiency: float = 0.85
    # Sustained fp32 training FLOP/s of ONE vCPU (forward and backward kernels mixed). AWS value is
    # an estimate for a Lambda x86 vCPU (AVX2/AVX-512 Xeon); local_platform() measures it.
    flops_per_vcpu: float = 2.5e10
    layer_overhead_s: float = 2e-4  # Python/dispatcher cost per layer call, independent of size
    # Storage: per-execution-environment network quota 625 Mbps ~ 78 MB/s (FuncPipe measured 70).
    bandwidth_Bps: float = 78e6
    storage_latency_s: float = 0.03  # FuncPipe: t_lat < 40 ms
    # Step Functions dispatch + warm Lambda invoke, per phase, on the critical path, not billed.
    invoke_overhead_s: float = 0.08
    # Between the starts of consecutive tasks of one Map state (its iterations start one by one).
    dispatch_s: float = 0.005
    # Per iteration, the window's bookkeeping states (Loop Choice, Advance Pass) on the critical path.
    iteration_overhead_s: float = 0.05
    # A worker waiting for another's object notices it this long after it lands, on average: half
    # a poll cycle (the channel's longest back-off, 20 ms, plus a 404's round trip).
    poll_delay_s: float = 0.025
    # Memory: the worker process (Python + torch + boto3) before the model is loaded.
    runtime_base_mb: float = 380.0
    memory_headroom: float = 0.9  # plan at most this fraction of the configured memory
    max_task_s: float = float(LAMBDA_MAX_TIMEOUT_S)  # planner/limits.py
    # TimeoutSeconds = margin * predicted + 10 s, by the runtime contract's rule (plan.timeouts_from,
    # TIMEOUT_SAFETY); a plan whose task exceeds max_task_s / margin is refused there, so the
    # planner treats it as infeasible.
    timeout_margin: float = TIMEOUT_SAFETY
    optimizer_state_ratio: float = 2.0  # optimizer state bytes / parameter bytes (Adam: m and v)
    optimizer_flops_per_param: float = 12.0  # Adam update arithmetic per parameter
    # State that stays warm (docs/runtime.md; Job.warm_state, the default): with d = 1 a stage's
    # parameters and optimizer state stay in its worker's memory and reach S3 once per window, as
    # its checkpoint. Iterations per checkpoint: a window's length (planner/emit/asl.py
    # window_length: 19,992 history events / events per iteration, ~270 at d = 1 with 4 stages);
    # 200 is a round lower figure. 0: every iteration (Job(warm_state=False), the earlier runtime).
    warm_checkpoint_every: int = 200
    # A waiting worker's polling (lambdas/channel.py wait_bytes): the first pause, and the longest
    # (for plans of at most 20 concurrent workers; larger ones poll slower, so fewer GETs).
    poll_first_s: float = 0.005
    poll_max_s: float = 0.02
    # Prices (USD)
    price_gb_s: float = 0.0000166667  # Lambda x86; arm64 is 0.0000133334
    price_request: float = 0.20 / 1e6  # Lambda invocations
    price_transition: float = 0.025 / 1000  # Step Functions Standard
    price_put: float = 0.005 / 1000  # S3 PUT/COPY/POST/LIST
    price_get: float = 0.0004 / 1000  # S3 GET/HEAD
    prices_as_of: str = PRICES_AS_OF
    notes: str = ""

    # -- derived -------------------------------------------------------------------------------
    def vcpu(self, memory_mb: float) -> float:
        """vCPU-equivalents at a memory size: Lambda's proportional CPU share, capped."""
        return min(self.max_vcpu, memory_mb / self.mb_per_vcpu)

    def speedup(self, memory_mb: float) -> float:
        """Compute speed relative to one full vCPU.

        Below one vCPU the function gets a CPU-time share, so time scales exactly as 1/v; above,
        extra cores help with ``parallel_efficiency``.
        """
        v = self.vcpu(memory_mb)
        return v if v <= 1.0 else 1.0 + (v - 1.0) * self.parallel_efficiency

    def polls_while_waiting(self, wait_s: float) -> float:
        """The extra GETs (404s) a worker makes while it waits ``wait_s`` for an object, by the
        channel's back-off (x1.6 from poll_first_s to poll_max_s; its jitter averages out)."""
        if wait_s <= 0:
            return 0.0
        n, t, delay = 1, 0.0, self.poll_first_s  # the first GET misses, then one per pause that ends too soon
        while t + delay < wait_s:
            t += delay
            n += 1
            delay = min(self.poll_max_s, delay * 1.6)
        return float(n)

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
        notes="prices: AWS list prices; bandwidth: Lambda quota 625 Mbps; flops_per_vcpu: estimate",
    )
    return p.replace(**overrides) if overrides else p


def funcpipe_platform(**overrides: Any) -> Platform:
    """AWS with FuncPipe's measured bandwidth (70 MB/s), to compare with its published numbers."""
    return aws_platform(bandwidth_Bps=70e6, name="aws-funcpipe-measured", **overrides)


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


def local_platform(measure: bool = True, **overrides: Any) -> Platform:
    """This machine as the local runtime uses it.

    CPU: ``flops_per_vcpu`` measured single-threaded; the vCPU model maps tiers as on AWS, capped
    at this machine's core count (a 10 GB local worker still has only ``os.cpu_count()`` cores).
    Bandwidth: the local runtime's per-process limit emulates Lambda's 78 MB/s; storage latency of
    the embedded moto S3 over localhost is a few ms. Prices stay AWS's, so a local plan predicts
    what the same run would cost on AWS.
    """
    rate = 2.5e10
    if measure:
        if "rate" not in _LOCAL_CACHE:
            _LOCAL_CACHE["rate"] = measure_flop_rate()
        rate = _LOCAL_CACHE["rate"]
    p = Platform(
        name="local",
        max_vcpu=float(min(6, os.cpu_count() or 1)),
        flops_per_vcpu=rate,
        storage_latency_s=0.005,
        invoke_overhead_s=0.05,
        notes=f"flops_per_vcpu {'measured' if measure else 'default'} on this machine; bandwidth = runtime's emulated limit",
    )
    return p.replace(**overrides) if overrides else p


def emulated_platform(
    network: Platform, request_s: float, invoke_s: float, dispatch_s: float, iteration_s: float, **overrides: Any
) -> Platform:
    """The embedded local stack with Lambda's network emulated in every worker (lambdas/netem.py).

    Bandwidth and latency are ``network``'s (what the workers emulate; a real request to moto takes
    ``request_s``, which the emulation counts within the latency, lambdas/netem.py); the
    orchestration constants are the stack's, measured once by
    stagecoach.calibrate. Every local worker computes with one thread whatever its memory,
    so every tier has the speed of one vCPU (the profile's reference). Prices stay AWS's.
    """
    p = network.replace(
        name="local-emulated",
        mb_per_vcpu=1.0,
        max_vcpu=1.0,
        storage_latency_s=max(network.storage_latency_s, request_s),
        invoke_overhead_s=invoke_s,
        dispatch_s=dispatch_s,
        iteration_overhead_s=iteration_s,
        poll_delay_s=(0.02 + max(network.storage_latency_s, request_s)) / 2,
        notes="local stack with emulated network; orchestration measured by stagecoach.calibrate",
    )
    return p.replace(**overrides) if overrides else p
