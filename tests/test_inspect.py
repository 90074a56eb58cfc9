"""`stagecoach inspect`: failed tasks traced from a history, the time accounting, the plots, and a
real run on the local stack kept alive by `stagecoach local start`."""

import json
import os
from datetime import datetime, timezone

import pytest
from click.testing import CliRunner

from stagecoach.inspect_run import failed_tasks, iteration_breakdown, phase_timings, plot_breakdown, plot_gantt

PNG = b"\x89PNG\r\n\x1a\n"


def _ev(i, typ, prev, **details):
    e = {"id": i, "previousEventId": prev, "type": typ, "timestamp": datetime(2025, 1, 1, tzinfo=timezone.utc)}
    e.update(details)
    return e


def _scheduled(i, prev, phase, stage, replica, t):
    params = {"FunctionName": f"sc-j-s{stage}", "Payload": {"phase": phase, "job": "j", "bucket": "b", "t": t,
                                                              "window_start": 0, "stage": stage, "replica": replica}}
    return _ev(i, "TaskScheduled", prev, taskScheduledEventDetails={
        "resourceType": "lambda", "resource": "invoke", "region": "us-east-1", "parameters": json.dumps(params)})


def test_failed_tasks_are_traced_to_their_worker():
    """Step Functions' history schema: failure -> TaskStarted -> TaskScheduled (parameters) -> TaskStateEntered."""
    oom = json.dumps({"errorType": "Runtime.OutOfMemory", "errorMessage": "RequestId: x Error: Runtime exited with error: signal: killed"})
    events = [
        _ev(1, "ExecutionStarted", 0),
        _ev(2, "TaskStateEntered", 1, stateEnteredEventDetails={"name": "BackwardTask"}),
        _scheduled(3, 2, "backward", 1, 0, 7),
        _ev(4, "TaskStarted", 3),
        _ev(5, "TaskFailed", 4, taskFailedEventDetails={"error": "Lambda.ServiceException", "cause": "throttled"}),
        _scheduled(6, 5, "backward", 1, 0, 7),  # the retry
        _ev(7, "TaskStarted", 6),
        _ev(8, "TaskSucceeded", 7, taskSucceededEventDetails={"output": "{}"}),
        _ev(9, "TaskStateEntered", 1, stateEnteredEventDetails={"name": "BackwardTask"}),
        _scheduled(10, 9, "backward", 2, 1, 7),
        _ev(11, "TaskStarted", 10),
        _ev(12, "TaskFailed", 11, taskFailedEventDetails={"error": "Runtime.OutOfMemory", "cause": oom}),
        _ev(13, "ExecutionFailed", 12, executionFailedEventDetails={"error": "Runtime.OutOfMemory"}),
    ]
    got = failed_tasks(events, "arn:w")
    assert [(f.phase, f.stage, f.index, f.t, f.error, f.retried) for f in got] == [
        ("backward", 1, 0, 7, "Lambda.ServiceException", True),
        ("backward", 2, 1, 7, "Runtime.OutOfMemory", False),
    ]
    assert got[1].state == "BackwardTask" and got[1].function == "sc-j-s2"
    assert got[1].cause.startswith("Runtime.OutOfMemory: RequestId: x")


def _metrics(iterations=4, gap=0.7):
    out = []
    for t in range(iterations):
        base = 100.0 + t * 5.0
        for phase, off, dur in (("forward", 0.0, 1.0), ("backward", 1.0 + gap, 1.5), ("sync", 2.5 + 2 * gap, 0.5)):
            for s in range(2):
                for i in range(2):
                    d = dur + 0.1 * i
                    m = {"phase": phase, "t": t, "stage": s, "index": i, "start": base + off, "end": base + off + d,
                         "duration_s": d, "compute_s": 0.5 * d, "upload_s": 0.1 * d, "download_s": 0.1 * d, "wait_s": 0.3 * d}
                    if phase == "backward" and s == 1:
                        m["loss"] = 1.0 / (t + 1)
                    out.append(m)
    return out


def test_time_breakdown_adds_up_to_the_iteration():
    b = iteration_breakdown(_metrics())
    assert [x["t"] for x in b] == [0, 1, 2]  # the last iteration has no successor to end it
    for x in b:
        parts = x["orchestration_s"] + x["compute_s"] + x["transfer_s"] + x["wait_s"]
        assert parts == pytest.approx(x["iteration_s"]) and x["iteration_s"] == pytest.approx(5.0)
        assert x["compute_s"] / x["wait_s"] == pytest.approx(0.5 / 0.3)
    # phase spans: forward 1.1, backward 1.6, sync 0.6 -> orchestration = 5 - 3.3
    assert b[0]["orchestration_s"] == pytest.approx(5.0 - 3.3)
    assert iteration_breakdown(_metrics(), complete=2) == b[:2]


def test_phase_timings_skip_cold_iteration():
    ms = _metrics()
    for m in ms:
        if m["t"] == 0:
            m["duration_s"] = m["compute_s"] = 50.0  # a cold start must not skew the means
    pt = phase_timings(ms)
    assert pt["forward"]["span_s"] == pytest.approx(1.1)
    assert pt["backward"]["max_task_s"] == pytest.approx(1.6)
    assert pt["sync"]["tasks"] == 3 * 4


def test_plots_are_pngs(tmp_path):
    ms = _metrics()
    g = plot_gantt(ms, str(tmp_path / "g.png"))
    b = plot_breakdown(iteration_breakdown(ms), str(tmp_path / "b.png"))
    for p in (g, b):
        with open(p, "rb") as f:
            assert f.read(8) == PNG
    with pytest.raises(ValueError):
        plot_breakdown([], str(tmp_path / "none.png"))


def test_inspect_a_local_run_through_the_daemon(tmp_path, monkeypatch):
    """`local start`, train a tiny job on it, then inspect (report and plots) and clean up via the CLI."""
    import torch
    from torch import nn

    from stagecoach import Job
    from stagecoach.cli_aws import cleanup_command, inspect_command
    from stagecoach.cli_local import local_group, read_state
    from stagecoach.local.backend import LocalBackend

    monkeypatch.setenv("STAGECOACH_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(LocalBackend, "_stack", None)  # do not reuse this session's own stack
    runner = CliRunner()
    r = runner.invoke(local_group, ["start"])
    assert r.exit_code == 0, r.output
    try:
        st = read_state()
        assert st and st["endpoint"].startswith("http://127.0.0.1:")
        backend = LocalBackend()
        assert backend.stack.endpoint_url == st["endpoint"]  # attached, not a stack of its own
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(16, 4, generator=g), torch.randint(0, 2, (16,), generator=g)
        job = Job(model=lambda: nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)), loss=nn.CrossEntropyLoss(),
                  optimizer=lambda p: torch.optim.SGD(p, lr=0.1), train=(x, y), global_batch=8, iterations=3, seed=0, name="insp")
        run = job.run(plan=job.manual_plan(stages=2, replicas=1, memory_mb=1024, timeout_s=120), backend=backend)
        run.wait(progress=False, timeout_s=240)

        out = runner.invoke(inspect_command, [run.execution_arn, "--backend", "local", "--plot", str(tmp_path / "plots")])
        assert out.exit_code == 0, out.output
        assert "SUCCEEDED" in out.output and "iteration 3/3 done" in out.output and "failed tasks: none" in out.output
        assert "window 1/1: iterations [0, 3) SUCCEEDED" in out.output
        assert len(os.listdir(tmp_path / "plots")) == 3
        out = runner.invoke(inspect_command, [run.execution_arn, "--backend", "local", "--json"])
        data = json.loads(out.output)
        assert len(data["losses"]) == 3 and data["losses"] == pytest.approx(run.losses())

        out = runner.invoke(cleanup_command, [run.job_id, "--backend", "local"])
        assert out.exit_code == 0 and "removed 2 functions, 1 state machines" in out.output, out.output
    finally:
        r = runner.invoke(local_group, ["stop"])
        assert r.exit_code == 0, r.output
    assert read_state() is None
    out = runner.invoke(inspect_command, ["arn:aws:states:us-east-1:123456789012:execution:stagecoach-job:x", "--backend", "local"])
    assert out.exit_code != 0 and "stagecoach local start" in out.output
