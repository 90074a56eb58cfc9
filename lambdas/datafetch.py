"""A worker's samples: the records of its micro-batches, read from the data set's shards in S3
(core/samples.py has the format and the reasons).

A data set small beside the function's memory (planner/plan.py data_resident) is downloaded shard by shard
once per container and kept; a larger one is read by sample, one ranged GET per record, a
micro-batch's records requested at once (the channel keeps several in flight), so the container
holds only its micro-batch's samples, however large the data set. A first stage reads only the
inputs' records, a last stage only the targets'.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import default_collate

from stagecoach.core import keys
from stagecoach.core.samples import Manifest, as_dtype, decode, transformed
from stagecoach.lambdas.channel import Channel
from stagecoach.planner.plan import data_resident


class RemoteSamples:
    def __init__(self, ch: Channel, dataset_id: str, memory_mb: int):
        body = ch.get_bytes(keys.dataset(dataset_id))
        if body is None:
            raise FileNotFoundError(f"data set {keys.dataset(dataset_id)} is missing")
        self.manifest = Manifest.parse(body)
        self.resident = data_resident(self.manifest.total_bytes, memory_mb)
        self.shards: dict[int, bytes] = {}

    def _records(self, ch: Channel, indices: list[int], part: str) -> list[bytes]:
        m = self.manifest
        spots = [m.locate(i, part) for i in indices]
        if self.resident:
            missing = sorted({s for s, _, _ in spots} - set(self.shards))
            pending = [(s, ch.submit_get_bytes(keys.data_shard(m.shards[s]))) for s in missing]
            for s, fut in pending:
                body = fut.result()
                if body is None:
                    raise FileNotFoundError(f"data shard {keys.data_shard(m.shards[s])} is missing")
                self.shards[s] = body
            return [self.shards[s][a:b] for s, a, b in spots]
        futures = [ch.submit_get_bytes(keys.data_shard(m.shards[s]), (a, b)) for s, a, b in spots]
        out = []
        for (s, _, _), fut in zip(spots, futures):
            body = fut.result()
            if body is None:
                raise FileNotFoundError(f"data shard {keys.data_shard(m.shards[s])} is missing")
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
