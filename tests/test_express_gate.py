"""The iteration gate's cost cap for a job whose windows run as EXPRESS (lambdas/gate.py): each
window is priced as Express bills it (a request, and its duration in 100 ms steps at its memory in
64 MB steps, core/cost.py ``express_gb_s``), not by the Standard transitions its states would be,
so ``--max-cost`` does not stop an Express job early. In-memory S3 (tests/memory_s3.py), a clock
that advances 1.234 s per gate, every expected number written out by hand."""

import json
import types

import pytest
from memory_s3 import MemoryS3
from test_gate import GB_S, GET, JOB, PRICES, PUT, REQUEST, TRANSITION, channel, ev, put_iteration, spec

from stagecoach.core import keys
from stagecoach.core.cost import express_billed_s, express_gb_s
from stagecoach.lambdas import gate as gate_module
from stagecoach.lambdas import timeouts as timeouts_module
from stagecoach.lambdas.gate import gate

EXPRESS_REQUEST, EXPRESS_GB_S = 1.00 / 1e6, 0.00001667
EXPRESS_PRICES = {**PRICES, "express_request": EXPRESS_REQUEST, "express_gb_s": EXPRESS_GB_S}
# one iteration's tasks and phase watchers, as tests/test_gate.py's ITERATION_USD, without its 26
# Standard transitions
TASKS_USD = (2 * 0.101 + 2 * (2 * 0.101 + 2 * 0.101 * 2)) * GB_S + 10 * REQUEST + 40 * PUT + 50 * GET
TASKS_USD += 2 * (0.601 * GB_S + REQUEST + PUT) + 10 * GET


class Clock:
    """The gate's clock: 1.234 s further at every reading after the first (an iteration's time)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def time(self) -> float:
        now, self.now = self.now, self.now + 1.234
        return now


@pytest.fixture(autouse=True)
def fresh_container(monkeypatch):
    gate_module._SPECS.clear()
    gate_module._WARM.clear()
    timeouts_module._CACHE.clear()
    clock = Clock()
    monkeypatch.setattr(gate_module, "time", types.SimpleNamespace(time=clock.time))
    return clock


def express_spec(max_cost, memory_mb=100, iterations=10):
    return spec(max_cost=max_cost, iterations=iterations).model_copy(update={"express_memory_mb": memory_mb, "prices": EXPRESS_PRICES})


def run(s3, e, clock):
    return gate(e, channel(s3), clock.now - 0.0104, 1024)  # each gate itself: 10.4 ms before its reading


def test_an_express_window_is_metered_per_request_and_duration_not_per_transition(fresh_container):
    s3 = MemoryS3()
    s3.put_object(Bucket="bucket", Key=keys.job_spec(JOB), Body=express_spec(max_cost=1.0).model_dump_json().encode())
    run(s3, ev(0), fresh_container)
    first = json.loads(s3.objects[keys.cost_tally(JOB)])
    # the job's fixed states and its 8 per Express window; one Express request; nothing of the window's own states
    assert first["usage"]["transitions"] == 2 + 8 and first["usage"]["express_requests"] == 1
    for t in (1, 2, 3):
        put_iteration(s3, t - 1)
        run(s3, ev(t), fresh_container)
    after = json.loads(s3.objects[keys.cost_tally(JOB)])
    assert after["usage"]["transitions"] == 2 + 8  # 3 iterations: still no Standard transition
    assert after["usage"]["express_requests"] == 1
    # 3 x 1.234 s since the window's first gate: 3.702 s billed as 3.8 s, at 100 MB billed as 128 MB
    assert after["usage"]["express_gb_s"] == pytest.approx(3.8 * 128 / 1024, rel=1e-12)
    assert after["usage"]["express_gb_s"] == pytest.approx(express_gb_s(3.702, 100), rel=1e-12)
    # the gate's increment for an iteration: its tasks, the gate, 1.2 or 1.3 s more of the window; no transition
    step = after["usd"] - after["previous_usd"]
    gate_usd = 0.011 * GB_S + REQUEST + 12 * GET + PUT
    assert step == pytest.approx(TASKS_USD + gate_usd + (3.8 - 2.5) * 128 / 1024 * EXPRESS_GB_S, rel=1e-9)
    # a new window (the next attempt's first gate) is one more request and starts its own duration
    put_iteration(s3, 3)
    run(s3, ev(4, window_start=4, attempt="w1-a"), fresh_container)
    nxt = json.loads(s3.objects[keys.cost_tally(JOB)])
    assert nxt["usage"]["express_requests"] == 2 and nxt["usage"]["transitions"] == 2 + 8 + 8
    assert nxt["window_gb_s"] == 0.0 and nxt["usage"]["express_gb_s"] == after["usage"]["express_gb_s"]


def test_the_cap_does_not_stop_an_express_job_at_what_standard_would_have_cost(fresh_container):
    """A cap that the job's Express cost fits but its Standard transitions would not: the job runs
    all 4 iterations (before the fix, the gate stopped it after 1)."""
    s3 = MemoryS3()
    launch = 10 * PUT + 2 * GET + (2 + 8) * TRANSITION + EXPRESS_REQUEST
    gate_usd = 0.011 * GB_S + REQUEST + 12 * GET + PUT
    express_cost = express_gb_s(5 * 1.234, 64) * EXPRESS_GB_S
    cap = launch + 5 * gate_usd + 4 * TASKS_USD + express_cost + 1e-7
    standard_would = 4 * 26 * TRANSITION  # the window's states, were they billed
    assert standard_would > 1e-6 + 1e-7  # well past the cap's margin
    s3.put_object(
        Bucket="bucket", Key=keys.job_spec(JOB), Body=express_spec(max_cost=cap, memory_mb=64, iterations=4).model_dump_json().encode()
    )
    assert run(s3, ev(0, end=4), fresh_container)["stop"] is False
    for t in (1, 2, 3):
        put_iteration(s3, t - 1)
        assert run(s3, ev(t, end=4), fresh_container)["stop"] is False, t
    assert keys.stop_request(JOB) not in s3.objects


def test_express_billing_steps():
    assert [express_billed_s(s) for s in (0.0, 0.05, 0.1, 0.1000000001, 1.23, 29.99)] == [0.0, 0.1, 0.1, 0.1, 1.3, 30.0]
    assert express_gb_s(1.0, 64) == 64 / 1024 and express_gb_s(1.0, 65) == 128 / 1024
