"""FasDL's model and its two-stage pruning search: same optimum as brute force, fewer evaluations."""

import math
import random

import pytest

from stagecoach.planner.baselines.classic import BASELINES
from stagecoach.planner.baselines.fasdl import (
    FasDLModel,
    brute_force,
    fasdl_plan,
    fit_fasdl_model,
    fit_train_coefficients,
    sync_choice,
    two_stage_search,
)
from stagecoach.planner.model.platforms import aws_platform
from stagecoach.planner.profile.layers import LayerProfile, ModelProfile
from stagecoach.planner.solve.objective import objective_weights
from stagecoach.planner.solve.pareto import FUNCPIPE_WEIGHTS

MB = 2**20


def test_comm_and_cost_are_fasdls_formulas():
    m = FasDLModel(model_bytes=400e6, a=2000.0, b=2.0, m=100.0, up_Bps=60e6, down_Bps=80e6, ramp_bytes=1e6)
    S, W, K, M = 400e6, 8, 4, 3008
    up, down = m.tp_up(M, S / K), m.tp_down(M, S / K)
    assert up == pytest.approx(60e6 * (1 - math.exp(-100)))  # large objects reach p(M)
    assert m.comm_s(W, K, M) == pytest.approx(S / up + ((W - 1) / down + 1 / up) * S / K + S / down)
    t, c = m.iteration(256, W, K, M)
    assert t == pytest.approx(2000.0 * (32 + 2) / (M + 100) + m.comm_s(W, K, M))
    assert c == pytest.approx(m.price_gb_s * M / 1024 * W * t + m.price_put * K * W + m.price_get * 2 * K * (W - 1))
    assert m.comm_s(1, 1, M) == 0.0
    # small objects are slow (the throughput ramps with the object size)
    assert m.tp_up(M, 1e5) < 0.1 * m.tp_up(M, 1e8)


def test_fit_recovers_train_coefficients():
    a, b, mm = 2344.97, 2.37, 1145.66  # FasDL Table II, BERT-Base
    samples = [(B, M, a * (B + b) / (M + mm)) for B in (8, 16, 32, 64) for M in (1024, 1536, 2048, 3008)]
    fa, fb, fm = fit_train_coefficients(samples)
    assert fa == pytest.approx(a, rel=1e-3) and fb == pytest.approx(b, rel=1e-3) and fm == pytest.approx(mm, rel=1e-3)


def random_instance(rnd):
    model = FasDLModel(
        model_bytes=rnd.uniform(5, 500) * 1e6,
        a=rnd.uniform(10, 3000),
        b=rnd.uniform(0, 20),
        m=rnd.uniform(-100, 1200),
        up_Bps=rnd.uniform(20, 90) * 1e6,
        down_Bps=rnd.uniform(20, 90) * 1e6,
        ramp_bytes=rnd.uniform(0.1, 20) * 1e6,
        half_mb=rnd.choice([0.0, rnd.uniform(100, 2000)]),
    )
    G = rnd.choice([64, 128, 256, 512])
    workers = [w for w in range(1, 65) if G % w == 0]
    memories = list(range(rnd.choice([128, 512]), 3009, 64 * rnd.randint(1, 4)))
    base, per_sample, agg = rnd.uniform(200, 800), rnd.uniform(1, 40), rnd.uniform(0, 3) * model.model_bytes / MB

    def need(W, K):  # memory grows with the local batch and with the aggregator's share
        return base + per_sample * G / W + agg / K

    weights = objective_weights(*rnd.choice(FUNCPIPE_WEIGHTS))
    limit = rnd.choice([math.inf, rnd.uniform(5, 200)])
    return model, G, workers, memories, need, weights, limit


def test_two_stage_search_finds_the_brute_force_optimum_with_fewer_evaluations():
    rnd = random.Random(7)
    ratios = []
    for _ in range(60):
        model, G, workers, memories, need, (wc, wt), limit = random_instance(rnd)
        bf = brute_force(model, G, workers, memories, wc, wt, need, limit)
        ts = two_stage_search(model, G, workers, memories, wc, wt, need, limit)
        if bf is None:
            assert ts is None
            continue
        assert ts.objective == pytest.approx(bf.objective, rel=1e-12)
        assert (ts.workers, ts.k, ts.memory_mb) == (bf.workers, bf.k, bf.memory_mb)
        assert ts.time_s <= limit
        assert ts.evaluations < bf.evaluations
        ratios.append(bf.evaluations / (ts.evaluations + ts.bounds))
    assert len(ratios) > 30
    # counting its bound evaluations too, the search does less work than brute force in most cases
    assert sorted(ratios)[len(ratios) // 2] > 2.0


def toy(L=6, pmb=30.0):
    layers = tuple(LayerProfile(f"l{i}", pmb * MB, 8 * MB, 1 * MB, 1 * MB, 2e9, 4e9) for i in range(L))
    return ModelProfile("toy", layers, 1 * MB)


def test_fasdl_plan_is_pure_data_parallel_and_feasible():
    plat = aws_platform()
    fm = fit_fasdl_model(toy(), plat)
    assert fm.model_bytes == toy().param_bytes and fm.up_Bps == plat.bandwidth_Bps
    e = fasdl_plan(toy(), 64, plat)
    assert e is not None and e.feasible
    c = e.config
    assert c.stages == 1 and c.micro_batches == 1 and c.replicas * c.micro_batch == 64
    assert c.sync[0] == sync_choice(c.replicas, c.sync[0].k)
    assert sync_choice(1, 1).algo == "none" and sync_choice(8, 1).algo == "all_reduce"
    assert sync_choice(8, 8).algo == "scatter_reduce" and sync_choice(8, 3).algo == "k_reduce"
    assert BASELINES["FasDL"] is fasdl_plan
