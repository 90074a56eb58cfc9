"""What a hung task and a wait in vain cost (docs/reliability.md "Fault benchmark"): the learnt
timeout gives a Map three times its slowest task and a second, at least 2 s (1 s and a quarter
second timed out fault-free tasks on a loaded machine); a worker's waits end just before that timeout; and a
consumer whose wait ran out waits again at once through its Map's re-run loop, not after a Retry's
interval (at least 1 s, 0.5 s on average with FULL jitter)."""

import math

import pytest

from stagecoach.core.records import LearntTimeouts
from stagecoach.lambdas import timeouts
from stagecoach.lambdas.handler import wait_budget
from stagecoach.planner.emit import tasks
from stagecoach.planner.plan import Plan

PLAN = Plan(balance=[1, 1], replicas=2, micro_batches=1, global_batch=4, timeouts_s=[{"forward": 40, "backward": 50, "sync": 30}] * 2)


@pytest.mark.parametrize(
    ("slowest", "expected"),
    [
        (0.05, 2),  # far under a second: the least, 2 s
        (0.4, 2),  # 3 x 0.4 + 0.25 = 1.45: 2 s (the demo's tasks)
        (0.59, 3),  # 2.02: rounded up to 3 s, a timeout never under 3x the slowest and a quarter second
        (0.6, 3),  # 2.05 -> 3
        (2.0, 7),
    ],
)
def test_a_map_gets_three_times_its_slowest_task_and_a_quarter_second_in_whole_seconds_at_least_two(slowest, expected):
    got = timeouts.timeouts(PLAN, LearntTimeouts(samples={"s0": [slowest]}, cold_s=0.4))
    assert got["s0"] == expected and got["s0"] >= 3 * slowest + 0.25 and got["cold"] == 1
    assert got["b0"] == 50  # nothing learnt for it: the plan's


def test_the_least_timeout_applies_only_where_the_median_slowest_task_is_well_under_a_second():
    """An iteration a fault slowed down does not lift a Map off 2 s, nor does one fast iteration
    bring a slow Map down to it (median_low of the sampled slowest tasks)."""
    assert timeouts.timeouts(PLAN, LearntTimeouts(samples={"f": [0.2, 0.2, 3.0]}))["f"] == 2
    assert timeouts.timeouts(PLAN, LearntTimeouts(samples={"f": [0.6, 0.1, 0.7]}))["f"] == 3


def test_an_attempt_that_keeps_state_warm_keeps_ten_times_its_slowest_task_and_a_second():
    """There a slow task timed out runs again where its state is not: the window restarts."""
    got = timeouts.timeouts(PLAN, LearntTimeouts(samples={"s0": [0.05]}), warm=True)
    assert got["s0"] == math.ceil(10 * 0.05 + 1) == 2


@pytest.mark.parametrize(("timeout", "budget"), [(1, 0.75), (2, 1.5), (3, 2.25), (4, 3.0), (10, 9.0), (300, 299.0)])
def test_a_worker_stops_waiting_a_second_or_a_quarter_of_a_short_timeout_before_it(timeout, budget):
    """At a 1 s timeout, a second before it would give up at once: a consumer whose producer is a
    few tenths of a second late would fail without having waited."""
    assert wait_budget(900.0, timeout) == pytest.approx(budget)
    assert wait_budget(2.0, 10) == pytest.approx(1.5)  # and within the function's own time


def test_a_training_task_waits_again_at_once_and_a_fixed_timeout_task_keeps_no_wait_loop():
    learnt = tasks.worker_task("backward", "fn", None, "replica")
    loop = tasks.worker_map("B", "$.items", {"timeout.$": "$.gate.timeouts.b0"}, learnt, None)["ItemProcessor"]["States"]
    again = next(c for c in loop["BTask"]["Catch"] if c["Next"] == "BAgain?")
    assert "ObjectWaitTimeout" in again["ErrorEquals"] and "States.Timeout" in again["ErrorEquals"]
    # no Retry takes it first (a Retrier matching it would wait its interval before the Catch)
    assert all("ObjectWaitTimeout" not in r["ErrorEquals"] for r in learnt["Retry"])
    fixed = tasks.worker_task("checkpoint", None, 900, "replica")
    loop = tasks.worker_map("C", "$.items", {}, fixed, None)["ItemProcessor"]["States"]
    again = next(c for c in loop["CTask"]["Catch"] if c["Next"] == "CAgain?")
    assert "ObjectWaitTimeout" not in again["ErrorEquals"]  # its waits end with the function's time
