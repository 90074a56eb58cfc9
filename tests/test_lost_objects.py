"""A lost hand-off object is recognised about a second after its producer finished, not at the
consumer's Task timeout.

A task writes its metrics only after all its uploads have landed (lambdas/handler.py), naming the
window attempt that ran it. A consumer waiting for an activation or an input gradient looks for its
producer's metrics at the abort marker's cadence (lambdas/channel.py ABORT_CHECK_S): metrics of its
own attempt and still no object means the object is lost (ObjectLost), and the window runs the
iteration again at once (planner/emit/asl.py REDO_ERRORS); an earlier attempt's metrics say nothing
about this attempt's objects.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import uuid
from concurrent.futures import Future
from typing import Any

import pytest
import torch
from helpers import recovery_job, same_parameters, task_errors, window_statuses
from safetensors.torch import save as st_save

from stagecoach.core import keys
from stagecoach.core.netem import Network
from stagecoach.core.records import TaskMetrics
from stagecoach.lambdas.channel import ABORT_CHECK_S, Channel, ObjectLost, ObjectWaitTimeout, Pools
from stagecoach.lambdas.stageio import ChainIO, KeyedIO
from stagecoach.local.backend import LocalBackend
from stagecoach.planner.profile.flows import Route, Transfer

ATTEMPT = "w0-1111"
EARLIER = "w0-0000"  # an earlier attempt at the same window, which ran the same iteration


def task_metrics(phase: str, t: int, stage: int, index: int, attempt: str) -> TaskMetrics:
    """A finished task's record, as the handler writes it."""
    now = time.time()
    return TaskMetrics(
        phase=phase,
        t=t,
        stage=stage,
        index=index,
        start=now - 1.0,
        end=now,
        duration_s=1.0,
        upload_s=0.1,
        download_s=0.1,
        transfer_s=0.2,
        wait_s=0.0,
        bytes_up=100,
        bytes_down=100,
        puts=2,
        gets=2,
        compute_s=0.8,
        container="c",
        container_started=now - 5.0,
        invocation=1,
        cold=True,
        memory_mb=1024,
        max_rss_mb=300.0,
        attempt=attempt,
    )


class Hand:
    """One consumer's view of the local stack's S3: a job of its own, a channel of the attempt."""

    def __init__(self, backend: Any) -> None:
        self.s3, self.bucket = backend.clients.s3, backend.resources.bucket
        self.job = f"lost-{uuid.uuid4().hex[:8]}"
        self.key = keys.act(self.job, 1, 0, 0, 0)
        self.producer = keys.metrics(self.job, 1, "forward", 0, 0)

    def channel(self, s3: Any = None) -> Channel:
        return Channel(s3 or self.s3, self.bucket, net=Network(None), pools=Pools(), attempt=ATTEMPT)

    def finished(self, attempt: str) -> None:
        body = task_metrics("forward", 1, 0, 0, attempt).model_dump_json(exclude_none=True).encode()
        self.s3.put_object(Bucket=self.bucket, Key=self.producer, Body=body)


@pytest.fixture
def hand(backend: Any) -> Hand:
    return Hand(backend)


def test_an_object_missing_after_its_producer_finished_in_this_attempt_is_lost_within_seconds(hand):
    hand.finished(ATTEMPT)
    t0 = time.time()
    with pytest.raises(ObjectLost) as e:
        hand.channel().wait_bytes(hand.key, deadline=t0 + 30.0, producer=hand.producer)
    assert time.time() - t0 < 2 * ABORT_CHECK_S + 0.5, "recognised at the first check, not at the deadline"
    assert hand.key in str(e.value) and hand.producer in str(e.value)


def test_a_deadline_shorter_than_the_check_period_still_tells_a_lost_object_from_a_late_one(hand):
    """A learnt Task timeout (lambdas/timeouts.py) may leave a consumer less than a second: it
    looks once more at its deadline, so a lost object fails the window at once (ObjectLost) and is
    not waited for again by the Task's Retry of ObjectWaitTimeout (planner/emit/asl.py)."""
    hand.finished(ATTEMPT)
    t0 = time.time()
    with pytest.raises(ObjectLost):
        hand.channel().wait_bytes(hand.key, deadline=t0 + 0.4 * ABORT_CHECK_S, producer=hand.producer)
    assert time.time() - t0 < ABORT_CHECK_S


def test_an_earlier_attempt_s_metrics_or_unreadable_ones_keep_the_consumer_waiting(hand):
    """The earlier attempt's task wrote the object and its metrics; this attempt's has not run yet
    (or its object was deleted with the iteration): wait, as for any object not yet written."""
    hand.finished(EARLIER)
    t0 = time.time()
    with pytest.raises(ObjectWaitTimeout):
        hand.channel().wait_bytes(hand.key, deadline=t0 + 2.5 * ABORT_CHECK_S, producer=hand.producer)
    assert time.time() - t0 >= 2.0 * ABORT_CHECK_S, "waited until the deadline"
    hand.s3.put_object(Bucket=hand.bucket, Key=hand.producer, Body=b'{"attempt": "w0-1111", "phase"')
    with pytest.raises(ObjectWaitTimeout):
        hand.channel().wait_bytes(hand.key, deadline=time.time() + 2.5 * ABORT_CHECK_S, producer=hand.producer)


def test_a_channel_without_an_attempt_or_a_wait_without_a_producer_never_calls_an_object_lost(hand):
    hand.finished("")  # a task run outside a window execution (no attempt): it proves nothing
    bare = Channel(hand.s3, hand.bucket, net=Network(None), pools=Pools())
    with pytest.raises(ObjectWaitTimeout):
        bare.wait_bytes(hand.key, deadline=time.time() + 1.5 * ABORT_CHECK_S, producer=hand.producer)
    hand.finished(ATTEMPT)
    with pytest.raises(ObjectWaitTimeout):
        hand.channel().wait_bytes(hand.key, deadline=time.time() + 1.5 * ABORT_CHECK_S)


def test_an_object_that_appears_is_returned(hand):
    body = st_save({"x": torch.arange(4.0)})
    later = threading.Timer(1.5 * ABORT_CHECK_S, lambda: hand.s3.put_object(Bucket=hand.bucket, Key=hand.key, Body=body))
    later.start()
    try:
        got = hand.channel().wait_bytes(hand.key, deadline=time.time() + 30.0, producer=hand.producer)
    finally:
        later.join()
    assert got == body


class _LandsBeforeTheMetricsAreRead:
    """The race the second GET rules out: the producer's object and then its metrics land between
    the consumer's poll of the object and its read of the metrics."""

    def __init__(self, hand: Hand, body: bytes) -> None:
        self.hand, self.body, self.exceptions = hand, body, hand.s3.exceptions

    def get_object(self, **kw: Any) -> Any:
        if kw["Key"] == self.hand.producer:
            self.hand.s3.put_object(Bucket=self.hand.bucket, Key=self.hand.key, Body=self.body)
            self.hand.finished(ATTEMPT)
        return self.hand.s3.get_object(**kw)


def test_an_object_that_lands_just_before_its_producer_s_metrics_are_read_is_returned(hand):
    body = st_save({"x": torch.arange(3.0)})
    ch = hand.channel(_LandsBeforeTheMetricsAreRead(hand, body))
    assert ch.wait_bytes(hand.key, deadline=time.time() + 30.0, producer=hand.producer) == body


# -- which task writes which hand-off (lambdas/phases.py) --------------------------------------------
class _Recorder:
    """A channel that answers every wait at once and notes which producer it was given."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors
        self.waits: list[tuple[str, str | None]] = []

    def submit_wait(self, key: str, deadline: float, producer: str | None = None) -> Future[dict[str, torch.Tensor]]:
        self.waits.append((key, producer))
        f: Future[dict[str, torch.Tensor]] = Future()
        f.set_result(self.tensors)
        return f

    def wait_tensors(self, key: str, deadline: float, producer: str | None = None) -> dict[str, torch.Tensor]:
        return self.submit_wait(key, deadline, producer).result()


def test_an_activation_is_written_by_the_forward_task_and_an_input_gradient_by_the_backward_task():
    job, t, r = "j", 3, 1
    ch = _Recorder({"x": torch.ones(2), "g": torch.ones(2)})
    io = ChainIO(job, 1, last=False)
    io.receive_later(ch, t, r, 0, 0.0)()
    io.output_grads(ch, t, r, 0, torch.ones(2, requires_grad=True), 0.0)
    assert ch.waits == [
        (keys.act(job, t, 0, r, 0), keys.metrics(job, t, "forward", 0, r)),
        (keys.grad(job, t, 2, r, 0), keys.metrics(job, t, "backward", 2, r)),
    ]
    ChainIO(job, 1, last=False, space="eval/").receive_later(ch, t, r, 1, 0.0)()
    assert ch.waits[-1] == (keys.act(job, t, 0, r, 1, space="eval/"), None), "an evaluate task's hand-off: no producer known"

    route = Route(
        inputs=(Transfer(0, (2,), ("a",), ("a",)), Transfer(1, (2, 3), ("b",), ("b",))),
        outputs=(Transfer(2, (3, 4), ("c",), ("c",)),),
    )
    ch = _Recorder({"a": torch.ones(2), "b": torch.ones(2), "c": torch.ones(2)})
    keyed = KeyedIO(job, 2, last=False, route=route)
    keyed.receive_later(ch, t, r, 0, 0.0)()
    keyed.output_grads(ch, t, r, 0, {"c": torch.ones(2, requires_grad=True)}, 0.0)
    assert [p for _, p in ch.waits] == [
        keys.metrics(job, t, "forward", 0, r),
        keys.metrics(job, t, "forward", 1, r),
        keys.metrics(job, t, "backward", 3, r),
        keys.metrics(job, t, "backward", 4, r),
    ]
    KeyedIO(job, 2, last=False, route=route, space="eval/").receive_later(ch, t, r, 0, 0.0)()
    assert [p for _, p in ch.waits[-2:]] == [None, None]


# -- on the stack ----------------------------------------------------------------------------------------
TIMEOUT_S = 60  # what a consumer of a lost object waited before ObjectLost


def _run(backend: Any, name: str) -> Any:
    job = dataclasses.replace(recovery_job(name), iterations=3)
    r = job.run(stages=2, replicas=2, micro_batches=2, timeout_s=TIMEOUT_S, backend=backend)
    r.wait(progress=False, poll_s=0.2, timeout_s=900)
    return r


def test_a_lost_activation_is_recognised_within_seconds_and_its_iteration_runs_again_bit_identically(backend):
    """Stage 0's forward task for replica 0 at t = 0 succeeds and its first activation is then
    deleted: stage 1's backward task finds stage 0's metrics of its own attempt without the object
    and fails with ObjectLost about a second later, instead of waiting out its 60 s Task timeout
    (at t = 0 the plan's: the gate learns shorter ones from the tasks' metrics only later,
    lambdas/timeouts.py). The window runs iteration 0's phases again (Redo, planner/emit/asl.py
    REDO_ERRORS) under a new attempt name, in the same execution: no window restart."""
    faulty = LocalBackend(faults={"once": [{"kind": "delete", "phase": "forward", "t": 0, "stage": 0, "replica": 0}]})
    try:
        r = _run(faulty, "lost-fast")
        errors = task_errors(r)
        assert "ObjectLost" in errors and "ObjectWaitTimeout" not in errors, errors
        assert errors.count("ObjectLost") == 1, "not retried by the Task's Retry: the object does not come back"
        assert window_statuses(r) == ["SUCCEEDED"]
        history = r.history(execution_arn=r.window_executions()[0])
        redo = [e for e in history if e["type"] == "PassStateEntered" and e["stateEnteredEventDetails"]["name"] == "Redo"]
        forwards = [e for e in history if e["type"] == "ParallelStateEntered" and e["stateEnteredEventDetails"]["name"] == "Forward"]
        assert len(redo) == 1 and len(forwards) == 3 + 1, "iterations 0, 1, 2 and iteration 0 again"
        lost = next(e for e in history if (e.get("taskFailedEventDetails") or {}).get("error") == "ObjectLost")
        started = next(e for e in history if e["type"] == "MapStateEntered")
        took = (lost["timestamp"] - started["timestamp"]).total_seconds()
        assert took < 20 < TIMEOUT_S, f"the lost object was recognised {took:.1f} s into the iteration"
        assert same_parameters(r.trained_model(), _run(backend, "lost-fast-clean").trained_model())
    finally:
        faulty.stack.close()
