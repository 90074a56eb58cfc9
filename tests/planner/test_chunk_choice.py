"""The planner's chunk count C per stage (planner/model/chunking.py, Plan.chunks): chosen by the
performance model's predicted cost, recorded in the plan, priced as the runtime lays it out."""

import json

import pytest

from stagecoach.core.training import stage_layout
from stagecoach.planner.model.chunking import choose_chunks, chunk_candidates, with_stage_chunks
from stagecoach.planner.model.perfmodel import Config, evaluate
from stagecoach.planner.model.platforms import aws_platform
from stagecoach.planner.model.syncmodel import SyncChoice, rule_chunks
from stagecoach.planner.plan import MAX_CHUNKS, Plan, PlanError, chunk_count
from stagecoach.planner.profile.zoo import zoo_profile

SGD = aws_platform(optimizer_state_ratio=0.0)


@pytest.fixture(scope="module")
def resnet():
    """ResNet-101 merged to 12 layers, 3 stages of 4, d = 8, m = 8: the paper-scale shape the cost benchmark plans."""
    prof = zoo_profile("resnet101").merged(12, SGD, micro_batch=4)
    cfg = Config((4, 4, 4), (3008,) * 3, 8, 4, 8, (SyncChoice("pipelined_scatter_reduce", 8),) * 3)
    return prof, cfg


def _costs(prof, cfg, plat, stage):
    """The model's predicted cost and time per candidate C of ``stage`` (the others at the rule)."""
    return {c: evaluate(prof, with_stage_chunks(cfg, stage, c), plat) for c in chunk_candidates(prof, cfg, stage)}


def test_fewer_chunks_where_requests_cost_more_than_the_lag(resnet):
    prof, cfg = resnet
    rule = [chunk_candidates(prof, cfg, s)[-1] for s in range(cfg.stages)]
    assert all(c > 1 for c in rule)  # the size rule cuts these shards: there is a choice to make
    chosen = choose_chunks(prof, cfg, SGD)
    for s in range(cfg.stages):
        est = _costs(prof, cfg, SGD, s)
        c = chosen.sync[s].chunks
        assert est[c].cost == min(e.cost for e in est.values())  # the cheapest C, by the model
        assert c < rule[s]
        # the trade-off as the model prices it: the requests saved exceed the longer lag's Lambda seconds
        saved_s3 = est[rule[s]].cost_s3 - est[c].cost_s3
        lag_usd = est[c].cost_lambda_duration - est[rule[s]].cost_lambda_duration
        assert est[c].time_s >= est[rule[s]].time_s and saved_s3 > lag_usd >= 0


def test_more_chunks_kept_where_the_lag_dominates(resnet):
    """With requests free the lag is all that C changes: the rule's C, the shortest lag, stays."""
    prof, cfg = resnet
    free = SGD.replace(price_put=0.0, price_get=0.0)
    chosen = choose_chunks(prof, cfg, free)
    for s in range(cfg.stages):
        est = _costs(prof, cfg, free, s)
        rule = max(est)
        assert chosen.sync[s].chunks == rule
        assert est[rule].cost < est[1].cost  # the longer lag of one chunk per shard costs Lambda seconds


def test_a_time_weight_keeps_the_chunks_a_cost_weight_gives_up(resnet):
    """The plan's weights decide: a weight on seconds values the shorter lag over the requests."""
    prof, cfg = resnet
    cheap = choose_chunks(prof, cfg, SGD, 1.0, 0.0)
    fast = choose_chunks(prof, cfg, SGD, 0.0, 1.0)
    assert evaluate(prof, fast, SGD).time_s < evaluate(prof, cheap, SGD).time_s
    assert evaluate(prof, cheap, SGD).cost < evaluate(prof, fast, SGD).cost


def test_the_model_prices_the_layout_the_runtime_cuts():
    """Plan.chunks reaches both sides: the runtime's layout has C chunks per shard (fewer only where
    a shard has fewer elements), the model's shards are K x C, and 0 is the size rule."""
    numel, d = 3_000_000, 4
    for c in (0, 1, 5):
        layout = stage_layout(numel, 4, d, d, c)
        want = chunk_count(numel // d, 4, d) if c == 0 else c
        assert {len(shard) for shard in layout} == {want}
        sy = SyncChoice("scatter_reduce", d, chunks=c).algorithm.stage(d, d, 4.0 * numel, 0.0, 0.0, SGD)
        assert sy.shards == d * want
    assert rule_chunks(d, d, 4.0 * numel) == chunk_count(numel // d, 4, d)
    assert {len(shard) for shard in stage_layout(10, 4, 2, 2, 50)} == {5}  # never an empty chunk


def test_plan_chunks_are_validated_and_serialised():
    plan = Plan(balance=(1, 1), replicas=2, global_batch=4, chunks=(1, 3))
    assert Plan.from_json(plan.to_json()).chunks == (1, 3)
    assert json.loads(plan.to_json())["chunks"] == [1, 3]
    old = Plan(balance=(1, 1), replicas=2, global_batch=4)
    assert old.chunks == (0, 0) and "chunks" not in old.to_dict()  # an older plan reads as before
    for bad, why in (((1,), "entries"), ((1, MAX_CHUNKS + 1), "chunks per shard"), ((1, -1), "chunks per shard")):
        with pytest.raises(PlanError, match=why):
            Plan(balance=(1, 1), replicas=2, global_batch=4, chunks=bad)
    with pytest.raises(PlanError, match="1 replica"):
        Plan(balance=(1,), chunks=(2,))


def test_dynamic_workers_refuse_named_chunks():
    """A change of d re-lays the shards by the size rule (sdk/dynamic.py): a schedule naming C is refused."""
    small, large = (Plan(balance=(1, 1), replicas=d, global_batch=8) for d in (2, 4))
    assert Plan(balance=(1, 1), replicas=4, global_batch=8, segments=((0, small), (3, large))).segments
    named = Plan(balance=(1, 1), replicas=2, global_batch=8, chunks=(2, 2))
    with pytest.raises(PlanError, match="dynamic workers"):
        Plan(balance=(1, 1), replicas=4, global_batch=8, segments=((0, named), (3, large)))


def test_the_recommended_plan_records_the_chunks_its_prediction_priced():
    """plan_model chooses C per stage and to_plan writes it: the plan's prediction is the model's
    for exactly the layout the runtime will cut."""
    from stagecoach.planner.profile.layers import LayerProfile, ModelProfile
    from stagecoach.planner.solve.sweep import plan_model

    mb = 2**20
    layers = tuple(
        LayerProfile(f"l{i}", p * mb, 30 * mb, 3 * mb, 3 * mb, (2 + i) * 1e9, (4 + 2 * i) * 1e9) for i, p in enumerate((120, 300, 80))
    )
    res = plan_model(ModelProfile("toy", layers, 3 * mb), 16, SGD, replicas=(4,), micro_batch_sizes=(2,), max_stages=2, use_milp=False)
    for cand in res.candidates:
        plan, cfg = cand.to_plan(), cand.config
        assert plan.chunks == tuple(c.chunks for c in cfg.sync) and all(c >= 1 for c in plan.chunks)
        assert evaluate(res.profile, cfg, SGD).cost == cand.cost
        for s, c in enumerate(plan.chunks):
            assert c in chunk_candidates(res.profile, cfg, s)
