"""Measure the local stack's own overheads once, so the performance model can predict local runs.

The performance model (planner/model/perfmodel.py) prices what Step Functions and S3 add around the
workers' compute and transfers with a few platform constants. On AWS they come from the docs and
from FuncPipe's measurements; here they are properties of this machine and of moto, so they are
measured — once, on a calibration job of negligible compute, never fitted to the runs they then
predict:

- ``request_s``: what one S3 request costs beyond the emulated latency (moto over loopback);
- ``invoke_s``: from the state before a phase to the first task's handler running (the Map state's
  entry and a warm Lambda invocation through moto and the local runtime);
- ``dispatch_s``: between the starts of consecutive tasks of one Map (moto starts them one by one);
- ``iteration_s``: per iteration, what the window's bookkeeping states add on top (the iteration gate, Go?, Advance).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch
from torch import nn

from stagecoach.core.netem import Network
from stagecoach.core.records import TaskMetrics
from stagecoach.job import Job
from stagecoach.lambdas.channel import Channel
from stagecoach.local.backend import LocalBackend


@dataclass(frozen=True)
class LocalOverheads:
    request_s: float
    invoke_s: float
    dispatch_s: float
    iteration_s: float

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def _calibration_job(iterations: int) -> Job:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(96, 4, generator=g)
    y = torch.randint(0, 2, (96,), generator=g)
    return Job(
        model=lambda: nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)),
        loss=nn.CrossEntropyLoss(),
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        train=(x, y),
        global_batch=6,
        iterations=iterations,
        seed=0,
        name="calibrate",
    )


def request_overhead(backend: LocalBackend, n: int = 20) -> float:
    """Mean seconds per small S3 request beyond the emulated latency, seen from a worker's channel."""
    ch = Channel(backend.stack.client("s3"), backend.resources.bucket, net=Network(None))
    body = b"x" * 1024
    t0 = time.perf_counter()
    for i in range(n):
        ch.put_bytes(f"calibrate/req-{i}", body)
        ch.get_bytes(f"calibrate/req-{i}")
    per = (time.perf_counter() - t0) / (2 * n)
    ch.delete([f"calibrate/req-{i}" for i in range(n)])
    return per


def measure_overheads(backend: LocalBackend, iterations: int = 16, replicas: int = 3) -> LocalOverheads:
    """Run the calibration job (2 stages x ``replicas``, one micro-batch, scatter-reduce) and read
    the gaps between its phases off the tasks' own start and end times."""
    job = _calibration_job(iterations)
    run = job.run(stages=2, replicas=replicas, micro_batches=1, timeout_s=120, backend=backend)
    run.wait(progress=False, poll_s=1.0, timeout_s=900)
    by_t: dict[int, list[TaskMetrics]] = {}
    for m in run.metrics():
        by_t.setdefault(m.t, []).append(m)
    phase_gaps, iteration_gaps, dispatch = [], [], []
    for t in range(2, iterations - 1):  # warm containers only
        ms, nxt = by_t[t], by_t[t + 1]

        def of(phase: str, stage: int | None = None, pool: list[TaskMetrics] = ms) -> list[TaskMetrics]:
            return [m for m in pool if m.phase == phase and (stage is None or m.stage == stage)]

        fw, bw = of("forward"), of("backward")
        phase_gaps.append(min(m.start for m in bw) - max(m.end for m in fw))
        for s in range(2):
            phase_gaps.append(min(m.start for m in of("sync", s)) - max(m.end for m in of("backward", s)))
        iteration_gaps.append(min(m.start for m in of("forward", pool=nxt)) - max(m.end for m in of("sync")))
        for group in (fw, of("backward", 0), of("backward", 1), of("sync", 0), of("sync", 1)):
            starts = sorted(m.start for m in group)
            dispatch += [b - a for a, b in zip(starts, starts[1:])]
    invoke = statistics.median(phase_gaps)
    return LocalOverheads(
        request_s=request_overhead(backend),
        invoke_s=invoke,
        dispatch_s=statistics.median(dispatch),
        iteration_s=max(0.0, statistics.median(iteration_gaps) - invoke),
    )
