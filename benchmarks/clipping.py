"""What clipping by the global gradient norm adds per iteration, measured side by side.

The same job (an MLP with Adam, 2 stages) with and without ``clip_grad_norm``, on the embedded
local stack with Lambda's network emulated in every worker (core/netem.py: the planner's AWS
platform, ~30 ms per request), for the three ways a stage updates: sync tasks (scatter-reduce,
d = 2), the backward task alone (d = 1) and the backward tasks exchanging shards (pipelined
scatter-reduce, d = 2). Printed: the mean seconds per iteration (iteration 0, the cold start,
left out) with and without, their difference and ratio, and what the performance model predicts
the exchange adds (docs/performance-model.md §3.3). The machine's two cores are shared by every
worker: compare the columns of one run, not runs of different days.

Run: python benchmarks/clipping.py [--iterations 8]
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from stagecoach import Job
from stagecoach.local.backend import LocalBackend
from stagecoach.metrics import iteration_breakdown
from stagecoach.planner.model.platforms import aws_platform


def make_job(name: str, clip: float | None, iterations: int) -> Job:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 256, generator=g), torch.randint(0, 10, (64,), generator=g)
    return Job(
        name=name,
        model=lambda: nn.Sequential(nn.Linear(256, 512), nn.Tanh(), nn.Linear(512, 512), nn.Tanh(), nn.Linear(512, 10)),
        loss=nn.CrossEntropyLoss(),
        optimizer=lambda p: torch.optim.Adam(p, lr=1e-3),
        clip_grad_norm=clip,
        train=(x, y),
        global_batch=16,
        iterations=iterations,
        seed=0,
    )


def seconds_per_iteration(backend: LocalBackend, name: str, clip: float | None, iterations: int, **plan: object) -> float:
    run = make_job(name, clip, iterations).run(stages=2, micro_batches=2, backend=backend, **plan)
    run.wait(progress=False, poll_s=1.0, timeout_s=1800)
    rows = [r for r in iteration_breakdown(run.metrics(), complete=run.iterations_done()) if r["t"] >= 1]
    return sum(r["iteration_s"] for r in rows) / len(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=8)
    args = ap.parse_args()
    plat = aws_platform()
    backend = LocalBackend(network=plat)
    print(f"network emulated: {plat.bandwidth_Bps / 1e6:.0f} MB/s, {plat.storage_latency_s * 1e3:.0f} ms per request")
    print(f"model's added time per iteration: 2 x latency + poll = {(2 * plat.storage_latency_s + plat.poll_delay_s) * 1e3:.0f} ms")
    print(f"{'plan':<26}{'no clip s/it':>14}{'clip s/it':>12}{'added s':>10}{'ratio':>8}")
    for label, plan in (
        ("d = 2 scatter-reduce", dict(replicas=2)),
        ("d = 1 alone", dict(replicas=1)),
        ("d = 2 pipelined", dict(replicas=2, sync="pipelined_scatter_reduce")),
    ):
        tag = label.split()[2][:4]
        a = seconds_per_iteration(backend, f"clip-off-{plan['replicas']}-{tag}", None, args.iterations, **plan)
        b = seconds_per_iteration(backend, f"clip-on-{plan['replicas']}-{tag}", 1.0, args.iterations, **plan)
        print(f"{label:<26}{a:>14.3f}{b:>12.3f}{b - a:>10.3f}{b / a:>8.2f}", flush=True)


if __name__ == "__main__":
    main()
