"""The evaluate and checkpoint passes' model (planner/model/passes.py): what one pass's tasks are
billed for, checked against the iteration's own stage terms and the runtime's cut of the set."""

import pytest

from stagecoach.lambdas.evaluation import eval_batches
from stagecoach.planner.model.passes import checkpoint_pass, eval_micro_batches, evaluate_pass
from stagecoach.planner.model.perfmodel import Config, layer_terms
from stagecoach.planner.model.platforms import aws_platform
from stagecoach.planner.model.syncmodel import SyncChoice
from stagecoach.planner.profile.zoo import zoo_profile

PLAT = aws_platform()
PROF = zoo_profile("resnet101")
L = len(PROF.layers)
NONE, SR2 = SyncChoice("none", 1), SyncChoice("scatter_reduce", 2)


@pytest.mark.parametrize("samples,replicas,b", [(13, 2, 2), (360, 2, 16), (5, 4, 2), (3, 4, 2), (1, 1, 8)])
def test_each_replica_walks_the_micro_batches_the_evaluate_task_cuts(samples, replicas, b):
    assert eval_micro_batches(samples, replicas, b) == [len(eval_batches(samples, replicas, r, b)) for r in range(replicas)]


def test_one_stage_evaluation_grows_by_one_forward_per_micro_batch():
    cfg = Config((L,), (4096,), 1, 4, 2, (NONE,))
    f = layer_terms(PROF, 0, L, True, True, 4096, NONE, 1, 4, 10, PLAT).fwd_compute_s
    small, large = evaluate_pass(PROF, cfg, PLAT, 40), evaluate_pass(PROF, cfg, PLAT, 80)
    assert large.task_s[0] - small.task_s[0] == pytest.approx(10 * f, rel=1e-9)
    # alone, the stage reads its samples locally and PUTs only its record: no hand-offs
    assert small.puts == 1 and small.tasks == (1,) and small.transitions == 3  # the Parallel, its Map, the task


def test_a_later_stage_ends_after_the_stage_that_feeds_it_and_replicas_split_the_set():
    two = Config((L // 2, L - L // 2), (4096, 4096), 2, 4, 2, (SR2, SR2))
    p = evaluate_pass(PROF, two, PLAT, 100)
    assert p.task_s[1] > p.task_s[0] > 0 and p.tasks == (2, 2) and p.invocations == 4 and p.transitions == 1 + 2 * (1 + 2)
    # 50 samples a replica in micro-batches of 4: 13 hand-offs each, and each last-stage record
    assert p.puts == 2 * 13 + 2
    one = evaluate_pass(PROF, Config(two.balance, two.tiers_mb, 1, 4, 2, (NONE, NONE)), PLAT, 100)
    assert p.task_s[1] < one.task_s[1]  # half the samples per task


def test_a_checkpoint_writes_each_stage_once_at_the_link_bandwidth():
    cfg = Config((L // 2, L - L // 2), (4096, 4096), 1, 4, 2, (NONE, NONE))
    p = checkpoint_pass(PROF, cfg, PLAT)
    lo = 0
    for s, n in enumerate(cfg.balance):
        t = layer_terms(PROF, lo, lo + n, s == 0, s == 1, 4096, NONE, 1, 4, 2, PLAT)
        stored = sum(layer.param_bytes + layer.buffer_bytes for layer in PROF.layers[lo : lo + n])
        assert p.task_s[s] == pytest.approx(t.load_s + PLAT.storage_latency_s + stored / PLAT.bandwidth_Bps, rel=1e-12)
        lo += n
    assert p.tasks == (1, 1) and p.puts == 2
    slow = checkpoint_pass(PROF, cfg, PLAT.replace(bandwidth_Bps=PLAT.bandwidth_Bps / 2))
    assert all(b > a for a, b in zip(p.task_s, slow.task_s))
