"""FasDL's HAP window with and without its overlap (docs/elastic.md "HAP's overlap"): paired runs
of benchmarks/elastic.py's digits job (d = 4, K = 2, global batch 64), alternating in one process
on one local stack, so the machine's load moves them alike. "Before" is the same code with
asl.hap_overlap patched false in this client process, where the window is emitted: exactly the
window without the overlap (its iterations one after the other, with the phase watcher).

Run: python benchmarks/hap_overlap.py [iterations=64] [repetitions=1]; prints a Markdown table.
"""

import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import elastic  # noqa: E402

from stagecoach.local.backend import LocalBackend  # noqa: E402
from stagecoach.planner.emit import asl  # noqa: E402

ITER = int(sys.argv[1]) if len(sys.argv) > 1 else 64
REPS = int(sys.argv[2]) if len(sys.argv) > 2 else 1
real = asl.hap_overlap


def one(backend: LocalBackend, sync: str, extra: int, overlap: bool) -> tuple[float, float, float, float]:
    """One run: seconds per iteration (first task start to the last iteration's end, over the
    iterations), the median iteration step, the final loss, the measured cost."""
    asl.hap_overlap = real if overlap else (lambda plan: False)
    try:
        job = elastic.make_job(f"pair-{sync.replace('_', '-')}-{extra}-{int(overlap)}", 64, ITER, None)
        hap = {"hap_extra": extra} if extra else {}
        run = job.run(backend=backend, stages=1, replicas=4, sync=sync, aggregators=2, **hap)
    finally:
        asl.hap_overlap = real
    assert run.wait(progress=False, poll_s=2.0, timeout_s=1800) == "SUCCEEDED", run.failure()
    ends = elastic.elapsed_by_iteration(run.metrics())
    n = len(ends)
    steps = [ends[t] - ends[t - 1] for t in range(1, n)]
    losses = run.losses()
    return ends[n - 1] / n, statistics.median(steps), losses[-1], run.cost().usd


def main() -> None:
    """Every case, ``REPS`` times, in one process and on one stack."""
    backend = LocalBackend()
    cases = [
        ("k_reduce", 0, False),
        ("k_reduce_hap", 0, False),
        ("k_reduce_hap", 0, True),
        ("k_reduce_hap", 8, False),
        ("k_reduce_hap", 8, True),
    ]
    print("| run | sync | extra | window | s/iteration | median step s | final loss | cost $ |")
    print("|---|---|---|---|---|---|---|---|")
    for rep in range(REPS):
        for sync, extra, overlap in cases:
            per, med, last, usd = one(backend, sync, extra, overlap)
            window = "overlapped" if overlap else ("BSP" if sync == "k_reduce" else "one after the other (before)")
            print(f"| {rep} | {sync} | {extra} | {window} | {per:.3f} | {med:.3f} | {last:.3f} | {usd:.4f} |", flush=True)


if __name__ == "__main__":
    main()
