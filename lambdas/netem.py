"""Emulated Lambda networking for local runs: one upload and one download link per worker process.

A Lambda execution environment has ~78 MB/s to S3 (625 Mbps quota; FuncPipe measured ~70 MB/s)
and every request waits a storage latency (< 40 ms) before its bytes flow. On the local stack the
S3 server is a process on loopback, so without emulation transfers are nearly free and a plan that
is transfer-bound on Lambda looks compute-bound here. The local runtime sets ``STAGECOACH_NETWORK``
for its workers (from the planner's platform constants); on AWS it is unset and nothing is emulated.

The model, per direction: a request issued at time a starts moving bytes at
max(a + latency, the time the link is free) and holds the link for bytes / rate. Concurrent
requests therefore queue on the link (first come, first served) while their latencies overlap,
which is how pipelined S3 requests behave on a bandwidth-capped link. Upload and download are
separate links, as a full-duplex network interface is.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

ENV = "STAGECOACH_NETWORK"


@dataclass
class Link:
    """A token bucket of ``rate_Bps`` with per-request ``latency_s``; thread-safe.

    Requests take the link in the order they were issued (``ticket``), even when the real request
    behind a later one returns first: a GET learns its size only from the response.
    """

    rate_Bps: float
    latency_s: float = 0.0
    clock: Callable[[], float] = time.monotonic
    free_at: float = 0.0
    _cond: threading.Condition = field(default_factory=threading.Condition, repr=False)
    _issued: int = 0
    _served: int = 0

    def ticket(self) -> tuple[int, float]:
        """A place in the link's queue and the issue time, taken when a request is sent."""
        with self._cond:
            self._issued += 1
            return self._issued, self.clock()

    def reserve(self, nbytes: int, issued: float | None = None, ticket: int | None = None) -> float:
        """Book ``nbytes`` on the link for a request issued at ``issued``; returns when it completes.
        With a ``ticket``, wait until every earlier ticket has booked (or given up its place)."""
        a = self.clock() if issued is None else issued
        with self._cond:
            if ticket is not None:
                self._cond.wait_for(lambda: self._served >= ticket - 1, timeout=60)
            begin = max(a + self.latency_s, self.free_at)
            end = begin + (nbytes / self.rate_Bps if self.rate_Bps > 0 else 0.0)
            self.free_at = end
            if ticket is not None:
                self._served = max(self._served, ticket)
                self._cond.notify_all()
        return end

    def give_up(self, ticket: int) -> None:
        """A request that moved no bytes (a 404, an error) leaves the queue."""
        with self._cond:
            self._cond.wait_for(lambda: self._served >= ticket - 1, timeout=60)
            self._served = max(self._served, ticket)
            self._cond.notify_all()

    def latency_only(self, issued: float | None = None) -> float:
        """A request that moves no bytes (a 404, a DELETE): only the latency, no link time."""
        return (self.clock() if issued is None else issued) + self.latency_s


@dataclass(frozen=True)
class NetworkSpec:
    up_Bps: float
    down_Bps: float
    latency_s: float

    def to_env(self) -> str:
        return json.dumps({"up_Bps": self.up_Bps, "down_Bps": self.down_Bps, "latency_s": self.latency_s})

    @classmethod
    def from_env(cls, raw: str) -> "NetworkSpec":
        try:
            d = json.loads(raw)
            spec = cls(float(d["up_Bps"]), float(d["down_Bps"]), float(d.get("latency_s", 0.0)))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{ENV}={raw!r} is not a network spec ({e}): give JSON {{up_Bps, down_Bps, latency_s}}") from None
        if spec.up_Bps <= 0 or spec.down_Bps <= 0 or spec.latency_s < 0:
            raise ValueError(f"{ENV}={raw!r}: rates must be positive and latency non-negative")
        return spec


class Network:
    """The process's two links, or none when nothing is emulated."""

    def __init__(self, spec: NetworkSpec | None, clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> None:
        self.spec = spec
        self.clock = clock
        self.sleep = sleep
        self.up = Link(spec.up_Bps, spec.latency_s, clock) if spec else None
        self.down = Link(spec.down_Bps, spec.latency_s, clock) if spec else None

    def wait_until(self, t: float) -> None:
        delay = t - self.clock()
        if delay > 0:
            self.sleep(delay)


_NETWORK: Network | None = None
_PID = -1


def network() -> Network:
    """This process's emulated network (re-read after a fork: a forked worker gets fresh links)."""
    global _NETWORK, _PID
    if _NETWORK is None or _PID != os.getpid():
        raw = os.environ.get(ENV)
        _NETWORK = Network(NetworkSpec.from_env(raw) if raw else None)
        _PID = os.getpid()
    return _NETWORK
