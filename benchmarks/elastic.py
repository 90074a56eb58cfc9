"""Elastic benchmark (issue 27 item 3): Hydrozoa's dynamic workers and FasDL's HAP, measured on the
embedded local stack on scikit-learn's digits (examples/digits.py: its split, its MLP, Adam 3e-3).

1. Worker scaling (Hydrozoa seed 002 §4.3/§5.4, its DP-(1-16) against DP-1 and DP-16): one stage,
   each replica taking ``--per-replica`` samples per iteration, run for ``--iterations`` iterations as
     DP-1       d = 1 throughout, global batch b
     DP-8       d = 8 throughout, global batch 8b (sync k_reduce with K = 1, as the schedule's)
     DP-(1-8)   d 1 -> 2 -> 4 -> 8 at each quarter of the run, the global batch growing with d and
                the learning rate x 0.75 per doubling (``stagecoach.dynamic.adabatch``; the
                schedule's sync is k_reduce with K = the smallest d, 1).
   Evaluation during a run is refused with a replica schedule, so accuracy is measured from the
   trained parameters: every run keeps a checkpoint every ``--checkpoint-every`` iterations
   (``Job(checkpoint_every=)``, ``Run.checkpoint(v)``: the model's state_dict after v iterations),
   and each is loaded into the model and evaluated here on the 360 held-out images (eval mode).
   "To a target" is the first checkpoint whose accuracy is >= the target (``--target``, one or
   more), so it is resolved to the checkpoint interval. Epochs = the data-order position after
   that many iterations (core/training.py ``batch_position``: samples taken / 1,437, a batch that
   no longer fits in an epoch starting the next). Seconds and cost are measured on a second run of
   the same configuration stopped at that iteration (its schedule's later keys dropped): seconds
   from its first task start to its last task end (task metrics), cost its whole ``Run.cost()``
   (launch, orchestration, tasks, S3, the checkpoints it kept) — what training to the target
   costs. The second run's model at the target is checked bit-identical to the first run's
   checkpoint there (training is deterministic); a row whose is not says so instead of numbers.
2. HAP vs BSP (FasDL seed 001 Fig. 12): one stage, d = ``--hap-replicas``, K = d / 2 aggregators,
   the same job run with ``sync="k_reduce"`` (BSP: what plain PyTorch trains) and
   ``sync="k_reduce_hap"`` (non-aggregators train on the previous version; ``--hap-extra`` samples
   more per non-aggregator, FasDL's unequal partitioning, default 0: equal shares); per-iteration loss
   (``Run.losses()``: the global batch's mean loss as the tasks computed it) against the iteration
   and against seconds since the run's first task, and the loss each reaches at equal cost (the
   cheaper run's measured cost divided by each run's measured cost per iteration). A refused HAP
   run is reported as not measured, with the refusal's message.

The local stack runs every Lambda task as a process on this machine's cores, so d workers do not
get d times the compute they would on Lambda: wall time and GB-seconds grow with d here, and the
time ratios are this machine's, not Lambda's. No network is emulated (``LocalBackend()``).
Checkpoints add the same checkpoint tasks to every run of the first experiment.

Run: python benchmarks/elastic.py [--iterations 128] [--target 0.9 0.95] [--only scaling|hap].
Everything printed is measured now.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from stagecoach import Job
from stagecoach.core.records import TaskMetrics
from stagecoach.core.training import batch_position
from stagecoach.dynamic import adabatch
from stagecoach.errors import StagecoachError
from stagecoach.metrics import iteration_breakdown
from stagecoach.run import Run

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
import digits  # noqa: E402  (the README demo: its data split and model)

DECAY = 0.75  # Hydrozoa's learning-rate decay per doubling of the workers


@dataclass(frozen=True)
class Config:
    """One run of the scaling experiment: ``run`` is what ``Job.run`` takes besides stages."""

    name: str
    global_batch: int
    run: Mapping[str, Any]
    batches: list[tuple[int, int]]  # (first iteration, global batch)


@dataclass
class Measured:
    """What one run measured; ``curve`` is (iterations done, held-out accuracy) per checkpoint."""

    name: str
    iterations: int
    wall_s: float
    iteration_s: float
    cost_usd: float
    curve: list[tuple[int, float]]
    epochs: float
    # per target: (iterations, epochs, seconds, $) to the first checkpoint at it, None if none is, or why not measured
    to_target: dict[float, tuple[int, float, float, float] | str | None] = field(default_factory=dict)
    per_d: dict[int, float] = field(default_factory=dict)  # mean seconds per iteration at each d


# -- pure parts (tests/test_elastic_bench.py) -------------------------------------------------------
def epochs_after(version: int, n_samples: int, batches: Sequence[tuple[int, int]]) -> float:
    """Epochs of data taken after ``version`` iterations: the data-order position after the last of
    them (batch_position: a batch that does not fit in the rest of an epoch starts the next one)."""
    if version <= 0:
        return 0.0
    epoch, pos, size = batch_position(version - 1, n_samples, list(batches))
    return epoch + (pos + size) / n_samples


def seconds_by_d(metrics: list[TaskMetrics], complete: int, d_of: Callable[[int], int]) -> dict[int, float]:
    """Mean seconds per iteration (stagecoach.metrics.iteration_breakdown: first task start to the
    next iteration's) at each d; iteration 0 (cold starts) left out when later ones exist."""
    rows = [r for r in iteration_breakdown(metrics, complete=complete) if r["t"] >= 1] or iteration_breakdown(metrics, complete=complete)
    spans: dict[int, list[float]] = {}
    for r in rows:
        spans.setdefault(d_of(int(r["t"])), []).append(r["iteration_s"])
    return {d: sum(v) / len(v) for d, v in sorted(spans.items())}


def first_reaching(curve: Sequence[tuple[int, float]], target: float) -> int | None:
    """The first version (iterations done) whose accuracy is at least ``target``; None if none is."""
    for version, acc in sorted(curve):
        if acc >= target:
            return version
    return None


def elapsed_by_iteration(metrics: Sequence[TaskMetrics]) -> dict[int, float]:
    """Per iteration t, seconds from the run's first task start to t's last task end."""
    if not metrics:
        return {}
    t0 = min(m.start for m in metrics)
    out: dict[int, float] = {}
    for m in metrics:
        out[m.t] = max(out.get(m.t, 0.0), m.end - t0)
    return out


def loss_at(points: Sequence[tuple[float, float]], x: float) -> float:
    """The loss of the last point (x, loss) at or before ``x`` (a step curve); NaN before the first."""
    best = float("nan")
    for px, loss in sorted(points):
        if px > x:
            break
        best = loss
    return best


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A Markdown table; floats as given by ``cell``."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def cell(v: object) -> str:
    """A table cell: None as "not reached", small dollar amounts with enough digits to compare."""
    if v is None:
        return "not reached"
    if isinstance(v, float):
        if v != v:
            return "n/a"
        return f"{v:.3g}" if abs(v) < 0.01 else f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"
    return str(v)


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


# -- the runs ---------------------------------------------------------------------------------------
def make_job(name: str, global_batch: int, iterations: int, checkpoint_every: int | None) -> Job:
    """examples/digits.py's job with this benchmark's batch and length; warm state off (a replica
    schedule needs it off; every run here the same), standard windows (the same)."""
    train, test = digits.load()
    return Job(
        name=name,
        model=digits.model,
        loss=nn.CrossEntropyLoss(),
        optimizer=digits.optimizer,
        train=train,
        global_batch=global_batch,
        iterations=iterations,
        seed=0,
        warm_state=False,
        workflow="standard",
        checkpoint_every=checkpoint_every,
    )


def configs(iterations: int, per_replica: int, top: int = 8) -> list[Config]:
    """DP-1, DP-top and DP-(1-top): d doubling at equal steps of the run (1 -> 2 -> 4 -> 8 at quarters)."""
    steps = top.bit_length()  # 1, 2, 4, 8: four segments
    schedule = {i * iterations // steps: 1 << i for i in range(steps)}
    ada = adabatch(schedule, per_replica, DECAY)
    return [
        Config("DP-1", per_replica, {"replicas": 1}, [(0, per_replica)]),
        Config(f"DP-{top}", per_replica * top, {"replicas": top, "sync": "k_reduce", "aggregators": 1}, [(0, per_replica * top)]),
        Config(f"DP-(1-{top})", per_replica, ada, sorted(ada["global_batch"].items())),
    ]


def held_out_accuracy(model: nn.Module, test: tuple[torch.Tensor, torch.Tensor]) -> float:
    """Top-1 accuracy of ``model`` in eval mode (dropout off) as correct / total, exactly: a float32
    mean makes 324/360 0.89999998, short of a 90% target."""
    model.eval()
    with torch.no_grad():
        correct = int((model(test[0]).argmax(dim=-1) == test[1]).sum())
    return correct / len(test[1])


def accuracy_of(run: Run, version: int, test: tuple[torch.Tensor, torch.Tensor]) -> float:
    """Held-out accuracy of checkpoint ``version``."""
    model = digits.model()
    model.load_state_dict(run.checkpoint(version))
    return held_out_accuracy(model, test)


def truncated(settings: Mapping[str, Any], iterations: int) -> dict[str, Any]:
    """``Job.run`` settings for a run of only ``iterations``: a schedule's keys from then on dropped
    (they never apply to the first iterations, and a schedule key must be below the run's length)."""
    return {k: ({f: v for f, v in x.items() if f < iterations} if isinstance(x, Mapping) else x) for k, x in settings.items()}


def launch(cfg: Config, backend: Any, iterations: int, every: int, settings: Mapping[str, Any]) -> tuple[Run, float]:
    """Run ``cfg``'s job for ``iterations`` to its end: the run and its wall seconds (launch to end)."""
    job = make_job(f"elastic-{cfg.name.lower().replace('(', '').replace(')', '')}", cfg.global_batch, iterations, every)
    t0 = time.time()
    run = job.run(backend=backend, stages=1, **settings)
    status = run.wait(progress=False, poll_s=2.0, timeout_s=3600)
    if status != "SUCCEEDED":
        raise RuntimeError(f"{cfg.name}: the run ended {status}: {run.failure()}")
    return run, time.time() - t0


def same_state(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> bool:
    """Whether two state_dicts hold the same names and bit-identical tensors."""
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def to_target(cfg: Config, backend: Any, full: Run, hit: int, every: int) -> tuple[float, float] | str:
    """(seconds, $) of a run of ``cfg`` stopped at iteration ``hit``: its first task start to its
    last task end, and its ``Run.cost()``; or why not, when its model after ``hit`` iterations is
    not bit-identical to the full run's checkpoint there (then its numbers are not the target's)."""
    run, _ = launch(cfg, backend, hit, every, truncated(cfg.run, hit))
    if not same_state(run.checkpoint(hit), full.checkpoint(hit)):
        return f"the run to {hit} iterations did not reproduce the full run's checkpoint {hit}"
    return elapsed_by_iteration(run.metrics())[hit - 1], run.cost().usd


def measure_config(cfg: Config, backend: Any, iterations: int, every: int, targets: Sequence[float]) -> Measured:
    """Run one configuration to the end, read its checkpoints and metrics; then, per target it
    reached, run it again to the first checkpoint at the target and measure that run."""
    run, wall = launch(cfg, backend, iterations, every, cfg.run)
    test = digits.load()[1]
    curve = [(v, accuracy_of(run, v, test)) for v in run.checkpoints()]
    n = len(run.job.samples) if run.job is not None else 0
    iteration_s = run.time_breakdown().get("iteration_s", float("nan"))
    out = Measured(cfg.name, run.iterations_done(), wall, iteration_s, run.cost().usd, curve, epochs_after(iterations, n, cfg.batches))
    out.per_d = seconds_by_d(run.metrics(), run.iterations_done(), lambda t: run.plan.plan_at(t).replicas)
    measured: dict[int, tuple[float, float] | str] = {}
    for target in targets:
        hit = first_reaching(curve, target)
        if hit is None:
            out.to_target[target] = None
            continue
        if hit not in measured:
            measured[hit] = to_target(cfg, backend, run, hit, every)
        got = measured[hit]
        out.to_target[target] = (hit, epochs_after(hit, n, cfg.batches), *got) if not isinstance(got, str) else got
    return out


def part(r: Measured, target: float, i: int) -> float | None:
    """Field ``i`` of what reaching ``target`` took (1 epochs, 2 seconds, 3 $); None if not measured."""
    got = r.to_target.get(target)
    return float(got[i]) if isinstance(got, tuple) else None


def target_tables(results: Sequence[Measured], target: float) -> str:
    """What reaching ``target`` took per run, and Hydrozoa's ratios of it."""
    rows = []
    for r in results:
        got = r.to_target.get(target)
        rows.append([r.name, *got] if isinstance(got, tuple) else [r.name, got, "", "", ""])
    dp1, top, ada = results[0], results[1], results[2]
    ratios = [
        [f"{ada.name} time to {target:.0%} / {dp1.name}'s", ratio(part(ada, target, 2), part(dp1, target, 2))],
        [f"{ada.name} cost to {target:.0%} / {top.name}'s", ratio(part(ada, target, 3), part(top, target, 3))],
        [f"{ada.name} epochs to {target:.0%} / {top.name}'s", ratio(part(ada, target, 1), part(top, target, 1))],
        [f"{ada.name} cost to {target:.0%} / {dp1.name}'s", ratio(part(ada, target, 3), part(dp1, target, 3))],
    ]
    head = [f"to {target:.0%}", "iterations", "epochs", "seconds", "cost $"]
    return table(head, rows) + "\n\n" + table(["ratio (Hydrozoa §5.4)", "measured"], ratios)


def scaling_tables(results: Sequence[Measured], targets: Sequence[float]) -> str:
    """The runs side by side, per target what reaching it took, Hydrozoa's ratios (time vs DP-1,
    cost and epochs vs DP-top), and the accuracy curves."""
    rows = [[r.name, r.iterations, r.wall_s, r.iteration_s, r.cost_usd, r.epochs, r.curve[-1][1] if r.curve else None] for r in results]
    out = [table(["run", "iterations", "wall s", "s/iteration", "cost $", "epochs", "final acc"], rows)]
    per_d = "; ".join(f"{r.name} " + ", ".join(f"d={d}: {s:.2f}" for d, s in r.per_d.items()) for r in results)
    out.append(f"seconds per iteration at each d (task metrics, iteration 0 left out): {per_d}")
    out += [target_tables(results, target) for target in targets]
    curves = sorted({v for r in results for v, _ in r.curve})
    acc = {r.name: dict(r.curve) for r in results}
    out.append(table(["iterations done"] + [r.name for r in results], [[v] + [acc[r.name].get(v) for r in results] for v in curves]))
    return "\n\n".join(out)


@dataclass
class HapResult:
    """One run of the HAP experiment, or why it did not run (``refused``)."""

    sync: str
    losses: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)  # per iteration: since the first task start
    wall_s: float = float("nan")
    cost_usd: float = float("nan")
    refused: str | None = None


def run_sync(sync: str, backend: Any, replicas: int, global_batch: int, iterations: int, extra: int = 0) -> HapResult:
    """The digits job on one stage, d = ``replicas``, K = d / 2, with ``sync`` (HAP with ``extra``
    samples more per non-aggregator: FasDL's unequal partitioning, 0 = equal shares); a refusal
    (the project's StagecoachError, e.g. PlanError) is kept as the result's ``refused``."""
    job = make_job(f"elastic-{sync.replace('_', '-')}", global_batch, iterations, None)
    t0 = time.time()
    try:
        hap: dict[str, Any] = {"hap_extra": extra} if extra and sync == "k_reduce_hap" else {}
        run = job.run(backend=backend, stages=1, replicas=replicas, sync=sync, aggregators=max(1, replicas // 2), **hap)
    except StagecoachError as e:
        return HapResult(sync, refused=f"{type(e).__name__}: {e}")
    status = run.wait(progress=False, poll_s=2.0, timeout_s=3600)
    wall = time.time() - t0
    if status != "SUCCEEDED":
        return HapResult(sync, refused=f"the run ended {status}: {run.failure()}")
    ends = elapsed_by_iteration(run.metrics())
    losses = run.losses()
    return HapResult(sync, losses, [ends[t] for t in range(len(losses))], wall, run.cost().usd)


def per_iteration_usd(r: HapResult) -> float:
    return r.cost_usd / len(r.losses) if r.losses else float("nan")


def equal_cost_loss(r: HapResult, budget: float) -> float:
    """The loss after the iterations ``budget`` dollars buy at this run's measured cost per iteration."""
    if not r.losses:
        return float("nan")
    n = min(len(r.losses), int(budget / per_iteration_usd(r) + 1e-9))
    return r.losses[n - 1] if n >= 1 else float("nan")


def hap_tables(results: Sequence[HapResult], points: int = 8) -> str:
    """Summary per sync mode, then loss against iterations and against seconds (FasDL Fig. 12)."""
    ran = [r for r in results if r.refused is None]
    budget = min((r.cost_usd for r in ran), default=float("nan"))
    rows: list[list[object]] = []
    for r in results:
        if r.refused is not None:
            why: list[object] = [r.sync, "not measured: " + r.refused.replace("|", "/").replace("\n", " ")]
            rows.append(why + [""] * 6)
            continue
        last = r.losses[-1]
        rows.append([r.sync, "measured", len(r.losses), r.wall_s, r.cost_usd, per_iteration_usd(r), last, equal_cost_loss(r, budget)])
    head = ["sync", "status", "iterations", "wall s", "cost $", "$/iteration", "final loss", f"loss at ${cell(budget)}"]
    out = [table(head, rows)]
    if not ran:
        return out[0]
    n = max(len(r.losses) for r in ran)
    its = sorted({max(1, round(n * i / points)) for i in range(1, points + 1)})
    out.append(table(["iteration"] + [r.sync for r in ran], [[t] + [loss_at(list(enumerate(r.losses, 1)), t) for r in ran] for t in its]))
    horizon = max(r.seconds[-1] for r in ran)
    grid = [horizon * i / points for i in range(1, points + 1)]
    out.append(
        table(
            ["seconds"] + [r.sync for r in ran], [[round(s, 1)] + [loss_at(list(zip(r.seconds, r.losses)), s) for r in ran] for s in grid]
        )
    )
    # seconds per iteration: the first task's start to the last iteration's end, over the iterations
    out.append(table(["sync", "s/iteration"], [[r.sync, r.seconds[-1] / len(r.losses)] for r in ran]))
    return "\n\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--iterations", type=int, default=128, help="iterations of every run")
    ap.add_argument("--target", type=float, nargs="+", default=[0.9, 0.95], help="held-out accuracies to reach")
    ap.add_argument("--per-replica", type=int, default=16, help="samples per replica per iteration (DP-1's global batch)")
    ap.add_argument("--checkpoint-every", type=int, default=8, help="iterations between the checkpoints evaluated")
    ap.add_argument("--hap-replicas", type=int, default=4)
    ap.add_argument("--hap-batch", type=int, default=64, help="the HAP experiment's global batch")
    ap.add_argument("--hap-extra", type=int, default=0, help="HAP: a non-aggregator's samples beyond an aggregator's")
    ap.add_argument("--only", choices=["scaling", "hap"])
    args = ap.parse_args()
    from stagecoach.local.backend import LocalBackend  # the embedded stack (moto and a local Lambda runtime)

    backend = LocalBackend()
    try:
        if args.only != "hap":
            results = []
            for cfg in configs(args.iterations, args.per_replica):
                results.append(measure_config(cfg, backend, args.iterations, args.checkpoint_every, args.target))
                print(f"  {cfg.name}: {results[-1].wall_s:.0f} s", file=sys.stderr, flush=True)
            print(
                f"## Worker scaling: {args.iterations} iterations, {args.per_replica} samples per replica, targets {', '.join(f'{t:.0%}' for t in args.target)}\n"
            )
            print(scaling_tables(results, args.target) + "\n", flush=True)
        if args.only != "scaling":
            hap = [
                run_sync(s, backend, args.hap_replicas, args.hap_batch, args.iterations, args.hap_extra)
                for s in ("k_reduce", "k_reduce_hap")
            ]
            k = max(1, args.hap_replicas // 2)
            print(
                f"## HAP vs BSP: d = {args.hap_replicas}, K = {k}, global batch {args.hap_batch}, HAP extra {args.hap_extra}, {args.iterations} iterations\n"
            )
            print(hap_tables(hap), flush=True)
    finally:
        backend.stack.close()


if __name__ == "__main__":
    main()
