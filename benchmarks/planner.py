"""Planner benchmark: (a) MILP solve time at L=30 merged layers, 8 tiers, d in {1,...,32};
(b) seed-paper models at global batch 16/64/256: recommended plan vs the baselines.

Everything printed is measured now; nothing is hard-coded. Run: python benchmarks/planner.py
(--quick for fewer cases; --time-limit caps each MILP solve).
"""

from __future__ import annotations

import argparse
import statistics
import time

from stagecoach.planner.api import heuristic_estimates, plan_model
from stagecoach.planner.baselines import BASELINES
from stagecoach.planner.milp import objective_value, solve_fixed
from stagecoach.planner.platforms import aws_platform
from stagecoach.planner.zoo import zoo_profile


def solve_times(time_limit: float, weight: tuple[float, float]) -> None:
    plat = aws_platform()
    prof = zoo_profile("amoebanet_d36").merged(30, plat)
    print(f"(a) MILP solve time, {prof.name} merged to L={len(prof.layers)}, {len(plat.tiers_mb)} tiers, weights {weight}, global batch 256, b=4")
    times = []
    for d in (1, 2, 4, 8, 16, 32):
        m = 256 // (4 * d)
        heur = heuristic_estimates(prof, plat, d, 4, m, ("scatter_reduce",), 8)
        inc = min((objective_value(e.cost, e.time_s, *weight) for e in heur), default=None)
        r = solve_fixed(prof, plat, d, 4, m, *weight, time_limit=time_limit, incumbent_objective=inc)
        times.append(r.solve_s)
        print(f"  d={d:>2}  {r.solve_s:7.2f} s  status={r.status:<11} vars={r.variables:>5} rows={r.constraints:>5}  obj={r.objective:.4g} (heuristic {inc:.4g})")
    print(f"  median {statistics.median(times):.2f} s (target <= 10 s; FuncPipe's Gurobi MIQP: 274 s)\n")


def comparison(models: list[str], batches: list[int], time_limit: float, max_layers: int) -> None:
    plat = aws_platform()
    print("(b) recommended plan vs baselines (ratios = baseline / Stagecoach: time ratio = speed-up, cost ratio > 1 = Stagecoach cheaper)")
    for name in models:
        prof = zoo_profile(name)
        for G in batches:
            t0 = time.perf_counter()
            res = plan_model(prof, G, plat, time_limit=time_limit, max_layers=max_layers)
            rec = res.recommended
            print(f"  {name} G={G}: Stagecoach {rec.time_s:.2f} s/iter ${rec.cost:.5f}/iter  d={rec.config.replicas} "
                  f"stages={rec.config.stages} tiers={rec.config.tiers_mb} ({rec.method}; planned in {time.perf_counter() - t0:.1f} s)")
            for bname, fn in BASELINES.items():
                e = fn(res.profile, G, plat)
                if e is None:
                    print(f"    {bname:<12} no feasible configuration")
                    continue
                print(f"    {bname:<12} {e.time_s:8.2f} s ${e.cost:.5f}  time x{e.time_s / rec.time_s:5.2f}  cost x{e.cost / rec.cost:5.2f}"
                      f"  (d={e.config.replicas}, S={e.config.stages}, tier={e.config.tiers_mb[0]})")
            print("    FuncPipe-faithful  not implemented yet (planner/funcpipe_model.py missing)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="ResNet-101 at batch 64 only")
    ap.add_argument("--time-limit", type=float, default=10.0, help="seconds per MILP solve")
    ap.add_argument("--max-layers", type=int, default=12)
    ap.add_argument("--skip-a", action="store_true")
    args = ap.parse_args()
    if not args.skip_a:
        solve_times(args.time_limit, (1, 2**19))
    if args.quick:
        comparison(["resnet101"], [64], args.time_limit, args.max_layers)
    else:
        comparison(["resnet101", "amoebanet_d36", "bert_large"], [16, 64, 256], args.time_limit, args.max_layers)


if __name__ == "__main__":
    main()
