"""A data set in S3 as workers read it: samples in content-addressed shards, fetched by sample.

Why this shape (docs/data.md): a first or last stage needs only the samples of its micro-batches,
so a container's memory must not grow with the data set. Each sample is stored as its own
safetensors record (its input and target, any tensor structure: core/boundary.py), records are
concatenated into shards of a few MiB, and a manifest lists each shard's content hash and each
record's byte offset. A worker then reads a sample with one ranged GET of its record, or, when the
whole data set is small beside its function's memory, downloads every shard once and keeps it
(fewer requests, as one object would). Shards are named by their content's hash and the data set
by its manifest's, so the same data is uploaded once and shared by jobs.

Per-sample transforms (augmentation) run in the worker on the stored sample, with torch's RNG
seeded per (seed, epoch, sample index), so a retried task, another plan and the single-process
reference all draw the same augmentation.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from torch.utils import _pytree as pytree
from torch.utils.data import default_collate

from stagecoach.core import boundary
from stagecoach.core.training import derive_seed

SHARD_BYTES = 8 << 20  # a shard's target size: a few MiB, many samples per object, one PUT each
DIGEST_BYTES = 16  # a record's digest in the manifest (record_digest): 32 bytes a sample


def record_digest(record: bytes) -> bytes:
    """A record's digest as the manifest keeps it (BLAKE2b, 16 bytes): a worker checks each record
    it reads by range against it, so a shard need not be downloaded whole to be checked."""
    return hashlib.blake2b(record, digest_size=DIGEST_BYTES).digest()


@dataclass(frozen=True)
class Manifest:
    """``data/{id}/manifest``: the shards (``data/{id}/shards/<content hash>``, keys.data_shard) and where every sample's
    input and target records lie in them and each record's digest (``record_digest``); its id is
    its own body's hash, so the id covers the digests and the digests cover every record. Offsets
    are int64 tensors, 8 bytes per record, and digests 16 bytes per record, so a million samples
    cost a container 48 MB."""

    shards: tuple[str, ...]
    first: torch.Tensor  # [shards + 1]: each shard's first sample index; the sample count last
    offsets: torch.Tensor  # per shard, 2k + 1 byte offsets (input_i, target_i, ..., end), concatenated
    base: torch.Tensor  # [shards]: where each shard's offsets start in ``offsets``
    digests: torch.Tensor  # uint8 [2 * samples, DIGEST_BYTES]: record_digest of input_i (row 2i), target_i (2i + 1)
    input_bytes: int  # all samples' input tensors (what the planner's data terms count)
    target_bytes: int

    @property
    def samples(self) -> int:
        return int(self.first[-1])

    @property
    def total_bytes(self) -> int:
        ends = self.base + 2 * (self.first[1:] - self.first[:-1])
        return int(self.offsets[ends].sum())

    def locate(self, index: int, part: str = "both") -> tuple[int, int, int]:
        """(shard, start, end) of sample ``index``'s input, target or both (they are adjacent)."""
        if not 0 <= index < self.samples:
            raise IndexError(f"sample {index} of a data set of {self.samples}")
        shard = int(torch.searchsorted(self.first, index, right=True)) - 1
        at = int(self.base[shard]) + 2 * (index - int(self.first[shard]))
        start = int(self.offsets[at + (1 if part == "target" else 0)])
        end = int(self.offsets[at + (1 if part == "input" else 2)])
        return shard, start, end

    def digest(self, index: int, part: str) -> bytes:
        """The ``record_digest`` of sample ``index``'s input or target record, as uploaded."""
        return self.digests[2 * index + (1 if part == "target" else 0)].numpy().tobytes()

    def body(self) -> bytes:
        # one metadata entry: safetensors writes several in no fixed order, and the id is this body's hash
        meta = {"manifest": json.dumps({"shards": list(self.shards), "input_bytes": self.input_bytes, "target_bytes": self.target_bytes})}
        tensors = {"first": self.first, "offsets": self.offsets, "base": self.base, "digests": self.digests}
        return st_save(tensors, metadata=meta)

    @classmethod
    def parse(cls, body: bytes) -> Manifest:
        meta = json.loads(safe_open_metadata(body)["manifest"])
        t = st_load(body)
        if "digests" not in t:
            raise ValueError(
                "this data set's manifest predates per-record digests, so its records cannot be checked: launch the "
                "job again, whose upload writes the manifest anew (under a new data set id)"
            )
        shards, sizes = tuple(meta["shards"]), (int(meta["input_bytes"]), int(meta["target_bytes"]))
        return cls(shards, t["first"], t["offsets"], t["base"], t["digests"], *sizes)

    def dataset_id(self) -> str:
        return hashlib.sha256(self.body()).hexdigest()[:32]


def safe_open_metadata(body: bytes) -> dict[str, str]:
    (n,) = struct.unpack("<Q", body[:8])
    meta: dict[str, str] = json.loads(body[8 : 8 + n]).get("__metadata__", {})
    return meta


def encode(part: Any) -> bytes:
    """One record: a sample's input or its target, any tensor structure (boundary.pack)."""
    return st_save({k: v.detach().contiguous() for k, v in boundary.pack(part).items()})


def decode(body: bytes) -> Any:
    return boundary.unpack(st_load(body))


def leaf_bytes(obj: Any) -> int:
    return sum(t.numel() * t.element_size() for t in boundary.leaves(obj))


def check_sample(sample: Any, where: str) -> None:
    """A sample must be an (input, target) pair of tensors or tensor structures."""
    if not isinstance(sample, (tuple, list)) or len(sample) != 2:
        raise TypeError(f"{where} is {type(sample).__name__}: a data set's item must be an (input, target) pair")
    for part, name in zip(sample, ("input", "target")):
        bad = [type(leaf).__name__ for leaf in boundary.leaves(part) if not isinstance(leaf, torch.Tensor)]
        if bad or not boundary.leaves(part):
            raise TypeError(
                f"{where}'s {name} holds {bad[0] if bad else 'no tensor'}: inputs and targets must be tensors, or tuples, lists or dicts of tensors"
            )


def as_dtype(obj: Any, dtype: torch.dtype) -> Any:
    """Floating leaves in the job's dtype; ids and masks as they are."""
    return boundary.map_leaves(lambda t: t.to(dtype) if t.is_floating_point() else t, obj)


def collate(samples: Sequence[tuple[Any, Any]]) -> tuple[Any, Any]:
    """A batch as the stacked inputs and targets (torch's default_collate: x[idx] for tensors)."""
    inputs, targets = default_collate([s[0] for s in samples]), default_collate([s[1] for s in samples])
    return inputs, targets


def transformed(sample: tuple[Any, Any], transform: Callable[[Any], Any] | None, seed: int, epoch: int, index: int) -> tuple[Any, Any]:
    """The sample with ``transform`` applied to its input under torch's RNG seeded per (seed,
    epoch, sample): the same draw wherever and however often it runs."""
    if transform is None:
        return sample
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(derive_seed(seed, "transform", epoch, index))
        return transform(sample[0]), sample[1]
    finally:
        torch.random.set_rng_state(state)


def _as_tensor(v: Any) -> Any:
    """A Python number (a class index, as torchvision data sets return) or a numpy array or scalar
    as a tensor, as torch's default_collate makes it (numpy: torch.as_tensor, sharing the array's
    memory); anything else as it is."""
    if isinstance(v, (bool, int, float)):
        return torch.tensor(v)
    if isinstance(v, (np.ndarray, np.generic)):
        try:
            return torch.as_tensor(v)
        except (TypeError, ValueError) as e:  # object arrays, strings: no tensor of them
            raise TypeError(f"a numpy array of {v.dtype} cannot be a tensor ({e}): give numbers") from None
    return v


def _as_tensors(obj: Any) -> Any:
    """A sample's numbers and numpy arrays as tensors (``_as_tensor``), in any structure."""
    if isinstance(obj, torch.Tensor):
        return obj
    return pytree.tree_map(_as_tensor, obj)


_ARRAYS = (torch.Tensor, np.ndarray)  # what ``train=`` may give as (inputs, targets): row i is sample i


def _given_as_tensors(data: Any) -> bool:
    """Whether the data is given as tensors or numpy arrays (one, or a tuple or list of them)
    rather than as a Dataset: then it must be an (inputs, targets) pair (``_tensor_pair``)."""
    return isinstance(data, _ARRAYS) or (isinstance(data, (tuple, list)) and bool(data) and all(isinstance(t, _ARRAYS) for t in data))


def _tensor_pair(data: Any, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The (inputs, targets) tensors (numpy arrays as the tensors torch.from_numpy makes of them),
    refused unless they are two with as many rows, at least one."""
    if isinstance(data, _ARRAYS) or len(data) != 2:
        n = 1 if isinstance(data, _ARRAYS) else len(data)
        raise TypeError(f"job.{what} holds {n} tensor(s): give an (inputs, targets) pair; a data set without labels cannot be trained")
    try:
        x, y = (_as_tensor(t) for t in data)
    except TypeError as e:
        raise TypeError(f"job.{what}: {e}") from None
    if x.dim() == 0 or y.dim() == 0 or x.shape[0] != y.shape[0] or x.shape[0] == 0:
        n, m = (x.shape[0] if x.dim() else 0), (y.shape[0] if y.dim() else 0)
        raise TypeError(f"job.{what}: {n} inputs but {m} labels; they must match and be non-empty")
    return x, y


Shapes = tuple[tuple[str, Any, tuple[tuple[int, ...], ...]], ...]


def _shapes(sample: tuple[Any, Any]) -> Shapes:
    """A sample's input and target as their structures and their leaves' shapes."""
    out = []
    for part, name in zip(sample, ("input", "target")):
        leaves, spec = pytree.tree_flatten(part)
        out.append((name, spec, tuple(tuple(t.shape) for t in leaves)))
    return tuple(out)


def _unlike(what: str, i: int, got: Shapes, first: Shapes) -> str:
    """Why sample i cannot be stacked with sample 0 (``LocalSamples.check_all``)."""
    for (name, spec, shapes), (_, spec0, shapes0) in zip(got, first):
        if spec != spec0:
            return (
                f"job.{what}[{i}]'s {name} is structured otherwise than job.{what}[0]'s ({spec} vs {spec0}): a batch stacks "
                "its samples, so every sample must have the same structure"
            )
        if shapes != shapes0:
            show = (lambda s: str(s[0])) if len(shapes) == 1 else str
            return (
                f"job.{what}[{i}]'s {name} has shape {show(shapes)} but job.{what}[0]'s {show(shapes0)}: a batch stacks its "
                "samples (torch's default_collate), so every sample's tensors must have the same shapes; pad or crop them "
                "in the Dataset"
            )
    return f"job.{what}[{i}] differs from job.{what}[0]"


class LocalSamples:
    """The client's view of a job's data: an (inputs, targets) pair of tensors (sample i is row i
    of each) or any map-style torch Dataset whose items are (input, target) pairs."""

    def __init__(self, data: Any, what: str = "train"):
        self.data, self.what = data, what
        self.tensors: tuple[torch.Tensor, torch.Tensor] | None = _tensor_pair(data, what) if _given_as_tensors(data) else None
        if self.tensors is None and not (hasattr(data, "__getitem__") and hasattr(data, "__len__")):
            raise TypeError(
                f"job.{what} is {type(data).__name__}: give (inputs, targets) tensors or a map-style torch Dataset "
                "(with __len__ and __getitem__(i) -> (input, target))"
            )

        self._walked = self.tensors is not None  # rows of two tensors: alike by construction

    def __len__(self) -> int:
        return int(self.tensors[0].shape[0]) if self.tensors is not None else len(self.data)

    def check_all(self) -> None:
        """Read every item once, as the upload will, and refuse what would fail only in a worker:
        an index below ``len`` that ``__getitem__`` cannot read, an item that is not an (input,
        target) pair of tensors, and one whose structure or shapes differ from item 0's (a batch
        stacks its samples, as torch's default_collate does). Raises TypeError; done once."""
        if self._walked:
            return
        n, first = len(self), _shapes(self._item(0))
        for i in range(1, n):
            got = _shapes(self._item(i))
            if got != first:
                raise TypeError(_unlike(self.what, i, got, first))
        self._walked = True

    def _item(self, i: int) -> tuple[Any, Any]:
        try:
            return self[i]
        except TypeError as e:
            if str(e).startswith(f"job.{self.what}["):  # check_sample's: names the item already
                raise
            raise TypeError(f"job.{self.what}[{i}] fails: TypeError: {e}") from None
        except IndexError as e:
            raise TypeError(
                f"job.{self.what}[{i}] raises IndexError ({e}), but len(job.{self.what}) is {len(self)}: __len__ must count "
                "exactly the items __getitem__ returns"
            ) from None
        except Exception as e:
            raise TypeError(f"job.{self.what}[{i}] fails: {type(e).__name__}: {e}") from None

    def __getitem__(self, i: int) -> tuple[Any, Any]:
        if self.tensors is not None:
            return self.tensors[0][i], self.tensors[1][i]
        sample = self.data[i]
        if isinstance(sample, (tuple, list)) and len(sample) == 2:
            sample = (_as_tensors(sample[0]), _as_tensors(sample[1]))
        check_sample(sample, f"job.{self.what}[{i}]")
        return sample[0], sample[1]

    def batch(self, indices: torch.Tensor, transform: Callable[[Any], Any] | None = None, seed: int = 0, epoch: int = 0) -> tuple[Any, Any]:
        """Samples ``indices`` stacked (with ``transform`` seeded as the workers seed it)."""
        if self.tensors is not None and transform is None:
            return self.tensors[0][indices], self.tensors[1][indices]  # what collating its rows gives
        return collate([transformed(self[int(i)], transform, seed, epoch, int(i)) for i in indices])
