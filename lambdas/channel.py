"""The S3 channel between workers: tensors as safetensors, waiting by GET with backoff.

S3 is strongly consistent, so a worker that needs an object another worker writes simply GETs it
until it exists (never LIST). Transfer time, waiting time and bytes are counted for the task's
metrics.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

# Iteration objects carry this tag; the bucket's lifecycle rule expires tagged objects as a safety net
# (S3 lifecycle filters cannot match jobs/*/iter/ by prefix).
TRANSIENT_TAG = "stagecoach%3Atransient=true"
WAIT_FIRST_S = 0.005
WAIT_MAX_S = 0.1


class ObjectWaitTimeout(Exception):
    """An object another worker should have written did not appear in time."""


@dataclass
class ChannelStats:
    upload_s: float = 0.0
    download_s: float = 0.0
    wait_s: float = 0.0
    bytes_up: int = 0
    bytes_down: int = 0
    puts: int = 0
    gets: int = 0

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class Channel:
    s3: Any
    bucket: str
    stats: ChannelStats = field(default_factory=ChannelStats)

    def put_bytes(self, key: str, body: bytes) -> None:
        t0 = time.perf_counter()
        extra = {"Tagging": TRANSIENT_TAG} if "/iter/" in key else {}
        self.s3.put_object(Bucket=self.bucket, Key=key, Body=body, **extra)
        self.stats.upload_s += time.perf_counter() - t0
        self.stats.bytes_up += len(body)
        self.stats.puts += 1

    def put_tensors(self, key: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
        body = st_save({k: v.detach().contiguous() for k, v in tensors.items()}, metadata=metadata)
        self.put_bytes(key, body)

    def get_bytes(self, key: str) -> bytes | None:
        """The object's bytes, or None if it does not exist (yet)."""
        t0 = time.perf_counter()
        try:
            body = self.s3.get_object(Bucket=self.bucket, Key=key)["Body"].read()
        except self.s3.exceptions.NoSuchKey:
            self.stats.wait_s += time.perf_counter() - t0
            self.stats.gets += 1
            return None
        self.stats.download_s += time.perf_counter() - t0
        self.stats.bytes_down += len(body)
        self.stats.gets += 1
        return body

    def wait_bytes(self, key: str, deadline: float) -> bytes:
        """GET until the object exists; back off exponentially; give up at ``deadline`` (epoch s)."""
        delay = WAIT_FIRST_S
        while True:
            body = self.get_bytes(key)
            if body is not None:
                return body
            if time.time() + delay > deadline:
                raise ObjectWaitTimeout(f"s3://{self.bucket}/{key} did not appear before the task's deadline")
            t0 = time.perf_counter()
            time.sleep(delay)
            self.stats.wait_s += time.perf_counter() - t0
            delay = min(WAIT_MAX_S, delay * 1.6)

    def wait_tensors(self, key: str, deadline: float) -> dict[str, torch.Tensor]:
        return st_load(self.wait_bytes(key, deadline))

    def get_tensors(self, key: str) -> dict[str, torch.Tensor] | None:
        body = self.get_bytes(key)
        return None if body is None else st_load(body)

    def delete(self, keys: list[str]) -> None:
        """Delete up to 1,000 keys per request; missing keys are fine (idempotent)."""
        for i in range(0, len(keys), 1000):
            chunk = keys[i : i + 1000]
            if chunk:
                self.s3.delete_objects(
                    Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in chunk], "Quiet": True}
                )
