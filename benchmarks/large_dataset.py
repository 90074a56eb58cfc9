"""A training set several times a stage's memory trains: workers read their samples, not the set.

A map-style Dataset that makes sample i on demand (1 MiB of float32 each, drawn from a generator
seeded by i, so the client never holds the set either) is uploaded once in content-addressed
shards (docs/data.md), then trained on the embedded local stack with every stage function at
``--memory`` MB — a limit the local runtime enforces as Lambda does (a worker whose resident set
passes it is killed). The set is ``--ratio`` times that memory. Printed, all measured now: the
set's size against the functions' memory, the upload's time, each task kind's largest resident
set and bytes read, and the loss, which must be finite — first for a set of a tenth of the
memory (kept whole by each worker), then for the large one, so the resident sets compare.

Run: python benchmarks/large_dataset.py [--ratio 3] [--memory 512]
"""

from __future__ import annotations

import argparse
import math
import time

import torch
from torch import nn
from torch.utils.data import Dataset

from stagecoach import Job
from stagecoach.local.backend import LocalBackend

SAMPLE_FLOATS = 256 * 1024  # 1 MiB of float32


class Generated(Dataset):
    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(SAMPLE_FLOATS, generator=g)
        return x, int(x[:16].sum() > 0)


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(SAMPLE_FLOATS, 16), nn.Tanh(), nn.Linear(16, 2))


def train(backend: LocalBackend, ratio: float, memory: int, iterations: int) -> None:
    n = math.ceil(ratio * memory * 2**20 / (SAMPLE_FLOATS * 4))
    job = Job(
        name=f"large-data-{len(str(n))}",
        model=model,
        loss=nn.CrossEntropyLoss(),
        optimizer=lambda p: torch.optim.SGD(p, lr=0.01),
        train=Generated(n),
        global_batch=16,
        iterations=iterations,
        seed=0,
    )
    t0 = time.perf_counter()
    run = job.run(stages=2, micro_batches=2, memory_mb=memory, backend=backend)
    started = time.perf_counter() - t0
    run.wait(progress=False, poll_s=2.0, timeout_s=3600)
    set_mb = n * SAMPLE_FLOATS * 4 / 2**20
    print(f"\ntraining set: {n} samples, {set_mb:,.0f} MiB = {set_mb / memory:.2f} x the {memory} MB of every stage function")
    print(f"upload + deploy: {started:.1f} s")
    rows: dict[tuple[str, int], list[tuple[float, int]]] = {}
    for m in run.metrics():
        rows.setdefault((m.phase, m.stage), []).append((m.max_rss_mb, m.bytes_down))
    print(f"{'task':<14}{'largest RSS MB':>16}{'MB read per task':>18}")
    for (phase, stage), vals in sorted(rows.items()):
        print(f"{phase + ' s' + str(stage):<14}{max(v[0] for v in vals):>16.0f}{sum(v[1] for v in vals) / len(vals) / 1e6:>18.1f}")
    losses = [m.loss for m in run.metrics() if m.loss is not None]
    print(f"loss per iteration: {', '.join(f'{v:.4f}' for v in losses)}")
    assert all(math.isfinite(v) for v in losses)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ratio", type=float, default=3.0, help="training set size / a stage's memory")
    ap.add_argument("--memory", type=int, default=512, help="every stage function's memory, MB")
    ap.add_argument("--iterations", type=int, default=4)
    args = ap.parse_args()
    backend = LocalBackend()
    # side by side: a set small enough to keep (1/10 of the memory), then the large one
    for ratio in (0.1, args.ratio):
        train(backend, ratio, args.memory, args.iterations)


if __name__ == "__main__":
    main()
