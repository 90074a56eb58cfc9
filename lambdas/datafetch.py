"""A worker's samples: the records of its micro-batches, read from the data set's shards in S3
(core/samples.py has the format and the reasons).

A data set small beside the function's memory (planner/plan.py data_resident) is downloaded shard by shard
once per container and kept; a larger one is read by sample, one ranged GET per record, a
micro-batch's records requested at once (the channel keeps several in flight), so the container
holds only its micro-batch's samples, however large the data set. A first stage reads only the
inputs' records, a last stage only the targets'.

Every object of a data set lies under its prefix data/<id>/ (core/keys.py), and the job's role may
read the prefixes of its own data sets only (sdk/deploy/roles.py job_dataset_policy): a worker
reads its job's training and validation sets and nothing of another job's.

Nothing read is trusted for its name alone: the manifest and the shards are named by their content's
SHA-256, and whoever may write the bucket's data/ could put other bytes under a right name. So the
manifest is checked against the data set's id (the job's spec names it; the id is the manifest's
hash, and the manifest holds every record's digest), a whole shard a resident set downloads against
its name, and each record a streamed set reads by range against its digest in the manifest: no
shard is downloaded whole to check a ranged read. A mismatch fails the task with
:class:`DataIntegrityError`, naming the object and what to do.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import default_collate

from stagecoach.core import keys
from stagecoach.core.samples import Manifest, as_dtype, decode, record_digest, transformed
from stagecoach.errors import StagecoachError
from stagecoach.lambdas.channel import Channel
from stagecoach.planner.plan import data_resident


class DataIntegrityError(StagecoachError):
    """A data set's manifest, shard or record is not the bytes its name says."""


FIX = (
    "Nothing was trained on them. Something with write access to the bucket's data/ (the deployer "
    "policy grants it) replaced them: find out what, then launch the job again, whose upload checks the "
    "data set's objects and puts the right bytes back."
)


def _check(what: str, key: str, body: bytes, name: str) -> None:
    """``body`` must be what ``name`` (a SHA-256 in hex, or its first 32 or more digits) says."""
    got = hashlib.sha256(body).hexdigest()
    if len(name) < 32 or not got.startswith(name):
        raise DataIntegrityError(
            f"{what} {key} does not hash to its name (its SHA-256 is {got}): the bucket holds other bytes "
            f"under this content-addressed name than were uploaded. {FIX}"
        )


class RemoteSamples:
    def __init__(self, ch: Channel, dataset_id: str, memory_mb: int):
        self.id = dataset_id
        key = keys.dataset(dataset_id)
        body = ch.get_bytes(key)
        if body is None:
            raise FileNotFoundError(
                f"data set {key} is missing: a job launched before data sets were kept under a prefix of their own "
                "(data/<id>/, which the job's role is granted) cannot read its set; launch the job again, which uploads it there"
            )
        _check("data set", key, body, dataset_id)  # the id is the first 32 hex digits of its SHA-256
        self.manifest = Manifest.parse(body)
        self.resident = data_resident(self.manifest.total_bytes, memory_mb)
        self.shards: dict[int, bytes] = {}  # resident: checked shards, kept

    def _shard(self, s: int, body: bytes | None) -> bytes:
        key = keys.data_shard(self.id, self.manifest.shards[s])
        if body is None:
            raise FileNotFoundError(f"data shard {key} is missing")
        _check("data shard", key, body, self.manifest.shards[s])
        return body

    def _records(self, ch: Channel, indices: list[int], part: str) -> list[bytes]:
        m = self.manifest
        spots = [m.locate(i, part) for i in indices]
        if self.resident:
            missing = sorted({s for s, _, _ in spots} - set(self.shards))
            pending = [(s, ch.submit_get_bytes(keys.data_shard(self.id, m.shards[s]))) for s in missing]
            for s, fut in pending:
                self.shards[s] = self._shard(s, fut.result())
            return [self.shards[s][a:b] for s, a, b in spots]
        futures = [ch.submit_get_bytes(keys.data_shard(self.id, m.shards[s]), (a, b)) for s, a, b in spots]
        out = []
        for index, (s, a, b), fut in zip(indices, spots, futures):
            body = fut.result()
            if body is None:
                raise FileNotFoundError(f"data shard {keys.data_shard(self.id, m.shards[s])} is missing")
            if record_digest(body) != m.digest(index, part):
                raise DataIntegrityError(
                    f"sample {index}'s {part} record in data shard {keys.data_shard(self.id, m.shards[s])} (bytes {a}-{b - 1}) does "
                    f"not match its digest in the data set's manifest: the bucket holds other bytes under this "
                    f"content-addressed name than were uploaded. {FIX}"
                )
            out.append(body)
        return out

    def inputs(
        self, ch: Channel, indices: torch.Tensor, transform: Callable[[Any], Any] | None, seed: int, epoch: int, dtype: torch.dtype
    ) -> Any:
        """The samples' inputs, each transformed as samples.transformed does, stacked, floating
        leaves in the job's dtype."""
        idx = [int(i) for i in indices]
        parts = [decode(r) for r in self._records(ch, idx, "input")]
        return as_dtype(default_collate([transformed((p, None), transform, seed, epoch, i)[0] for p, i in zip(parts, idx)]), dtype)

    def targets(self, ch: Channel, indices: torch.Tensor) -> Any:
        return default_collate([decode(r) for r in self._records(ch, [int(i) for i in indices], "target")])
