"""Dynamic workers with a K (and chunks) that change between segments (issue 27 item 1,
docs/runtime.md "Dynamic workers"): every version is stored in the common refinement of every
segment's chunks (core/stored_layout.py), each iteration's shards runs of whole stored chunks, so
a version written at one d is read at the next unchanged, its elementwise optimizer state each
stored chunk's own. On the stack, d 1 -> 2 -> 4 and 1 -> 8 with K = d (scatter-reduce), d 1 -> 3
-> 4 with K = d and K = d - 1 (k-reduce) whose shards do not line up across segments, Adam and SGD
with momentum, a window restarted after a change, and a job stopped and resumed across changes of
K, each equal to plain PyTorch (float64, 1e-5)."""

import dataclasses
import itertools
import json
import time

import pytest
import torch
from helpers import max_diff
from torch import nn

from stagecoach import Job
from stagecoach.core import keys, stored_layout
from stagecoach.core.training import stage_layout
from stagecoach.planner.emit import asl
from stagecoach.planner.plan import Plan, PlanError
from stagecoach.planner.segments import ReplicaPolicy, scheduled_plan
from stagecoach.reference import train_reference

GLOBAL_BATCH = 24
ADAM = lambda p: torch.optim.Adam(p, lr=0.01)  # noqa: E731  # elementwise state and a step count per chunk
MOMENTUM = lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)  # noqa: E731


def model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4))


def make_job(name: str, optimizer=ADAM, iterations: int = 6, **options) -> Job:
    g = torch.Generator().manual_seed(11)
    x = torch.randn(96, 10, generator=g, dtype=torch.float64)
    y = torch.randint(0, 4, (96,), generator=g)
    return Job(
        model=model,
        loss=nn.CrossEntropyLoss(),
        optimizer=optimizer,
        train=(x, y),
        global_batch=GLOBAL_BATCH,
        seed=5,
        dtype=torch.float64,
        name=name,
        warm_state=False,
        iterations=iterations,
        **options,
    )


def mixed_plan(job: Job, schedule: dict[int, int]) -> Plan:
    """Stage 0 scatter-reduce (K = d), stage 1 k-reduce with K = d - 1: at d 1 -> 3 -> 4 no two
    segments cut either stage alike, and their shard boundaries do not line up (1408 elements:
    704 | 470, 939 | 352, 704, 1056)."""
    return scheduled_plan(
        schedule,
        job.iterations,
        lambda d: job.manual_plan(stages=2, replicas=d, sync=["scatter_reduce", "k_reduce"], aggregators=[d, max(1, d - 1)]),
    )


def test_the_stored_layout_refines_every_segments_chunks_and_names_them():
    job = make_job("recut-layout")
    plan = mixed_plan(job, {0: 1, 2: 2, 4: 3, 5: 4})
    numel = 32 * 10 + 32 + 32 * 32 + 32  # stage 0: two Linear layers
    stored = stored_layout.stored_layout(plan, 0, numel, 8)
    pieces = [ab for shard in stored for ab in shard]
    assert len(stored) == 4 and pieces[0][0] == 0 and pieces[-1][1] == numel  # the top plan's K = 4
    assert all(a < b and b == c for (a, b), (c, _) in zip(pieces, pieces[1:]))  # contiguous, none empty
    assert len(pieces) == 6  # 0 | 352 | 470 | 704 | 939 | 1056 | 1408
    for _, seg in plan.segments:
        own = stage_layout(numel, 8, seg.grad_shards(0), seg.replicas, seg.chunks[0])
        cut = stored_layout.iteration_cut(plan, seg, 0, numel, 8)
        assert [(sh[0][0], sh[-1][1]) for sh in cut.layout] == [(sh[0][0], sh[-1][1]) for sh in own]  # its own K shards
        assert {x for sh in own for ab in sh for x in ab} <= {x for ab in pieces for x in ab}  # its boundaries are stored ones
        names = [n for sh in cut.names for n in sh]
        assert [stored[k][c] for k, c in names] == [ab for sh in cut.layout for ab in sh]  # every piece once, in flat order


def test_a_chunk_count_that_changes_with_d_is_refined_too():
    """A large stage's size rule (planner/plan.py chunk_count) cuts a shard into fewer chunks at a
    larger d: the stored chunks refine both."""
    big = Plan(balance=(1,), replicas=2, global_batch=8, sync="k_reduce", aggregators=1)
    plan = scheduled_plan({0: 2, 2: 8}, 6, lambda d: dataclasses.replace(big, replicas=d))
    numel, itemsize = 20 << 20, 4  # 80 MiB of float32
    a, b = (stage_layout(numel, itemsize, 1, d) for d in (2, 8))
    assert len(a[0]) != len(b[0])
    stored = stored_layout.stored_layout(plan, 0, numel, itemsize)
    assert {x for ab in stored[0] for x in ab} == {x for lay in (a, b) for ab in lay[0] for x in ab}


def test_a_plan_whose_layouts_agree_is_stored_as_before():
    plan = scheduled_plan(
        {0: 2, 2: 4}, 6, lambda d: Plan(balance=(3, 2), replicas=d, global_batch=GLOBAL_BATCH, sync="k_reduce", aggregators=2)
    )
    cut = stored_layout.iteration_cut(plan, plan.plan_at(0), 0, 1408, 8)
    assert cut.names == () and cut.layout == stage_layout(1408, 8, 2, 2)
    assert stored_layout.stored_layout(plan, 0, 1408, 8) == stage_layout(1408, 8, 2, 4)


def test_what_stays_refused_names_cause_and_fix():
    plan = scheduled_plan({0: 1, 2: 4}, 6, lambda d: Plan(balance=(3, 2), replicas=d, global_batch=GLOBAL_BATCH, sync="scatter_reduce"))
    with pytest.raises(PlanError, match="more shards than it has elements"):
        stored_layout.check(plan, [1408, 3], 8)  # stage 1 of 3 elements in 4 shards
    stored_layout.check(plan, [1408, 132], 8)
    with pytest.raises(PlanError, match="share the largest choice's K"):
        make_job("recut-policy").run(
            stages=2, backend="no-such-backend", replicas=ReplicaPolicy(choose=lambda m: 2, choices=(1, 2)), sync="scatter_reduce"
        )
    with pytest.raises(PlanError, match="not supported with a replica schedule"):
        make_job("recut-fused").run(stages=2, backend="no-such-backend", replicas={0: 1, 2: 2}, sync="pipelined_scatter_reduce")


@pytest.fixture
def windows_of_two(monkeypatch):
    monkeypatch.setattr(asl, "window_length", lambda plan, limit=asl.HISTORY_LIMIT, **kw: 2)


def backward_tasks(run) -> list[int]:
    counts: dict[int, int] = {}
    for m in run.metrics():
        if m.phase == "backward" and m.stage == 1:
            counts[m.t] = counts.get(m.t, 0) + 1
    return [counts.get(t, 0) for t in range(run.job.iterations)]


def sync_tasks(run, stage: int) -> list[int]:
    """Per iteration, the sync tasks of ``stage``: its K (0 at d = 1: backward updates alone)."""
    counts: dict[int, int] = {}
    for m in run.metrics():
        if m.phase == "sync" and m.stage == stage:
            counts[m.t] = counts.get(m.t, 0) + 1
    return [counts.get(t, 0) for t in range(run.job.iterations)]


# SGD with momentum in the slow tier: Adam's state (two moments and a step per chunk) covers the re-cut state
@pytest.mark.parametrize("optimizer", [ADAM, pytest.param(MOMENTUM, marks=pytest.mark.slow)], ids=["adam", "sgd-momentum"])
def test_k_equal_to_d_in_every_segment_trains_what_plain_pytorch_trains(backend, windows_of_two, optimizer):
    job = make_job("recut-kd", optimizer=optimizer)
    run = job.run(backend=backend, stages=2, replicas={0: 1, 2: 2, 4: 4}, sync="scatter_reduce")
    assert run.wait(progress=False, poll_s=1.0, timeout_s=900) == "SUCCEEDED"
    assert backward_tasks(run) == [1, 1, 2, 2, 4, 4]
    assert sync_tasks(run, 0) == [0, 0, 2, 2, 4, 4]  # K = d: the stored shards re-grouped at each change
    assert max_diff(run.trained_model(), job.build_model()) > 1e-3  # it trained
    assert max_diff(run.trained_model(), train_reference(job)) < 1e-5


def test_misaligned_shards_and_two_algorithms_train_what_plain_pytorch_trains(backend, windows_of_two):
    job = make_job("recut-mixed", optimizer=ADAM)
    run = job.run(backend=backend, plan=mixed_plan(job, {0: 1, 2: 3, 4: 4}))
    assert run.wait(progress=False, poll_s=1.0, timeout_s=900) == "SUCCEEDED"
    assert sync_tasks(run, 0) == [0, 0, 3, 3, 4, 4] and sync_tasks(run, 1) == [0, 0, 2, 2, 3, 3]
    assert max_diff(run.trained_model(), train_reference(job)) < 1e-5
    stored = stored_layout.stored_layout(run.plan, 0, 1408, 8)
    listed = run.backend.clients.s3.list_objects_v2(Bucket=run.bucket, Prefix=f"jobs/{run.job_id}/params/v6/s0/")
    assert len(listed.get("Contents", [])) == sum(len(sh) for sh in stored)  # the last version, in the stored chunks
    assert keys.params(run.job_id, 6, 0, len(stored) - 1, len(stored[-1]) - 1) in {o["Key"] for o in listed["Contents"]}
    # each backward task deleted its gradient shards of two iterations before, as that iteration cut
    # them (K = 3 at t = 2, 3; deleted by t = 4, 5's tasks, K = 4): none is left for the lifecycle rule
    for t, s, r in itertools.product((2, 3), (0, 1), range(3)):
        prefix = keys.gshard(run.job_id, t, s, r, 0, 0).rsplit("k0/c0", 1)[0]
        assert run.backend.clients.s3.list_objects_v2(Bucket=run.bucket, Prefix=prefix).get("KeyCount", 0) == 0, prefix


@pytest.mark.slow  # the largest change; the re-cut itself is the default tier's K = d and misaligned runs
def test_one_to_eight_replicas_with_k_equal_to_d(backend, windows_of_two):
    job = make_job("recut-1to8", optimizer=MOMENTUM, iterations=4)
    run = job.run(backend=backend, stages=2, replicas={0: 1, 2: 8}, sync="scatter_reduce")
    assert run.wait(progress=False, poll_s=1.0, timeout_s=900) == "SUCCEEDED"
    assert backward_tasks(run) == [1, 1, 8, 8] and sync_tasks(run, 1) == [0, 0, 8, 8]
    assert max_diff(run.trained_model(), train_reference(job)) < 1e-5


def test_a_window_failed_after_a_change_restarts_and_trains_what_plain_pytorch_trains(windows_of_two):
    """The window [2, 4) fails at t = 3 (d = 2, K = 2, after the change from d = 1 at 2) and restarts
    at its resume point: every version has the same stored objects, so the completeness count of
    the resume point (core/versions.py) holds across the change."""
    from stagecoach.local.backend import LocalBackend

    faulty = LocalBackend(faults={"once": [{"kind": "fail", "phase": "backward", "t": 3, "stage": 0, "replica": 1}]})
    try:
        job = make_job("recut-restart", optimizer=ADAM)
        run = job.run(backend=faulty, stages=2, replicas={0: 1, 2: 2, 4: 4}, sync="scatter_reduce", timeout_s=12)
        assert run.wait(progress=False, poll_s=1.0, timeout_s=900) == "SUCCEEDED"
        windows = sorted(
            (faulty.clients.sfn.describe_execution(executionArn=a) for a in run.window_executions()), key=lambda d: d["startDate"]
        )
        assert [d["status"] for d in windows].count("FAILED") == 1
        assert [json.loads(d["input"])["first"] for d in windows] == [0, 2, 3, 4]
        assert max_diff(run.trained_model(), train_reference(job)) < 1e-5
    finally:
        faulty.stack.close()


def test_a_job_stopped_and_resumed_across_changes_of_k_trains_what_plain_pytorch_trains(backend):
    """Stopped at an iteration boundary (checkpoints every 2 versions), then resumed to more
    iterations across K 1 -> 2 -> 4: the resumed windows read the stopped version in the stored
    layout whatever segment wrote it."""
    schedule = {0: 1, 3: 2, 5: 4}
    long = make_job("recut-stop", iterations=1000, checkpoint_every=2).run(
        backend=backend, stages=2, replicas=schedule, sync="scatter_reduce"
    )
    while not long.metrics() or long.iterations_done() < 2:
        time.sleep(0.5)
    long.stop()
    assert long.wait(progress=False, poll_s=1.0, timeout_s=600) == "STOPPED"
    total = max(long.version() + 3, 7)
    resumed = backend.resume(long.job_id, iterations=total, job=make_job("recut-stop", iterations=1000, checkpoint_every=2))
    assert resumed.wait(progress=False, poll_s=2.0, timeout_s=900) == "SUCCEEDED"
    assert sync_tasks(resumed, 1)[:total] == [0, 0, 0, 2, 2] + [4] * (total - 5)
    assert max_diff(resumed.trained_model(), train_reference(make_job("recut-ref", iterations=total))) < 1e-5
