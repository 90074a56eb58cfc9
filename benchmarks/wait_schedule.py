"""S3 requests per iteration of the README demo with waits that learn when their object lands
(lambdas/channel.py WAIT_AHEAD, the default) and without (``STAGECOACH_WAIT_AHEAD=0``: every
wait polls from its start), each run on an embedded local stack of its own, counted from the
stack's request log as benchmarks/requests.py counts them (POLL: a GET answered 404), beside
seconds per iteration and whether both runs' parameters are the same bits.

Run: python benchmarks/wait_schedule.py [--iterations 10] [--repeat 1]
"""

from __future__ import annotations

import argparse
import os
import runpy
import tempfile
from typing import Any
from unittest import mock

import torch

from stagecoach.lambdas.channel import WAIT_AHEAD_ENV
from stagecoach.local.access import REQUEST_LOG_ENV
from stagecoach.local.backend import LocalBackend

HERE = os.path.dirname(os.path.abspath(__file__))
counting: dict[str, Any] = runpy.run_path(os.path.join(HERE, "requests.py"))


def s_per_iteration(run: Any) -> float:
    """From the first training task's start to the last's end, per iteration (benchmarks/cost.py)."""
    train = [m for m in run.metrics() if m.phase in ("forward", "backward", "sync")]
    its = sorted({m.t for m in train})
    first = min(m.start for m in train if m.t == its[0])
    last = max(m.end for m in train if m.t == its[-1])
    return float((last - first) / len(its))


def one(iterations: int, ahead: str) -> tuple[dict[str, float], float, list[torch.Tensor]]:
    """The demo on a stack of its own: (requests per steady iteration by class, s/iteration, the
    final parameters of every stage)."""
    log = os.path.join(tempfile.mkdtemp(prefix="stagecoach-waits-"), "s3.log")
    env = {REQUEST_LOG_ENV: log, WAIT_AHEAD_ENV: ahead, "STAGECOACH_LOCAL_ATTACH": "0", "STAGECOACH_LOCAL_START": "0"}
    with mock.patch.dict(os.environ, env):
        backend = LocalBackend()  # started now: the stack and its workers inherit the variables
        try:
            job, defaults = counting["demo_job"](iterations, f"waits-{ahead.replace('.', '')}")
            run = job.run(backend=backend, **defaults)
            assert run.wait(progress=False, timeout_s=1800) == "SUCCEEDED"
            s = s_per_iteration(run)
            params = [run.stage_vector(st) for st in range(run.plan.stages)]
        finally:
            backend.stack.close()
    each, _ = counting["per_iteration"](list(counting["read_log"](log)), iterations)
    return {cls: sum(v for (_k, c), v in each.items() if c == cls) for cls in ("PUT", "GET", "POLL")}, s, params


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iterations", type=int, default=10)
    ap.add_argument("--repeat", type=int, default=1)
    args = ap.parse_args()
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores at the start")
    print(f"{'waits':<12} {'PUT/it':>7} {'GET/it':>7} {'POLL/it':>8} {'s/it':>6}  same bits")
    for _ in range(args.repeat):
        first: list[torch.Tensor] | None = None
        for ahead, label in (("0", "from start"), ("0.8", "learnt")):
            c, s, params = one(args.iterations, ahead)
            same = "" if first is None else str(all(torch.equal(a, b) for a, b in zip(first, params)))
            first = first or params
            print(f"{label:<12} {c['PUT']:>7.2f} {c['GET']:>7.2f} {c['POLL']:>8.2f} {s:>6.3f}  {same}", flush=True)
    print(f"load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
