"""Warm state benchmark: bytes through S3 and seconds per iteration, before and after.

Runs real jobs on the embedded local stack with Lambda's network emulated in every worker
(core/netem.py, the planner's FuncPipe platform: ~70 MB/s each way per worker, 30 ms per
request), a model with Adam, and two plans:

  d = 1   (2 stages x 1 replica x 2 micro-batches)  the backward task updates its stage alone
  d = 4   (2 stages x 4 replicas x 2 micro-batches), scatter-reduce (a sync Map: sync task k owns
          shard k) and pipelined scatter-reduce (fused: replica r owns shard r)

each twice: ``before`` = ``Job(warm_state=False)`` (every iteration stores the stage's parameters
and Adam state in S3 and the next one reads them back), ``after`` = ``Job(warm_state=True)``
(docs/runtime.md "State that stays warm"): with d = 1 the parameters and the Adam state stay in the
stage's worker; with d = 4 every replica and every sync task has a function of its own, and each
sync task keeps its shard's Adam state and parameters in its container; the parameters' shards
still go through S3 every iteration (the replicas read them), the state only as the window's
checkpoint.

Per iteration, from the tasks' own metrics (TaskMetrics): bytes up + down over every task, and
seconds from its first task's start to the next iteration's (Run.time_breakdown). Iteration 0
(cold starts) and the last (which writes the window's checkpoint) are reported apart from the
steady state in between. Everything printed is measured now; the two cores of this machine are
shared by every worker, so compute is slower than on Lambda, the network is Lambda's.

Run: python benchmarks/warm_state.py [--quick]
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from stagecoach import Job
from stagecoach.local.backend import LocalBackend
from stagecoach.metrics import iteration_breakdown
from stagecoach.planner.model.platforms import funcpipe_platform

MB = 1_000_000


def make_job(name: str, warm: bool, width: int, iterations: int) -> Job:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, width, generator=g)
    y = torch.randint(0, 10, (64,), generator=g)

    def model() -> nn.Module:
        return nn.Sequential(
            nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width), nn.Linear(width, 10)
        )

    return Job(
        model=model,
        loss=nn.CrossEntropyLoss(),
        optimizer=lambda p: torch.optim.Adam(p, lr=1e-3),
        train=(x, y),
        global_batch=16,
        iterations=iterations,
        seed=1,
        name=name,
        warm_state=warm,
    )


def measure(backend: LocalBackend, name: str, warm: bool, replicas: int, algo: str, width: int, iterations: int) -> dict[str, float]:
    job = make_job(name, warm, width, iterations)
    sync = {} if replicas == 1 else {"sync": algo}
    r = job.run(stages=2, replicas=replicas, micro_batches=2, backend=backend, timeout_s=300, **sync)
    r.wait(progress=False, poll_s=1.0, timeout_s=3600)
    ms = r.metrics()
    rows = {row["t"]: row for row in iteration_breakdown(ms, complete=r.iterations_done())}
    steady = range(1, iterations - 1)

    def nbytes(ts: range) -> float:
        return sum(m.bytes_up + m.bytes_down for m in ms if m.t in ts) / len(ts)

    def secs(ts: range) -> float:
        return sum(rows[t]["iteration_s"] for t in ts if t in rows) / max(1, sum(1 for t in ts if t in rows))

    last = range(iterations - 1, iterations)  # no next iteration to time it by: its span, first start to last end
    return {"bytes": nbytes(steady), "s": secs(steady), "last_bytes": nbytes(last), "last_s": r.iteration_summary(iterations - 1)["span_s"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="a smaller model and fewer iterations")
    args = ap.parse_args()
    width, iterations = (512, 4) if args.quick else (1024, 6)
    params = 3 * (width * width + width) + 10 * width + 10
    print(f"model: 4 Linear layers, {params / 1e6:.2f} M parameters ({params * 4 / MB:.1f} MB float32), Adam; 2 stages, 2 micro-batches")
    print(f"{iterations} iterations in one window; steady = iterations 1..{iterations - 2}, last = the checkpoint-writing one")
    print()
    print(f"{'plan':<22} {'path':<7} {'MB/iteration':>13} {'s/iteration':>12} {'last: MB':>9} {'last: span s':>13}")
    backend = LocalBackend(network=funcpipe_platform())
    try:
        for d, algo in ((1, "none"), (4, "scatter_reduce"), (4, "pipelined_scatter_reduce")):
            for warm in (False, True):
                t0 = time.time()
                m = measure(backend, f"warm-d{d}-{algo[:4]}-{'after' if warm else 'before'}", warm, d, algo, width, iterations)
                label = "after" if warm else "before"
                plan = f"d = {d}" + ("" if d == 1 else f" {algo.replace('_scatter_reduce', ' s-r').replace('scatter_reduce', 's-r')}")
                print(
                    f"{plan:<22} {label:<7} {m['bytes'] / MB:13.1f} {m['s']:12.2f} {m['last_bytes'] / MB:9.1f} {m['last_s']:13.2f}"
                    f"   ({time.time() - t0:.0f} s to run)",
                    flush=True,
                )
    finally:
        backend.stack.close()


if __name__ == "__main__":
    main()
