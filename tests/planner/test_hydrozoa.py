"""Hydrozoa's DP partitioner against brute force, and its hybrid strategy selection."""

import random

import pytest

from stagecoach.planner.baselines.classic import BASELINES
from stagecoach.planner.baselines.hydrozoa import (
    brute_force_partition,
    hybrid_select,
    hydrozoa_plan,
    partition_dp,
    pipeline_runtime,
    storage_allreduce_s,
)
from stagecoach.planner.model.platforms import aws_platform
from stagecoach.planner.profile.layers import LayerProfile, ModelProfile

MB = 2**20


def test_pipeline_runtime_is_hydrozoas_formula():
    # sum(f+b) + 2 sum(c) + (M-1)(t_k + r_1)
    assert pipeline_runtime([1.0, 3.0, 2.0], [0.5, 0.25], 4, 0.1) == pytest.approx(6 + 1.5 + 3 * 3.1)
    assert pipeline_runtime([5.0], [], 1, 0.3) == 5.0
    with pytest.raises(ValueError, match="boundaries"):
        pipeline_runtime([1.0, 2.0], [], 2, 0.0)


@pytest.mark.parametrize("seed", range(30))
def test_dp_partitioner_equals_brute_force(seed):
    rnd = random.Random(seed)
    L = rnd.randint(2, 9)
    work = [rnd.uniform(0.1, 5.0) for _ in range(L)]
    comm = [rnd.uniform(0.0, 2.0) for _ in range(L - 1)]
    M, r1 = rnd.randint(1, 16), rnd.uniform(0, 0.5)
    cap = rnd.uniform(0.3, 1.0) * sum(work) if seed % 3 == 0 else None  # a memory-like limit on some instances
    fits = (lambda i, j: sum(work[i:j]) <= cap or j - i == 1) if cap else None
    for n in range(1, L + 1):
        bf = brute_force_partition(work, comm, n, M, r1, fits)
        dp = partition_dp(work, comm, n, M, r1, fits)  # exact candidate bounds
        if bf is None:
            assert dp is None
            continue
        part, rt = dp
        assert rt == pytest.approx(bf[1], rel=1e-12)
        assert sum(part.balance) == L and len(part.balance) == n
        if fits:
            edges = [0]
            for s in part.balance:
                edges.append(edges[-1] + s)
            assert all(fits(edges[q], edges[q + 1]) for q in range(n))
        if n != max(1, L // 2):
            continue
        # Hydrozoa's V = 1000 grid: never better than the optimum, worse by at most (M-1) grid steps
        grid = partition_dp(work, comm, n, M, r1, fits, bounds=1000)
        lo, hi = max(max(work), sum(work) / n), sum(work)
        assert bf[1] - 1e-9 <= grid[1] <= bf[1] + (M - 1) * (hi - lo) / 999 + 1e-9


def test_the_bound_dp_trades_communication_against_the_bottleneck():
    # cutting after layer 0 is balanced (bottleneck 3) but sends a huge tensor; after layer 1 the
    # cut is free but the bottleneck is 4
    work, comm = [2.0, 2.0, 1.0], [10.0, 0.0]
    part, rt = partition_dp(work, comm, 2, micro_batches=2, r1=0.0)
    assert part.balance == (2, 1) and rt == pytest.approx(5 + 0 + 1 * 4)
    part, rt = partition_dp(work, comm, 2, micro_batches=100, r1=0.0)  # many micro-batches: balance wins
    assert part.balance == (1, 2) and rt == pytest.approx(5 + 20 + 99 * 3)


def toy(L=8, pmb=80.0):
    layers = tuple(LayerProfile(f"l{i}", pmb * MB, 20 * MB, 2 * MB, 2 * MB, 3e9, 6e9) for i in range(L))
    return ModelProfile("toy", layers, 2 * MB)


def test_hybrid_selection_takes_dp_as_floor_of_cluster_over_mp():
    plat = aws_platform()
    ch = hybrid_select(toy(), 64, plat, cluster=12, tier_mb=4096)
    assert ch is not None
    assert ch.dp == 12 // ch.mp and 64 % (ch.dp * 4) == 0
    assert ch.micro_batches == 64 // (ch.dp * 4) and sum(ch.balance) == 8 and len(ch.balance) == ch.mp
    # it is the best throughput over every admissible mp
    for mp in range(1, 9):
        other = hybrid_select(toy(), 64, plat, cluster=mp * (12 // mp), tier_mb=4096, max_stages=mp)
        if other is not None and other.mp == mp and other.dp == 12 // mp:
            assert other.time_s >= ch.time_s - 1e-9
    assert storage_allreduce_s(100 * MB, 1, plat) == 0.0
    assert storage_allreduce_s(100 * MB, 4, plat) > storage_allreduce_s(100 * MB, 2, plat)


def test_hydrozoa_plan_is_feasible_under_our_model():
    plat = aws_platform()
    e = hydrozoa_plan(toy(), 32, plat)
    assert e is not None and e.feasible
    assert len(set(e.config.tiers_mb)) == 1  # Hydrozoa's workers are all the same size
    assert e.config.global_batch == 32 and e.config.micro_batch == 4
    # a profile longer than max_layers is merged, and the plan's balance is in the original layers
    e2 = hydrozoa_plan(toy(20, 20.0), 32, plat, max_layers=6)
    assert e2 is not None and sum(e2.config.balance) == 20
    assert BASELINES["Hydrozoa"] is hydrozoa_plan
