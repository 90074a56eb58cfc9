"""Per-layer profiles: plain data the performance model reads (no torch at import).

A *layer* is one block of the user's nn.Sequential (a block used twice counts twice). The planner
needs, per layer: the bytes of the parameters that train (synced and updated) and of what it holds
without training (buffers, frozen parameters), bytes saved for backward per sample (what a micro-batch's
recomputed forward keeps alive during backward), output and input(-gradient) bytes per sample
(what crosses a stage boundary), and forward/backward time per micro-batch size at each tier.

Two ways to obtain them: ``stagecoach.core.profiling`` runs the real layers (locally, or inside
Lambda per tier) and measures times, stored at one reference vCPU (``fwd_s``/``bwd_s``) or per
tier (``tier_s``); ``profile.meta.profile_meta`` sizes the model on the meta device and counts
FLOPs. The types are JSON-able (``to_dict``/``from_dict``) so a Lambda profile phase can return them.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

from stagecoach.errors import StagecoachError
from stagecoach.planner.profile.flows import Flow, StageBytes, merged_flows, stage_bytes

if TYPE_CHECKING:  # pragma: no cover
    from stagecoach.planner.model.platforms import Platform


class LayerTooLargeError(StagecoachError, ValueError):
    """A single layer cannot fit the largest Lambda memory; no partition can help."""


@dataclass(frozen=True)
class LayerProfile:
    """Measured or estimated facts about one layer (or a merged run of ``count`` layers)."""

    name: str
    # the parameters that train: what is synced, updated, stored per version and given optimizer
    # state (frozen ones, requires_grad=False, are in buffer_bytes and frozen_bytes instead)
    param_bytes: float
    saved_bytes_per_sample: float
    out_bytes_per_sample: float
    in_bytes_per_sample: float
    fwd_flops_per_sample: float = 0.0
    bwd_flops_per_sample: float = 0.0
    # measured seconds per micro-batch at ONE vCPU, keyed by micro-batch size
    fwd_s: Mapping[int, float] = field(default_factory=dict)
    bwd_s: Mapping[int, float] = field(default_factory=dict)
    # measured on the platform per tier: {memory_mb: {micro_batch: (fwd_s, bwd_s)}}
    tier_s: Mapping[int, Mapping[int, tuple[float, float]]] = field(default_factory=dict)
    count: int = 1  # how many original layers this profile stands for (after merging)
    in_requires_grad: bool = True  # False for integer inputs (token ids): no input-gradient
    # bytes per sample of the input's floating leaves (its gradient); None: all of the input
    in_grad_bytes_per_sample: float | None = None
    out_grad_bytes_per_sample: float | None = None  # the output's floating leaves; None: all of it
    # what the layer holds and never trains: buffers (BatchNorm's running statistics, fixed
    # tables) and frozen parameters (requires_grad=False: no gradient, sync or optimizer state)
    buffer_bytes: float = 0.0
    frozen_bytes: float = 0.0  # the frozen parameters' part of buffer_bytes

    @property
    def ingrad_bytes_per_sample(self) -> float:
        if not self.in_requires_grad:
            return 0.0
        return self.in_bytes_per_sample if self.in_grad_bytes_per_sample is None else self.in_grad_bytes_per_sample

    @property
    def outgrad_bytes_per_sample(self) -> float:
        return self.out_bytes_per_sample if self.out_grad_bytes_per_sample is None else self.out_grad_bytes_per_sample

    def times(self, tier_mb: int, micro_batch: int, platform: Platform) -> tuple[float, float]:
        """(forward, backward) seconds for one micro-batch at a memory tier (docs/performance-model.md §1).

        Priority: measured on the platform per tier (the AWS profile phase, ``tier_s``) > measured at
        one vCPU scaled by the tier curve > FLOPs / calibrated FLOP rate plus parameter passes.
        Per-tier measurements are used whenever present: at a measured tier, exactly at a measured
        micro-batch size or on the line through that tier's sizes; between measured tiers, speed
        (1/time) interpolated linearly in memory; beyond them, the nearest measured tier scaled by
        the platform's tier curve (``Platform.speedup``).
        """
        if self.tier_s:
            return self._tier_times(tier_mb, micro_batch, platform)
        sp = platform.speedup(tier_mb)
        if self.fwd_s:
            return (_affine_in_b(self.fwd_s, micro_batch) / sp, _affine_in_b(self.bwd_s, micro_batch) / sp)
        rate = platform.flops_per_vcpu * sp
        # one pass over the layer's parameters forward; backward two over those that train (their
        # gradient), one over the frozen ones (the input's gradient only)
        trains = platform.param_pass_s(self.param_bytes, tier_mb)
        frozen = platform.param_pass_s(self.frozen_bytes, tier_mb)
        return (
            self.fwd_flops_per_sample * micro_batch / rate + trains + frozen,
            self.bwd_flops_per_sample * micro_batch / rate + 2 * trains + frozen,
        )

    def _measured_at(self, tier_mb: int, micro_batch: int) -> tuple[float, float]:
        per = self.tier_s[tier_mb]
        if micro_batch in per:
            f, b = per[micro_batch]
            return float(f), float(b)
        return (_affine_in_b({k: v[0] for k, v in per.items()}, micro_batch), _affine_in_b({k: v[1] for k, v in per.items()}, micro_batch))

    def _tier_times(self, tier_mb: int, micro_batch: int, platform: Platform) -> tuple[float, float]:
        if tier_mb in self.tier_s:
            return self._measured_at(tier_mb, micro_batch)
        measured = sorted(self.tier_s)
        lo = [t for t in measured if t < tier_mb]
        hi = [t for t in measured if t > tier_mb]
        if lo and hi:  # between two measured tiers: speed linear in memory
            t0, t1 = lo[-1], hi[0]
            w = (tier_mb - t0) / (t1 - t0)
            out = []
            for a, b in zip(self._measured_at(t0, micro_batch), self._measured_at(t1, micro_batch)):
                out.append(0.0 if a <= 0 or b <= 0 else 1.0 / ((1 - w) / a + w / b))
            return out[0], out[1]
        near = lo[-1] if lo else hi[0]
        k = platform.speedup(near) / platform.speedup(tier_mb)
        f, b = self._measured_at(near, micro_batch)
        return f * k, b * k

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["fwd_s"] = {str(k): v for k, v in self.fwd_s.items()}
        d["bwd_s"] = {str(k): v for k, v in self.bwd_s.items()}
        d["tier_s"] = {str(t): {str(b): list(v) for b, v in per.items()} for t, per in self.tier_s.items()}
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LayerProfile:
        d = dict(d)
        d["fwd_s"] = {int(k): float(v) for k, v in d.get("fwd_s", {}).items()}
        d["bwd_s"] = {int(k): float(v) for k, v in d.get("bwd_s", {}).items()}
        d["tier_s"] = {int(t): {int(b): (float(v[0]), float(v[1])) for b, v in per.items()} for t, per in d.get("tier_s", {}).items()}
        return cls(**d)


def _affine_in_b(points: Mapping[int, float], b: int) -> float:
    """Time at micro-batch size b from measured points: exact if measured, else a least-squares
    line t = c0 + c1*b through them (one point: proportional)."""
    if b in points:
        return float(points[b])
    xs = sorted(points)
    if len(xs) == 1:
        return float(points[xs[0]]) * b / xs[0]
    n = len(xs)
    mx = sum(xs) / n
    my = sum(points[x] for x in xs) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    c1 = sum((x - mx) * (points[x] - my) for x in xs) / sxx
    c0 = my - c1 * mx
    return max(0.0, c0 + c1 * b)


@dataclass(frozen=True)
class ModelProfile:
    """A model as the planner sees it: an ordered tuple of layer profiles."""

    name: str
    layers: tuple[LayerProfile, ...]
    input_bytes_per_sample: float
    label_bytes_per_sample: float = 8.0
    source: str = "meta"  # "meta" (FLOP-based) or "measured"
    # bytes every container allocates to build its stage whatever the stage: 0 when it builds only
    # its stage (on the meta device, core/stagebuild.py); the whole model's parameters and
    # buffers for a job whose factory needs the full build (JobSpec.build = "full")
    build_bytes: float = 0.0
    # a model cut from its graph passes named values, each sent by the stage computing it straight
    # to the stages reading it (planner/profile/flows.py); empty: each layer's output is the next
    # layer's whole input, relayed stage by stage
    flows: tuple[Flow, ...] = ()
    # the training set's bytes as stored (samples and their record headers): a set too large to
    # keep in a worker (planner/plan.py data_resident) is read by sample, which the model charges
    data_bytes: float = 0.0
    # the job clips its global gradient norm: a barrier among the updating tasks (perfmodel §3.3)
    clip_grad_norm: bool = False
    # stored parameter bytes per computed one: 2 for a bfloat16 job, whose master weights are fp32
    master_ratio: float = 1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))
        object.__setattr__(self, "flows", tuple(self.flows))
        if not self.layers:
            raise ValueError(f"model {self.name!r} has no layers: give an nn.Sequential with at least one child")

    @property
    def param_bytes(self) -> float:
        """The bytes of the parameters that train (frozen ones: ``frozen_bytes``)."""
        return sum(l.param_bytes for l in self.layers)

    @property
    def frozen_bytes(self) -> float:
        return sum(l.frozen_bytes for l in self.layers)

    def trains_before(self, layer: int) -> bool:
        """Whether a layer before ``layer`` has parameters that train. If none does (a frozen
        backbone, or layers without parameters), no gradient is needed before ``layer``: a
        stage starting there sends no input gradient back (lambdas/phases.py)."""
        return any(l.param_bytes > 0 for l in self.layers[:layer])

    def stage_io(self, lo: int, hi: int) -> StageBytes:
        """Bytes per sample a stage of layers [lo, hi) receives and sends (and their gradients).
        The first stage's input is its rows of the data set; the last stage's output the model's
        (held for the loss, sent nowhere). No gradient crosses a cut with nothing that trains
        before it (:meth:`trains_before`)."""
        first, last = self.layers[lo], self.layers[hi - 1]
        whole = StageBytes(
            first.in_bytes_per_sample, last.out_bytes_per_sample, first.ingrad_bytes_per_sample, last.outgrad_bytes_per_sample
        )
        if self.flows:
            direct = stage_bytes(self.flows, lo, hi)
            end = hi == len(self.layers)
            whole = StageBytes(
                whole.in_ps if lo == 0 else direct.in_ps,
                whole.out_ps if end else direct.out_ps,
                whole.ingrad_ps if lo == 0 else direct.ingrad_ps,
                whole.outgrad_ps if end else direct.outgrad_ps,
            )
        ingrad = whole.ingrad_ps if self.trains_before(lo) else 0.0
        outgrad = whole.outgrad_ps if self.trains_before(hi) else 0.0
        return StageBytes(whole.in_ps, whole.out_ps, ingrad, outgrad)

    @property
    def original_layers(self) -> int:
        return sum(l.count for l in self.layers)

    def merged(self, max_layers: int, platform: Platform, micro_batch: int = 4) -> ModelProfile:
        """Merge consecutive layers into at most ``max_layers`` groups of balanced compute time.

        Why: the MILP's size grows with the layer count; most models have far more children than
        useful stage boundaries. Groups minimise the largest group's forward+backward time (linear
        partition, exact DP), so boundaries remain where the work is evenly divisible. Stage
        boundaries can only fall between groups afterwards: the plan is optimal over those.
        """
        n = len(self.layers)
        if max_layers >= n:
            return self
        ref = platform.tiers_mb[len(platform.tiers_mb) // 2]
        w = [sum(l.times(ref, micro_batch, platform)) for l in self.layers]
        groups = balanced_partition(w, max_layers)
        out = []
        i = 0
        for g in groups:
            out.append(merge_layers(self.layers[i : i + g]))
            i += g
        return replace(self, layers=tuple(out), flows=merged_flows(self.flows, groups))

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "layers": [l.to_dict() for l in self.layers],
            "input_bytes_per_sample": self.input_bytes_per_sample,
            "label_bytes_per_sample": self.label_bytes_per_sample,
            "source": self.source,
            "build_bytes": self.build_bytes,
            "flows": [f.to_dict() for f in self.flows],
            "data_bytes": self.data_bytes,
            "clip_grad_norm": self.clip_grad_norm,
            "master_ratio": self.master_ratio,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ModelProfile:
        return cls(
            name=d["name"],
            layers=tuple(LayerProfile.from_dict(l) for l in d["layers"]),
            input_bytes_per_sample=float(d["input_bytes_per_sample"]),
            label_bytes_per_sample=float(d.get("label_bytes_per_sample", 8.0)),
            source=d.get("source", "measured"),
            build_bytes=float(d.get("build_bytes", 0.0)),
            flows=tuple(Flow.from_dict(f) for f in d.get("flows", [])),
            data_bytes=float(d.get("data_bytes", 0.0)),
            clip_grad_norm=bool(d.get("clip_grad_norm", False)),
            master_ratio=float(d.get("master_ratio", 1.0)),
        )


def balanced_partition(weights: Sequence[float], parts: int) -> list[int]:
    """Split ``weights`` into ``parts`` contiguous non-empty groups minimising the largest sum.

    Exact O(parts * n^2) dynamic programme; returns group sizes. Ties prefer later cuts, so equal
    weights split evenly.
    """
    n = len(weights)
    parts = max(1, min(parts, n))
    pre = [0.0]
    for w in weights:
        pre.append(pre[-1] + w)
    INF = math.inf
    best = [[INF] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for j in range(k, n + 1):
            for i in range(k - 1, j):
                v = max(best[k - 1][i], pre[j] - pre[i])
                if v <= best[k][j]:
                    best[k][j], cut[k][j] = v, i
    sizes = []
    j = n
    for k in range(parts, 0, -1):
        i = cut[k][j]
        sizes.append(j - i)
        j = i
    return sizes[::-1]


def _summed_times(layers: Sequence[LayerProfile]) -> tuple[dict[int, float], dict[int, float]]:
    """Forward and backward seconds at one vCPU of layers run as a unit: sums, at the micro-batch
    sizes every one of them was measured at (a size some layer lacks cannot be summed)."""
    bs = set(layers[0].fwd_s)
    for l in layers:
        bs &= set(l.fwd_s)
    return {b: sum(l.fwd_s[b] for l in layers) for b in bs}, {b: sum(l.bwd_s[b] for l in layers) for b in bs}


def _summed_tier_times(layers: Sequence[LayerProfile]) -> dict[int, dict[int, tuple[float, float]]]:
    """The per-tier counterpart of ``_summed_times``: at the tiers, and there the micro-batch sizes,
    every one of the layers was measured at."""
    tiers: dict[int, dict[int, tuple[float, float]]] = {}
    common_t = set(layers[0].tier_s)
    for l in layers:
        common_t &= set(l.tier_s)
    for t in common_t:
        cb = set(layers[0].tier_s[t])
        for l in layers:
            cb &= set(l.tier_s[t])
        tiers[t] = {b: (sum(l.tier_s[t][b][0] for l in layers), sum(l.tier_s[t][b][1] for l in layers)) for b in cb}
    return tiers


def merge_layers(layers: Sequence[LayerProfile]) -> LayerProfile:
    """One profile for consecutive layers run as a unit (sums; boundary sizes from the ends)."""
    if len(layers) == 1:
        return layers[0]
    fwd_s, bwd_s = _summed_times(layers)
    return LayerProfile(
        name=f"{layers[0].name}..{layers[-1].name}",
        param_bytes=sum(l.param_bytes for l in layers),
        saved_bytes_per_sample=sum(l.saved_bytes_per_sample for l in layers),
        out_bytes_per_sample=layers[-1].out_bytes_per_sample,
        in_bytes_per_sample=layers[0].in_bytes_per_sample,
        fwd_flops_per_sample=sum(l.fwd_flops_per_sample for l in layers),
        bwd_flops_per_sample=sum(l.bwd_flops_per_sample for l in layers),
        fwd_s=fwd_s,
        bwd_s=bwd_s,
        tier_s=_summed_tier_times(layers),
        count=sum(l.count for l in layers),
        in_requires_grad=layers[0].in_requires_grad,
        in_grad_bytes_per_sample=layers[0].in_grad_bytes_per_sample,
        out_grad_bytes_per_sample=layers[-1].out_grad_bytes_per_sample,
        buffer_bytes=sum(l.buffer_bytes for l in layers),
        frozen_bytes=sum(l.frozen_bytes for l in layers),
    )


def compositions(n: int, max_parts: int) -> Iterator[tuple[int, ...]]:
    """Every way to cut n ordered layers into at most max_parts non-empty contiguous groups (the
    partitions the brute force and FuncPipe's search enumerate)."""
    for cuts in range(min(n, max_parts)):
        for pos in itertools.combinations(range(1, n), cuts):
            edges = (0, *pos, n)
            yield tuple(edges[i + 1] - edges[i] for i in range(len(edges) - 1))
