"""The hierarchical sync (DiSDeL's aggregation tree): the same bits as every other algorithm, the
plan's fan-in checked up front, keys whose request rates S3 serves at 1,000 replicas, and the
performance model's requests.

The collectives run as in tests/test_collectives.py: replicas and sync tasks as threads over an
in-memory S3 (tests/memory_s3.py), each replica really computing its gradient.
"""

from __future__ import annotations

import math
import time
from collections import Counter

import pytest
import test_collectives
import torch
from memory_s3 import MemoryS3
from test_collectives import JOB, OPTIMIZERS, distributed, reference

from stagecoach.core import keys
from stagecoach.core.training import flat_params, stage_layout
from stagecoach.lambdas import collectives
from stagecoach.lambdas.channel import poll_cap_s
from stagecoach.lambdas.collectives import SyncSpec
from stagecoach.planner import plan as plan_module
from stagecoach.planner.limits import JOB_POLL_BUDGET_PER_S, S3_GET_PER_PREFIX_PER_S, S3_PUT_PER_PREFIX_PER_S
from stagecoach.planner.model.platforms import aws_platform
from stagecoach.planner.model.syncmodel import SYNC_ALGORITHMS, Hierarchical, SyncChoice, sync_choices, sync_requests
from stagecoach.planner.plan import DEFAULT_FAN_IN, MAX_FAN_IN, Plan, PlanError

ITERATIONS = 3


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 4 floats (as in tests/test_collectives.py), for the in-process runs only: a run on
    the local stack must keep the workers' chunking, which this process cannot change."""
    monkeypatch.setattr(plan_module, "MIN_CHUNK_BYTES", 16)


def algorithms(d: int) -> list[tuple[str, int]]:
    """Every algorithm at d replicas, with the K values that exercise it."""
    return [
        ("hierarchical", 1),
        ("hierarchical", 2),
        ("hierarchical", d),
        ("scatter_reduce", d),
        ("k_reduce", 2),
        ("all_reduce", 1),
        ("pipelined_scatter_reduce", d),
        ("lambdaml_scatter_reduce", d),
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("d,fan_in", [(3, 2), (5, 2), (5, 3), (7, 2), (7, 3)])
def test_every_algorithm_gives_the_bits_of_the_blocked_sum(d, fan_in, dtype, small_chunks):
    """The tree sums each block into a partial and the partials at the root; every other
    algorithm sums the same blocks in one task: all equal one optimizer stepping on the blocked
    sum, bit for bit, at every iteration."""
    make_opt = OPTIMIZERS["adam"]
    want = reference(d, make_opt, ITERATIONS, fan_in=fan_in, dtype=dtype)
    for algo, k in algorithms(d):
        got, _ = distributed(algo, d, k, make_opt, ITERATIONS, fan_in=fan_in, dtype=dtype)
        for t in range(ITERATIONS):
            assert got[t].dtype == dtype
            assert torch.equal(got[t], want[t]), f"{algo} K={k} iteration {t}: max diff {(got[t] - want[t]).abs().max()}"


def test_blocks_change_the_rounding_so_the_order_is_the_plans():
    """The blocked order is not today's left fold at d > fan_in (float32): the comparison above
    would hold for no reason if they were equal; at d <= fan_in it is exactly the left fold."""
    make_opt = OPTIMIZERS["adam"]
    assert not torch.equal(reference(7, make_opt, 2, fan_in=3)[-1], reference(7, make_opt, 2)[-1])
    assert torch.equal(reference(4, make_opt, 2, fan_in=DEFAULT_FAN_IN)[-1], reference(4, make_opt, 2)[-1])
    g = [torch.tensor([1e8], dtype=torch.float32), torch.tensor([1.0]), torch.tensor([-1e8]), torch.tensor([1.0])]
    assert collectives.fold(g).item() == 1.0  # ((1e8 + 1) - 1e8) + 1: the 1 is lost in 1e8's rounding
    assert collectives.fold(g, 2).item() == 0.0  # (1e8 + 1) + (-1e8 + 1): both lost


def test_the_tree_writes_partials_the_roots_read_and_cleans_them_up(small_chunks):
    d, fan_in, k = 5, 2, 2
    _, s3 = distributed("hierarchical", d, k, OPTIMIZERS["sgd"], ITERATIONS, fan_in=fan_in)
    partials = [key for key in s3.keys("jobs/") if "/partial/" in key]
    p0 = flat_params(distributed.__globals__["stage"]().parameters())
    layout = stage_layout(p0.numel(), p0.element_size(), k, d)
    last = {keys.partial(JOB, ITERATIONS - 1, 0, b, kk, c) for b in range(3) for kk in range(k) for c in range(len(layout[kk]))}
    assert last <= set(partials), "every (block, shard, chunk) of the last iteration has its partial"
    assert not [key for key in partials if "/iter/0/" in key], "a level-1 task deletes its partials of t-2"


def test_sync_roles_number_the_roots_first_then_the_blocks():
    p0 = flat_params(distributed.__globals__["stage"]().parameters())
    spec = SyncSpec(JOB, 0, 0, 7, stage_layout(p0.numel(), 4, 2, 7), OPTIMIZERS["sgd"], 0, time.time() + 5, fan_in=3)
    plan = Plan(balance=(1,), replicas=7, global_batch=7, sync="hierarchical", aggregators=2, fan_in=3)
    assert plan.blocks(0) == spec.blocks == 3 and plan.sync_tasks(0) == 2 * (3 + 1)
    roles = [collectives.sync_role("hierarchical", spec, i) for i in range(plan.sync_tasks(0))]
    assert [r.shard for r in roles[:2]] == [0, 1] and all(isinstance(r, collectives.ShardOwner) for r in roles[:2])
    assert [(r.block, r.shard) for r in roles[2:]] == [(b, kk) for b in range(3) for kk in range(2)]
    assert [list(spec.block_replicas(b)) for b in range(3)] == [[0, 1, 2], [3, 4, 5], [6]]
    with pytest.raises(ValueError, match="does not exist"):
        collectives.sync_role("hierarchical", spec, plan.sync_tasks(0))
    # k_reduce with the same fan-in: K owners summing the blocks themselves, no partials
    assert all(isinstance(collectives.sync_role("k_reduce", spec, i), collectives.ShardOwner) for i in range(2))


# -- the plan ------------------------------------------------------------------------------------
def test_plan_fan_in_defaults_and_sync_tasks():
    p = Plan(balance=(1, 1), replicas=1000, global_batch=1000, sync="hierarchical")
    assert p.fan_in == (DEFAULT_FAN_IN,) * 2 and p.aggregators == (DEFAULT_FAN_IN,) * 2
    assert p.blocks(0) == 25 and p.sync_tasks(0) == 40 * 26
    small = Plan(balance=(1,), replicas=6, global_batch=6, sync="hierarchical")
    assert small.aggregators == (6,) and small.sync_tasks(0) == 6, "d <= fan-in: K roots alone, k_reduce's Map"
    assert Plan(balance=(1,), replicas=6, global_batch=6, sync="hierarchical", aggregators=3, fan_in=2).sync_tasks(0) == 3 * 4
    assert Plan(balance=(1,), replicas=6, global_batch=6, sync="k_reduce", aggregators=3, fan_in=2).sync_tasks(0) == 3
    again = Plan.from_json(Plan(balance=(1, 2), replicas=6, global_batch=6, sync="hierarchical", fan_in=(2, 3)).to_json())
    assert again.fan_in == (2, 3) and again.aggregators == (2, 3) and again.sync_tasks(1) == 3 * (2 + 1)
    assert Plan.from_dict({"balance": [1], "replicas": 2, "global_batch": 2}).fan_in == (DEFAULT_FAN_IN,), "plans saved before fan-in"


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(fan_in=1), r"fan_in\[0\]=1: an aggregator sums at least 2"),
        (dict(fan_in=(2, 2)), r"fan_in has 2 entries"),
        (dict(sync="hierarchical", fan_in=MAX_FAN_IN + 1), r"choose fan_in between"),
        (dict(sync="hierarchical", replicas=200, global_batch=200, fan_in=2), r"roots of 100 partials.*between 4 and 64"),
        (dict(sync="hierarchical", aggregators=9), r"aggregators\[0\]=9: K must be between 1 and the 8 replicas"),
        (dict(sync="scatter_reduce", aggregators=2), r"use sync 'k_reduce' or 'hierarchical'"),
    ],
)
def test_plan_refuses_a_fan_in_the_tree_cannot_run(kwargs, message):
    base = dict(balance=(1,), replicas=8, global_batch=8)
    with pytest.raises(PlanError, match=message):
        Plan(**{**base, **kwargs})


# -- request rates at 1,000 replicas (docs/runtime.md "Request rates") ---------------------------------
def sync_requests_by_prefix(d: int, k: int, fan_in: int, stages: int, chunks: int) -> tuple[Counter[str], Counter[str]]:
    """PUTs and GETs per prefix of one iteration's sync at d replicas, from the real key functions:
    each replica's gradient shards (PUT by it, GET by a level-1 aggregator), the partials (PUT by
    level-1, GET by the roots), the updated parameters (PUT by the roots, GET by each replica's
    next forward task) and the optimizer state (GET and PUT by the roots)."""
    puts: Counter[str] = Counter()
    gets: Counter[str] = Counter()
    blocks = -(-d // fan_in)
    read = keys.params_copy if d >= keys.READ_COPIES_MIN_REPLICAS else keys.params
    for s in range(stages):
        for c in range(chunks):
            for kk in range(k):
                for r in range(d):
                    key = keys.rate_prefix(keys.gshard("j-1", 5, s, r, kk, c))
                    puts[key] += 1
                    gets[key] += 1
                    gets[keys.rate_prefix(read("j-1", 6, s, kk, c))] += 1
                for b in range(blocks if blocks > 1 else 0):
                    puts[keys.rate_prefix(keys.partial("j-1", 5, s, b, kk, c))] += 1
                    gets[keys.rate_prefix(keys.partial("j-1", 5, s, b, kk, c))] += 1
                puts[keys.rate_prefix(keys.params("j-1", 6, s, kk, c))] += 1
                if read is keys.params_copy:
                    puts[keys.rate_prefix(keys.params_copy("j-1", 6, s, kk, c))] += 1
                for key in (keys.optim("j-1", 5, s, kk, c), keys.optim("j-1", 6, s, kk, c)):
                    (gets if "/v5/" in key else puts)[keys.rate_prefix(key)] += 1
    return puts, gets


def test_keys_prefix_is_the_part_that_outlives_an_iteration():
    assert keys.rate_prefix(keys.gshard("j-1", 7, 1, 130, 2, 0)) == "jobs/j-1/sync02/"
    assert keys.rate_prefix(keys.partial("j-1", 7, 1, 3, 2, 0)) == "jobs/j-1/sync03/"
    assert keys.rate_prefix(keys.params("j-1", 7, 1, 2, 0)) == "jobs/j-1/params/"
    assert keys.rate_prefix(keys.act("j-1", 7, 1, 0, 0)) == "jobs/j-1/"
    assert keys.rate_prefix(keys.metrics("j-1", 7, "sync", 1, 0)) == "jobs/j-1/metrics/"
    for key in (keys.gshard("j-1", 7, 1, 130, 2, 0), keys.partial("j-1", 7, 1, 3, 2, 0)):
        assert key.startswith(keys.job_prefix("j-1")) and "/iter/" in key, "under the job (IAM), tagged transient"


def test_no_prefix_exceeds_s3s_request_rates_in_a_1000_replica_iteration():
    """The hierarchical sync at d = 1,000 (the plan's defaults: fan-in 40, K = 40, 25 blocks) on 4
    stages of 100 MB, counted per prefix and divided by the predicted sync phase alone (backward
    tail and the sync Map: shorter than the iteration, so the rates are upper bounds), plus the
    job's whole polling budget on every prefix: every prefix stays under S3's 3,500 PUT/s and
    5,500 GET/s. The flat scatter-reduce at d = 1,000 would not (its parameters' prefix alone)."""
    d, stages, p_bytes = 1000, 4, 100e6
    plan = Plan(balance=(1,) * stages, replicas=d, global_batch=d, sync="hierarchical")
    k, fan_in = plan.aggregators[0], plan.fan_in[0]
    plat = aws_platform()
    sy = SYNC_ALGORITHMS["hierarchical"].stage(d, k, p_bytes, 0.5, 5.0, plat, last_backward_s=0.5)
    chunks = sy.shards // k
    seconds = sy.tail_s + sy.task_s
    puts, gets = sync_requests_by_prefix(d, k, fan_in, stages, chunks)
    assert len(puts) > keys.SPREAD / 2
    assert max(puts.values()) / seconds < S3_PUT_PER_PREFIX_PER_S, puts.most_common(3)
    assert max(gets.values()) / seconds + JOB_POLL_BUDGET_PER_S < S3_GET_PER_PREFIX_PER_S, gets.most_common(3)
    assert poll_cap_s(plan.peak_invocations()) >= plan.peak_invocations() / JOB_POLL_BUDGET_PER_S
    flat = SYNC_ALGORITHMS["scatter_reduce"].stage(d, d, p_bytes, 0.5, 5.0, plat, last_backward_s=0.5)
    _, flat_gets = sync_requests_by_prefix(d, d, d, stages, flat.shards // d)
    assert max(flat_gets.values()) / (flat.tail_s + flat.task_s) > S3_GET_PER_PREFIX_PER_S
    # without the read copies the parameters' one prefix would take every replica's GETs
    stored = sum(1 for _ in range(stages * k * chunks)) * d
    assert stored / seconds > S3_GET_PER_PREFIX_PER_S


def test_many_replicas_read_the_parameters_through_spread_copies(monkeypatch, small_chunks):
    """From READ_COPIES_MIN_REPLICAS on (3 here, so a small run shows it), the shards' owners store
    a read copy of each updated chunk, the next phase's gather reads it (version 0, uploaded by the
    client, from the stored version), the bits are unchanged, and old copies are deleted."""
    monkeypatch.setattr(keys, "READ_COPIES_MIN_REPLICAS", 3)
    reads: list[str] = []

    class Recording(MemoryS3):
        def get_object(self, Bucket: str, Key: str, **kw: object) -> dict:
            reads.append(Key)
            return super().get_object(Bucket=Bucket, Key=Key, **kw)

    monkeypatch.setattr(test_collectives, "MemoryS3", Recording)
    want = reference(5, OPTIMIZERS["adam"], ITERATIONS, fan_in=2)
    got, s3 = distributed("hierarchical", 5, 2, OPTIMIZERS["adam"], ITERATIONS, fan_in=2)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    copies = [key for key in reads if "/iter/" in key and "/params/" in key]
    assert copies and not [key for key in reads if key.startswith(f"jobs/{JOB}/params/v{ITERATIONS}/")]
    assert {key.split("/iter/")[1].split("/")[0] for key in s3.keys("jobs/") if "/params/" in key and "/iter/" in key} == {
        str(ITERATIONS - 1),
        str(ITERATIONS),
    }, "a shard's owner deletes the copies of version t-1"


def test_the_models_read_copy_threshold_is_the_runtimes():
    from stagecoach.planner.model import syncmodel

    assert syncmodel.READ_COPIES_MIN_REPLICAS == keys.READ_COPIES_MIN_REPLICAS


# -- the performance model --------------------------------------------------------------------------
def test_model_requests_per_level_and_the_flat_algorithms_d_squared():
    plat = aws_platform()
    for d in (64, 256, 1000):
        flat = sync_requests(SyncChoice("scatter_reduce", d), d, 100e6, plat)
        tree = sync_requests(SyncChoice("hierarchical", min(d, DEFAULT_FAN_IN)), d, 100e6, plat)
        c = flat.chunks
        assert flat.gets >= 2 * d * d * c and tree.gets < flat.gets and tree.usd < flat.usd
        if d == 1000:
            assert flat.gets > 20 * tree.gets and flat.usd > 20 * tree.usd
        b = math.ceil(d / DEFAULT_FAN_IN)
        kk = min(d, DEFAULT_FAN_IN)
        assert tree.levels["replicas"].puts == d * kk * tree.chunks
        assert tree.levels["level-1"].gets == d * kk * tree.chunks and tree.levels["level-1"].puts == b * kk * tree.chunks
        assert tree.levels["roots"].gets >= b * kk * tree.chunks
        assert tree.levels["gather"].gets == d * kk * tree.chunks
    one = sync_requests(SyncChoice("scatter_reduce", 1000), 1000, 100e6, plat)
    assert one.levels["sync tasks"].gets >= 1e6 and one.levels["sync tasks"].gets * plat.price_get == pytest.approx(0.4, rel=0.01)


def test_model_hierarchical_is_k_reduce_within_one_block_and_prices_both_levels_beyond():
    plat = aws_platform()
    h, kr = SYNC_ALGORITHMS["hierarchical"], SYNC_ALGORITHMS["k_reduce"]
    assert h.stage(8, 4, 50e6, 0.3, 2.0, plat) == kr.stage(8, 4, 50e6, 0.3, 2.0, plat).__class__(
        **{**kr.stage(8, 4, 50e6, 0.3, 2.0, plat).__dict__, "name": "hierarchical"}
    )
    big = h.stage(1000, 40, 100e6, 0.3, 2.0, plat)
    assert big.tasks == 40 * 26
    # 40 flat aggregators each download 1,000 / 40 = 25 stages' worth of gradient; the tree's
    # level-1 aggregators one each and its roots 25 partials of 1/40 of the stage
    flat40 = Hierarchical(fan_in=1000).stage(1000, 40, 100e6, 0.3, 2.0, plat)
    assert flat40.tasks == 40 and big.task_s < flat40.task_s / 5
    assert {c.algo for c in sync_choices(8)} >= {"k_reduce"} and "hierarchical" not in {c.algo for c in sync_choices(8)}
    assert {(c.algo, c.k) for c in sync_choices(1000) if c.algo == "hierarchical"} == {
        ("hierarchical", 10),
        ("hierarchical", 20),
        ("hierarchical", 40),
    }
    assert SyncChoice("hierarchical", 40).plan_fields() == ("hierarchical", 40)


# -- end to end on the local stack ---------------------------------------------------------------------
def test_a_tree_trains_plain_pytorchs_model_with_the_bits_of_k_reduce(backend):
    """Two stages x 3 replicas, fan-in 2 (two blocks: a tree of 2 roots and 4 level-1 aggregators
    per stage in stage 0; the pipelined exchange, summing by the same blocks, in stage 1) against
    k_reduce (K = 2) in both stages with the same fan-in: the same bits through the whole
    runtime (Step Functions' sync Map, the phases' dispatch), and plain PyTorch's parameters
    within 1e-5 (float64, as tests/test_transparency.py)."""
    import dataclasses

    from helpers import max_diff
    from test_transparency import OPTIMIZERS as OPTS
    from test_transparency import make_job, model_with_dropout

    from stagecoach.reference import train_reference

    runs = {}
    for name, sync in (("tree", ("hierarchical", "pipelined_scatter_reduce")), ("kred", ("k_reduce", "k_reduce"))):
        job = make_job(f"hier-{name}", model_with_dropout, OPTS["adam"])
        aggregators = (2, 3) if name == "tree" else (2, 2)
        plan = dataclasses.replace(job.manual_plan(stages=2, replicas=3, micro_batches=2, sync=sync, aggregators=aggregators), fan_in=2)
        assert plan.sync_tasks(0) == (2 * 3 if name == "tree" else 2)
        runs[name] = job.run(plan=plan, backend=backend)
    for run in runs.values():
        run.wait(progress=False, poll_s=2.0, timeout_s=900)
    tree, kred = runs["tree"], runs["kred"]
    for s in range(2):
        assert torch.equal(tree.stage_vector(s), kred.stage_vector(s)), f"stage {s}"
    expected = train_reference(tree.job, replicas=3, micro_batches=2)
    assert max_diff(tree.trained_model(), tree.job.build_model()) > 1e-3
    assert max_diff(tree.trained_model(), expected) < 1e-5
