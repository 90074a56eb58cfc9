"""A wait that recurs every iteration (a hand-off, an exchanged chunk: keys under ``iter/{t}/``)
sleeps most of what it took before and then polls as a fresh wait (lambdas/channel.py
WAIT_AHEAD): far fewer GETs, the object noticed no later; a wait that comes early still returns
and the next one polls from its start again; the window's abort marker and a failed task are
still noticed on time; the performance model counts the GETs that are left. Checked on the
channel's real wait loop with a simulated clock (a GET takes its round trip of it)."""

from __future__ import annotations

import random
import threading
import time

import pytest
from sim_clock import Clock

from stagecoach.core import keys
from stagecoach.core.netem import Network
from stagecoach.lambdas import channel as channel_module
from stagecoach.lambdas.channel import (
    ABORT_CHECK_S,
    WAIT_AHEAD,
    WAIT_SLEEP_STEP_S,
    Channel,
    ObjectWaitTimeout,
    WindowAborted,
    expected_wait_s,
    remember_wait,
    wait_pattern,
)
from stagecoach.planner.model.platforms import aws_platform

AWS_ROUND_TRIP_S = 0.03


class Landing:
    """S3 where each key lands at its own time of the simulated clock (``at``), each GET taking
    ``latency_s`` of it; GETs counted per key."""

    class exceptions:  # noqa: N801 - botocore's attribute name
        class NoSuchKey(Exception):
            pass

    def __init__(self, clock: Clock, latency_s: float = AWS_ROUND_TRIP_S) -> None:
        self.clock, self.latency_s = clock, latency_s
        self.at: dict[str, float] = {}
        self.gets: dict[str, int] = {}

    def get_object(self, Key: str, **_: object) -> dict:  # noqa: N803 - boto3's argument name
        self.gets[Key] = self.gets.get(Key, 0) + 1
        there = self.clock.now >= self.at.get(Key, float("inf"))
        self.clock.now += self.latency_s
        if not there:
            raise self.exceptions.NoSuchKey()

        class Body:
            @staticmethod
            def read() -> bytes:
                return b"x"

        return {"Body": Body()}


@pytest.fixture
def clock(monkeypatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(channel_module.time, "time", c.time)
    monkeypatch.setattr(channel_module.time, "sleep", c.sleep)
    monkeypatch.setattr(channel_module, "_WAITS", {})  # a fresh process: nothing learnt yet
    random.seed(3)
    return c


def channel(s3: Landing, phase: str = "forward", attempt: bool = True) -> Channel:
    ch = Channel(s3, "b", net=Network(None))
    ch.waits_of = phase
    if attempt:
        ch.abort_key, ch.attempt = "abort", "w0-a"
    return ch


def first_wait(key: str, phase: str) -> str:
    """The memory's name for a task's first wait of ``key``'s pattern (``Channel._nth``)."""
    return f"{wait_pattern(key, phase)}#0"


def wait_at(s3: Landing, clock: Clock, key: str, wait_s: float, phase: str = "forward") -> tuple[int, float]:
    """Wait for ``key`` landing ``wait_s`` after the wait starts: (its 404s, how long after the
    landing the wait returned)."""
    s3.at[key] = clock.now + wait_s
    before = s3.gets.get(key, 0)
    channel(s3, phase).wait_bytes(key, deadline=clock.now + 1e4, producer="metrics")
    return s3.gets[key] - before - 1, clock.now - s3.at[key]


def iterations(s3: Landing, clock: Clock, wait_s: float, n: int, t0: int = 0, replica: int = 0) -> list[tuple[int, float]]:
    return [wait_at(s3, clock, keys.act("j", t, 1, replica, 0), wait_s) for t in range(t0, t0 + n)]


@pytest.mark.parametrize("wait_s", [0.1, 0.4, 2.6])
def test_a_recurring_wait_polls_at_most_half_as_often_and_is_noticed_no_later(clock, wait_s):
    """The first wait polls from its start; from the second iteration on, the same wait GETs at
    most half as often (about a third, at a 30 ms round trip), and returns as soon after the
    landing (within 10 ms on average)."""
    s3 = Landing(clock)
    first = iterations(s3, clock, wait_s, 1)
    learnt = iterations(s3, clock, wait_s, 40, t0=1)
    cold = [wait_at(s3, clock, f"jobs/j/once/{i}", wait_s) for i in range(40)]  # not under iter/: never learnt
    mean = lambda xs, i: sum(x[i] for x in xs) / len(xs)  # noqa: E731
    assert first[0][0] == pytest.approx(mean(cold, 0), abs=2)
    assert mean(learnt, 0) <= mean(cold, 0) / 2
    assert mean(learnt, 1) <= mean(cold, 1) + 0.01


def test_a_wait_that_comes_early_still_returns_and_the_next_polls_from_its_start(clock):
    """Learnt at 2 s, a wait whose object lands at once returns when its sleep ends (at most
    WAIT_AHEAD x 2 s late, never at the deadline); since the object was there at its first GET,
    the pattern is forgotten and the next wait, 0.3 s, polls from its start (it is not late again),
    and the one after that learns the 0.3 s."""
    s3 = Landing(clock)
    iterations(s3, clock, 2.0, 3)
    pattern = first_wait(keys.act("j", 0, 1, 0, 0), "forward")
    assert expected_wait_s(pattern) == pytest.approx(2.0, abs=0.08)
    gets, late = wait_at(s3, clock, keys.act("j", 3, 1, 0, 0), 0.0)
    assert gets == 0 and 0 < late <= WAIT_AHEAD * 2.0 + AWS_ROUND_TRIP_S + 0.01
    assert expected_wait_s(pattern) == 0.0
    gets, late = wait_at(s3, clock, keys.act("j", 4, 1, 0, 0), 0.3)
    assert gets >= 3 and late < 0.1  # polled from its start, as a first wait does
    assert expected_wait_s(pattern) == pytest.approx(0.3, abs=0.06)


def test_another_replica_reuses_the_wait_and_the_backward_task_keeps_its_own(clock):
    """A container serving replica 5 next iteration knows the wait it made for replica 2; the
    backward task's re-read of the same input (there at once) is another wait and does not make
    the forward's shorter; a key outside ``iter/`` is never learnt."""
    s3 = Landing(clock)
    iterations(s3, clock, 1.0, 2, replica=2)
    gets, _ = iterations(s3, clock, 1.0, 1, t0=2, replica=5)[0]
    assert gets <= 8  # a fresh wait of 1 s polls ~17 times at a 30 ms round trip
    for t in range(3):
        wait_at(s3, clock, keys.act("j", t, 1, 2, 0), 0.0, phase="backward")
    assert expected_wait_s(first_wait(keys.act("j", 9, 1, 7, 0), "forward")) == pytest.approx(1.0, abs=0.08)
    assert expected_wait_s(first_wait(keys.act("j", 9, 1, 7, 0), "backward")) == 0.0
    assert wait_pattern(keys.plan("j"), "forward") is None


def test_a_sleeping_wait_still_looks_for_the_abort_marker_every_second(clock):
    """Learnt at 5 s, a wait sleeps 4 s without a GET of its object, but it still GETs the abort
    marker every ABORT_CHECK_S: a marker written at 1.5 s stops it at the look at 2 s."""
    s3 = Landing(clock)
    iterations(s3, clock, 5.0, 1)
    key = keys.act("j", 1, 1, 0, 0)
    start, looked = clock.now, s3.gets["abort"]
    s3.at["abort"] = start + 1.5
    with pytest.raises(WindowAborted):
        channel(s3).wait_bytes(key, deadline=start + 1e4, producer="metrics")
    assert clock.now - start == pytest.approx(2 * ABORT_CHECK_S, abs=3 * AWS_ROUND_TRIP_S)
    assert s3.gets.get(key, 0) == 0 and s3.gets["abort"] - looked == 2


def test_a_sleeping_wait_ends_at_its_deadline(clock):
    """A deadline inside the learnt sleep ends the wait there, after its last look, not after the sleep."""
    s3 = Landing(clock)
    iterations(s3, clock, 5.0, 1)
    start = clock.now
    with pytest.raises(ObjectWaitTimeout):
        channel(s3).wait_bytes(keys.act("j", 1, 1, 0, 0), deadline=start + 0.5, producer="metrics")
    assert clock.now - start < 0.5 + 4 * AWS_ROUND_TRIP_S


def test_a_failed_task_stops_a_sleeping_wait_at_once():
    """In real time: a wait learnt at 3 s sleeps 2.4 s; the task failing elsewhere (settle(failed))
    stops it within a sleep step, not at the sleep's end."""
    channel_module._WAITS.clear()
    key = keys.act("j-real", 7, 1, 0, 0)
    remember_wait(first_wait(key, "forward"), 3.0)
    s3 = Landing(Clock())  # its own clock: GETs only, nothing lands
    ch = channel(s3)
    fut = ch.submit_wait(key, time.time() + 60, "metrics")
    time.sleep(0.2)
    t0 = time.perf_counter()
    ch.settle(failed=True)
    assert time.perf_counter() - t0 < WAIT_SLEEP_STEP_S + 0.2
    with pytest.raises(ObjectWaitTimeout):
        fut.result()
    assert s3.gets.get(key, 0) == 0
    channel_module._WAITS.clear()


@pytest.mark.parametrize("latency_s", [0.0, AWS_ROUND_TRIP_S])
@pytest.mark.parametrize("wait_s", [0.01, 0.05, 0.1, 0.2, 0.37, 1.0, 1.7, 3.0, 10.0, 30.0])
def test_the_model_counts_the_gets_of_a_learnt_wait(clock, wait_s, latency_s):
    """Platform.polls_while_waiting(learnt=True) is what the channel's loop makes once the wait is
    learnt (the mean of 60 iterations after the first, its looks for the abort marker and the
    producer's metrics included): within 1.5 GETs, from 10 ms to 30 s, on the local stack's
    near-zero round trip and on AWS's 30 ms."""
    s3 = Landing(clock, latency_s)
    iterations(s3, clock, wait_s, 1)
    looks_before = s3.gets.get("abort", 0) + s3.gets.get("metrics", 0)
    learnt = iterations(s3, clock, wait_s, 60, t0=1)
    looks = s3.gets.get("abort", 0) + s3.gets.get("metrics", 0) - looks_before
    measured = (sum(g for g, _ in learnt) + looks) / len(learnt)
    plat = aws_platform(storage_latency_s=latency_s)
    assert plat.poll_ahead == WAIT_AHEAD
    assert measured == pytest.approx(plat.polls_while_waiting(wait_s, looks=2, learnt=True), abs=1.5)
    assert plat.polls_while_waiting(wait_s, looks=2, learnt=True) <= plat.polls_while_waiting(wait_s, looks=2)


def test_waits_of_several_threads_share_what_they_learnt():
    """The memory is the process's: a wait learnt by one task's thread serves the next task's."""
    channel_module._WAITS.clear()
    pattern = first_wait(keys.grad("j", 0, 2, 0, 1), "backward")
    threads = [threading.Thread(target=remember_wait, args=(pattern, 0.5 + i / 10)) for i in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert expected_wait_s(pattern) >= 0.5 and len(channel_module._WAITS[pattern]) == 3
    channel_module._WAITS.clear()


def test_the_waits_of_one_pattern_in_a_task_are_learnt_each_on_its_own(clock):
    """A backward task reads two chunks of each of two peers' exchange objects (one pattern: the
    peer's replica left out); the first chunk of each object waits 0.5 s, the second finds it there:
    the waits are told apart by their order in the task, so the second's finding does not make the
    first forget, and every iteration after the first polls less. A version's objects (the updated
    parameters, ``params/v{n}``) recur like an iteration's; the window's abort marker does not."""
    s3 = Landing(clock)
    polls = []
    for t in range(6):
        ch = channel(s3, "backward")
        objects = [keys.gsend("j", t, 2, src, 0) for src in (1, 2)]
        for key in objects:
            s3.at[key] = clock.now + 0.5
        before = sum(s3.gets.get(k, 0) for k in objects)
        for key in objects:
            ch.wait_bytes(key, deadline=clock.now + 1e4, byte_range=(0, 4))
            ch.wait_bytes(key, deadline=clock.now + 1e4, byte_range=(4, 8))
        polls.append(sum(s3.gets.get(k, 0) for k in objects) - before - 4)
    assert polls[0] >= 8 and max(polls[1:]) <= polls[0] / 2
    assert wait_pattern(keys.params("j", 7, 1, 0, 2)) == ":jobs/j/params/v*/s1/k0/c2"
    assert wait_pattern(keys.window_abort("j", "w0-a")) is None
