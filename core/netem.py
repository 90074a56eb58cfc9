"""Emulated Lambda networking for local runs: one upload and one download link per worker process.

A Lambda execution environment has ~78 MB/s to S3 (625 Mbps quota; FuncPipe measured ~70 MB/s)
and every request waits a storage latency (< 40 ms) before its bytes flow. On the local stack the
S3 server is a process on loopback, so without emulation transfers are nearly free and a plan that
is transfer-bound on Lambda looks compute-bound here. The local runtime sets ``STAGECOACH_NETWORK``
for its workers (from the planner's platform constants); on AWS it is unset and nothing is emulated.

The model, per direction, is a shared link of ``rate_Bps``: the requests moving bytes at the same
time share it fairly (processor sharing, as TCP flows through one rate-limited interface roughly
do), so a small GET next to a large download still gets through quickly; each request also waits
the storage latency once, overlapping other requests' transfers. An upload becomes visible to
others only when its transfer and latency have passed (the real PUT is made then), a download
returns its bytes only after theirs. Upload and download are separate links, as a full-duplex
network interface is.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

ENV = "STAGECOACH_NETWORK"


def share(remaining: dict[Hashable, float], elapsed: float, rate: float) -> None:
    """Advance every unfinished transfer by its fair share of ``elapsed`` seconds of a link of
    ``rate`` bytes/s (in place). A transfer that finishes frees its share for the others at once."""
    while elapsed > 0 and rate > 0:
        live = [k for k, r in remaining.items() if r > 0]
        if not live:
            return
        n = len(live)
        first = min(remaining[k] for k in live)
        t = first * n / rate
        if t <= elapsed:
            for k in live:
                remaining[k] = max(0.0, remaining[k] - first)
            elapsed -= t
        else:
            for k in live:
                remaining[k] -= elapsed * rate / n
            return


@dataclass
class Link:
    """A link of ``rate_Bps`` shared fairly by the transfers on it; thread-safe."""

    rate_Bps: float
    clock: Callable[[], float] = time.monotonic
    _cond: threading.Condition = field(default_factory=threading.Condition, repr=False)
    _remaining: dict[Hashable, float] = field(default_factory=dict, repr=False)
    _t: float = 0.0

    def _advance(self) -> None:
        now = self.clock()
        share(self._remaining, now - self._t, self.rate_Bps)
        self._t = now

    def transfer(self, nbytes: int) -> None:
        """Block until ``nbytes`` have crossed the link alongside whatever else is on it."""
        if nbytes <= 0 or self.rate_Bps <= 0:
            return
        key = object()
        with self._cond:
            self._advance()
            self._remaining[key] = float(nbytes)
            self._cond.notify_all()  # the others' shares just shrank: let them recompute
            while True:
                self._advance()
                if self._remaining[key] <= 1e-6:
                    del self._remaining[key]
                    self._cond.notify_all()
                    return
                live = [r for r in self._remaining.values() if r > 0]
                next_done = min(live) * len(live) / self.rate_Bps
                self._cond.wait(timeout=min(max(next_done, 1e-4), 0.05))


@dataclass(frozen=True)
class NetworkSpec:
    up_Bps: float
    down_Bps: float
    latency_s: float

    def to_env(self) -> str:
        return json.dumps({"up_Bps": self.up_Bps, "down_Bps": self.down_Bps, "latency_s": self.latency_s})

    @classmethod
    def from_env(cls, raw: str) -> NetworkSpec:
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

    def __init__(
        self, spec: NetworkSpec | None, clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep
    ) -> None:
        self.spec = spec
        self.clock = clock
        self.sleep = sleep
        self.up = Link(spec.up_Bps, clock) if spec else None
        self.down = Link(spec.down_Bps, clock) if spec else None
        self._put_s_per_byte = 0.0

    def latency(self, spent: float = 0.0) -> None:
        """One request's round trip to storage (overlaps whatever else is in flight), less
        ``spent``: the real request to the local S3 server takes time too, and it is the same
        round trip, not an extra one."""
        if self.spec and self.spec.latency_s > spent:
            self.sleep(self.spec.latency_s - spent)

    def expected_put_s(self, nbytes: int) -> float:
        """How long a real PUT of ``nbytes`` to the local server is likely to take (observed)."""
        return self._put_s_per_byte * max(nbytes, 65536)

    def observed_put(self, nbytes: int, seconds: float) -> None:
        self._put_s_per_byte = 0.8 * self._put_s_per_byte + 0.2 * seconds / max(nbytes, 65536)


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
