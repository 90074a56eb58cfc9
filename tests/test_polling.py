"""Workers wait for each other's objects by polling S3; a job's waiters together stay within its GET
budget (planner/limits.py JOB_POLL_BUDGET_PER_S), far under S3's 5,500 GET/s per prefix, even at
1,000 waiting workers. Checked on the channel's real wait loop with a simulated clock."""

import threading
import time

import pytest

from stagecoach.core.netem import Network
from stagecoach.lambdas import channel as channel_module
from stagecoach.lambdas.channel import WAIT_MAX_S, Channel, ObjectWaitTimeout, poll_cap_s
from stagecoach.planner.limits import JOB_POLL_BUDGET_PER_S, S3_GET_PER_PREFIX_PER_S
from stagecoach.planner.plan import Plan


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def time(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s


class NeverThere:
    """S3 where the awaited object never appears: every GET is a 404 (counted)."""

    class exceptions:  # noqa: N801 - botocore's attribute name
        class NoSuchKey(Exception):
            pass

    def __init__(self) -> None:
        self.gets = 0

    def get_object(self, **_: object) -> dict:
        self.gets += 1
        raise self.exceptions.NoSuchKey()


def gets_while_waiting(waiters: int, seconds: float, monkeypatch) -> int:
    clock = Clock()
    monkeypatch.setattr(channel_module.time, "time", clock.time)
    monkeypatch.setattr(channel_module.time, "sleep", clock.sleep)
    s3 = NeverThere()
    ch = Channel(s3, "b", net=Network(None), poll_cap=poll_cap_s(waiters))
    with pytest.raises(ObjectWaitTimeout):
        ch.wait_bytes("k", deadline=clock.now + seconds)
    return s3.gets


@pytest.mark.parametrize("waiters", [2, 80, 1_000])
def test_a_job_s_waiters_together_poll_within_its_budget(waiters, monkeypatch):
    seconds = 60.0
    per_waiter = gets_while_waiting(waiters, seconds, monkeypatch) / seconds
    job_rate = waiters * per_waiter
    # each pause is at least 3/4 of the cap once the back-off has ramped up (a few GETs in the first 0.1 s)
    assert job_rate <= waiters * (1 / (0.75 * max(WAIT_MAX_S, poll_cap_s(waiters))) + 10 / seconds)
    assert poll_cap_s(waiters) == waiters / JOB_POLL_BUDGET_PER_S
    if waiters >= 80:  # the bound bites: far below S3's per-prefix limit
        assert job_rate < S3_GET_PER_PREFIX_PER_S / 3


def test_small_jobs_keep_the_fast_20_ms_poll_and_the_largest_plan_slows_to_80_ms():
    assert poll_cap_s(Plan(balance=[1, 1], replicas=4, global_batch=4).peak_invocations()) < WAIT_MAX_S
    # 2 stages x 40 replicas back-propagate at once
    larger = Plan(balance=[1, 1], replicas=40, global_batch=40)
    assert larger.peak_invocations() == 80 and poll_cap_s(80) == pytest.approx(0.08)


def test_an_endpoint_s_own_budget_replaces_the_job_s(monkeypatch):
    """The local stack's runtime passes its S3's lower budget to the workers (local/runtime.py)."""
    monkeypatch.setenv(channel_module.POLL_BUDGET_ENV, "100")
    assert poll_cap_s(80) == pytest.approx(0.8)


def test_a_worker_waiting_for_several_objects_polls_no_faster_than_one_waiter():
    """Four threads of one task wait at once (a gather, a sync task's inputs): the cap is spaced by
    their number, so the task's GETs stay near one waiter's rate, not four times it. Real threads and
    a real clock: a second of waiting with a 50 ms cap."""
    s3 = NeverThere()
    ch = Channel(s3, "b", net=Network(None), poll_cap=0.05)
    deadline = time.time() + 1.0

    def wait() -> None:
        with pytest.raises(ObjectWaitTimeout):
            ch.wait_bytes("k", deadline=deadline)

    threads = [threading.Thread(target=wait) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    one_waiter = 1 / (0.75 * 0.05) + 8  # at the cap, plus the back-off's ramp from 5 ms
    assert s3.gets <= one_waiter + 3 * 8  # each waiter's own ramp; four uncapped waiters make ~4 x 35


class AppearsAt:
    """S3 where the awaited object lands at a given time of the simulated clock."""

    exceptions = NeverThere.exceptions

    def __init__(self, clock: Clock, at: float) -> None:
        self.clock, self.at, self.misses = clock, at, 0

    def get_object(self, **_: object) -> dict:
        if self.clock.now < self.at:
            self.misses += 1
            raise self.exceptions.NoSuchKey()

        class Body:
            @staticmethod
            def read() -> bytes:
                return b"x"

        return {"Body": Body()}


@pytest.mark.parametrize("wait_s", [0.01, 0.05, 0.2, 1.0])
def test_the_performance_model_counts_the_polls_the_channel_makes(wait_s, monkeypatch):
    """The model's GETs per wait (Platform.polls_while_waiting) are what the channel's back-off
    makes while an object is on its way (the channel jitters each pause; the mean over 200 waits)."""
    import random

    from stagecoach.planner.model.platforms import aws_platform

    random.seed(5)
    clock = Clock()
    monkeypatch.setattr(channel_module.time, "time", clock.time)
    monkeypatch.setattr(channel_module.time, "sleep", clock.sleep)
    misses = []
    for _ in range(200):
        s3 = AppearsAt(clock, clock.now + wait_s)
        Channel(s3, "b", net=Network(None)).wait_bytes("k", deadline=clock.now + 60)
        misses.append(s3.misses)
    predicted = aws_platform().polls_while_waiting(wait_s)
    assert sum(misses) / len(misses) == pytest.approx(predicted, rel=0.15, abs=1.0)
