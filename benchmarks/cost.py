"""What a run costs per phase and per component, Standard vs Express windows, predicted and measured (issue 26, item 5).

For the README demo (examples/digits.py, its ``defaults`` plan, as ``make demo`` runs it),
examples/bert.py (its ``defaults`` plan) and the seed papers' three models' recommended plans
(ResNet-101, AmoebaNet-D36, BERT-Large at ``--batch``, planned by ``plan_model`` as
benchmarks/planner.py (b) plans them, SGD as FuncPipe §5.1), it prints in one run:

1. the predicted cost per iteration per phase (forward, backward, sync, evaluate, checkpoint,
   gate+control = the iteration gates, the windows' bookkeeping states and the job's, then the S3
   requests, which the performance model counts per iteration, not per phase), Standard and
   Express windows side by side (sdk/cost.py ``predict``, the figure ``stagecoach train`` prints);
2. the same per component: Lambda GB-s and requests, Step Functions transitions (Standard) or
   Express requests and duration, S3 PUT/LIST and GET requests; and the orchestration share
   (Step Functions + S3 requests) of the total;
3. before vs after: before = Standard windows (how every run was billed before issue 26), after =
   what ``workflow="auto"`` picks (planner/emit/workflow.py ``choose``);
4. for the local runs (``--local``, default the demo and bert; ``--predicted-only`` skips them):
   each example run for ``--iterations`` iterations with Standard and with Express windows on one
   embedded local stack, its measured cost (``Run.cost()``, as the demo reports it) beside the
   prediction, and its seconds per iteration (the first training task's start to the last one's
   end, over the iterations);
5. the issue's targets as measured ratios: the demo's measured cost Standard / Express (target
   >= 2.5x) and its seconds per iteration Express / Standard (target <= 1), and the orchestration
   share of the paper-scale plans' predicted cost after (target < 10%), with, per paper plan, the
   chunks per shard the planner chose (Plan.chunks) beside the same plan cut by the size rule
   (planner/plan.py chunk_count): its cost, seconds and share. Printed, not asserted: the
   machine is shared and the local times are noisy.

Run: python benchmarks/cost.py [--iterations 30] [--predicted-only] [--local demo,bert] [--batch 256]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import runpy
import time
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from stagecoach.core.cost import Usage
from stagecoach.cost import CostReport, WindowRun, predict
from stagecoach.local.backend import LocalBackend
from stagecoach.planner.emit import workflow
from stagecoach.planner.model.chunking import chunk_candidates
from stagecoach.planner.model.perfmodel import evaluate
from stagecoach.planner.model.platforms import aws_platform
from stagecoach.planner.plan import PlanError
from stagecoach.planner.profile.zoo import zoo_profile
from stagecoach.planner.solve.sweep import plan_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = {"demo": os.path.join(ROOT, "examples", "digits.py"), "bert": os.path.join(ROOT, "examples", "bert.py")}
PAPER_MODELS = ("resnet101", "amoebanet_d36", "bert_large")
WORKFLOWS = ("standard", "express")
# the columns of the per-component table: (name, the Usage fields it prices)
COMPONENTS = (
    ("Lambda GB-s", ("gb_s",)),
    ("Lambda req", ("invocations",)),
    ("SFN transitions", ("transitions",)),
    ("Express req", ("express_requests",)),
    ("Express dur", ("express_gb_s",)),
    ("S3 PUT/LIST", ("puts",)),
    ("S3 GET", ("gets",)),
)
ORCHESTRATION = ("SFN transitions", "Express req", "Express dur", "S3 PUT/LIST", "S3 GET")
MILLI = 1000.0  # the tables print thousandths of a dollar (m$) per iteration


@dataclass(frozen=True)
class Case:
    """One model's plan, its predicted cost with each workflow (None: Express cannot run it, ``why``),
    and what ``workflow="auto"`` picks."""

    name: str
    predicted: dict[str, CostReport | None]
    auto: str
    why: str
    s_per_iteration: float
    # a paper plan's chunks per shard (Plan.chunks, the planner's choice) and the size rule's, and the
    # same plan with the rule's C, priced with the auto workflow and its seconds per iteration
    chunks: str = ""
    rule: CostReport | None = None
    rule_s_per_iteration: float = 0.0


def components(report: CostReport) -> dict[str, float]:
    """USD of the report's total by component (COMPONENTS): they sum to ``report.usd``."""
    total = report.total
    return {name: Usage(**{f: getattr(total, f) for f in fs}).usd(report.prices) for name, fs in COMPONENTS}


def orchestration_share(report: CostReport) -> float:
    """Step Functions (transitions, Express requests and duration) and S3 requests over the total."""
    parts = components(report)
    return sum(parts[c] for c in ORCHESTRATION) / report.usd if report.usd else 0.0


def phases(report: CostReport) -> dict[str, float]:
    """USD per phase without S3 (the model does not place S3 requests in phases), then "S3 requests"."""
    out = report.phase_usd(s3=False)
    out["S3 requests"] = report.s3_usd
    return out


def example_job(name: str, iterations: int, workflow_name: str, suffix: str = "") -> tuple[Any, Any]:
    """The example's job (its own module's ``job``) for ``iterations`` with ``workflow_name``, and its defaults plan."""
    ns = runpy.run_path(EXAMPLES[name])
    job = dataclasses.replace(ns["job"], iterations=iterations, workflow=workflow_name, name=f"cost-{name}-{workflow_name[:3]}{suffix}")
    return job, job.manual_plan(**ns["defaults"])


def example_case(name: str, iterations: int) -> Case:
    """An example's predicted cost, Standard, Express and auto (``Job.predict_cost``)."""
    job, plan = example_job(name, iterations, "auto")
    predicted: dict[str, CostReport | None] = {}
    why = ""
    for wf in WORKFLOWS:
        try:
            predicted[wf] = job.predict_cost(plan, workflow=wf)
        except PlanError as e:  # Express refused for this plan
            predicted[wf], why = None, str(e)
    choice = job.window_choice(plan, workflow="auto")
    return Case(f"{name} (examples/{os.path.basename(EXAMPLES[name])})", predicted, choice.workflow.lower(), why, job.predict(plan).time_s)


def paper_case(model: str, batch: int, iterations: int, time_limit: float) -> Case:
    """A seed-paper model's recommended plan (plan_model, as benchmarks/planner.py (b)), its cost each way."""
    plat = aws_platform(optimizer_state_ratio=0.0)  # SGD, as FuncPipe §5.1 and benchmarks/planner.py
    rec = plan_model(zoo_profile(model), batch, plat, time_limit=time_limit, max_layers=12).recommended
    plan, est = rec.to_plan(), rec.estimate
    predicted: dict[str, CostReport | None] = {}
    for wf in WORKFLOWS:
        try:
            c = workflow.choose(wf, plan, iterations, est.time_s, rec.platform)  # "express" is refused where it cannot run
        except PlanError:
            predicted[wf] = None
            continue
        predicted[wf] = predict(plan, est, iterations, rec.platform, windows=WindowRun(c.workflow, c.window_length, c.memory_mb))
    auto = workflow.choose("auto", plan, iterations, est.time_s, rec.platform)
    cfg = est.config
    tiers = f"{min(cfg.tiers_mb)}-{max(cfg.tiers_mb)}" if min(cfg.tiers_mb) < max(cfg.tiers_mb) else str(cfg.tiers_mb[0])
    label = f"{model} G={batch} d={cfg.replicas} S={cfg.stages} {tiers} MB"
    # the same plan cut by the size rule (Plan.chunks 0): what the planner's choice of C changed
    rule_cfg = dataclasses.replace(cfg, sync=tuple(dataclasses.replace(c, chunks=0) for c in cfg.sync))
    rule_est = evaluate(rec.profile, rule_cfg, rec.platform)
    rule_plan = dataclasses.replace(plan, chunks=(0,) * plan.stages)
    windows = WindowRun(auto.workflow, auto.window_length, auto.memory_mb)
    rule = predict(rule_plan, rule_est, iterations, rec.platform, windows=windows)
    sizes = tuple(chunk_candidates(rec.profile, cfg, s)[-1] for s in range(cfg.stages))
    chunks = f"C={','.join(map(str, plan.chunks))} (size rule {','.join(map(str, sizes))})"
    why = auto.why_not if auto.express_usd is None else ""
    return Case(label, predicted, auto.workflow.lower(), why, est.time_s, chunks, rule, rule_est.time_s)


@dataclass(frozen=True)
class Measured:
    """One local run: its measured and predicted cost, its seconds per iteration and wall seconds."""

    name: str
    workflow: str
    measured: CostReport
    predicted: CostReport
    s_per_iteration: float
    wall_s: float
    status: str


def measure(name: str, iterations: int, wf: str, backend: LocalBackend) -> Measured:
    """Run the example with ``wf`` windows on ``backend``; its cost as ``Run.cost()`` measures it."""
    job, plan = example_job(name, iterations, wf, suffix=f"-{int(time.time())}")
    predicted = job.predict_cost(plan, workflow=wf)
    t0 = time.perf_counter()
    run = job.run(plan=plan, backend=backend)
    status = run.wait(progress=False, timeout_s=3600)
    wall = time.perf_counter() - t0
    train = [m for m in run.metrics() if m.phase in ("forward", "backward", "sync")]
    its = sorted({m.t for m in train})
    first = min(m.start for m in train if m.t == its[0])
    last = max(m.end for m in train if m.t == its[-1])
    return Measured(name, wf, run.cost(), predicted, (last - first) / len(its), wall, status)


def _m(usd: float, iterations: int) -> str:
    return f"{MILLI * usd / max(1, iterations):>9.4f}"


def _rows(cases: Iterable[Case]) -> Iterable[tuple[Case, str, CostReport | None]]:
    for case in cases:
        for wf in WORKFLOWS:
            yield case, wf, case.predicted[wf]


def print_phases(cases: list[Case]) -> None:
    names = ["forward", "backward", "sync", "evaluate", "checkpoint", "orchestration", "S3 requests"]
    heads = ["forward", "backward", "sync", "evaluate", "ckpt", "gate+ctl", "S3 req"]
    print("\n1. predicted cost per iteration per phase, m$ (thousandths of a USD); gate+ctl = the iteration gates,")
    print("   the windows' bookkeeping states and the job's (Standard: transitions; Express: requests and duration)")
    print(f"   {'plan':<48} {'windows':<9}" + "".join(f" {h:>9}" for h in heads) + f" {'total':>9}  s/iter")
    for case, wf, r in _rows(cases):
        mark = "*" if wf == case.auto else " "
        if r is None:
            print(f"   {case.name:<48} {wf:<8}{mark} cannot run: {case.why[:100]}")
            continue
        p = phases(r)
        cells = "".join(_m(p.get(n, 0.0), r.iterations) for n in names)
        print(f"   {case.name:<48} {wf:<8}{mark}{cells} {_m(r.usd, r.iterations)}  {case.s_per_iteration:.3f}")
    print("   (* = what workflow='auto' picks)")


def print_components(cases: list[Case]) -> None:
    print("\n2. predicted cost per iteration per component, m$; orch = Step Functions + S3 requests, share of the total")
    print(f"   {'plan':<48} {'windows':<9}" + "".join(f" {c[0]:>11}" for c in COMPONENTS) + f" {'total':>9} {'orch':>6}")
    for case, wf, r in _rows(cases):
        if r is None:
            continue
        parts = components(r)
        cells = "".join(f" {MILLI * parts[c] / r.iterations:>11.4f}" for c, _ in COMPONENTS)
        mark = "*" if wf == case.auto else " "
        print(f"   {case.name:<48} {wf:<8}{mark}{cells} {_m(r.usd, r.iterations)} {100 * orchestration_share(r):>5.1f}%")


def print_before_after(cases: list[Case]) -> None:
    print("\n3. before (Standard windows) vs after (workflow='auto'), predicted per iteration")
    print(f"   {'plan':<48} {'before m$':>10} {'orch':>6} | {'after':<8} {'m$':>9} {'orch':>6} | {'before/after':>12}")
    for case in cases:
        before, after = case.predicted["standard"], case.predicted[case.auto]
        assert before is not None and after is not None  # Standard always runs; auto picks one that does
        print(
            f"   {case.name:<48} {_m(before.usd, before.iterations):>10} {100 * orchestration_share(before):>5.1f}% | "
            f"{case.auto:<8} {_m(after.usd, after.iterations)} {100 * orchestration_share(after):>5.1f}% | {before.usd / after.usd:>11.2f}x"
        )


def print_measured(runs: list[Measured]) -> None:
    print("\n4. local runs: measured (Run.cost()) beside predicted, per iteration, m$; s/iter measured on this machine")
    print(
        f"   {'example':<8} {'windows':<9} {'status':<10} {'predicted':>9} {'measured':>9} {'meas/pred':>9} "
        f"{'Lambda':>9} {'SFN':>9} {'S3 req':>9} {'orch':>6} {'s/iter':>7} {'wall s':>7}"
    )
    for m in runs:
        r, parts = m.measured, components(m.measured)
        sfn = parts["SFN transitions"] + parts["Express req"] + parts["Express dur"]
        lam = parts["Lambda GB-s"] + parts["Lambda req"]
        s3 = parts["S3 PUT/LIST"] + parts["S3 GET"]
        print(
            f"   {m.name:<8} {m.workflow:<9} {m.status:<10} {_m(m.predicted.usd, m.predicted.iterations)} {_m(r.usd, r.iterations)} "
            f"{r.usd / r.iterations / (m.predicted.usd / m.predicted.iterations):>9.3f} {_m(lam, r.iterations)} {_m(sfn, r.iterations)} "
            f"{_m(s3, r.iterations)} {100 * orchestration_share(r):>5.1f}% {m.s_per_iteration:>7.3f} {m.wall_s:>7.1f}"
        )
        print(f"   {'':<8} {'':<9} {r.quantities()}")


def print_targets(cases: list[Case], runs: list[Measured], paper: int) -> None:
    print("\n5. the issue's targets, as measured ratios (printed, not asserted: a shared machine)")
    demo = {m.workflow: m for m in runs if m.name == "demo"}
    if len(demo) == 2:
        std, exp = demo["standard"], demo["express"]
        ratio = (std.measured.usd / std.measured.iterations) / (exp.measured.usd / exp.measured.iterations)
        slow = exp.s_per_iteration / std.s_per_iteration
        print(f"   demo measured cost Standard / Express: {ratio:.2f}x (target >= 2.5x: {'met' if ratio >= 2.5 else 'NOT met'})")
        print(f"   demo s/iteration Express / Standard: {slow:.3f} (target <= 1: {'met' if slow <= 1 else 'NOT met'})")
    else:
        print("   demo: not run locally (--predicted-only or --local without demo)")
    for case in cases[-paper:] if paper else []:
        after = case.predicted[case.auto]
        assert after is not None
        share = orchestration_share(after)
        print(
            f"   {case.name}: orchestration {100 * share:.1f}% of the predicted cost after (target < 10%: {'met' if share < 0.10 else 'NOT met'})"
        )
        if case.rule is not None:
            print(
                f"      chunks per shard {case.chunks}: {_m(after.usd, after.iterations).strip()} m$, {case.s_per_iteration:.3f} s/iter; "
                f"with the size rule's {_m(case.rule.usd, case.rule.iterations).strip()} m$, {case.rule_s_per_iteration:.3f} s/iter, "
                f"orchestration {100 * orchestration_share(case.rule):.1f}%"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iterations", type=int, default=30, help="iterations of each local run and of the examples' predictions")
    ap.add_argument("--paper-iterations", type=int, default=1000, help="iterations the paper-scale plans' predictions cover")
    ap.add_argument("--batch", type=int, default=256, help="the paper models' global batch")
    ap.add_argument("--models", default=",".join(PAPER_MODELS), help="seed-paper models (planner/profile/zoo.py); '' for none")
    ap.add_argument("--local", default="demo,bert", help="examples to run locally (demo, bert)")
    ap.add_argument("--predicted-only", action="store_true", help="no local runs")
    ap.add_argument("--time-limit", type=float, default=60.0, help="seconds per exact solve of the planner")
    args = ap.parse_args()
    warnings.simplefilter("ignore", DeprecationWarning)
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores at the start")
    cases = [example_case(name, args.iterations) for name in EXAMPLES]
    models = [m for m in args.models.split(",") if m]
    cases += [paper_case(m, args.batch, args.paper_iterations, args.time_limit) for m in models]
    print(f"predictions: the examples over {args.iterations} iterations, the paper models over {args.paper_iterations}")
    print_phases(cases)
    print_components(cases)
    print_before_after(cases)
    runs: list[Measured] = []
    if not args.predicted_only:
        # a stack of its own: never this project's daemon's (its other jobs would share the cores)
        os.environ["STAGECOACH_LOCAL_ATTACH"] = "0"
        backend = LocalBackend()
        try:
            for name in [n for n in args.local.split(",") if n]:
                for wf in WORKFLOWS:
                    runs.append(measure(name, args.iterations, wf, backend))
        finally:
            backend.stack.close()
        print_measured(runs)
    print_targets(cases, runs, len(models))
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores at the end")


if __name__ == "__main__":
    main()
