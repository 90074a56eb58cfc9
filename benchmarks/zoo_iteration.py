"""One real training iteration of each zoo model (planner/profile/zoo.py) on the embedded local stack.

For each of ResNet-101, AmoebaNet-D (18 and 36 normal cells, 256 filters) and BERT-Large, at full
size: a Job whose data is generated here with the model's input shape (random 3x224x224 images and
1,000 classes; random token ids, 128 per sequence, and 2 classes), a plan of a few stages balanced
by the memory model's weight of each block (8 P + b x saved bytes: what a d = 1 backward task
holds), one replica and one micro-batch (the BatchNorm models keep the global batch together), plain
SGD, a reduced global batch. Every container builds only its stage on the meta device
(docs/runtime.md, "Building a stage"). Then ONE iteration runs through the state machines, and the
script prints per model: stages, batch, parameters per stage, the iteration's wall time (first
task's start to last task's end), each container's peak resident set (measured, and the memory
model's prediction: planner/model/perfmodel.py stage_memory_bytes plus the runtime base), the
peak of the whole run (client, moto server and every worker: the sum of their proportional set
sizes, sampled every 0.5 s) and the loss — or why it does not run here.

Each model runs in a child process with a stack of its own; the parent samples the child's
process tree and stops it if the run passes ``--max-memory-gb`` (default 8: this 24 GiB, 2-core
machine is shared), and a model whose estimated peak passes it is not started (``--force`` starts
it anyway). The estimate: every stage holds its parameters and the gradients its backward task
left (2 P_s), the stage whose update is running the memory model's prediction for it, every worker
its runtime base (measured locally at about 0.26 GB), the moto server and the idle client about
0.8 GB; before the run, the client holds two copies of the model while it validates the job
(sdk/exactness.py), which the estimate takes if larger. The client process fixes glibc's mmap
threshold at 1 MiB (mallopt), so the copies it drops give their memory back: by default glibc
raises the threshold to the largest block freed so far and keeps later tensors of up to 32 MiB on
its heap, and a client that validated BERT-Large held 3.4 GB afterwards. The workers keep glibc's
defaults, as on Lambda.

    python benchmarks/zoo_iteration.py                 # every zoo model
    python benchmarks/zoo_iteration.py --only resnet101 --stages 4 --batch 2
    python benchmarks/zoo_iteration.py --dry-run       # plans and estimates only, nothing runs
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from stagecoach.planner.model.perfmodel import stage_memory_bytes
from stagecoach.planner.model.platforms import aws_platform
from stagecoach.planner.profile.layers import balanced_partition
from stagecoach.planner.profile.zoo import zoo_model, zoo_names, zoo_profile

GiB, MiB = 2**30, 2**20
STAGES = {"resnet101": 4, "amoebanet_d18": 4, "amoebanet_d36": 6, "bert_large": 6}
# the global batch: 2, but AmoebaNet-D36's run at 2 passed 8 GiB here (8.4 GiB, stopped)
BATCH = {"amoebanet_d36": 1}
CLASSES = {"bert_large": 2}  # the others: 1,000 (ImageNet)
VOCAB = 30522
WORKER_BASE = 0.26 * GiB  # a local worker's resident set before it builds anything (measured)
MEMORY_MB = 10240  # every stage function: Lambda's largest tier, so the stack kills nothing that fits here
TIMEOUT_S = 900


@dataclass
class Row:
    model: str
    stages: int
    batch: int
    params_mib: float
    stage_params_mib: list[float]
    predicted_mb: list[float]  # per stage: the memory model's peak plus the platform's runtime base
    estimate_gib: float  # the whole run's estimated peak (see the module docstring)
    measured_mb: list[float] = field(default_factory=list)  # per stage: its containers' peak resident set
    model_mib: list[float] = field(default_factory=list)  # per stage: what its containers' stage modules hold
    iteration_s: float | None = None
    total_s: float | None = None  # job.run to the iteration's end: validation, upload, deployment included
    peak_gib: float | None = None  # the whole run's peak (sum of proportional set sizes)
    loss: float | None = None
    status: str = "not run"


def make_job(name: str, batch: int) -> Any:
    from stagecoach import Job

    factory, sample = zoo_model(name)
    g = torch.Generator().manual_seed(0)
    if sample.dtype == torch.long:
        x = torch.randint(0, VOCAB, (batch, *sample.shape), generator=g)
    else:
        x = torch.randn(batch, *sample.shape, generator=g)
    y = torch.randint(0, CLASSES.get(name, 1000), (batch,), generator=g)
    return Job(
        model=factory,
        loss=nn.CrossEntropyLoss(),
        optimizer=lambda params: torch.optim.SGD(params, lr=0.01),
        train=(x, y),
        global_batch=batch,
        iterations=1,
        seed=0,
        name=f"zoo-{name.replace('_', '-')}",
    )


def planned(name: str, stages: int, batch: int) -> tuple[Row, list[int]]:
    """The balance and the estimates, from the meta-device profile (nothing is built)."""
    prof = zoo_profile(name)
    plat = aws_platform()
    weights = [8 * l.param_bytes + batch * l.saved_bytes_per_sample for l in prof.layers]
    balance = balanced_partition(weights, stages)
    groups, i = [], 0
    for n in balance:
        groups.append(prof.layers[i : i + n])
        i += n
    params = [sum(l.param_bytes for l in g) for g in groups]
    predicted = [stage_memory_bytes(g, batch, 1, plat) for g in groups]
    whole = sum(params)
    run = sum(2 * p + WORKER_BASE for p in params) + max(m - 2 * p for m, p in zip(predicted, params)) + 0.8 * GiB
    client = 2 * whole + 0.8 * GiB
    return Row(
        model=name,
        stages=len(balance),
        batch=batch,
        params_mib=whole / MiB,
        stage_params_mib=[p / MiB for p in params],
        predicted_mb=[(m + plat.runtime_base_mb * MiB) / MiB for m in predicted],
        estimate_gib=max(run, client) / GiB,
    ), balance


def run_one(name: str, stages: int, batch: int) -> Row:
    """In the child: run the model's one iteration on a stack of its own."""
    import ctypes

    from stagecoach import Plan
    from stagecoach.local.backend import LocalBackend
    from stagecoach.planner.plan import PHASES

    ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD (see the module docstring)
    row, balance = planned(name, stages, batch)
    job = make_job(name, batch)
    plan = Plan(
        balance=balance,
        replicas=1,
        micro_batches=1,
        global_batch=batch,
        memory_mb=(MEMORY_MB,) * len(balance),
        timeouts_s=tuple({p: TIMEOUT_S for p in PHASES} for _ in balance),
    )
    t0 = time.time()
    run = job.run(plan=plan, backend=LocalBackend())
    status = run.wait(progress=False, poll_s=2.0, timeout_s=3 * 3600)
    row.status = status.lower() if status == "SUCCEEDED" else f"{status.lower()}: {run.failure()[:300]}"
    ms = [m for m in run.metrics() if m.t == 0]
    if ms:
        row.iteration_s = max(m.end for m in ms) - min(m.start for m in ms)
        row.total_s = max(m.end for m in ms) - t0
        row.measured_mb = [max(m.max_rss_mb for m in ms if m.stage == s) for s in range(len(balance))]
        row.model_mib = [max((m.model_bytes or 0) for m in ms if m.stage == s) / MiB for s in range(len(balance))]
    losses = run.losses()
    row.loss = losses[0] if losses else None
    return row


# -- the parent: one child per model, its process tree sampled ---------------------------------------------
def _children() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            out.setdefault(ppid, []).append(int(d))
    return out


def _pss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def tree_pss(root: int) -> dict[int, int]:
    """The proportional set size of ``root`` and of every descendant (shared pages counted once), by pid."""
    kids = _children()
    todo, out = [root], {}
    while todo:
        pid = todo.pop()
        out[pid] = _pss_bytes(pid)
        todo += kids.get(pid, [])
    return out


def _role(pid: int, root: int) -> str:
    if pid == root:
        return "client"
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "gone"
    return "server" if "stagecoach.local.stack" in cmd else "worker"


def run_child(name: str, stages: int, batch: int, cap_gib: float) -> Row:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as out:
        path = out.name
    cmd = [sys.executable, __file__, "--child", name, "--stages", str(stages), "--batch", str(batch), "--json-out", path]
    child = subprocess.Popen(cmd)
    peak, over, t0, at = 0, False, time.time(), ""
    while child.poll() is None:
        by_pid = tree_pss(child.pid)
        pss = sum(by_pid.values())
        if pss > peak:
            roles: dict[str, int] = {}
            for pid, b in by_pid.items():
                role = _role(pid, child.pid)
                roles[role] = roles.get(role, 0) + b
            peak, at = pss, f"{time.time() - t0:.0f} s: " + ", ".join(f"{k} {v / GiB:.1f}" for k, v in sorted(roles.items()))
        if pss > cap_gib * GiB:
            over = True
            child.send_signal(signal.SIGKILL)  # its stack exits when the child's pipe to it closes
            break
        time.sleep(0.5)
    child.wait()
    print(f"{name}: peak {peak / GiB:.1f} GiB at {at} GiB", file=sys.stderr, flush=True)
    row, _ = planned(name, stages, batch)
    if os.path.getsize(path):
        with open(path) as f:
            row = Row(**json.load(f))
    os.unlink(path)
    row.peak_gib = peak / GiB
    if over:
        row.status = f"stopped: the run passed {cap_gib:g} GiB"
    elif child.returncode and row.status == "not run":
        row.status = f"failed (exit {child.returncode})"
    return row


def table(rows: list[Row]) -> str:
    head = (
        "| model | params MiB | stages | batch | params per stage MiB | iteration s | job s | "
        "peak per container MB, measured (predicted) | run peak GiB (estimate) | loss | status |"
    )
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        per = " / ".join(f"{p:.0f}" for p in r.stage_params_mib)
        if r.measured_mb:
            mem = " / ".join(f"{m:.0f} ({p:.0f})" for m, p in zip(r.measured_mb, r.predicted_mb))
        else:
            mem = "— (" + " / ".join(f"{p:.0f}" for p in r.predicted_mb) + ")"
        peak = f"{r.peak_gib:.1f}" if r.peak_gib is not None else "—"
        lines.append(
            f"| {r.model} | {r.params_mib:.0f} | {r.stages} | {r.batch} | {per} | "
            f"{'—' if r.iteration_s is None else f'{r.iteration_s:.0f}'} | {'—' if r.total_s is None else f'{r.total_s:.0f}'} | "
            f"{mem} | {peak} ({r.estimate_gib:.1f}) | {'—' if r.loss is None else f'{r.loss:.3f}'} | {r.status} |"
        )
    return "\n".join(lines)


def machine() -> str:
    with open("/proc/meminfo") as f:
        mem = int(f.readline().split()[1]) / 2**20
    return f"{platform.machine()}, {os.cpu_count()} cores, {mem:.0f} GiB, Linux {platform.release()}, torch {torch.__version__}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", action="append", choices=zoo_names(), help="a zoo model (repeatable; default: all)")
    ap.add_argument("--stages", type=int, default=None, help="stages per model (default: per model, 4-6)")
    ap.add_argument("--batch", type=int, default=None, help="the global batch (default 2; AmoebaNet-D36: 1)")
    ap.add_argument("--max-memory-gb", type=float, default=8.0, help="stop (or do not start) a run above this (GiB)")
    ap.add_argument("--force", action="store_true", help="start a model whose estimate passes --max-memory-gb")
    ap.add_argument("--dry-run", action="store_true", help="print the plans and estimates; run nothing")
    ap.add_argument("--json", dest="json_path", default=None, help="also write the rows as JSON")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--json-out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:  # one model, in its own process
        row = run_one(args.child, args.stages, args.batch)
        with open(args.json_out, "w") as f:
            json.dump(asdict(row), f)
        return
    rows = []
    started = time.strftime("%Y-%m-%d %H:%M")
    for name in args.only or zoo_names():
        stages = args.stages or STAGES[name]
        batch = args.batch or BATCH.get(name, 2)
        row, _ = planned(name, stages, batch)
        if args.dry_run:
            row.status = "dry run"
        elif row.estimate_gib > args.max_memory_gb and not args.force:
            row.status = f"not started: estimated {row.estimate_gib:.1f} GiB > {args.max_memory_gb:g} GiB on this machine"
        else:
            print(f"{name}: {row.stages} stages, batch {row.batch} ...", file=sys.stderr, flush=True)
            row = run_child(name, stages, batch, args.max_memory_gb)
        rows.append(row)
    print(f"{started}, {machine()}")
    print(table(rows))
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)


if __name__ == "__main__":
    main()
