"""Timeouts the iteration gate learns from the job's task metrics (lambdas/timeouts.py), on an
in-memory S3 (tests/memory_s3.py), each expected number worked out by hand from the formula
min(planned, max(2, ceil(3 * median_low(slowest) + 1))) for a task's first run, and ``cold`` more for
each re-run: the longest a cold task worked (its Init and duration, less its waits), rounded up."""

import pytest
from memory_s3 import MemoryS3

from stagecoach.core import keys
from stagecoach.core.netem import Network
from stagecoach.core.records import LearntTimeouts, TaskMetrics
from stagecoach.lambdas import timeouts
from stagecoach.lambdas.channel import Channel, Pools
from stagecoach.planner.emit import asl
from stagecoach.planner.plan import Plan

JOB = "lt-0123abcd"
# 2 stages x 2 replicas: Forward (stage 0), Backward0/1, Sync0/1 (2 shards each)
PLAN = Plan(balance=[1, 1], replicas=2, micro_batches=1, global_batch=4, timeouts_s=[{"forward": 40, "backward": 50, "sync": 30}] * 2)


@pytest.fixture(autouse=True)
def fresh_container():
    timeouts._CACHE.clear()


def channel(s3):
    return Channel(s3, "bucket", net=Network(None), pools=Pools())


def put_iteration(s3, t, seconds, init_s=None):
    """Every task of iteration t, each taking ``seconds[phase key]`` (a quarter of it waiting for
    other workers' objects); cold with ``init_s``."""
    tasks = [("forward", 0, r) for r in range(2)] + [(p, s, i) for p in ("backward", "sync") for s in range(2) for i in range(2)]
    for phase, stage, index in tasks:
        d = seconds[timeouts.phase_key(phase, stage)] * (1.0 if index == 0 else 0.5)  # the slowest is index 0
        m = TaskMetrics(
            phase=phase, t=t, stage=stage, index=index, start=0.0, end=d, duration_s=d,
            upload_s=0.0, download_s=0.0, transfer_s=0.0, wait_s=d / 4, bytes_up=0, bytes_down=0, puts=1, gets=1,
            compute_s=d, container="c", container_started=0.0, invocation=1, cold=init_s is not None,
            memory_mb=1024, max_rss_mb=100.0, attempt="w0-a", init_s=init_s,
        )  # fmt: skip
        s3.put_object(Bucket="bucket", Key=keys.metrics(JOB, t, phase, stage, index), Body=m.model_dump_json().encode())


SECONDS = {"f": 1.0, "b0": 2.0, "b1": 1.5, "s0": 0.2, "s1": 0.5}
INIT = 0.3  # with b0's cold task (2 s, 0.5 s of it waiting): cold = 0.3 + 2 - 0.5 = 1.8 s


def test_before_any_iteration_the_plans_timeouts_hold_the_forward_map_under_its_slowest_stages():
    s3 = MemoryS3()
    assert timeouts.learn(channel(s3), JOB, PLAN, 0) == {"f": 40, "b0": 50, "b1": 50, "s0": 30, "s1": 30, "cold": 0}
    assert keys.learnt_timeouts(JOB) not in s3.objects


def test_after_an_iteration_each_map_gets_three_times_its_slowest_task_and_a_quarter_second_and_a_rerun_a_cold_task_more():
    s3 = MemoryS3()
    put_iteration(s3, 0, SECONDS, init_s=INIT)
    got = timeouts.learn(channel(s3), JOB, PLAN, 1)
    # f: 3*1.0+0.25 -> 4; b0: 6.25 -> 7; b1: 4.75 -> 5; s0: 0.85 -> 2; s1: 1.75 -> 2; cold: 1.8 -> 2
    assert got == {"f": 4, "b0": 7, "b1": 5, "s0": 2, "s1": 2, "cold": 2}
    stored = LearntTimeouts.model_validate_json(s3.objects[keys.learnt_timeouts(JOB)])
    assert stored.through == 0 and stored.cold_s == pytest.approx(1.8) and stored.samples["b0"] == [2.0]


def test_a_window_attempt_that_keeps_state_warm_leaves_ten_times_its_slowest_task():
    """A slow task timed out there runs again where its warm state is not: the window restarts."""
    learnt = LearntTimeouts(samples={"b0": [2.0], "s0": [0.2]}, cold_s=1.8)
    # b0: 10*2+1 = 21; s0: 10*0.2+1 = 3; the rest the plan's
    assert timeouts.timeouts(PLAN, learnt, warm=True) == {"f": 40, "b0": 21, "b1": 50, "s0": 3, "s1": 30, "cold": 2}
    assert timeouts.timeouts(PLAN, learnt)["b0"] == 7


def test_without_a_cold_task_seen_a_rerun_is_allowed_ten_seconds_more_and_the_plan_stays_the_ceiling():
    s3 = MemoryS3()
    put_iteration(s3, 4, {**SECONDS, "b1": 30.0})
    got = timeouts.learn(channel(s3), JOB, PLAN, 5)
    # as above, b1: 90+1 > 50 -> 50; a re-run gets 10 s more
    assert got == {"f": 4, "b0": 7, "b1": 50, "s0": 2, "s1": 2, "cold": 10}


def test_an_iteration_a_fault_slowed_down_does_not_raise_the_timeouts():
    s3 = MemoryS3()
    put_iteration(s3, 0, SECONDS, init_s=INIT)
    timeouts.learn(channel(s3), JOB, PLAN, 1)
    put_iteration(s3, 1, {**SECONDS, "b0": 9.0})  # a consumer waited for a hung producer's re-run
    put_iteration(s3, 2, SECONDS)
    c = channel(s3)
    timeouts.learn(c, JOB, PLAN, 2)
    assert timeouts.learn(c, JOB, PLAN, 3)["b0"] == 7  # median_low of [2, 9, 2]: 2 -> 3*2+0.25 -> 7
    # with two samples the lower one counts: [2, 9] -> 2, never their mean
    assert timeouts.timeouts(PLAN, LearntTimeouts(samples={"b0": [2.0, 9.0]}, cold_s=1.8))["b0"] == 7


def test_a_new_container_and_a_later_window_start_from_the_stored_record_without_sampling_again():
    s3 = MemoryS3()
    put_iteration(s3, 0, SECONDS, init_s=INIT)
    first = timeouts.learn(channel(s3), JOB, PLAN, 1)
    timeouts._CACHE.clear()  # another container of the stage-0 function
    c = channel(s3)
    assert timeouts.learn(c, JOB, PLAN, 1) == first  # the window's gate, retried
    assert c.stats.gets == 1  # the record only: iteration 0 was sampled already


def test_sampling_is_early_then_every_fifth_iteration():
    s3 = MemoryS3()
    c = channel(s3)
    for t in range(12):
        put_iteration(s3, t, SECONDS, init_s=INIT if t == 0 else None)
    sampled = []
    for t in range(1, 13):
        before = c.stats.gets
        timeouts.learn(c, JOB, PLAN, t)
        if c.stats.gets - before > 1:
            sampled.append(t - 1)
    assert sampled == [0, 1, 2, 3, 4, 9]


def test_every_training_map_takes_its_timeout_from_the_gate_and_evaluate_and_checkpoint_keep_their_functions():
    plan = Plan(balance=[1, 1, 1], replicas=2, micro_batches=1, global_batch=4)
    d = asl.window_definition(plan, ["a", "b", "c"], abort_key_format=keys.WINDOW_ABORT, evals=[1], saves=[1])
    st = d["States"]
    assert st["Gate"]["ResultSelector"]["timeouts.$"] == "$.Payload.timeouts"
    maps = {}
    for b in [*asl.phase_parallel(st, "Forward")["Branches"], *asl.phase_parallel(st, "BackwardSync")["Branches"]]:
        maps.update({k: v for k, v in b["States"].items() if v["Type"] == "Map"})
    assert sorted(maps) == ["Backward0", "Backward1", "Backward2", "Forward0", "Forward1", "Sync0", "Sync1", "Sync2"]
    for name, m in maps.items():
        key = "f" if name.startswith("Forward") else name[0].lower() + name[-1]
        assert m["ItemSelector"]["timeout.$"] == f"$.gate.timeouts.{key}"
        assert m["ItemProcessor"]["States"][f"{name}Task"]["TimeoutSecondsPath"] == "$.timeout"
        # a re-run (after a kill or a timeout) gets the gate's ``cold`` seconds more, once
        assert m["ItemSelector"]["cold.$"] == "$.gate.timeouts.cold"
        again = m["ItemProcessor"]["States"][f"{name}Again"]["Parameters"]
        assert again["timeout.$"] == "States.MathAdd($.timeout, $.cold)" and again["cold"] == 0 and "cold.$" not in again
    assert set(timeouts.planned(plan)) == {"f", "b0", "b1", "b2", "s0", "s1", "s2"}
    evaluate = [b["States"][f"Evaluate{s}"] for s, b in enumerate(st["Evaluate"]["Branches"])]
    for name, m in [("Checkpoint", st["Checkpoint"]), *((f"Evaluate{s}", e) for s, e in enumerate(evaluate))]:
        task = m["ItemProcessor"]["States"][f"{name}Task"]
        assert (
            task["TimeoutSeconds"] == max(plan.function_timeout_s(s) for s in range(3)) and "timeout.$" not in task["Parameters"]["Payload"]
        )
