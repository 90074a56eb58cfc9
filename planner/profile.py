"""Per-layer profiles (plain data) and meta-device sizing.

A *layer* is one child of the user's nn.Sequential. The planner needs, per layer: parameter bytes,
bytes saved for backward per sample (what a micro-batch's recomputed forward keeps alive during
backward), output and input(-gradient) bytes per sample (what crosses a stage boundary), and
forward/backward time per micro-batch size at each memory tier.

Two ways to obtain them:
* ``stagecoach.lambdas.profiling`` runs the real layers (locally or inside Lambda per tier) and
  measures times; those times are stored at one reference vCPU (``fwd_s``/``bwd_s``) or per tier
  (``tier_s``, measured on AWS).
* ``profile_meta`` builds the model on ``torch.device("meta")``: sizes are exact, FLOPs are counted
  with torch.utils.flop_counter, times come from the platform's calibrated FLOP rate. This plans
  paper-scale models without allocating them.

The types are JSON-able (``to_dict``/``from_dict``) so a Lambda profile phase can return them.
torch is imported lazily: importing this module is cheap.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any, Mapping, Sequence

if TYPE_CHECKING:  # pragma: no cover
    from .platforms import Platform


class LayerTooLargeError(ValueError):
    """A single layer cannot fit the largest Lambda memory; no partition can help."""


@dataclass(frozen=True)
class LayerProfile:
    """Measured or estimated facts about one layer (or a merged run of ``count`` layers)."""

    name: str
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

    @property
    def ingrad_bytes_per_sample(self) -> float:
        return self.in_bytes_per_sample if self.in_requires_grad else 0.0

    def times(self, tier_mb: int, micro_batch: int, platform: "Platform") -> tuple[float, float]:
        """(forward, backward) seconds for one micro-batch at a memory tier.

        Priority: measured at that tier (AWS profile phase) > measured at one vCPU scaled by the
        vCPU model > FLOPs / calibrated FLOP rate scaled by the vCPU model.
        """
        per = self.tier_s.get(tier_mb)
        if per and micro_batch in per:
            f, b = per[micro_batch]
            return float(f), float(b)
        sp = platform.speedup(tier_mb)
        if self.fwd_s:
            return (_affine_in_b(self.fwd_s, micro_batch) / sp, _affine_in_b(self.bwd_s, micro_batch) / sp)
        ov = platform.layer_overhead_s * self.count
        rate = platform.flops_per_vcpu * sp
        return (ov + self.fwd_flops_per_sample * micro_batch / rate, ov + self.bwd_flops_per_sample * micro_batch / rate)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["fwd_s"] = {str(k): v for k, v in self.fwd_s.items()}
        d["bwd_s"] = {str(k): v for k, v in self.bwd_s.items()}
        d["tier_s"] = {str(t): {str(b): list(v) for b, v in per.items()} for t, per in self.tier_s.items()}
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "LayerProfile":
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

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))
        if not self.layers:
            raise ValueError(f"model {self.name!r} has no layers: give an nn.Sequential with at least one child")

    @property
    def param_bytes(self) -> float:
        return sum(l.param_bytes for l in self.layers)

    @property
    def original_layers(self) -> int:
        return sum(l.count for l in self.layers)

    def merged(self, max_layers: int, platform: "Platform | None" = None, micro_batch: int = 4) -> "ModelProfile":
        """Merge consecutive layers into at most ``max_layers`` groups of balanced compute time.

        Why: the MILP's size grows with the layer count; most models have far more children than
        useful stage boundaries. Groups minimise the largest group's forward+backward time (linear
        partition, exact DP), so boundaries remain where the work is evenly divisible. Stage
        boundaries can only fall between groups afterwards: the plan is optimal over those.
        """
        n = len(self.layers)
        if max_layers >= n:
            return self
        from .platforms import aws_platform

        plat = platform or aws_platform()
        ref = plat.tiers_mb[len(plat.tiers_mb) // 2]
        w = [sum(l.times(ref, micro_batch, plat)) for l in self.layers]
        groups = balanced_partition(w, max_layers)
        out = []
        i = 0
        for g in groups:
            out.append(merge_layers(self.layers[i : i + g]))
            i += g
        return replace(self, layers=tuple(out))

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "layers": [l.to_dict() for l in self.layers],
            "input_bytes_per_sample": self.input_bytes_per_sample,
            "label_bytes_per_sample": self.label_bytes_per_sample,
            "source": self.source,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ModelProfile":
        return cls(
            name=d["name"],
            layers=tuple(LayerProfile.from_dict(l) for l in d["layers"]),
            input_bytes_per_sample=float(d["input_bytes_per_sample"]),
            label_bytes_per_sample=float(d.get("label_bytes_per_sample", 8.0)),
            source=d.get("source", "measured"),
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


def merge_layers(layers: Sequence[LayerProfile]) -> LayerProfile:
    """One profile for consecutive layers run as a unit (sums; boundary sizes from the ends)."""
    if len(layers) == 1:
        return layers[0]
    bs = set(layers[0].fwd_s)
    for l in layers:
        bs &= set(l.fwd_s)
    tiers: dict[int, dict[int, tuple[float, float]]] = {}
    common_t = set(layers[0].tier_s)
    for l in layers:
        common_t &= set(l.tier_s)
    for t in common_t:
        cb = set(layers[0].tier_s[t])
        for l in layers:
            cb &= set(l.tier_s[t])
        tiers[t] = {b: (sum(l.tier_s[t][b][0] for l in layers), sum(l.tier_s[t][b][1] for l in layers)) for b in cb}
    return LayerProfile(
        name=f"{layers[0].name}..{layers[-1].name}",
        param_bytes=sum(l.param_bytes for l in layers),
        saved_bytes_per_sample=sum(l.saved_bytes_per_sample for l in layers),
        out_bytes_per_sample=layers[-1].out_bytes_per_sample,
        in_bytes_per_sample=layers[0].in_bytes_per_sample,
        fwd_flops_per_sample=sum(l.fwd_flops_per_sample for l in layers),
        bwd_flops_per_sample=sum(l.bwd_flops_per_sample for l in layers),
        fwd_s={b: sum(l.fwd_s[b] for l in layers) for b in bs},
        bwd_s={b: sum(l.bwd_s[b] for l in layers) for b in bs},
        tier_s=tiers,
        count=sum(l.count for l in layers),
        in_requires_grad=layers[0].in_requires_grad,
    )


# -- tensor helpers shared with the measuring profiler -------------------------------------------
def tensor_bytes(obj: Any) -> int:
    """Bytes of every tensor in a (nested) tensor/tuple/list/dict output."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (tuple, list)):
        return sum(tensor_bytes(o) for o in obj)
    if isinstance(obj, dict):
        return sum(tensor_bytes(o) for o in obj.values())
    return 0


def batch_like(sample: Any, b: int, device: Any = None) -> Any:
    """A batch of ``b`` copies of one sample (tensor or nested), on ``device``."""
    import torch

    if isinstance(sample, torch.Tensor):
        x = sample.unsqueeze(0).expand(b, *sample.shape)
        x = x.to(device) if device is not None else x
        return x.contiguous() if x.device.type != "meta" else torch.empty(x.shape, dtype=x.dtype, device="meta")
    if isinstance(sample, (tuple, list)):
        return type(sample)(batch_like(s, b, device) for s in sample)
    raise TypeError(f"sample input must be a tensor or a tuple of tensors, got {type(sample).__name__}")


def requires_grad_(obj: Any) -> Any:
    import torch

    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point():
            obj = obj.detach().requires_grad_(True)
        return obj
    if isinstance(obj, (tuple, list)):
        return type(obj)(requires_grad_(o) for o in obj)
    return obj


def any_requires_grad(obj: Any) -> bool:
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.is_floating_point()
    if isinstance(obj, (tuple, list)):
        return any(any_requires_grad(o) for o in obj)
    return False


def grad_seed(out: Any) -> tuple[list[Any], list[Any]]:
    """Tensors of an output needing grad and matching ones-like seeds for backward."""
    import torch

    outs, seeds = [], []
    items = out if isinstance(out, (tuple, list)) else (out,)
    for o in items:
        if isinstance(o, torch.Tensor) and o.requires_grad:
            outs.append(o)
            seeds.append(torch.ones_like(o))
    return outs, seeds


class SavedBytes:
    """Context manager summing bytes of tensors autograd saves for backward (deduplicated).

    Real tensors are deduplicated by storage address (a tensor saved by two ops, or a view of
    one, counts once); meta tensors have no address, so by object identity.
    """

    def __init__(self) -> None:
        self.total = 0
        self._seen: set[Any] = set()
        self._keep: list[Any] = []
        self._ctx: Any = None

    def _pack(self, t: Any) -> Any:
        if t.device.type == "meta":
            key: Any = ("id", id(t))
            self._keep.append(t)
            nbytes = t.numel() * t.element_size()
        else:
            st = t.untyped_storage()
            key = ("ptr", st.data_ptr())
            nbytes = st.nbytes()
        if key not in self._seen:
            self._seen.add(key)
            self.total += nbytes
        return t

    def __enter__(self) -> "SavedBytes":
        import torch

        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._ctx.__exit__(*exc)
        self._keep.clear()


def _size_layer(layer: Any, x: Any, flops: bool = True) -> tuple[Any, int, float, float]:
    """Run one layer with grad on input x: (output, saved bytes, fwd FLOPs, bwd FLOPs).

    FLOP counting on meta goes through decompositions and is slow, so callers count it once.
    """
    import contextlib

    import torch
    from torch.utils.flop_counter import FlopCounterMode

    x = requires_grad_(x)
    fwd = bwd = 0.0
    with torch.enable_grad():
        fc = FlopCounterMode(display=False) if flops else contextlib.nullcontext()
        with fc:
            with SavedBytes() as sb:
                y = layer(x)
        if flops:
            fwd = fc.get_total_flops()
            outs, seeds = grad_seed(y)
            if outs:
                with FlopCounterMode(display=False) as fb:
                    torch.autograd.backward(outs, seeds)
                bwd = fb.get_total_flops()
    return y, sb.total, float(fwd), float(bwd)


def _detach(obj: Any) -> Any:
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.detach()
    if isinstance(obj, (tuple, list)):
        return type(obj)(_detach(o) for o in obj)
    return obj


def profile_meta(
    model: Any,
    sample_input: Any,
    name: str = "model",
    label_bytes_per_sample: float = 8.0,
) -> ModelProfile:
    """Profile an nn.Sequential on the meta device: exact sizes, FLOP-counted compute.

    ``model``: an nn.Sequential, or a zero-argument factory (called under torch.device("meta") so
    nothing is allocated). ``sample_input``: one sample (no batch dimension), any device.
    Per-sample quantities come from batch sizes 1 and 2 (difference), so batch-independent saved
    tensors (weights) are excluded.
    """
    import torch

    with torch.device("meta"):
        m = model() if callable(model) and not isinstance(model, torch.nn.Module) else model
    if any(p.device.type != "meta" for p in m.parameters()):
        import copy

        m = copy.deepcopy(m).to("meta")  # never move the caller's model
    if not isinstance(m, torch.nn.Sequential):
        raise TypeError(f"{name}: the planner partitions an nn.Sequential of blocks, got {type(m).__name__}")
    sample = _to_meta(sample_input)
    x1, x2 = batch_like(sample, 1, "meta"), batch_like(sample, 2, "meta")
    in1 = tensor_bytes(x1)
    layers = []
    for i, (child_name, child) in enumerate(m._modules.items()):  # a block used twice counts twice
        rg = any_requires_grad(x1)
        y1, s1, f1, b1 = _size_layer(child, x1)
        y2, s2, _, _ = _size_layer(child, x2, flops=False)
        pbytes = sum(p.numel() * p.element_size() for p in child.parameters())
        layers.append(
            LayerProfile(
                name=f"{i}:{child_name}" if not child_name.isdigit() else f"{i}:{type(child).__name__}",
                param_bytes=float(pbytes),
                saved_bytes_per_sample=float(max(0, s2 - s1)),
                out_bytes_per_sample=float(tensor_bytes(y2) - tensor_bytes(y1)),
                in_bytes_per_sample=float(tensor_bytes(x2) - tensor_bytes(x1)),
                fwd_flops_per_sample=f1,
                bwd_flops_per_sample=b1,
                in_requires_grad=rg,
            )
        )
        x1, x2 = _detach(y1), _detach(y2)
    return ModelProfile(name=name, layers=tuple(layers), input_bytes_per_sample=float(in1), label_bytes_per_sample=label_bytes_per_sample, source="meta")


def _to_meta(obj: Any) -> Any:
    import torch

    if isinstance(obj, torch.Tensor):
        return torch.empty(obj.shape, dtype=obj.dtype, device="meta")
    if isinstance(obj, (tuple, list)):
        return type(obj)(_to_meta(o) for o in obj)
    raise TypeError(f"sample input must be a tensor or tuple of tensors, got {type(obj).__name__}")


def check_fits(profile: ModelProfile, platform: "Platform", micro_batch: int = 1) -> None:
    """Raise LayerTooLargeError naming the first layer that cannot fit the largest tier alone.

    A layer alone in a stage at micro-batch ``micro_batch`` needs at least its weights, gradients
    and a flat gradient copy plus one micro-batch's saved activations and boundary tensors; if that
    exceeds the largest tier, no plan exists. Fix: split the layer into smaller children of the
    nn.Sequential, or use a smaller micro-batch.
    """
    from .perfmodel import stage_memory_bytes
    from .syncmodel import sync_choices

    top = max(platform.tiers_mb)
    cap = platform.usable_bytes(top)
    for l in profile.layers:
        # the least it needs under any data-parallel degree and sync algorithm (they differ in the
        # buffers they add), so a layer is refused only if no plan at all can hold it
        need = min(stage_memory_bytes([l], micro_batch, replicas=d, platform=platform, sync=ch)
                   for d in (1, 2, 4, 8, 16, 32) for ch in sync_choices(d))
        if need > cap:
            raise LayerTooLargeError(
                f"layer {l.name!r} of {profile.name!r} cannot fit in {top} MB of Lambda memory: it has "
                f"{l.param_bytes / 2**20:.0f} MB of parameters and needs about {need / 2**20:.0f} MB alone "
                f"(weights, gradients, a flat gradient copy and {micro_batch} sample(s) of activations: "
                f"{l.saved_bytes_per_sample / 2**20:.0f} MB/sample) but at most {cap / 2**20:.0f} MB is usable. "
                "Split this layer into several children of the nn.Sequential."
            )
