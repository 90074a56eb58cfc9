"""The training arithmetic shared by the workers and the single-process reference.

Everything that must agree bit for bit between a pipelined, data-parallel run and plain PyTorch
lives here: which samples form iteration t's global batch, how it splits into replicas and
micro-batches, how randomness is seeded, and how a stage's parameters flatten into shards.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from stagecoach.core import boundary
from stagecoach.planner.plan import stage_chunks, writes_through

# The dtypes a job may train in, by the names its spec carries.
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


def master_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the stored parameters and the optimizer's state: float32 under bfloat16
    (mixed precision: bf16 compute and transfers, fp32 master weights), else the job's own."""
    return torch.float32 if dtype == torch.bfloat16 else dtype


DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def build_model(factory: Callable[[], nn.Module], seed: int, dtype: torch.dtype) -> nn.Module:
    """The model at its initial parameters and buffers: the factory run under the job's seed.

    The client and every container build it alike, so buffers (which never travel) agree, and
    parameters agree before version 0 is even loaded.
    """
    torch.manual_seed(seed)
    model = factory()
    return model.to(dtype) if isinstance(model, nn.Module) else model


def derive_seed(*parts: object) -> int:
    """A 63-bit seed from (seed, iteration, layer, replica, micro-batch...): stable across processes."""
    h = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 63) - 1)


# A growing global batch (dynamic workers, docs/runtime.md "Dynamic workers"): (first iteration,
# global batch) pairs in order, the first at iteration 0; None or one pair: a fixed global batch.
BatchSizes = Sequence[tuple[int, int]]


def epoch_of(t: int, n_samples: int, global_batch: int, sizes: BatchSizes | None = None) -> int:
    """The epoch iteration t belongs to (each epoch: n_samples // global_batch iterations; with
    ``sizes``, see :func:`batch_position`)."""
    if sizes is not None and len(sizes) > 1:
        return batch_position(t, n_samples, sizes)[0]
    return t // (n_samples // global_batch)


def batch_indices(seed: int, t: int, n_samples: int, global_batch: int, sizes: BatchSizes | None = None) -> torch.Tensor:
    """Sample indices of iteration t's global batch: epochs of a seeded permutation, last partial batch dropped.
    ``sizes``: a global batch that changes (:func:`batch_position`)."""
    if sizes is not None and len(sizes) > 1:
        epoch, start, size = batch_position(t, n_samples, sizes)
        g = torch.Generator().manual_seed(derive_seed(seed, "data", epoch))
        return torch.randperm(n_samples, generator=g)[start : start + size]
    steps = n_samples // global_batch
    epoch, i = divmod(t, steps)
    g = torch.Generator().manual_seed(derive_seed(seed, "data", epoch))
    perm = torch.randperm(n_samples, generator=g)
    return perm[i * global_batch : (i + 1) * global_batch]


def batch_position(t: int, n_samples: int, sizes: BatchSizes) -> tuple[int, int, int]:
    """(epoch, first position in the epoch's permutation, global batch) of iteration t when the
    global batch changes at the iterations ``sizes`` says: each iteration takes the next samples
    of the epoch's permutation after the previous iteration's (the cumulative offset, not t * G);
    one whose batch no longer fits in what is left of the epoch starts the next epoch (the rest is
    dropped, as a fixed batch drops its last partial one). For one size it is :func:`batch_indices`'
    own rule: epoch t // steps, position (t % steps) * G."""
    epoch, pos = 0, 0
    for i, (first, size) in enumerate(sizes):
        if not 0 < size <= n_samples:
            raise ValueError(f"global batch {size} from iteration {first}: must be in [1, {n_samples}] (the training set's size)")
        if pos + size > n_samples:  # a larger batch does not fit in what is left: the next epoch
            epoch, pos = epoch + 1, 0
        end = sizes[i + 1][0] if i + 1 < len(sizes) else None
        count = (end if end is not None and end <= t else t) - first  # this size's iterations before t
        left = (n_samples - pos) // size
        if count < left:
            pos += count * size
        else:
            steps = n_samples // size
            epoch, pos = epoch + 1 + (count - left) // steps, ((count - left) % steps) * size
        if end is None or t < end:
            return epoch, pos, size
    raise ValueError(f"batch sizes {list(sizes)}: iteration {t} is before the first ({sizes[0][0] if sizes else 'none'})")


def micro_batch(batch: torch.Tensor, replicas: int, micro_batches: int, replica: int, mb: int) -> torch.Tensor:
    """Replica r takes the r-th contiguous slice of the global batch, then splits it into micro-batches."""
    size = batch.numel() // (replicas * micro_batches)
    start = (replica * micro_batches + mb) * size
    return batch[start : start + size]


def run_layers(layers: Iterable[nn.Module], first_layer: int, x: Any, seed: int, t: int, replica: int, mb: int) -> Any:
    """Run consecutive layers, reseeding the RNG before each one; each takes what the previous one
    returned (a tensor, or a tuple, list or dict of tensors: core/boundary.py).

    Seeding per (seed, t, layer, replica, micro-batch) makes dropout masks independent of how the
    layers are split into stages, and lets the backward phase's recompute see the forward's masks.
    """
    for i, layer in enumerate(layers):
        torch.manual_seed(derive_seed(seed, t, first_layer + i, replica, mb))
        x = layer(x)
        if not isinstance(x, torch.Tensor):
            boundary.check(x, f"layer {first_layer + i} ({type(layer).__name__})")
    return x


@dataclass(frozen=True)
class Tied:
    """A parameter a stage uses that an earlier stage owns (tied weights, a module used twice)."""

    param: nn.Parameter  # this model instance's tensor
    owner: int  # the stage that owns and updates it
    index: int  # its position in the owner's parameter list
    offset: int  # where it starts in the owner's flat vector


@dataclass(frozen=True)
class Ownership:
    """Which stage owns which parameter: the first stage that uses it, once each, in order of
    use. A stage's flat vector holds only what it owns; the parameters it shares with an earlier
    stage are that stage's, read from its version and updated with both stages' gradients summed.

    Only parameters that train are owned: a frozen one (``requires_grad=False``) is in no flat
    vector, so no gradient of it is computed, moved, reduced or clipped, no optimizer state is
    made for it and no update touches it — as torch.optim skips a parameter whose ``.grad`` is
    None. It travels with the stage's buffers instead (core/stagebuild.py ``stage_buffers``)."""

    owned: list[list[nn.Parameter]]
    tied: list[list[Tied]]
    numels: list[int]  # of each stage's flat vector
    users_of: list[list[int]]  # per stage, the later stages that use parameters it owns

    def numel(self, stage: int) -> int:
        return self.numels[stage]

    def users(self, stage: int) -> list[int]:
        return self.users_of[stage]

    def for_stage(self, stage: int) -> Ownership:
        """Only ``stage``'s tensors kept (a container must not hold the other stages' parameters)."""
        keep = range(len(self.owned))
        return Ownership(
            [self.owned[s] if s == stage else [] for s in keep],
            [self.tied[s] if s == stage else [] for s in keep],
            self.numels,
            self.users_of,
        )


def ownership(layers: Sequence[nn.Module], stages: Sequence[range]) -> Ownership:
    """Owned and tied parameters per stage of ``layers`` cut into ``stages`` (index ranges); frozen
    parameters are neither (:class:`Ownership`)."""
    owner: dict[int, tuple[int, int, int]] = {}  # id -> (stage, index, offset)
    owned: list[list[nn.Parameter]] = []
    tied: list[list[Tied]] = []
    for s, rng in enumerate(stages):
        mine: list[nn.Parameter] = []
        theirs: list[Tied] = []
        seen: set[int] = set()
        offset = 0
        for i in rng:
            for p in layers[i].parameters():
                if id(p) in seen or not p.requires_grad:
                    continue
                seen.add(id(p))
                if id(p) in owner:
                    o, idx, off = owner[id(p)]
                    theirs.append(Tied(p, o, idx, off))
                else:
                    owner[id(p)] = (s, len(mine), offset)
                    mine.append(p)
                    offset += p.numel()
        owned.append(mine)
        tied.append(theirs)
    numels = [sum(p.numel() for p in mine) for mine in owned]
    users_of = [[b for b in range(len(tied)) if any(t.owner == a for t in tied[b])] for a in range(len(owned))]
    return Ownership(owned, tied, numels, users_of)


RUNNING_STATS = ("running_mean", "running_var", "num_batches_tracked")


def tracked_norms(layers: Iterable[nn.Module], first_layer: int) -> dict[str, nn.modules.batchnorm._BatchNorm]:
    """The BatchNorms with running statistics in consecutive layers, keyed "<layer>.<module path>"
    by the layer's index in the model, so a stage's and the whole model's keys agree."""
    out: dict[str, nn.modules.batchnorm._BatchNorm] = {}
    for i, layer in enumerate(layers):
        for path, m in layer.named_modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats:
                out[".".join(x for x in (str(first_layer + i), path) if x)] = m
    return out


def running_stats(layers: Iterable[nn.Module], first_layer: int) -> dict[str, torch.Tensor]:
    """The buffers a forward pass in train mode updates — BatchNorm's running statistics — of
    consecutive layers, keyed "<layer>.<module path>.<buffer>" (tracked_norms' keys)."""
    out: dict[str, torch.Tensor] = {}
    for key, m in tracked_norms(layers, first_layer).items():
        for name in RUNNING_STATS:
            buf = getattr(m, name, None)
            if isinstance(buf, torch.Tensor):
                out[f"{key}.{name}"] = buf
    return out


def install_buffers(mine: dict[str, torch.Tensor], values: dict[str, torch.Tensor], what: str) -> None:
    """Copy ``values`` into a stage's buffers ``mine`` (same keys, every one of them)."""
    if set(mine) != set(values):
        raise ValueError(f"{what} {sorted(values)} do not fit the stage's {sorted(mine)}")
    with torch.no_grad():
        for k, buf in mine.items():
            buf.copy_(values[k])


def load_running_stats(layers: Iterable[nn.Module], first_layer: int, values: dict[str, torch.Tensor]) -> None:
    """Install running statistics saved by :func:`running_stats` (every one of them)."""
    install_buffers(running_stats(layers, first_layer), values, "running statistics")


def trains_up_to(own: Ownership, stage: int) -> bool:
    """Whether a stage at or before ``stage`` owns a parameter that trains: else no gradient is
    needed at or before it (a frozen backbone), so its backward pass has nothing to compute and
    the next stage sends it no input gradient (lambdas/phases.py)."""
    return any(n > 0 for n in own.numels[: stage + 1])


def flat_params(params: Iterable[nn.Parameter]) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in params]) if params else torch.zeros(0)


def flat_grads(params: Iterable[nn.Parameter]) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])


def assign_flat(params: Sequence[nn.Parameter], flat: torch.Tensor) -> None:
    offset = 0
    with torch.no_grad():
        for p in params:
            n = p.numel()
            p.copy_(flat[offset : offset + n].view_as(p))
            offset += n
    if offset != flat.numel():
        raise ValueError(f"parameter vector has {flat.numel()} elements, the stage needs {offset}")


def shard_bounds(numel: int, shards: int) -> list[tuple[int, int]]:
    """Contiguous, nearly equal [start, end) ranges of a flat vector: shard k is reduced by sync task k."""
    q, r = divmod(numel, shards)
    out, start = [], 0
    for k in range(shards):
        end = start + q + (1 if k < r else 0)
        out.append((start, end))
        start = end
    return out


def stage_layout(numel: int, itemsize: int, shards: int, replicas: int, chunks: int = 0) -> list[list[tuple[int, int]]]:
    """Per shard, its chunks as [start, end) ranges of the stage's flat vector.

    Everyone derives the same layout from the stage's size and the plan (shards = K, replicas = d,
    chunks = the plan's C for the stage, 0 for the size rule), so object keys need no manifest; the
    chunk count is part of the runtime contract (planner/plan.py ``stage_chunks``), which the
    performance model reads too, so what it predicts is what runs.
    """
    out = []
    for a, b in shard_bounds(numel, shards):
        n = stage_chunks(chunks, b - a, itemsize, replicas)
        out.append([(a + x, a + y) for x, y in shard_bounds(b - a, n)])
    return out


def stage_writes_through(numel: int, itemsize: int, shards: int, replicas: int) -> bool:
    """Whether a warm stage of ``numel`` stored parameters is written through at every version:
    its largest shard is small (planner/plan.py ``writes_through``)."""
    return all(writes_through(sum(b - a for a, b in chunks) * itemsize) for chunks in stage_layout(numel, itemsize, shards, replicas))
