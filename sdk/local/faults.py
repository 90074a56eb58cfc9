"""Seeded fault injection for the local Lambda runtime: the failures a Lambda training run meets.

Configured by the environment variable ``STAGECOACH_FAULTS`` of the local stack process, a JSON
object of probabilities per training-task invocation, e.g.
``{"seed": 1, "kill": 0.1, "throttle": 0.05, "hang": 0.02, "delete": 0.02}``:

- kill:     the worker process is killed at a random point of its task (mid-upload included);
            the invocation fails with ``Runtime.ExitError``.
- throttle: the invocation is refused by the "service" with ``TooManyRequestsException``
            (Step Functions sees ``Lambda.TooManyRequestsException``).
- hang:     the worker never answers; the invocation times out (``Sandbox.Timedout``) unless the
            Task's own timeout fires first (``States.Timeout``).
- delete:   after a forward task succeeds, one activation it wrote is deleted, so its consumer waits
            in vain and the window must be restarted from its checkpoint.
- fail:     the task fails at once with an error no Retry matches (``Stagecoach.InjectedFailure``):
            its phase, and the window, fail while the phase's other tasks are still running.

Every injected fault is noted in the stack's workers.log (``[runtime] <function>: injected <kind>
{phase, t, stage, ...}``), so a run can be told what it survived (benchmarks/faults.py counts them).

Each invocation's draw depends on the seed and on the task's identity only (its phase, iteration,
stage, replica or shard, a watcher's phase, and how many invocations of that identity came before:
a retry, a watcher's re-run, a restarted window's), not on the order invocations reach the
runtime: two runs with one seed meet the same faults on the same tasks, however their timing
differs, so benchmarks/faults.py compares runs on equal terms.

``once`` scripts faults for tests: a list of {"kind", and event fields to match such as "phase",
"t", "stage", "replica", "shard"; a phase watcher's: "phase": "watch", "watch": "forward" or
"backward"}; each fires on the first invocation that matches it.
"""

from __future__ import annotations

import json
import os
import random
import threading
from dataclasses import dataclass, field
from typing import Any

KINDS = ("kill", "throttle", "hang", "delete", "fail")
# what tells one task from another (core/events.py): a training task's, a phase watcher's
IDENTITY = ("phase", "t", "stage", "replica", "shard", "watch")


@dataclass
class Fault:
    kind: str
    delay_s: float = 0.0  # for kill: how far into the task


@dataclass
class FaultInjector:
    seed: int = 0
    kill: float = 0.0
    throttle: float = 0.0
    hang: float = 0.0
    delete: float = 0.0
    fail: float = 0.0
    kill_within_s: float = 0.5
    once: list[dict[str, Any]] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=lambda: {k: 0 for k in KINDS})
    _seen: dict[str, int] = field(default_factory=dict, repr=False)  # invocations per task identity
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        for f in self.once:
            if f.get("kind") not in KINDS:
                raise ValueError(f"STAGECOACH_FAULTS: once entry {f} needs a kind in {KINDS}")
        for k in KINDS:
            p = getattr(self, k)
            if not 0.0 <= p <= 1.0:
                raise ValueError(f"STAGECOACH_FAULTS: {k}={p} is not a probability")

    @classmethod
    def from_env(cls) -> FaultInjector | None:
        raw = os.environ.get("STAGECOACH_FAULTS")
        if not raw:
            return None
        try:
            spec = json.loads(raw)
            return cls(**spec)
        except (ValueError, TypeError) as e:
            raise ValueError(f"STAGECOACH_FAULTS={raw!r} is not a valid fault spec ({e}); see stagecoach/local/faults.py") from None

    def draw(self, event: object) -> Fault | None:
        """The fault (if any) to inject into this invocation: training tasks, and the phase watchers
        beside them (lambdas/watcher.py: a Lambda invocation like any, which AWS's faults do not spare)."""
        if not isinstance(event, dict) or event.get("phase") not in ("forward", "backward", "sync", "watch"):
            return None
        with self._lock:
            rng = self._rng_of(event)
            for i, f in enumerate(self.once):
                if all(event.get(k) == v for k, v in f.items() if k != "kind"):
                    del self.once[i]
                    self.counts[f["kind"]] += 1
                    return Fault(f["kind"], rng.uniform(0.0, self.kill_within_s))
            u = rng.random()
            delay = rng.uniform(0.0, self.kill_within_s)
            edge = 0.0
            for kind in KINDS:
                edge += getattr(self, kind)
                if u < edge:
                    if kind == "delete" and event["phase"] != "forward":  # a watcher writes no activation
                        return None
                    self.counts[kind] += 1
                    return Fault(kind, delay)
        return None

    def _rng_of(self, event: dict[str, Any]) -> random.Random:
        """The draws of this invocation: seeded by the seed, the task's identity and its count so
        far (a str seed is hashed by SHA-512: the same in every process and run)."""
        ident = json.dumps([event.get(k) for k in IDENTITY], separators=(",", ":"))
        n = self._seen.get(ident, 0)
        self._seen[ident] = n + 1
        return random.Random(f"{self.seed}:{ident}:{n}")
