"""Scale benchmark: hundreds of workers in one phase on the embedded local stack.

Two parts, each measured in this run (nothing estimated):

1. Jobs. A small MLP (float64) trained for ``--iterations`` iterations on a local stack of its
   own per size, with 2 stages x d replicas (the forward phase runs 2 d tasks at once): d = 20,
   64, 128 and 256, i.e. 40, 128, 256 and 512 workers per phase. Per size it prints the wall
   seconds per iteration (Run.time_breakdown: the mean from one iteration's first task to the
   next's, the first iteration's cold starts left out), the peak memory of the stack (the sum
   of the proportional set sizes, PSS, of the stack's server, its zygotes and every worker,
   sampled every second: shared pages counted once, unlike RSS), the history events per
   iteration (the job's, window and group executions'), the S3 requests per iteration (the
   measured cost's PUT- and GET-class requests: Run.cost) and whether the trained parameters
   are bit-identical to single-process PyTorch (stagecoach.reference.train_reference, with the
   same replicas and micro-batches; torch.equal on every tensor, and the largest difference).
   Gradients are synchronised by the hierarchical algorithm with one shard (``SYNC``); a stage's
   Map of more than 40 tasks runs in group executions. A size the plan refuses prints the
   PlanError.

2. ``--runtime N``: N concurrent invocations of a light task (tests/handlers/light.py: the
   worker's handler imported in the zygote; a float64 stage's forward, backward and Adam step,
   an S3 client, a full garbage collection) through the local Lambda runtime alone, each in a
   process of its own; prints the workers' unique memory (USS) and the sum of PSS of the zygote
   and all N workers. This is the memory evidence for phases the planner cannot emit yet.

Run: python benchmarks/scale.py [--iterations 3] [--sizes 40 128 256 512] [--runtime 256 512]
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from stagecoach import Job, PlanError
from stagecoach.local.backend import LocalBackend
from stagecoach.local.process import OwnedStack
from stagecoach.reference import train_reference
from stagecoach.run import Run

STAGES = 2
# DiSDeL's aggregation chain with one shard (the MLP's 1,700 parameters make one small object): per
# stage and iteration d gradient PUTs, d + B GETs by the B level-1 aggregators, one partial by the
# root; scatter-reduce's d^2 GETs would be 16,384 a stage at d = 128 (benchmarks/sync_requests.py)
SYNC = "hierarchical"
HANDLERS = str(Path(__file__).resolve().parent.parent / "tests" / "handlers")


def smaps_mb(pid: int) -> dict[str, float]:
    """A process's Rss, Pss and unique (private) memory in MB, from /proc/<pid>/smaps_rollup."""
    fields: dict[str, float] = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                parts = line.split()
                if len(parts) == 3 and parts[2] == "kB":
                    fields[parts[0].rstrip(":")] = int(parts[1]) / 1024.0
    except OSError:
        return {}
    return {"rss": fields["Rss"], "pss": fields["Pss"], "uss": fields["Private_Clean"] + fields["Private_Dirty"]}


def descendants(root: int) -> list[int]:
    """``root`` and every process below it (the stack server, its zygotes, their workers)."""
    parent: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    parent[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    out, frontier = [root], [root]
    while frontier:
        frontier = [p for p, pp in parent.items() if pp in frontier]
        out += frontier
    return out


class PeakMemory:
    """Samples the sum of PSS over a process tree every ``every_s`` seconds; keeps the peak."""

    def __init__(self, root: int, every_s: float = 1.0) -> None:
        self.root, self.every_s = root, every_s
        self.peak_mb, self.processes = 0.0, 0
        self.server_mb = 0.0  # at the peak: the stack server's PSS (moto, the interpreter, the runtime)
        self.worker_uss_mb = 0.0  # at the peak: the largest unique memory of a zygote or worker
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(self.every_s):
            pids = descendants(self.root)
            memory = {p: smaps_mb(p) for p in pids}
            total = sum(m.get("pss", 0.0) for m in memory.values())
            if total > self.peak_mb:
                self.peak_mb, self.processes = total, len(pids)
                self.server_mb = memory[self.root].get("pss", 0.0)
                self.worker_uss_mb = max((m.get("uss", 0.0) for p, m in memory.items() if p != self.root), default=0.0)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))


def mlp_job(replicas: int, iterations: int) -> Job:
    """Two samples per replica and iteration; four global batches of data."""
    g = torch.Generator().manual_seed(25)
    global_batch = 2 * replicas
    x = torch.randn(4 * global_batch, 16, generator=g, dtype=torch.float64)
    y = torch.randint(0, 4, (len(x),), generator=g)
    return Job(
        model=model,
        loss=nn.CrossEntropyLoss(),
        optimizer=lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
        train=(x, y),
        global_batch=global_batch,
        iterations=iterations,
        seed=3,
        dtype=torch.float64,
        name=f"scale{replicas}",
        # one function per stage: with warm state every worker gets a function of its own, and
        # creating 512 of them takes the local stack ten minutes before the first iteration
        warm_state=False,
    )


@dataclass
class Row:
    workers: int
    status: str
    iteration_s: float = float("nan")
    peak_mb: float = float("nan")
    server_mb: float = float("nan")
    worker_uss_mb: float = float("nan")
    processes: int = 0
    events: float = float("nan")
    requests: float = float("nan")
    identical: str = "-"

    def line(self) -> str:
        return (
            f"{self.workers:>7} {self.status:<28} {self.iteration_s:>9.2f} {self.peak_mb:>9.0f} {self.server_mb:>9.0f} "
            f"{self.worker_uss_mb:>11.1f} {self.processes:>9} "
            f"{self.events:>11.0f} {self.requests:>9.0f}  {self.identical}"
        )


def compare(run: Run, job: Job, replicas: int) -> str:
    expected = train_reference(job, replicas=replicas, micro_batches=1)
    trained = run.trained_model()
    pairs = list(zip(trained.parameters(), expected.parameters(), strict=True))
    diff = max(float((p - q).detach().abs().max()) for p, q in pairs)
    same = all(torch.equal(p, q) for p, q in pairs)
    return f"{'yes' if same else 'no'} (max |diff| {diff:.1e})"


def run_size(workers: int, iterations: int) -> Row:
    replicas = workers // STAGES
    job = mlp_job(replicas, iterations)
    backend = LocalBackend()
    assert isinstance(backend.stack, OwnedStack)  # a stack of its own, whose processes it measures
    peak = PeakMemory(backend.stack.proc.pid)
    try:
        try:
            run = job.run(backend=backend, stages=STAGES, replicas=replicas, micro_batches=1, sync=SYNC, aggregators=1)
        except PlanError as e:
            print(f"  {workers} workers: refused ({e})", flush=True)
            return Row(workers, "refused")
        status = run.wait(progress=False, poll_s=2.0, timeout_s=3600)
        peak.stop()
        done = run.iterations_done()
        if status != "SUCCEEDED" or done == 0:
            return Row(workers, f"{status} ({run.failure()[:40]})", peak_mb=peak.peak_mb, processes=peak.processes)
        usage = run.cost().total
        return Row(
            workers,
            status,
            iteration_s=run.time_breakdown().get("iteration_s", float("nan")),
            peak_mb=peak.peak_mb,
            server_mb=peak.server_mb,
            worker_uss_mb=peak.worker_uss_mb,
            processes=peak.processes,
            events=len(run.history(windows=True)) / done,
            requests=(usage.puts + usage.gets) / done,
            identical=compare(run, job, replicas),
        )
    finally:
        peak.stop()
        backend.stack.close()


def runtime_only(n: int, hold_s: float) -> None:
    """N concurrent light invocations through the local Lambda runtime, each in its own process."""
    from stagecoach.local.runtime import FunctionSpec, LocalLambdaRuntime

    backend = LocalBackend()
    runtime = LocalLambdaRuntime(backend.stack.endpoint_url)
    spec = FunctionSpec(name="light", handler="light.handler", memory_mb=1024, timeout_s=600, environment=(("PYTHONPATH", HANDLERS),))
    try:
        t0 = time.time()
        with ThreadPoolExecutor(n) as pool:
            replies = list(pool.map(lambda _: runtime.invoke(spec, {"hold_s": hold_s}), range(n)))
        errors = sum(1 for _, errored, _ in replies if errored)
        pids = {w.pid for w in runtime._all}
        zygotes = [z.proc.pid for z in runtime._zygotes.values()]
        memory = [smaps_mb(p) for p in pids]
        uss = sorted(m["uss"] for m in memory)
        total = sum(m["pss"] for m in memory) + sum(smaps_mb(z).get("pss", 0.0) for z in zygotes)
        print(
            f"runtime, {n} concurrent light tasks ({time.time() - t0:.0f} s, {errors} failed): {len(pids)} worker processes; "
            f"unique memory per worker median {uss[len(uss) // 2]:.1f} MB, max {uss[-1]:.1f} MB; "
            f"sum of PSS (zygote and workers) {total:.0f} MB; RSS per worker {memory[0]['rss']:.0f} MB",
            flush=True,
        )
    finally:
        runtime.shutdown()
        backend.stack.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iterations", type=int, default=3)
    ap.add_argument("--sizes", type=int, nargs="*", default=[40, 128, 256, 512], help="workers per phase (2 stages x size/2)")
    ap.add_argument("--runtime", type=int, nargs="*", default=[], help="also N concurrent light tasks on the runtime alone")
    ap.add_argument("--hold", type=float, default=20.0, help="seconds each light task holds its process (--runtime)")
    args = ap.parse_args()
    for n in args.runtime:
        runtime_only(n, args.hold)
    rows = []
    for workers in args.sizes:
        rows.append(run_size(workers, args.iterations))
        print(f"  ran {workers} workers: {rows[-1].line()}", flush=True)
    if rows:
        print(
            f"\nA small MLP (float64), {STAGES} stages x workers/{STAGES} replicas, {args.iterations} iterations, one local stack per size"
        )
        print(
            f"{'workers':>7} {'status':<28} {'s / iter':>9} {'peak MB':>9} {'server MB':>9} {'max USS MB':>11} {'processes':>9} "
            f"{'events/iter':>11} {'S3 / iter':>9}  "
            "bit-identical to single-process PyTorch"
        )
        for r in rows:
            print(r.line())


if __name__ == "__main__":
    main()
