"""Planner benchmark.

(a) Exact solve time at L = 30 merged layers (AmoebaNet-D36), 8 tiers, every sync algorithm per
    stage, every d plan_model searches at the global batch (the powers of two the account fits:
    1-256 at G = 1,024): from the profile to a proven optimum (candidate stages, heuristic, bounds,
    MILPs), per d and weights. Target: every solve <= 10 s on this machine with status "optimal"
    (FuncPipe: 274 s with Gurobi); --layers 12 measures plan_model's default merging.
(b) ResNet-101, AmoebaNet-D36, BERT-Large at global batch 16, 64, 256: the recommended plan
    (plan_model defaults) against every baseline in planner.baselines.BASELINES — the baselines as
    FuncPipe §5.1 defines them, and the searched variants named apart — predicted time and cost
    ratios. Targets at G = 64 and 256: >= 1.3x faster and >= 7% cheaper than LambdaML by its paper's
    rule (FuncPipe measured 1.3x-2.2x and 7%-77% against it); never worse than TPDMP / Bayes on the
    weighted objective they optimise (checked per weight).

(c) Past 40 workers (issue 25): BERT-Large and AmoebaNet-D36 at G = 1,024 and 256, the recommended
    plan with the rule before groups (every phase's workers in one inline Map: d <= 40,
    (S-1) d <= 40) and with the account's concurrency (default 1,000: S d invocations, twice that
    while a window restarts), the fastest plan (weights (0, 1)), and LambdaML by its rule under
    each: predicted s and $ per iteration, side by side.

Every plan trains with plain SGD, as in FuncPipe's evaluation (§5.1), so its measured claims compare;
--optimizer adam prices Adam's state instead. Everything printed is measured now; nothing is
hard-coded. Run: python benchmarks/planner.py (--quick: ResNet-101 at 64 only; --skip-a / --skip-b;
--models, --batches; (a) for some d and weights only: --solve-replicas 16,32,64 --solve-weights 22,
the weights as exponents of a2, -1 for (1, 0)). (a) prints each solve's CPU seconds and objective
under its row: on a shared machine the wall times are not the solve's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings

from stagecoach.planner.baselines.classic import BASELINES
from stagecoach.planner.model.platforms import aws_platform
from stagecoach.planner.profile.zoo import zoo_profile
from stagecoach.planner.solve.candidates import candidate_groups
from stagecoach.planner.solve.objective import objective_value
from stagecoach.planner.solve.pareto import FUNCPIPE_WEIGHTS
from stagecoach.planner.solve.search import solve_fixed
from stagecoach.planner.solve.sweep import plan_model, replica_candidates

W_LABEL = {w: f"(1,2^{w[1].bit_length() - 1})" if w[1] else "(1,0)" for w in FUNCPIPE_WEIGHTS}


OPTIMIZER_STATE = {"sgd": 0.0, "adam": 2.0}  # state bytes per parameter byte


def solve_times(
    time_limit: float,
    headline: tuple[int, int] = (1, 2**19),
    G: int = 1024,
    b: int = 4,
    optimizer: str = "sgd",
    layers: int = 30,
    replicas: list[int] | None = None,
    weights: list[tuple[int, int]] | None = None,
) -> None:
    plat = aws_platform(optimizer_state_ratio=OPTIMIZER_STATE[optimizer])
    prof = zoo_profile("amoebanet_d36").merged(layers, plat)
    ws = list(weights or FUNCPIPE_WEIGHTS)
    headline = headline if headline in ws else ws[-1]
    print(
        f"(a) exact solve, {prof.name} merged to L={len(prof.layers)}, {len(plat.tiers_mb)} tiers, all 4 sync algorithms per stage, "
        f"global batch {G}, micro-batch {b}; seconds from the profile to a proven optimum"
    )
    print(
        f"    {'d':>3} {'m':>3} {'stages':>7} {'kept':>5} {'MILPs':>5} {'vars':>5} {'rows':>5}  {'time ' + W_LABEL[headline]:>14}  status    objective  "
        + "  ".join(f"{W_LABEL[w]:>9}" for w in ws)
    )
    head, per_w, statuses, cpu, slow = [], {w: [] for w in ws}, [], [], []
    for d in replica_candidates(G, (b,), plat):
        if replicas and d not in replicas:
            continue
        m = G // (b * d)
        row, cpu_of = {}, {}
        for w in ws:
            t0, c0 = time.perf_counter(), time.process_time()
            cands = candidate_groups(prof, plat, d, b, m)  # built per solve here, so the time is the whole solve
            r = solve_fixed(prof, plat, d, b, m, *w, candidates=cands, time_limit=time_limit)
            row[w] = (time.perf_counter() - t0, r, cands)
            per_w[w].append(row[w][0])
            cpu.append(time.process_time() - c0)
            cpu_of[w] = cpu[-1]
            statuses.append(r.status)
            if row[w][0] > 10 or r.status != "optimal":
                slow.append(f"d={d} {W_LABEL[w]} {row[w][0]:.1f} s ({cpu[-1]:.1f} s CPU) {r.status}")
        t, r, cands = row[headline]
        head.append(t)
        print(
            f"    {d:>3} {m:>3} {cands.size:>7} {r.kept:>5} {len(r.info.get('milps', [])):>5} {r.variables:>5} {r.constraints:>5}  "
            f"{t:>12.2f} s  {r.status:<8}  {r.objective:.10g}  " + "  ".join(f"{row[w][0]:>7.2f} s" for w in ws),
            flush=True,
        )
        # CPU seconds and objective per weight: on a shared machine the wall times above are not the solve's
        print(f"    {'':>3} CPU s / objective: " + "  ".join(f"{cpu_of[w]:.2f} / {row[w][1].objective:.10g}" for w in ws), flush=True)
    print(
        f"    median {W_LABEL[headline]}: {statistics.median(head):.2f} s (target: every solve <= 10 s; FuncPipe's Gurobi MIQP: 274 s); "
        + ", ".join(f"median {W_LABEL[w]}: {statistics.median(v):.2f} s" for w, v in per_w.items())
        + f"; max of all {max(max(v) for v in per_w.values()):.2f} s ({max(cpu):.2f} s of CPU; over 10 s: {sum(t > 10 for v in per_w.values() for t in v)}); proven optimal: {sum(s == 'optimal' for s in statuses)}/{len(statuses)}"
    )
    # wall seconds on a shared machine are several times the CPU's: the load says how much
    print(f"    over 10 s or not proven: {'; '.join(slow) or 'none'}; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(
        "    (stages = candidate (interval, tier, sync) stages; kept = left after the bound test; MILPs = MILPs solved; vars/rows = of the last; 0: LPs decided)\n"
    )


def _label(e) -> str:  # noqa: ANN001
    c = e.config
    return f"d={c.replicas} S={c.stages} b={c.micro_batch} tiers={'/'.join(map(str, c.tiers_mb))} sync={','.join(sorted({s.label() for s in c.sync}))}"


def comparison(models: list[str], batches: list[int], time_limit: float, max_layers: int, optimizer: str = "sgd") -> None:
    plat = aws_platform(optimizer_state_ratio=OPTIMIZER_STATE[optimizer])
    print(
        "(b) recommended plan vs baselines; speed-up = baseline s / ours, cost cut = 1 - our $ / baseline $ (negative: we cost more); "
        f"every plan trains with {optimizer}" + (" as FuncPipe §5.1's evaluation" if optimizer == "sgd" else "")
    )
    summary = []
    for name in models:
        prof = zoo_profile(name)
        for G in batches:
            t0 = time.perf_counter()
            res = plan_model(prof, G, plat, time_limit=time_limit, max_layers=max_layers)
            rec = res.recommended
            print(
                f"  {name} G={G}: recommended {rec.time_s:.2f} s/iter ${rec.cost:.5f}/iter  {_label(rec.estimate)}  weights {W_LABEL.get(rec.weights, rec.weights)}"
                f"  (planned in {time.perf_counter() - t0:.1f} s, {'proven optimal' if res.proven else 'NOT proven'})",
                flush=True,
            )
            for bname, fn in BASELINES.items():
                tb = time.perf_counter()
                e = fn(res.profile, G, plat)
                if e is None:
                    print(f"    {bname:<18} no feasible configuration")
                    continue
                sp, cut = e.time_s / rec.time_s, 1 - rec.cost / e.cost
                extra = ""
                if bname in ("TPDMP", "Bayes"):  # they minimise a1*cost + a2*time per weight: are we ever worse?
                    worst = max(
                        objective_value(c.cost, c.time_s, *c.weights) / objective_value(e.cost, e.time_s, *c.weights)
                        for c in res.candidates
                    )
                    extra = f"  our optimum / their plan, worst weight: {worst:.3f} ({'never worse' if worst <= 1 + 1e-9 else 'WORSE'})"
                if bname == "LambdaML" and G in (64, 256):
                    ok = sp >= 1.3 and cut >= 0.07
                    summary.append((name, G, sp, cut, ok))
                    extra = f"  target >=1.3x and >=7%: {'MET' if ok else 'NOT MET'}"
                    dom = [c for c in res.pareto if e.time_s / c.time_s >= 1.3 and 1 - c.cost / e.cost >= 0.07]
                    if not ok and dom:
                        f = min(dom, key=lambda c: c.time_s)
                        extra += (
                            f"; on our Pareto front: {f.time_s:.2f} s ${f.cost:.5f} ({e.time_s / f.time_s:.2f}x, "
                            f"{100 * (1 - f.cost / e.cost):.0f}% cheaper, weights {W_LABEL.get(f.weights, f.weights)})"
                        )
                print(
                    f"    {bname:<18} {e.time_s:8.2f} s ${e.cost:.5f}  speed-up x{sp:5.2f}  cost cut {100 * cut:6.1f}%  ({_label(e)}; {time.perf_counter() - tb:.1f} s){extra}",
                    flush=True,
                )
    if summary:
        print(
            "  vs LambdaML (its paper's rule) at G = 64, 256: "
            + "; ".join(f"{n} {G}: x{sp:.2f} {100 * cut:.0f}% {'MET' if ok else 'not met'}" for n, G, sp, cut, ok in summary)
        )
        top = max(sp for _, _, sp, _, _ in summary)
        print(
            f"  largest predicted speed-up over LambdaML: x{top:.2f} (FuncPipe measured 1.3x-2.2x over LambdaML on AWS, §5.2)"
            + ("" if top <= 2.2 else ": above anything FuncPipe measured")
        )


def _scale_row(label: str, e, extra: str = "") -> str:  # noqa: ANN001
    c = e.config
    state = "" if e.feasible else f"  INFEASIBLE: {'; '.join(e.violations)}"
    return f"    {label:<30} {e.time_s:8.2f} s  ${e.cost:.5f}  d={c.replicas:<4} S={c.stages} workers={c.stages * c.replicas:<4} {extra}{state}"


def scale(models: list[str], batches: list[int], time_limit: float, max_layers: int, concurrency: int, optimizer: str = "sgd") -> None:
    base = aws_platform(optimizer_state_ratio=OPTIMIZER_STATE[optimizer], concurrency=concurrency)
    print(
        f"(c) past 40 workers: the recommended plan with the inline-Map cap (d <= 40, (S-1) d <= 40) and with the account's "
        f"concurrency ({concurrency}: S d <= {(concurrency - 1) // 2}), LambdaML by its rule under each; {optimizer}"
    )
    for name in models:
        prof = zoo_profile(name)
        for G in batches:
            print(f"  {name} G={G}", flush=True)
            for label, plat in (("40-worker cap", base.replace(inline_map_only=True)), (f"concurrency {concurrency}", base)):
                t0 = time.perf_counter()
                res = plan_model(prof, G, plat, time_limit=time_limit, max_layers=max_layers)
                rec, took = res.recommended, time.perf_counter() - t0
                fastest = min(res.pareto, key=lambda c: c.time_s)
                how = f"planned in {took:.0f} s, {'proven' if res.proven else 'NOT proven'}; cold +{rec.estimate.cold_ramp_s:.1f} s"
                print(_scale_row(f"recommended, {label}", rec.estimate, how), flush=True)
                print(_scale_row(f"fastest Pareto, {label}", fastest.estimate, f"weights {W_LABEL.get(fastest.weights)}"), flush=True)
                t0 = time.perf_counter()
                quick = plan_model(prof, G, plat, weights=((0.0, 1.0),), time_limit=time_limit, max_layers=max_layers)
                took = f"planned in {time.perf_counter() - t0:.0f} s, {'proven' if quick.proven else 'NOT proven'}"
                print(_scale_row(f"time only (0,1), {label}", quick.recommended.estimate, took), flush=True)
                lam = BASELINES["LambdaML"](res.profile, G, plat)
                if lam is None:
                    print(f"    {'LambdaML, ' + label:<30} no local batch fits", flush=True)
                else:
                    print(_scale_row(f"LambdaML, {label}", lam, f"b={lam.config.micro_batch}"), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="(b) for ResNet-101 at batch 64 only")
    ap.add_argument("--time-limit", type=float, default=60.0, help="seconds per exact solve")
    ap.add_argument("--max-layers", type=int, default=12, help="(b): plan_model's layer merging")
    ap.add_argument("--models", default="resnet101,amoebanet_d36,bert_large")
    ap.add_argument("--batches", default="16,64,256")
    ap.add_argument("--skip-a", action="store_true")
    ap.add_argument("--skip-b", action="store_true")
    ap.add_argument("--skip-c", action="store_true")
    ap.add_argument("--only-c", action="store_true", help="(c) alone")
    ap.add_argument("--layers", type=int, default=30, help="(a): merged layers")
    ap.add_argument("--solve-batch", type=int, default=1024, help="(a): global batch (the d searched follow from it)")
    ap.add_argument("--solve-replicas", default="", help="(a): only these d, comma-separated (default: every d searched)")
    ap.add_argument("--solve-weights", default="", help="(a): only these weights, as a2 exponents: 22 is (1, 2^22), -1 is (1, 0)")
    ap.add_argument("--scale-models", default="bert_large,amoebanet_d36")
    ap.add_argument("--scale-batches", default="1024,256")
    ap.add_argument("--concurrency", type=int, default=1000, help="(c): the account's Lambda concurrency")
    ap.add_argument("--optimizer", choices=sorted(OPTIMIZER_STATE), default="sgd", help="what every plan trains with (FuncPipe §5.1: SGD)")
    args = ap.parse_args()
    warnings.simplefilter("ignore", DeprecationWarning)
    if args.only_c:
        args.skip_a = args.skip_b = True
    if not args.skip_a:
        replicas = [int(x) for x in args.solve_replicas.split(",") if x]
        weights = [(1, 2 ** int(x) if int(x) >= 0 else 0) for x in args.solve_weights.split(",") if x]
        solve_times(args.time_limit, G=args.solve_batch, optimizer=args.optimizer, layers=args.layers, replicas=replicas, weights=weights)
    if not args.skip_c:
        models, batches = args.scale_models.split(","), [int(x) for x in args.scale_batches.split(",")]
        scale(models, batches, args.time_limit, args.max_layers, args.concurrency, args.optimizer)
    if not args.skip_b:
        if args.quick:
            comparison(["resnet101"], [64], args.time_limit, args.max_layers, args.optimizer)
        else:
            comparison(args.models.split(","), [int(x) for x in args.batches.split(",")], args.time_limit, args.max_layers, args.optimizer)


if __name__ == "__main__":
    main()
