"""Fault benchmark: the demo under killed, throttled, hung tasks and lost objects, against fault-free.

Runs examples/digits.py's job (3 stages x 2 replicas x 2 micro-batches, Adam, dropout; its test-set
evaluation left out) for ``--iterations`` iterations on the embedded local stack, once fault-free and
once per fault mix, each on a stack of its own with the local runtime's seeded fault injection
(stagecoach/local/faults.py): 10/20/30/40% of training tasks killed (at a random point of the task,
mid-upload included), and 20% kills with 5% throttles, 2% hangs (``--hangs``: one mix per rate) and
2% lost activations.

For each run it prints the job execution's time (Step Functions' start to stop date, the job alone:
deploy and upload are the same with and without faults) and the time from launch (deploy, upload,
run, as `make demo` waits) to the end, each with its ratio to the fault-free run's, the
window attempts (window executions), the faults injected and the tasks' failures by error, and whether every trained
parameter is bit-identical to the fault-free run's (``torch.equal``). Nothing is estimated: every
number is measured in this run; this machine's two cores are shared by every worker, so absolute
times are the machine's, the ratios are what to compare.

It also prints each run's iterations alone ("iter s": from the end of the first window's first
gate to the job's end), which leaves out the one thing no fault touches and this shared machine's
load stretches most: the gate function's first, cold invocation (torch and the job loaded; 5 to
30 s here, against ~1.5 s per iteration). That ratio is the stricter one (the same fault cost
over a smaller base). And, per fault, what it cost where it struck ("profile"): the mean time of
a Map item's whole run (first start to last success, re-runs included) that met it, against the
items that met none (a hang's timeout, a kill's cut work and cold re-run, a throttle's Retry wait).

Run: python benchmarks/faults.py [--iterations 20] [--seed 1] [--only 30 -1] [--hangs 0.01 0.02] [--dump DIR]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import re
import runpy
import time
from pathlib import Path
from typing import Any

import torch

from stagecoach import Job
from stagecoach.local.backend import LocalBackend
from stagecoach.planner.emit.asl import PHASE_DONE
from stagecoach.run import Run

DEMO = Path(__file__).resolve().parent.parent / "examples" / "digits.py"
HANG_TIMEOUT_S = 20  # the plan's Task timeouts: iteration 0's, and the ceiling of those the gate learns


def demo_job(iterations: int) -> tuple[Job, dict[str, Any]]:
    ns = runpy.run_path(str(DEMO))
    job: Job = ns["job"]
    return dataclasses.replace(job, iterations=iterations, test=None, metrics={}), dict(ns["defaults"])


def mixes(seed: int, hangs: list[float]) -> list[tuple[str, dict[str, Any] | None]]:
    """Fault-free, 10-40% kills, and one mix per hang rate in ``hangs`` (a hang costs at least the
    learnt timeouts' 2 s floor, several of the demo's ~0.3 s tasks: docs/reliability.md)."""
    kills = [(f"{int(p * 100)}% killed", {"seed": seed, "kill": p}) for p in (0.1, 0.2, 0.3, 0.4)]
    mixed = [
        (f"20% killed + 5% throttled, {h * 100:g}% hung, 2% lost", {"seed": seed, "kill": 0.2, "throttle": 0.05, "hang": h, "delete": 0.02})
        for h in hangs
    ]
    return [("fault-free", None), *kills, *mixed]


@dataclasses.dataclass
class Outcome:
    label: str
    status: str
    seconds: float
    iterations_s: float  # from the end of the first gate (its cold start) to the job's end
    launched: float  # deploy, upload and run, as `make demo` waits for them
    windows: int
    injected: collections.Counter[str]  # the faults the local runtime injected (its log)
    errors: collections.Counter[str]
    params: dict[str, torch.Tensor] | None
    item_s: dict[str, list[float]]  # a Map item's whole run, by the faults it met (``item_seconds``)


def task_errors(r: Run) -> collections.Counter[str]:
    """The tasks' failures by error; a phase watcher's PhaseDone (lambdas/watcher.py) counts as
    "watcher re-ran" when it ran a task again, and not at all otherwise (no failure: a phase's
    end, which moto records also for an abandoned watcher, docs/local-stack.md)."""
    out: collections.Counter[str] = collections.Counter()
    for arn in r.window_executions():
        for ev in r.history(execution_arn=arn):
            det = ev.get("taskFailedEventDetails") or ev.get("taskTimedOutEventDetails")
            if det and det.get("error") == PHASE_DONE:
                out["watcher re-ran"] += "ran again" in (det.get("cause") or "")
            elif det and det.get("error"):
                out[det["error"]] += 1
    return +out


def execution_seconds(r: Run) -> float:
    """From the first job execution's start to the last one's stop (the job follows its chain)."""
    first = r._c.sfn.describe_execution(executionArn=r.executions()[0])
    last = r.describe()
    return float((last["stopDate"] - first["startDate"]).total_seconds())


def window_histories(r: Run) -> list[list[dict[str, Any]]]:
    """Every window execution's events, timestamps in epoch seconds, the first execution first
    (ListExecutions lists the newest first)."""
    runs = [[{**ev, "timestamp": ev["timestamp"].timestamp()} for ev in r.history(execution_arn=arn)] for arn in r.window_executions()]
    return sorted((events for events in runs if events), key=lambda events: events[0]["timestamp"])


def first_gate_end(histories: list[list[dict[str, Any]]]) -> float | None:
    """When the first window's first gate ended: its cold start (torch, the job) is behind it."""
    for ev in histories[0] if histories else []:
        if ev["type"] == "TaskStateExited" and ev["stateExitedEventDetails"]["name"] == "Gate":
            return float(ev["timestamp"])
    return None


FAULT_OF = {
    "States.Timeout": "hung",
    "Sandbox.Timedout": "hung",
    "Runtime.ExitError": "killed",
    "Lambda.TooManyRequestsException": "throttled",
}


def item_seconds(histories: list[list[dict[str, Any]]]) -> dict[str, list[float]]:
    """Each Map item's whole run (its first task start to its last success, re-runs and Retry
    waits included), by what it met: "none", or the faults (``FAULT_OF``, else the error) joined.
    An item's events chain by previousEventId from its MapIterationStarted."""
    out: dict[str, list[float]] = collections.defaultdict(list)
    for events in histories:
        item: dict[int, int] = {}
        runs: dict[int, list[dict[str, Any]]] = collections.defaultdict(list)
        for ev in events:
            root = ev["id"] if ev["type"] == "MapIterationStarted" else item.get(ev.get("previousEventId", -1))
            if root is None or ev["type"] in ("MapStateSucceeded", "MapStateExited", "MapStateFailed"):
                continue
            item[ev["id"]] = root
            runs[root].append(ev)
        for evs in runs.values():
            started = [e["timestamp"] for e in evs if e["type"] == "TaskStarted"]
            done = [e["timestamp"] for e in evs if e["type"] == "TaskSucceeded"]
            if not started or not done:
                continue
            met = {FAULT_OF.get(d.get("error", ""), d.get("error", "")) for e in evs if (d := _failure(e))}
            out[" + ".join(sorted(met)) or "none"].append(done[-1] - started[0])
    return out


def _failure(ev: dict[str, Any]) -> dict[str, Any] | None:
    return ev.get("taskFailedEventDetails") or ev.get("taskTimedOutEventDetails")


def run_one(label: str, faults: dict[str, Any] | None, iterations: int, dump: Path | None = None) -> Outcome:
    job, plan = demo_job(iterations)
    job = dataclasses.replace(job, name="faults")
    backend = LocalBackend(faults=faults)
    try:
        t0 = time.time()
        r = job.run(backend=backend, timeout_s=HANG_TIMEOUT_S, **plan)
        try:
            status = r.wait(progress=False, poll_s=1.0, timeout_s=3600)
        except Exception as e:  # noqa: BLE001 - a failed run is a row of the table
            status = f"FAILED ({type(e).__name__})"
        launched = time.time() - t0
        seconds = execution_seconds(r) if r.status() != "RUNNING" else launched
        params = dict(r.trained_model().state_dict()) if status == "SUCCEEDED" else None
        histories = window_histories(r)
        if dump is not None:
            dump.mkdir(parents=True, exist_ok=True)
            (dump / (re.sub(r"[^a-z0-9]+", "-", label.lower()).strip("-") + ".json")).write_text(json.dumps(histories, default=str))
        gated = first_gate_end(histories)
        stop = r.describe().get("stopDate")
        iterations_s = stop.timestamp() - gated if gated is not None and stop is not None else seconds
        injected = collections.Counter(re.findall(r"injected (\w+)", Path(backend.stack.log_path).read_text()))
        errors = task_errors(r)
        return Outcome(label, status, seconds, iterations_s, launched, len(histories), injected, errors, params, item_seconds(histories))
    finally:
        backend.stack.close()


def identical(a: dict[str, torch.Tensor] | None, b: dict[str, torch.Tensor] | None) -> str:
    if a is None or b is None:
        return "-"
    return "yes" if a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a) else "NO"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--only", type=int, nargs="*", help="kill percentages to run besides fault-free (and 'mixed' if -1)")
    ap.add_argument("--dump", type=Path, help="write each run's window execution histories here (JSON, for profiling)")
    ap.add_argument("--hangs", type=float, nargs="+", default=[0.02], help="the mixes' hang rates (one mix each; default 0.02)")
    args = ap.parse_args()
    rows = mixes(args.seed, args.hangs)
    if args.only is not None:
        wanted = {f"{p}% killed" for p in args.only if p >= 0}
        rows = [r for r in rows if r[0] == "fault-free" or r[0] in wanted or (-1 in args.only and r[0].startswith("20% killed +"))]
    outcomes: list[Outcome] = []
    for label, faults in rows:
        o = run_one(label, faults, args.iterations, args.dump)
        outcomes.append(o)
        print(f"  ran {label}: {o.status} in {o.seconds:.1f} s", flush=True)
    print_table(outcomes, args.iterations, args.seed)


def print_table(outcomes: list[Outcome], iterations: int, seed: int) -> None:
    base = outcomes[0]
    print(f"\nThe demo's job ({iterations} iterations, 3 stages x 2 replicas x 2 micro-batches), fault seed {seed}")
    print(
        f"{'faults':<46} {'status':<18} {'job s':>7} {'x':>5} {'iter s':>7} {'x':>5} {'launch+job s':>12} {'x':>5} {'windows':>7} "
        f"{'bit-identical':>13}  injected; task failures"
    )
    for o in outcomes:
        ratios = (o.seconds / base.seconds, o.iterations_s / base.iterations_s, o.launched / base.launched)
        errs = ", ".join(f"{k} {v}" for k, v in o.injected.most_common()) + "; " + ", ".join(f"{k} {v}" for k, v in o.errors.most_common())
        print(
            f"{o.label:<46} {o.status:<18} {o.seconds:>7.1f} {ratios[0]:>5.2f} {o.iterations_s:>7.1f} {ratios[1]:>5.2f} "
            f"{o.launched:>12.1f} {ratios[2]:>5.2f} {o.windows:>7} {identical(o.params, base.params):>13}  {errs}"
        )
    print("\nprofile: a Map item's whole run (s, mean and count) by the faults it met")
    for o in outcomes:
        costs = "; ".join(f"{k} {sum(v) / len(v):.2f} ({len(v)})" for k, v in sorted(o.item_s.items(), key=lambda kv: -len(kv[1])))
        print(f"  {o.label:<46} {costs}")


if __name__ == "__main__":
    main()
