"""Mixed precision where transfer dominates: the same job in float32 and in bfloat16, side by side.

A model whose stages hand each other large activations and hold few parameters (per sample a
1024 x 64 feature map through 64-wide per-position layers: 256 KiB of fp32 activations per sample
against 17 K parameters; 4 stages, 2 replicas, 4 micro-batches, Adam) on the embedded local stack with Lambda's network emulated in every worker
(core/netem.py: ~73 MB/s each way, 30 ms per request), so S3 transfer is most of an iteration.
``Job(dtype=torch.bfloat16)`` halves the activations, input gradients and gradient shards it moves
(the parameters and Adam's state stay fp32 master copies). Printed: seconds per iteration (the
first, cold, left out), the bytes moved per iteration, and the ratios; the loss after the last
iteration of each, which must be close.

Run: python benchmarks/bf16.py [--iterations 6]
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from stagecoach import Job
from stagecoach.local.backend import LocalBackend
from stagecoach.metrics import iteration_breakdown
from stagecoach.planner.model.platforms import aws_platform

TOKENS, WIDTH = 1024, 64


class Pool(nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h.mean(dim=1)


def make_job(dtype: torch.dtype, iterations: int) -> Job:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(256, TOKENS, WIDTH, generator=g), torch.randint(0, 10, (256,), generator=g)
    return Job(
        name=f"bf16-bench-{str(dtype).split('.')[-1][:4]}",
        model=lambda: nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(4)], Pool(), nn.Linear(WIDTH, 10)),
        loss=nn.CrossEntropyLoss(),
        optimizer=lambda p: torch.optim.Adam(p, lr=1e-3),
        train=(x, y),
        global_batch=128,
        iterations=iterations,
        seed=0,
        dtype=dtype,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=6)
    args = ap.parse_args()
    plat = aws_platform()
    backend = LocalBackend(network=plat)
    print(f"network emulated: {plat.bandwidth_Bps / 1e6:.0f} MB/s, {plat.storage_latency_s * 1e3:.0f} ms per request")
    rows = {}
    for dtype in (torch.float32, torch.bfloat16):
        run = make_job(dtype, args.iterations).run(stages=4, replicas=2, micro_batches=4, memory_mb=2048, backend=backend)
        run.wait(progress=False, poll_s=1.0, timeout_s=3600)
        ms = run.metrics()
        its = [r for r in iteration_breakdown(ms, complete=run.iterations_done()) if r["t"] >= 1]
        per_it = sum(r["iteration_s"] for r in its) / len(its)
        steady = [m for m in ms if 1 <= m.t < args.iterations]
        nbytes = sum(m.bytes_up + m.bytes_down for m in steady) / max(1, len({m.t for m in steady}))
        rows[dtype] = (per_it, nbytes, run.losses()[-1])
        print(
            f"{str(dtype):<16} {per_it:7.2f} s/iteration  {nbytes / 1e6:8.1f} MB/iteration  final loss {run.losses()[-1]:.4f}", flush=True
        )
    (a, ba, _), (b, bb, _) = rows[torch.float32], rows[torch.bfloat16]
    print(f"bfloat16 / float32: {b / a:.2f}x the time ({a / b:.2f}x faster), {bb / ba:.2f}x the bytes")


if __name__ == "__main__":
    main()
