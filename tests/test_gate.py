"""The iteration gate on an in-memory S3 (tests/memory_s3.py): when it stops a job, and how it
meters a capped one — once per gate even when retried, again for iterations a restarted window
re-runs — with every expected number written out by hand. Ctrl-C in Run.wait stops nothing."""

import json
import types

import pytest
from memory_s3 import MemoryS3

from stagecoach.core import keys
from stagecoach.core.events import GateEvent
from stagecoach.core.netem import Network
from stagecoach.core.records import CostTally, DatasetRef, JobSpec, StopRequest, TaskMetrics
from stagecoach.lambdas.channel import Channel, Pools
from stagecoach.lambdas.gate import gate, next_iteration_usd
from stagecoach.lambdas.timeouts import planned
from stagecoach.planner.plan import Plan

JOB = "gt-0123abcd"
GB_S, REQUEST, TRANSITION, PUT, GET = 0.0000166667, 0.20 / 1e6, 0.025 / 1000, 0.005 / 1000, 0.0004 / 1000
PRICES = {"gb_s": GB_S, "request": REQUEST, "transition": TRANSITION, "put": PUT, "get": GET, "as_of": "test"}
# 2 stages x 2 replicas, scatter-reduce: 2 forward, 4 backward, 4 sync tasks per iteration
PLAN = Plan(balance=[1, 1], replicas=2, micro_batches=1, global_batch=4, memory_mb=[1024, 2048])
# Gate, Go?, Advance; Forward Parallel + stage 0's Map + 2 items; Parallel; 2 x (Backward Map + 2); 2 x (Sync Map + 2);
# both phases beside their watchers (the phase's inner Parallel and Fail, the watcher's Task: 3 each)
TRANSITIONS_PER_ITERATION = 3 + 4 + 1 + 6 + 6 + 2 * 3


@pytest.fixture(autouse=True)
def fresh_container(monkeypatch):
    """Each test is a new container: the gate caches the job's spec per container. Its clock
    stands still, so every gate lasts exactly 10.4 ms (billed 11 ms)."""
    from stagecoach.lambdas import gate as gate_module
    from stagecoach.lambdas import timeouts as timeouts_module

    gate_module._SPECS.clear()
    gate_module._WARM.clear()
    timeouts_module._CACHE.clear()
    monkeypatch.setattr(gate_module, "time", types.SimpleNamespace(time=lambda: 1000.0))


def spec(max_cost=None, iterations=10):
    return JobSpec(
        job=JOB,
        name="gt",
        seed=0,
        iterations=iterations,
        global_batch=4,
        dtype="float32",
        layers=2,
        dataset=DatasetRef(id="d", n_train=4),
        plan=PLAN.to_dict(),
        created=0.0,
        max_cost_usd=max_cost,
        prices=PRICES,
        launch_requests={"puts": 10, "gets": 2},
    )


def channel(s3):
    return Channel(s3, "bucket", net=Network(None), pools=Pools())


def put_iteration(s3, t):
    """Every task of iteration t: 0.1005 s (billed 101 ms), 3 PUTs and 5 GETs each."""
    tasks = [("forward", 0, r) for r in range(2)] + [(p, s, i) for p in ("backward", "sync") for s in range(2) for i in range(2)]
    for phase, stage, index in tasks:
        m = TaskMetrics(
            phase=phase, t=t, stage=stage, index=index, start=0.0, end=0.1005, duration_s=0.1005,
            upload_s=0.0, download_s=0.0, transfer_s=0.0, wait_s=0.0, bytes_up=0, bytes_down=0, puts=3, gets=5,
            compute_s=0.1, container="c", container_started=0.0, invocation=1, cold=False,
            memory_mb=PLAN.memory_mb[stage], max_rss_mb=100.0,
        )  # fmt: skip
        s3.put_object(Bucket="bucket", Key=keys.metrics(JOB, t, phase, stage, index), Body=m.model_dump_json().encode())


# one iteration's tasks: forward 2 x 101 ms at 1 GB, backward and sync 2 x 101 ms at 1 GB + 2 at 2 GB each;
# its two phase watchers as the gate meters them (lambdas/gate.py watchers_usage): each phase's span
# (0.1005 s) and the 0.5 s grace at stage 0's 1 GB, billed 601 ms, an invocation, a PUT, a GET per task
ITERATION_USD = (
    (2 * 0.101 * 1 + 2 * (2 * 0.101 * 1 + 2 * 0.101 * 2)) * GB_S
    + 10 * REQUEST
    + 10 * (3 + 1) * PUT  # + each task's metrics object
    + 10 * 5 * GET
    + TRANSITIONS_PER_ITERATION * TRANSITION
    + 2 * (0.601 * GB_S + REQUEST + PUT)
    + 10 * GET
)


def ev(t, end=10, window_start=0, attempt="w0-a"):
    return GateEvent(phase="gate", job=JOB, bucket="bucket", t=t, end=end, window_start=window_start, attempt=attempt)


def tally(s3):
    return json.loads(s3.objects[keys.cost_tally(JOB)])


def run_gate(s3, e):
    return gate(e, channel(s3), 1000.0 - 0.0104, 1024)


def test_without_a_request_the_job_goes_on_and_nothing_is_metered():
    s3 = MemoryS3()
    s3.put_object(Bucket="bucket", Key=keys.job_spec(JOB), Body=spec().model_dump_json().encode())
    # nothing learnt yet: the plan's timeouts, and nothing for the phase watchers to expect
    assert run_gate(s3, ev(0)) == {"stop": False, "timeouts": {**planned(PLAN), "cold": 0}, "expect": {}}
    assert keys.cost_tally(JOB) not in s3.objects and keys.stopped(JOB) not in s3.objects


def test_a_stop_request_stops_before_the_iteration_and_records_the_version():
    s3 = MemoryS3()
    s3.put_object(Bucket="bucket", Key=keys.job_spec(JOB), Body=spec().model_dump_json().encode())
    req = StopRequest(reason="requested", time=1.0)
    s3.put_object(Bucket="bucket", Key=keys.stop_request(JOB), Body=req.model_dump_json().encode())
    # at the window's end the window just ends: the next window's first gate stops the job
    assert run_gate(s3, ev(10, end=10))["stop"] is False and keys.stopped(JOB) not in s3.objects
    assert run_gate(s3, ev(4, attempt="w0-b"))["stop"] is True
    record = json.loads(s3.objects[keys.stopped(JOB)])
    assert record["version"] == 4 and record["reason"] == "requested" and record["attempt"] == "w0-b"


def test_the_cap_meters_each_iteration_once_and_stops_past_it():
    s3 = MemoryS3()
    first = 10 * PUT + 2 * GET + (2 + 4 + 7) * TRANSITION  # launch; the job's and the window's fixed states (WindowType? among them)
    # the gates, 11 ms at 1 GB each: the first GETs the spec, the stop request and the (missing)
    # tally; a later one the stop request, the tally and the iteration's 10 metrics; each PUTs the tally
    gate0 = 0.011 * GB_S + REQUEST + 3 * GET + PUT
    gate = 0.011 * GB_S + REQUEST + 12 * GET + PUT
    # a third iteration would pass it: the gate before that iteration stops the job
    cap = first + gate0 + 2 * (ITERATION_USD + gate) + 1e-6
    s3.put_object(Bucket="bucket", Key=keys.job_spec(JOB), Body=spec(max_cost=cap).model_dump_json().encode())
    out = run_gate(s3, ev(0))
    assert out["stop"] is False and tally(s3)["usd"] == pytest.approx(first + gate0, rel=1e-9)
    put_iteration(s3, 0)
    assert run_gate(s3, ev(1))["stop"] is False  # one iteration in, the second's within the cap
    put_iteration(s3, 1)
    out = run_gate(s3, ev(2))
    after2 = tally(s3)
    assert after2["through"] == 2 and after2["usage"]["transitions"] == 13 + 2 * TRANSITIONS_PER_ITERATION
    assert after2["usage"]["invocations"] == 3 + 2 * (10 + 2)  # the gates, and each iteration's tasks and watchers
    assert after2["usd"] == pytest.approx(first + gate0 + 2 * (ITERATION_USD + gate), rel=1e-9)
    # within the cap, but the third iteration (estimated by the second: ITERATION_USD + gate) is not
    assert out["stop"] is True and out["usd"] <= cap < out["usd"] + ITERATION_USD + gate
    assert after2["usd"] - after2["previous_usd"] == pytest.approx(ITERATION_USD + gate, rel=1e-9)
    assert json.loads(s3.objects[keys.stop_request(JOB)])["reason"] == "max_cost"
    assert json.loads(s3.objects[keys.stopped(JOB)])["version"] == 2
    # the same gate again (a Lambda retry): counted once, the same answer
    assert run_gate(s3, ev(2))["stop"] is True and tally(s3) == after2


def test_a_restarted_window_is_metered_again_and_the_last_iteration_never_stops():
    s3 = MemoryS3()
    s3.put_object(Bucket="bucket", Key=keys.job_spec(JOB), Body=spec(max_cost=1.0, iterations=3).model_dump_json().encode())
    run_gate(s3, ev(0, end=3))
    put_iteration(s3, 0)
    run_gate(s3, ev(1, end=3))
    before = tally(s3)
    # the window failed in iteration 1 and restarts from 0: its gates at 0 and 1 count iteration 0 again
    run_gate(s3, ev(0, end=3, attempt="w0-retry"))
    run_gate(s3, ev(1, end=3, attempt="w0-retry"))
    again = tally(s3)
    # a window's fixed states and a window's worth of the job's (the restart path's, roughly), iteration 0's
    assert again["usage"]["transitions"] == before["usage"]["transitions"] + 4 + 7 + TRANSITIONS_PER_ITERATION
    assert again["usage"]["invocations"] == before["usage"]["invocations"] + 2 + 10 + 2
    # past the cap at the job's end: no stop request (nothing is left to stop)
    s3.put_object(Bucket="bucket", Key=keys.job_spec(JOB), Body=spec(max_cost=1e-9, iterations=3).model_dump_json().encode())
    from stagecoach.lambdas import gate as gate_module
    from stagecoach.lambdas import timeouts as timeouts_module

    gate_module._SPECS.clear()
    gate_module._WARM.clear()
    timeouts_module._CACHE.clear()  # a new container reads the new spec
    for t in (1, 2):
        put_iteration(s3, t)
    assert run_gate(s3, ev(3, end=3, attempt="w0-retry"))["stop"] is False
    assert keys.stop_request(JOB) not in s3.objects


def test_ctrl_c_in_wait_stops_nothing_and_prints_the_commands_on_aws(monkeypatch, capsys):
    from stagecoach.aws.backend import AwsBackend
    from stagecoach.run import Run

    aws = types.SimpleNamespace(stack="mystack", region="eu-west-1")
    backend = types.SimpleNamespace(job_commands=lambda job, arn: AwsBackend.job_commands(aws, job, arn))
    job = types.SimpleNamespace(iterations=10)
    arn = "arn:aws:states:eu-west-1:123456789012:execution:mystack-job:gt-0123abcd"
    run = Run(backend, job, PLAN, JOB, arn)
    stops = []
    monkeypatch.setattr(run, "status", lambda: "RUNNING")
    monkeypatch.setattr(run, "_fetch_metrics", lambda: None)
    monkeypatch.setattr(run, "stop", lambda: stops.append(1))

    def interrupt(_s):
        raise KeyboardInterrupt

    monkeypatch.setattr("stagecoach.run.time.sleep", interrupt)
    with pytest.raises(KeyboardInterrupt):
        run.wait(progress=False)
    out = capsys.readouterr().out
    assert not stops and "keeps running (nothing was stopped)" in out
    assert f"stagecoach stop {JOB} --stack mystack --region eu-west-1" in out
    assert f"stagecoach inspect {arn}" in out and f"stagecoach cleanup {JOB} --stack mystack --region eu-west-1" in out
    assert "stagecoach.attach('gt-0123abcd', backend='aws:mystack')" in out and "stagecoach resume gt-0123abcd --stack mystack" in out

    local = types.SimpleNamespace(job_commands=lambda job, arn: None)  # the embedded stack
    run.backend = local
    with pytest.raises(KeyboardInterrupt):
        run.wait(progress=False)
    assert "inside this process" in capsys.readouterr().out


def put_losses(s3, t, losses):
    """The last stage's backward task of each replica at iteration t, with its loss."""
    for r, loss in enumerate(losses):
        m = TaskMetrics(
            phase="backward", t=t, stage=1, index=r, start=0.0, end=0.1, duration_s=0.1,
            upload_s=0.0, download_s=0.0, transfer_s=0.0, wait_s=0.0, bytes_up=0, bytes_down=0, puts=3, gets=5,
            compute_s=0.1, container="c", container_started=0.0, invocation=1, cold=False,
            memory_mb=2048, max_rss_mb=100.0, loss=loss,
        )  # fmt: skip
        s3.put_object(Bucket="bucket", Key=keys.metrics(JOB, t, "backward", 1, r), Body=m.model_dump_json(exclude_none=True).encode())


def test_a_nonfinite_loss_stops_the_job_at_the_next_boundary_when_asked():
    s3 = MemoryS3()
    nan = float("nan")
    s3.put_object(Bucket="bucket", Key=keys.job_spec(JOB), Body=spec().model_dump_json().encode())
    put_losses(s3, 0, [1.0, nan])
    assert run_gate(s3, ev(1))["stop"] is False  # not asked: the job trains on
    assert keys.stop_request(JOB) not in s3.objects

    from stagecoach.lambdas import gate as gate_module
    from stagecoach.lambdas import timeouts as timeouts_module

    gate_module._SPECS.clear()
    gate_module._WARM.clear()
    timeouts_module._CACHE.clear()  # a new job (container) that asks for the stop
    asked = spec().model_copy(update={"stop_on_nonfinite_loss": True})
    s3.put_object(Bucket="bucket", Key=keys.job_spec(JOB), Body=asked.model_dump_json().encode())
    put_losses(s3, 0, [1.0, 1.2])
    assert run_gate(s3, ev(1))["stop"] is False
    put_losses(s3, 1, [1.0, nan])
    assert run_gate(s3, ev(2))["stop"] is True
    request = json.loads(s3.objects[keys.stop_request(JOB)])
    assert request["reason"] == "nonfinite_loss" and request["detail"] == "iteration 1's loss is nan on replica 1 of 2"
    record = json.loads(s3.objects[keys.stopped(JOB)])
    assert record["version"] == 2 and record["reason"] == "nonfinite_loss"


def test_a_nonfinite_loss_in_a_windows_last_iteration_stops_the_next_window():
    s3 = MemoryS3()
    asked = spec().model_copy(update={"stop_on_nonfinite_loss": True})
    s3.put_object(Bucket="bucket", Key=keys.job_spec(JOB), Body=asked.model_dump_json().encode())
    put_losses(s3, 4, [float("inf"), 1.0])
    # the window [0, 5) ends: its last gate finds the infinite loss and asks; the next window stops at once
    assert run_gate(s3, ev(5, end=5))["stop"] is False
    assert json.loads(s3.objects[keys.stop_request(JOB)])["detail"] == "iteration 4's loss is inf on replica 0 of 2"
    assert run_gate(s3, ev(5, end=10, window_start=5, attempt="w1-a"))["stop"] is True
    assert json.loads(s3.objects[keys.stopped(JOB)])["version"] == 5
    # resumed from version 5 (the request removed): its first gate looks at nothing before it
    del s3.objects[keys.stop_request(JOB)], s3.objects[keys.stopped(JOB)]
    assert run_gate(s3, ev(5, end=10, window_start=5, attempt="r1-a"))["stop"] is False
    # the job's last iteration: nothing is left to stop
    put_losses(s3, 9, [float("nan"), float("nan")])
    assert run_gate(s3, ev(10, end=10, window_start=5, attempt="r1-a"))["stop"] is False
    assert keys.stop_request(JOB) not in s3.objects


def test_a_window_attempt_that_keeps_state_warm_gets_roomier_timeouts_than_a_restarted_one():
    """Iteration 0's tasks took 0.1005 s: a warm attempt's Maps get ceil(10 x 0.1005 + 1) = 3 s (a
    slow task timed out there would restart the window: its state is in no other container), an
    attempt after a failed one (its abort marker exists; every version is stored) 2 s."""
    from stagecoach.lambdas import gate as gate_module

    s3 = MemoryS3()
    s3.put_object(
        Bucket="bucket",
        Key=keys.job_spec(JOB),
        Body=spec().model_copy(update={"warm_state": True, "window_length": 10}).model_dump_json().encode(),
    )
    put_iteration(s3, 0)
    assert set(run_gate(s3, ev(1, attempt="w0-first"))["timeouts"].values()) == {
        3,
        10,
    }  # every Map 3 s; a re-run 10 s more (no cold task seen)
    s3.put_object(Bucket="bucket", Key=keys.window_abort(JOB, "w0-first"), Body=b"{}")
    gate_module._SPECS.clear()
    assert set(run_gate(s3, ev(1, attempt="w0-second"))["timeouts"].values()) == {2, 10}


def test_a_warm_attempt_whose_every_stage_writes_through_gets_a_restarted_ones_timeouts():
    """Every stage's state is small and stored at every version (JobSpec.write_through): a slow
    task timed out there reloads it in its new container, the window goes on, so the warm attempt
    needs no roomier timeouts: ceil(3 x 0.1005 + 0.25) = 1, at least 2 s, as after a failed attempt. One stage
    that keeps its state only in memory brings the warm factor back (3 s)."""
    s3 = MemoryS3()
    warm = spec().model_copy(update={"warm_state": True, "window_length": 10, "write_through": [True, True]})
    s3.put_object(Bucket="bucket", Key=keys.job_spec(JOB), Body=warm.model_dump_json().encode())
    put_iteration(s3, 0)
    assert set(run_gate(s3, ev(1, attempt="w0-first"))["timeouts"].values()) == {2, 10}

    from stagecoach.lambdas import gate as gate_module

    gate_module._SPECS.clear()
    gate_module._WARM.clear()
    mixed = warm.model_copy(update={"write_through": [True, False]})
    s3.put_object(Bucket="bucket", Key=keys.job_spec(JOB), Body=mixed.model_dump_json().encode())
    assert set(run_gate(s3, ev(1, attempt="w0-first"))["timeouts"].values()) == {3, 10}


def test_the_cap_s_estimate_of_the_next_iteration():
    """By the increment a later gate metered (one iteration and the gate); at a window's first gate
    by the mean so far, which holds the launch and errs high; before any iteration, nothing."""
    window_first = ev(4, window_start=4)  # a window's first gate: its increment holds the window's fixed states
    later = ev(5, window_start=4)
    tally = CostTally(through=4, last_gate="w:4", usage={}, usd=0.010, previous_usd=0.004)
    assert next_iteration_usd(tally, window_first) == pytest.approx(0.010 / 4)
    tally = CostTally(through=5, last_gate="w:5", usage={}, usd=0.0125, previous_usd=0.010)
    assert next_iteration_usd(tally, later) == pytest.approx(0.0025)
    start = CostTally(through=0, last_gate="w:0", usage={}, usd=0.0004, previous_usd=0.0)
    assert next_iteration_usd(start, ev(0)) == 0.0
