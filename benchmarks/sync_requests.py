"""S3 requests per iteration of one stage's sync: the flat scatter-reduce against the hierarchical chain.

The performance model's own counts (planner/model/syncmodel.py ``sync_requests``, the numbers it
charges; docs/performance-model.md §5), by level, and their price at AWS's list prices, for a stage
of ``--mb`` MB at d = 64, 256 and 1,000 replicas. The hierarchical sync runs with the plan's
defaults: fan-in f = 40 (planner/plan.py DEFAULT_FAN_IN) and K = min(d, f) shards; scatter-reduce
with K = d. Per shard the hierarchical sync's level-1 aggregators form a chain (each GETs its
block's gradients and the previous one's prefix), and the root GETs the last prefix: one object
per chunk. Polls (GETs of an object not yet there) are not counted: a job's waiting workers make
at most ~1,000 a second together (lambdas/channel.py ``poll_cap_s``).

Run: python benchmarks/sync_requests.py [--mb 100] [--replicas 64 256 1000]. Nothing is measured:
these are the model's counts, which tests/test_hierarchical.py checks against the key functions.
"""

from __future__ import annotations

import argparse

from stagecoach.planner.model.platforms import aws_platform
from stagecoach.planner.model.syncmodel import SyncChoice, SyncRequests, sync_requests
from stagecoach.planner.plan import DEFAULT_FAN_IN, reduction_blocks


def rows(d: int, p_bytes: float) -> tuple[SyncRequests, SyncRequests]:
    plat = aws_platform()
    flat = sync_requests(SyncChoice("scatter_reduce", d), d, p_bytes, plat)
    tree = sync_requests(SyncChoice("hierarchical", min(d, DEFAULT_FAN_IN)), d, p_bytes, plat)
    return flat, tree


def describe(r: SyncRequests) -> str:
    levels = ", ".join(f"{name} {lv.puts:,.0f} PUT / {lv.gets:,.0f} GET" for name, lv in r.levels.items())
    return f"K={r.k}, C={r.chunks}: {levels}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=100.0, help="the stage's parameter megabytes (fp32)")
    ap.add_argument("--replicas", type=int, nargs="+", default=[64, 256, 1000])
    args = ap.parse_args()
    p_bytes = args.mb * 1e6
    print(f"one stage of {args.mb:g} MB, one iteration; hierarchical: fan-in {DEFAULT_FAN_IN}, K = min(d, {DEFAULT_FAN_IN})")
    print(f"{'d':>6} | {'scatter_reduce PUT':>18} {'GET':>11} {'USD':>8} | {'hierarchical PUT':>16} {'GET':>9} {'USD':>8} | {'B':>3}")
    for d in args.replicas:
        flat, tree = rows(d, p_bytes)
        b = reduction_blocks(d, DEFAULT_FAN_IN)
        print(
            f"{d:>6} | {flat.puts:>18,.0f} {flat.gets:>11,.0f} {flat.usd:>8.4f} | "
            f"{tree.puts:>16,.0f} {tree.gets:>9,.0f} {tree.usd:>8.4f} | {b:>3}"
        )
    for d in args.replicas:
        flat, tree = rows(d, p_bytes)
        print(f"\nd = {d}\n  scatter_reduce  {describe(flat)}\n  hierarchical    {describe(tree)}")


if __name__ == "__main__":
    main()
