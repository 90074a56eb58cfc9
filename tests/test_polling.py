"""Workers wait for each other's objects by polling S3, pausing a tenth of the time waited so far;
a job's waiters together stay within its GET budget (planner/limits.py JOB_POLL_BUDGET_PER_S), far
under S3's 5,500 GET/s per prefix, even at 1,000 waiting workers; the performance model counts the
GETs the loop makes. Checked on the channel's real wait loop with a simulated clock."""

import math
import random
import threading
import time

import pytest
from sim_clock import Clock

from stagecoach.core.netem import Network
from stagecoach.lambdas import channel as channel_module
from stagecoach.lambdas.channel import (
    ABORT_CHECK_S,
    WAIT_FACTOR,
    WAIT_FIRST_S,
    WAIT_JITTER,
    WAIT_MAX_S,
    Channel,
    ObjectWaitTimeout,
    poll_cap_s,
)
from stagecoach.planner.limits import JOB_POLL_BUDGET_PER_S, S3_GET_PER_PREFIX_PER_S
from stagecoach.planner.model.platforms import Platform, aws_platform
from stagecoach.planner.plan import Plan


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


def ramp_gets(cap: float) -> float:
    """The most GETs one waiter makes before its pause reaches ``cap``, its jitter at its lowest
    (3/4): pauses of WAIT_FIRST_S until WAIT_FACTOR of the wait exceeds it, then the wait grows
    by at least 1 + 3/4 WAIT_FACTOR a GET."""
    f = WAIT_FACTOR
    return 1 / f / 0.75 + math.log(cap / WAIT_FIRST_S * f) / math.log1p(0.75 * f) + 1


@pytest.mark.parametrize("waiters", [2, 80, 1_000])
def test_a_job_s_waiters_together_poll_within_its_budget(waiters, monkeypatch):
    seconds = 60.0
    per_waiter = gets_while_waiting(waiters, seconds, monkeypatch) / seconds
    job_rate = waiters * per_waiter
    cap = max(WAIT_MAX_S, poll_cap_s(waiters))
    # each pause is at least 3/4 of the cap once WAIT_FACTOR of the wait reaches it (ramp_gets: ~35 GETs before, at 1 s)
    assert job_rate <= waiters * (1 / (0.75 * cap) + ramp_gets(cap) / seconds)
    assert poll_cap_s(waiters) == waiters / JOB_POLL_BUDGET_PER_S
    if waiters >= 80:  # the bound bites: far below S3's per-prefix limit
        assert job_rate < S3_GET_PER_PREFIX_PER_S / 3


def test_the_job_s_budget_raises_the_cap_only_for_plans_of_more_than_40_workers():
    assert poll_cap_s(Plan(balance=[1, 1], replicas=4, global_batch=4).peak_invocations()) < WAIT_MAX_S
    # 2 stages x 40 replicas back-propagate at once: each pause up to 80 ms
    larger = Plan(balance=[1, 1], replicas=40, global_batch=40)
    assert larger.peak_invocations() == 80 and poll_cap_s(80) == pytest.approx(0.08)
    ch = Channel(NeverThere(), "b", net=Network(None), poll_cap=poll_cap_s(80))
    ch._waiting = 1
    assert poll_cap_s(40) == pytest.approx(WAIT_MAX_S) and ch.pause_s(60.0) == pytest.approx(0.08)


def test_the_pause_is_a_fifth_of_the_wait_between_the_floor_and_the_cap():
    ch = Channel(NeverThere(), "b", net=Network(None), poll_cap=poll_cap_s(8))
    ch._waiting = 1
    assert ch.pause_s(0.0) == WAIT_FIRST_S and ch.pause_s(0.02) == WAIT_FIRST_S
    assert ch.pause_s(0.1) == pytest.approx(0.02) and ch.pause_s(0.15) == pytest.approx(0.03)
    assert ch.pause_s(0.2) == pytest.approx(WAIT_MAX_S) and ch.pause_s(60.0) == WAIT_MAX_S
    # 1,000 waiters' budget: 1 s, reached after 5 s of waiting
    ch.poll_cap = poll_cap_s(1_000)
    assert ch.pause_s(2.0) == pytest.approx(0.4) and ch.pause_s(5.0) == pytest.approx(1.0) == ch.pause_s(60.0)


def test_an_endpoint_s_own_budget_replaces_the_job_s(monkeypatch):
    """The local stack's runtime passes its S3's lower budget to the workers (local/runtime.py)."""
    monkeypatch.setenv(channel_module.POLL_BUDGET_ENV, "100")
    assert poll_cap_s(80) == pytest.approx(0.8)


def test_a_worker_waiting_for_several_objects_polls_no_faster_than_one_waiter(monkeypatch):
    """Four threads of one task wait at once (a gather, a sync task's inputs): the cap is spaced by
    their number, so the task's GETs stay near one waiter's rate, not four times it. Real threads
    and a real clock (0.3 s) count the waiters each pause sees; the pause they give, past the
    ramp, is four times the budget's cap for one."""
    s3 = NeverThere()
    ch = Channel(s3, "b", net=Network(None), poll_cap=0.1)
    seen: list[int] = []
    pause = Channel.pause_s

    def spy(self: Channel, waited_s: float) -> float:
        seen.append(self._waiting)
        return pause(self, waited_s)

    monkeypatch.setattr(Channel, "pause_s", spy)
    deadline = time.time() + 0.3

    def wait() -> None:
        with pytest.raises(ObjectWaitTimeout):
            ch.wait_bytes("k", deadline=deadline)

    threads = [threading.Thread(target=wait) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert max(seen) == 4 and ch._waiting == 0
    ch._waiting = 4
    assert pause(ch, 100.0) == pytest.approx(0.4), "four waiters at a 0.1 s budget cap"
    ch.poll_cap = 0.005
    ch._waiting = 1
    assert pause(ch, 100.0) == WAIT_MAX_S


class AppearsAt:
    """S3 where the awaited object lands at a given time of the simulated clock, each GET taking
    ``latency_s`` of it (a 404's round trip); other keys (the abort marker, the producer's
    metrics) never appear."""

    exceptions = NeverThere.exceptions

    def __init__(self, clock: Clock, at: float, latency_s: float) -> None:
        self.clock, self.at, self.latency_s, self.gets = clock, at, latency_s, 0

    def get_object(self, Key: str, **_: object) -> dict:  # noqa: N803 - boto3's argument name
        self.gets += 1
        there = Key == "k" and self.clock.now >= self.at
        self.clock.now += self.latency_s
        if not there:
            raise self.exceptions.NoSuchKey()

        class Body:
            @staticmethod
            def read() -> bytes:
                return b"x"

        return {"Body": Body()}


def mean_extra_gets(wait_s: float, latency_s: float, looks: bool, monkeypatch, poll_cap: float = 0.0, runs: int = 100) -> float:
    """The GETs the channel makes before the one that finds an object landing ``wait_s`` after the
    wait starts, averaged over ``runs`` jittered waits; ``looks``: a task of a window attempt
    (abort marker) waiting for a producer's object (its metrics), so each look GETs both."""
    random.seed(5)
    clock = Clock()
    monkeypatch.setattr(channel_module.time, "time", clock.time)
    monkeypatch.setattr(channel_module.time, "sleep", clock.sleep)
    total = 0
    for _ in range(runs):
        s3 = AppearsAt(clock, clock.now + wait_s, latency_s)
        ch = Channel(s3, "b", net=Network(None), poll_cap=poll_cap)
        if looks:
            ch.abort_key, ch.attempt = "abort", "w0-a"
        ch.wait_bytes("k", deadline=clock.now + 1e4, producer="metrics" if looks else None)
        total += s3.gets - 1
    return total / runs


@pytest.mark.parametrize("latency_s", [0.0, 0.03])
@pytest.mark.parametrize("looks", [False, True])
@pytest.mark.parametrize("wait_s", [0.01, 0.05, 0.2, 1.0, 3.0, 10.0, 30.0])
def test_the_performance_model_counts_the_gets_the_channel_makes(wait_s, latency_s, looks, monkeypatch):
    """The model's GETs per wait (Platform.polls_while_waiting) are what the channel's loop makes
    while an object is on its way, its 404s and its looks for the abort marker and the producer's
    metrics: within 1.5 GETs of the mean over 100 jittered waits, at the local stack's near-zero
    round trip and at AWS's 30 ms, for waits from 10 ms to 30 s, and with a budget's larger cap."""
    plat = aws_platform(storage_latency_s=latency_s)
    assert (plat.poll_first_s, plat.poll_factor, plat.poll_max_s) == (WAIT_FIRST_S, WAIT_FACTOR, WAIT_MAX_S)
    assert (plat.poll_look_every_s, plat.poll_jitter) == (ABORT_CHECK_S, WAIT_JITTER)
    measured = mean_extra_gets(wait_s, latency_s, looks, monkeypatch)
    predicted = plat.polls_while_waiting(wait_s, looks=2 if looks else 0)
    assert measured == pytest.approx(predicted, abs=1.5)


@pytest.mark.parametrize("wait_s", [0.2, 3.0, 10.0, 30.0])
def test_the_model_counts_the_gets_under_a_budget_s_cap(wait_s, monkeypatch):
    """A plan of 1,000 concurrent workers: each pause up to 1 s (``cap_s``), the same count."""
    plat = aws_platform()
    measured = mean_extra_gets(wait_s, plat.storage_latency_s, True, monkeypatch, poll_cap=poll_cap_s(1_000))
    assert measured == pytest.approx(plat.polls_while_waiting(wait_s, cap_s=poll_cap_s(1_000)), abs=1.5)


def test_a_wait_polls_with_its_log_until_the_cap():
    """At AWS's 30 ms round trip: up to the cap (0.2 s of waiting) each GET comes after 1.2 times
    the wait so far, a 0.2 s wait 5 GETs as with the old loop (x1.6 from 5 to 20 ms); past it one
    GET per 70 ms (the old loop's 50 ms), and the looks' two GETs a little less than every second
    (a look waits for the first GET to end after its period)."""
    plat = aws_platform()
    assert plat.polls_while_waiting(0.2) == 5 and plat.polls_while_waiting(0.02) == 1
    later = plat.polls_while_waiting(10.0) - plat.polls_while_waiting(1.0)
    polls = 9 / (plat.storage_latency_s + WAIT_MAX_S)
    # the looks (at most one a second) take up to two round trips a second from the polls
    assert polls * (1 - 2 * plat.storage_latency_s / ABORT_CHECK_S) <= later <= polls + 2 * 9 / ABORT_CHECK_S
    assert Platform.polls_while_waiting(plat, 0.0) == 0.0
