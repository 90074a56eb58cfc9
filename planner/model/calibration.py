"""The published AWS Lambda measurements the compute constants come from, and the fits.

Every number below is quoted from a paper, with the table or section that states it; the functions
derive the constants ``platforms.aws_platform()`` uses, and tests/planner/test_calibration.py checks
that the constants there equal these derivations (so no constant drifts from its source).
docs/performance-model.md §1 writes the compute model down.

Units: "MB" in the papers and in Lambda's memory setting is MiB (2^20 bytes): Lambda bills GB-s
as memory_mb / 1024; FuncPipe's Table 1 and FasDL's Table II model sizes match the models' exact
parameter bytes in MiB (ResNet-101 169.9 MiB = "170 MB"; torchvision's ResNet-50, 25.56 M fp32
parameters = 97.49 MiB = FasDL's "97.49 MB"). Seconds are seconds.

What the seed papers measured on Lambda, and what each one can tell:

* FasDL (Chen et al., IEEE TC 2025) Table II fits one training iteration on Lambda as
  T = a (B + b) / (M + m) (its eq. 4: B samples, M MB), profiled per memory size and batch size.
  Its *shape* is model-independent enough to use: speed grows as (M + m) — the median m of its
  four models is -93 MB, so a tier's speed is (M - 93) / (1769 - 93) times one vCPU's, linear up
  to 10,240 MB — and a part of the iteration does not grow with B: a b / (M + m) seconds, which
  for the four models is 2.7-5.9 ns per parameter byte at one vCPU, i.e. proportional to the
  model's size, not to its samples. Its absolute rate is not usable: the FLOPs of its inputs are
  not stated (CIFAR-10 at 32 x 32 and CoLA at an unstated sequence length), and over the readings
  they admit the four models imply 23-83 GFLOP/s per vCPU.
* FuncPipe (Liu et al., POMACS 2022) §1 and Fig. 1(a), with its slides ("AmoebaNet-D (900MB
  model) ... Computation: 6s/iteration; Communication: 35.5s/iteration"): LambdaML training
  AmoebaNet-D36 on 8 workers of 10,240 MB (LambdaML's rule: the largest memory), local batch 8
  (§1: "32 vs. 8 without partition"), 224 x 224 images (its AmoebaNet ends in AvgPool2d(7)), plain
  SGD (its harness: optimizer "SGD"): 6.0 s of computation per iteration. The only absolute
  measurement of a large model's compute on Lambda in the seed papers: it sets the FLOP rate.

Hydrozoa (serverless containers on Azure) and DiSDeL (OpenWhisk) measured no Lambda compute.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING

from stagecoach.planner.profile.zoo import zoo_profile

if TYPE_CHECKING:  # pragma: no cover
    from stagecoach.planner.model.platforms import Platform
    from stagecoach.planner.profile.layers import ModelProfile

MIB = 2**20
LAMBDA_MB_PER_VCPU = 1769  # https://docs.aws.amazon.com/lambda/latest/dg/configuration-memory.html


@dataclass(frozen=True)
class FasDLFit:
    """One row of FasDL Table II: T = a (B + b) / (M + m) seconds per iteration on Lambda."""

    model: str
    a: float
    b: float
    m: float
    size_mib: float  # the model's parameters, FasDL's "Model Size (MB)"

    def fixed_s_per_byte(self) -> float:
        """The part of an iteration that does not grow with B, per parameter byte, at one vCPU."""
        return self.a * self.b / (LAMBDA_MB_PER_VCPU + self.m) / (self.size_mib * MIB)


# FasDL, IEEE Transactions on Computers 74(2), 2025, Table II ("Workloads").
FASDL_TABLE2: tuple[FasDLFit, ...] = (
    FasDLFit("BERT-Base (CoLA)", 2344.97, 2.37, 1145.66, 417.17),
    FasDLFit("ResNet50 (CIFAR10)", 37.19, 12.48, -111.46, 97.49),
    FasDLFit("MobileNet (CIFAR10)", 13.50, 9.57, -92.88, 13.37),
    FasDLFit("SqueezeNet (CIFAR10)", 2.16, 22.60, -93.22, 4.71),
)

# Passes over the parameters in one iteration of FasDL's profiler (one batch, plain SGD, as LambdaML's
# code, on which FasDL builds, trains): forward reads the weights (1); backward reads them and writes
# the weight gradients (2); SGD reads weights and gradients, writes the weights, and zeroes the
# gradients (4). The per-byte constant below is FasDL's fixed part spread over these 7 passes.
PASSES_FORWARD = 1
PASSES_BACKWARD = 2
PASSES_SGD_STEP = 4


def optimizer_passes(state_ratio: float) -> float:
    """Passes over the parameters of one optimizer step: SGD's 4, plus reading and writing the state
    (rho parameter-sized buffers: SGD-momentum 1, Adam 2)."""
    return PASSES_SGD_STEP + 2.0 * state_ratio


def optimizer_seconds(p_bytes: float, tier_mb: int, plat: Platform) -> float:
    """Time of the optimizer update over p_bytes of fp32 parameters at a tier: memory-bound passes
    over the parameters (``optimizer_passes``: SGD 4, + 2 per state buffer; Adam 8). Here, beside
    the pass counts, so that both the performance model and ``compute_seconds`` read it."""
    return optimizer_passes(plat.optimizer_state_ratio) * plat.param_pass_s(p_bytes, tier_mb)


def tier_offset_mb() -> float:
    """m of the speed curve (M + m) / (1769 + m): the median of FasDL Table II's four fits."""
    return float(statistics.median(f.m for f in FASDL_TABLE2))


def param_pass_s_per_byte() -> float:
    """Seconds per parameter byte per pass at one vCPU: the median of FasDL Table II's fixed parts
    over the 7 passes of an SGD iteration."""
    per = [f.fixed_s_per_byte() / (PASSES_FORWARD + PASSES_BACKWARD + PASSES_SGD_STEP) for f in FASDL_TABLE2]
    return float(statistics.median(per))


@dataclass(frozen=True)
class ComputeMeasurement:
    """A measured compute time on Lambda: one worker's forward + backward + update of one batch."""

    source: str
    model: str  # a zoo name
    tier_mb: int
    batch: int  # samples in the one forward/backward pass
    seconds: float
    optimizer_state_ratio: float  # 0: plain SGD


FUNCPIPE_FIG1A_COMPUTE = ComputeMeasurement(
    source="FuncPipe §1 Fig. 1(a) and its slides: LambdaML, AmoebaNet-D36, 8 workers x 10,240 MB, local batch 8",
    model="amoebanet_d36",
    tier_mb=10240,
    batch=8,
    seconds=6.0,
    optimizer_state_ratio=0.0,
)


def compute_seconds(profile: ModelProfile, tier_mb: int, batch: int, plat: Platform, state_ratio: float) -> float:
    """The model's compute seconds for one worker running the whole model on one batch: every
    layer's forward and backward (``LayerProfile.times``) plus the optimizer step."""
    t = sum(sum(l.times(tier_mb, batch, plat)) for l in profile.layers)
    return t + optimizer_seconds(profile.param_bytes, tier_mb, plat.replace(optimizer_state_ratio=state_ratio))


def calibrate_flops_per_vcpu(measurement: ComputeMeasurement, plat: Platform, profile: ModelProfile | None = None) -> float:
    """The per-vCPU FLOP rate at which the model reproduces ``measurement`` exactly (all other
    constants as in ``plat``). Times are linear in 1/rate, so one evaluation at a reference rate
    and one at twice it solve it."""
    if profile is None:
        profile = zoo_profile(measurement.model)
    # flop part F / r and the rest R: t(r) = F / r + R
    r0 = 1e10
    t1 = compute_seconds(
        profile, measurement.tier_mb, measurement.batch, plat.replace(flops_per_vcpu=r0), measurement.optimizer_state_ratio
    )
    t2 = compute_seconds(
        profile, measurement.tier_mb, measurement.batch, plat.replace(flops_per_vcpu=2 * r0), measurement.optimizer_state_ratio
    )
    flop_part = 2 * (t1 - t2) * r0  # F: t1 - t2 = F / (2 r0)
    rest = t1 - flop_part / r0
    if measurement.seconds <= rest:
        raise ValueError(f"{measurement.source}: {measurement.seconds} s is below the model's non-FLOP part ({rest:.2f} s)")
    return flop_part / (measurement.seconds - rest)
