"""The hierarchical sync (DiSDeL's aggregation service as a chain of level-1 aggregators per
shard): the bits of plain PyTorch at every d and fan-in, as every other algorithm; the chain
pipelined over chunks; the plan's fan-in checked up front; keys whose request rates S3 serves at
1,000 replicas; and the performance model's latency and requests.

The collectives run as in tests/test_collectives.py: replicas and sync tasks as threads over an
in-memory S3 (tests/memory_s3.py), each replica really computing its gradient.
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter

import pytest
import test_collectives
import torch
from memory_s3 import MemoryS3
from test_collectives import JOB, OPTIMIZERS, accumulated_like_pytorch, blocked_sum, distributed, reference

from stagecoach.core import keys
from stagecoach.core.training import flat_params, stage_layout
from stagecoach.lambdas import collectives
from stagecoach.lambdas.channel import poll_cap_s
from stagecoach.lambdas.collectives import SyncSpec
from stagecoach.planner import plan as plan_module
from stagecoach.planner.limits import JOB_POLL_BUDGET_PER_S, S3_GET_PER_PREFIX_PER_S, S3_PUT_PER_PREFIX_PER_S
from stagecoach.planner.model.calibration import optimizer_passes
from stagecoach.planner.model.platforms import aws_platform
from stagecoach.planner.model.syncmodel import PASSES_FOLD_ADD, SYNC_ALGORITHMS, Hierarchical, SyncChoice, sync_choices, sync_requests
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
# the default run: the smallest tree and one with two levels of blocks; the rest `-m slow`
@pytest.mark.parametrize("d,fan_in", [(3, 2), (7, 3), *(pytest.param(*c, marks=pytest.mark.slow) for c in [(5, 2), (5, 3), (7, 2)])])
def test_every_algorithm_trains_plain_pytorchs_bits_at_d_above_the_fan_in(d, fan_in, dtype, small_chunks):
    """Three iterations of Adam on real gradients: every algorithm (the hierarchical chain with K = 1,
    2 and d: B = 2..4 links of several chunks per shard) equals one optimizer stepping on the
    gradients accumulated as plain PyTorch accumulates .grad, bit for bit, at every iteration."""
    make_opt = OPTIMIZERS["adam"]
    want = reference(d, make_opt, ITERATIONS, dtype=dtype)
    for algo, k in algorithms(d):
        got, _ = distributed(algo, d, k, make_opt, ITERATIONS, fan_in=fan_in, dtype=dtype)
        for t in range(ITERATIONS):
            assert got[t].dtype == dtype
            assert torch.equal(got[t], want[t]), f"{algo} K={k} iteration {t}: max diff {(got[t] - want[t]).abs().max()}"


def test_the_fan_in_changes_no_bits():
    """A left fold can be continued (the chain) but not regrouped (the tree it replaced): in float32
    ((1e8 + 1) - 1e8) + 1 keeps the last 1, (1e8 + 1) + (-1e8 + 1) loses both. So a plan's fan-in
    is a matter of memory and requests only: every fan-in trains the same parameters."""
    g = [torch.tensor([1e8], dtype=torch.float32), torch.tensor([1.0]), torch.tensor([-1e8]), torch.tensor([1.0])]
    assert collectives.left_fold(g).item() == accumulated_like_pytorch(g).item() == 1.0
    assert collectives.left_fold([collectives.left_fold(g[:2]), *g[2:]]).item() == 1.0, "the chain's prefix, continued"
    assert blocked_sum(g, 2).item() == 0.0, "the blocks' sums, summed"
    runs = {f: distributed("hierarchical", 7, 2, OPTIMIZERS["adam"], 2, fan_in=f)[0][-1] for f in (2, 3, 6, DEFAULT_FAN_IN)}
    assert all(torch.equal(v, runs[DEFAULT_FAN_IN]) for v in runs.values())


def test_each_link_stores_the_running_prefix_and_the_root_reads_the_last(monkeypatch, small_chunks):
    """Link b's partial is g_0 + ... + g_{(b+1)f-1} left to right, chunk by chunk (the last block
    may be shorter); the root reads one partial per chunk, the last link's; each partial is read
    once (by the next link or the root); a level-1 task deletes its partials of t-2."""
    d, fan_in, k = 7, 2, 2
    got: list[str] = []

    class Recording(MemoryS3):
        def get_object(self, Bucket: str, Key: str, **kw: object) -> dict:
            out = super().get_object(Bucket=Bucket, Key=Key, **kw)
            got.append(Key)  # found (a missing key raised above)
            return out

    monkeypatch.setattr(test_collectives, "MemoryS3", Recording)
    _, s3 = distributed("hierarchical", d, k, OPTIMIZERS["sgd"], ITERATIONS, fan_in=fan_in)
    read = Counter(key for key in got if "/partial/" in key)
    t = ITERATIONS - 1
    p0 = flat_params(distributed.__globals__["stage"]().parameters())
    layout = stage_layout(p0.numel(), p0.element_size(), k, d)
    spec = SyncSpec(JOB, 0, t, d, layout, OPTIMIZERS["sgd"], 0, time.time() + 5, fan_in=fan_in)
    assert spec.blocks == 4 and all(len(chunks) > 1 for chunks in layout), "a chain of 4 links over several chunks"
    ch = test_collectives.channel(s3)
    for b in range(spec.blocks):
        for kk in range(k):
            for c in range(len(layout[kk])):
                grads = [ch.get_tensors(keys.gshard(JOB, t, 0, r, kk, c))["g"] for r in range(min(d, (b + 1) * fan_in))]
                assert torch.equal(ch.get_tensors(keys.partial(JOB, t, 0, b, kk, c))["g"], accumulated_like_pytorch(grads)), (b, kk, c)
    root = collectives.partial_inputs(spec, 1)
    assert root.count == 1 and root.keys(0) == [keys.partial(JOB, t, 0, spec.blocks - 1, 1, 0)]
    assert root.producer == keys.metrics(JOB, t, "sync", 0, collectives.level1_task(spec, spec.blocks - 1, 1))
    assert set(read.values()) == {1} and len(read) == ITERATIONS * spec.blocks * sum(len(x) for x in layout)
    assert not [key for key in s3.keys("jobs/") if "/partial/" in key and "/iter/0/" in key], "deleted at t = 2"


def test_the_chain_is_pipelined_over_chunks(monkeypatch, small_chunks):
    """Link b+1 folds chunk 0 before link b has stored its last chunk: the store of every link's
    last chunk is held until the next link's first chunk is there. A chain that waited for a whole
    prefix before folding would never get there (the hold gives up after 10 s, and the test fails)."""
    d, fan_in, k = 7, 2, 2
    first_of_next: dict[str, threading.Event] = {}
    held: list[bool] = []
    p0 = flat_params(distributed.__globals__["stage"]().parameters())
    last_chunk = len(stage_layout(p0.numel(), p0.element_size(), k, d)[0]) - 1
    blocks = plan_module.reduction_blocks(d, fan_in)
    for b in range(blocks - 1):
        first_of_next[keys.partial(JOB, 0, 0, b, 0, last_chunk)] = threading.Event()
    releases = {keys.partial(JOB, 0, 0, b + 1, 0, 0): keys.partial(JOB, 0, 0, b, 0, last_chunk) for b in range(blocks - 1)}

    class Holding(MemoryS3):
        def put_object(self, Bucket: str, Key: str, Body: bytes, **kw: object) -> dict:
            if Key in first_of_next:
                held.append(first_of_next[Key].wait(10))
            out = super().put_object(Bucket=Bucket, Key=Key, Body=Body, **kw)
            if Key in releases:
                first_of_next[releases[Key]].set()
            return out

    monkeypatch.setattr(test_collectives, "MemoryS3", Holding)
    got, _ = distributed("hierarchical", d, k, OPTIMIZERS["sgd"], 1, fan_in=fan_in)
    assert last_chunk > 0 and held == [True] * (blocks - 1)
    assert torch.equal(got[0], reference(d, OPTIMIZERS["sgd"], 1)[0])


def test_sync_roles_number_the_roots_first_then_the_blocks():
    p0 = flat_params(distributed.__globals__["stage"]().parameters())
    spec = SyncSpec(JOB, 0, 0, 7, stage_layout(p0.numel(), 4, 2, 7), OPTIMIZERS["sgd"], 0, time.time() + 5, fan_in=3)
    plan = Plan(balance=(1,), replicas=7, global_batch=7, sync="hierarchical", aggregators=2, fan_in=3)
    assert plan.blocks(0) == spec.blocks == 3 and plan.sync_tasks(0) == 2 * (3 + 1)
    roles = [collectives.sync_role("hierarchical", spec, i) for i in range(plan.sync_tasks(0))]
    assert [r.shard for r in roles[:2]] == [0, 1] and all(isinstance(r, collectives.ShardOwner) for r in roles[:2])
    assert [(r.block, r.shard) for r in roles[2:]] == [(b, kk) for b in range(3) for kk in range(2)]
    assert [collectives.level1_task(spec, r.block, r.shard) for r in roles[2:]] == list(range(2, plan.sync_tasks(0)))
    assert [list(spec.block_replicas(b)) for b in range(3)] == [[0, 1, 2], [3, 4, 5], [6]]
    with pytest.raises(ValueError, match="does not exist"):
        collectives.sync_role("hierarchical", spec, plan.sync_tasks(0))
    # k_reduce with the same fan-in: K owners summing the d replicas themselves, no partials
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
        (dict(fan_in=0), r"fan_in\[0\]=0: an aggregator sums at least 2"),  # 0 is not "the default"
        (dict(sync="hierarchical", fan_in=(0,)), r"fan_in\[0\]=0: an aggregator sums"),  # named before the K it implies
        (dict(fan_in=(2, 2)), r"fan_in has 2 entries"),
        (dict(sync="hierarchical", fan_in=MAX_FAN_IN + 1), r"choose fan_in between"),
        (dict(sync="hierarchical", replicas=200, global_batch=200, fan_in=2), r"a chain of 100 links.*between 4 and 64"),
        (dict(sync="hierarchical", aggregators=9), r"aggregators\[0\]=9: K must be between 1 and the 8 replicas"),
        (dict(sync="scatter_reduce", aggregators=2), r"use sync 'k_reduce' or 'hierarchical'"),
    ],
)
def test_plan_refuses_a_fan_in_the_tree_cannot_run(kwargs, message):
    base = dict(balance=(1,), replicas=8, global_batch=8)
    with pytest.raises(PlanError, match=message):
        Plan(**{**base, **kwargs})


def test_job_manual_plan_and_run_take_the_fan_in(monkeypatch):
    """``Job.run(fan_in=...)`` through ``Job.manual_plan``: one fan-in for every stage or one per
    stage, as Plan takes it, setting a hierarchical stage's default K to min(d, fan-in); a fan-in
    Plan refuses is refused with Plan's message before any backend is reached."""
    from torch import nn

    import stagecoach.job as job_module
    from stagecoach import Job

    job = Job(
        model=lambda: nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)),
        loss=nn.CrossEntropyLoss(),
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        train=(torch.randn(32, 4), torch.randint(0, 2, (32,))),
        global_batch=8,
        iterations=1,
        name="fan-in",
    )
    p = job.manual_plan(stages=2, replicas=4, sync="hierarchical", fan_in=2)
    assert p.fan_in == (2, 2) and p.aggregators == (2, 2) and p.blocks(0) == 2 and p.sync_tasks(0) == 2 * (2 + 1)
    p = job.manual_plan(stages=2, replicas=4, sync=("hierarchical", "k_reduce"), aggregators=(1, 2), fan_in=(3, 2))
    assert p.fan_in == (3, 2) and p.aggregators == (1, 2) and p.sync_tasks(0) == 1 * (2 + 1) and p.sync_tasks(1) == 2
    assert job.manual_plan(stages=2, replicas=4, sync="hierarchical").fan_in == (DEFAULT_FAN_IN,) * 2
    assert job.manual_plan(stages=2, replicas=4, sync="hierarchical").aggregators == (4, 4)  # min(d, the default fan-in)

    def no_backend(*_args, **_kwargs):
        raise AssertionError("the job reached a backend with a plan Plan refuses")

    monkeypatch.setattr(job_module, "get_backend", no_backend)
    for fan_in, message in (
        (1, r"plan.fan_in\[0\]=1: an aggregator sums at least 2 gradients"),
        ((2,), r"plan.fan_in has 1 entries but the plan has 2 stages"),
        (MAX_FAN_IN + 1, rf"plan.fan_in\[0\]={MAX_FAN_IN + 1} with 4 replicas .* choose fan_in between 2 and {MAX_FAN_IN}"),
    ):
        with pytest.raises(PlanError, match=message):
            job.run(stages=2, replicas=4, sync="hierarchical", fan_in=fan_in)


# -- request rates at 1,000 replicas (docs/runtime.md "Request rates") ---------------------------------
def sync_requests_by_prefix(d: int, k: int, fan_in: int, stages: int, chunks: int) -> tuple[Counter[str], Counter[str]]:
    """PUTs and GETs per prefix of one iteration's sync at d replicas, from the real key functions:
    each replica's gradient shards (PUT by it, GET by a level-1 aggregator), the partials (PUT by
    a link of the chain, GET once: by the next link or, the last, by the root), the updated parameters (PUT by the roots, GET by each replica's
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
    want = reference(5, OPTIMIZERS["adam"], ITERATIONS)
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
        kk, cc = min(d, DEFAULT_FAN_IN), tree.chunks
        state = 1 if plat.optimizer_state_ratio > 0 else 0
        assert b == 1 or tree.levels["roots"].gets < b * kk * cc
        assert tree.levels["replicas"].puts == d * kk * cc
        # a link GETs its block's gradients and (b > 0) the previous link's prefix; PUTs its prefix
        assert tree.levels["level-1"].gets == (d + b - 1) * kk * cc and tree.levels["level-1"].puts == b * kk * cc
        # a root reads one prefix per chunk, not B (and its state, once per window with warm state)
        assert kk * cc <= tree.levels["roots"].gets <= kk * cc * (1 + state) + 1e-6
        assert tree.levels["gather"].gets == d * kk * cc
    one = sync_requests(SyncChoice("scatter_reduce", 1000), 1000, 100e6, plat)
    assert one.levels["sync tasks"].gets >= 1e6 and one.levels["sync tasks"].gets * plat.price_get == pytest.approx(0.4, rel=0.01)


def test_model_hierarchical_is_k_reduce_within_one_block_and_prices_the_chain_beyond():
    plat = aws_platform()
    h, kr = SYNC_ALGORITHMS["hierarchical"], SYNC_ALGORITHMS["k_reduce"]
    assert h.stage(8, 4, 50e6, 0.3, 2.0, plat) == kr.stage(8, 4, 50e6, 0.3, 2.0, plat).__class__(
        **{**kr.stage(8, 4, 50e6, 0.3, 2.0, plat).__dict__, "name": "hierarchical"}
    )
    big = h.stage(1000, 40, 100e6, 0.3, 2.0, plat)
    assert big.tasks == 40 * 26
    # 40 flat aggregators each download 1,000 / 40 = 25 stages' worth of gradient; the chain's links
    # one each (and a prefix), its roots one prefix of 1/40 of the stage, but 24 hops behind link 0
    flat40 = Hierarchical(fan_in=1000).stage(1000, 40, 100e6, 0.3, 2.0, plat)
    assert flat40.tasks == 40 and big.task_s < flat40.task_s / 4
    assert {c.algo for c in sync_choices(8)} >= {"k_reduce"} and "hierarchical" not in {c.algo for c in sync_choices(8)}
    assert {(c.algo, c.k) for c in sync_choices(1000) if c.algo == "hierarchical"} == {
        ("hierarchical", 10),
        ("hierarchical", 20),
        ("hierarchical", 40),
    }
    assert SyncChoice("hierarchical", 40).plan_fields() == ("hierarchical", 40)


def test_the_model_prices_a_plans_own_fan_in():
    """A plan's fan-in below d makes a chain: the model the job predicts with (SyncChoice from the
    plan) prices it, not the default fan-in's one block, and labels the choice with it."""
    plat = aws_platform()
    default, two = SyncChoice("hierarchical", 2), SyncChoice("hierarchical", 2, fan_in=2)
    assert default.algorithm.stage(8, 2, 50e6, 0.3, 2.0, plat) == SYNC_ALGORITHMS["hierarchical"].stage(8, 2, 50e6, 0.3, 2.0, plat)
    chain = two.algorithm.stage(8, 2, 50e6, 0.3, 2.0, plat)
    assert chain == Hierarchical(fan_in=2).stage(8, 2, 50e6, 0.3, 2.0, plat)
    # four links of 2 gradients each instead of 2 roots reading all 8: more tasks, each reading less
    assert chain.tasks == 2 * (4 + 1) and chain.task_s != default.algorithm.stage(8, 2, 50e6, 0.3, 2.0, plat).task_s
    assert two.label() == "hierarchical(K=2, fan_in=2)" and default.label() == "hierarchical(K=2)"


def test_model_each_block_adds_one_hop_of_a_chunk():
    """At d > 20 a shard is one chunk (plan.chunk_count): each block the chain grows by adds one hop,
    the next link noticing, GETting, folding (f adds) and PUTting the prefix's chunk; and a level-1
    task's memory stays its f gradients and two prefixes however long the chain."""
    plat, k, p, opt = aws_platform(), 40, 100e6, 0.3
    h = SYNC_ALGORITHMS["hierarchical"]
    times = [h.stage(DEFAULT_FAN_IN * b, k, p, opt, 2.0, plat).task_s for b in (4, 5, 6)]
    chunk = p / k
    hop = plat.poll_delay_s + 2 * (plat.storage_latency_s + chunk / plat.bandwidth_Bps)
    hop += PASSES_FOLD_ADD * DEFAULT_FAN_IN * opt / (k * optimizer_passes(plat.optimizer_state_ratio))
    assert times[1] - times[0] == pytest.approx(hop) and times[2] - times[1] == pytest.approx(hop)
    mem = {h.stage(DEFAULT_FAN_IN * b, k, p, opt, 2.0, plat).task_bytes for b in (4, 25)}
    assert mem == {(DEFAULT_FAN_IN * p + 2 * p) / k}


# -- end to end on the local stack ---------------------------------------------------------------------
def test_a_chain_trains_plain_pytorchs_bits_end_to_end(backend):
    """Two stages x 5 replicas, fan-in 2 (three blocks): stage 0 hierarchical with K = 2 (a sync Map
    of 2 roots and 2 chains of 3 links), stage 1 the pipelined exchange, through the whole runtime
    (Step Functions' sync Map, the phases' dispatch, the workers' S3 channel): the trained model
    equals single-process PyTorch's (``train_reference``: loss.backward() per replica accumulating
    into .grad) bit for bit, float64, at d > fan-in."""
    import dataclasses

    from helpers import max_diff
    from test_transparency import OPTIMIZERS as OPTS
    from test_transparency import make_job, model_with_dropout

    from stagecoach.reference import train_reference

    d = 5
    job = dataclasses.replace(make_job("hier-chain", model_with_dropout, OPTS["adam"]), global_batch=6 * d, iterations=3)
    plan = job.manual_plan(stages=2, replicas=d, micro_batches=1, sync=("hierarchical", "pipelined_scatter_reduce"), aggregators=(2, d))
    plan = dataclasses.replace(plan, fan_in=2)
    assert plan.blocks(0) == 3 and plan.sync_tasks(0) == 2 * (3 + 1) and plan.sync_tasks(1) == 0
    run = job.run(plan=plan, backend=backend)
    run.wait(progress=False, poll_s=0.2, timeout_s=900)
    trained, expected = run.trained_model(), train_reference(run.job, replicas=d, micro_batches=1)
    assert max_diff(trained, run.job.build_model()) > 1e-3, "training must have moved the parameters"
    for (name, p), q in zip(trained.named_parameters(), expected.parameters()):
        assert p.dtype == q.dtype == torch.float64
        assert torch.equal(p, q), f"{name}: max diff {(p - q).abs().max()}"
