"""`stagecoach inspect`: failed tasks traced from a history, the time accounting, the plots, and a
real run on the local stack kept alive by `stagecoach local start`."""

import json
import os
from datetime import UTC, datetime

import pytest
from click.testing import CliRunner

from stagecoach.core.records import TaskMetrics
from stagecoach.inspect.events import failed_tasks
from stagecoach.inspect.plots import gantt_rows, plot_breakdown, plot_gantt, plot_loss
from stagecoach.metrics import iteration_breakdown, phase_timings

PNG = b"\x89PNG\r\n\x1a\n"


def _ev(i, typ, prev, **details):
    e = {"id": i, "previousEventId": prev, "type": typ, "timestamp": datetime(2025, 1, 1, tzinfo=UTC)}
    e.update(details)
    return e


def _scheduled(i, prev, phase, stage, replica, t):
    params = {
        "FunctionName": f"sc-j-s{stage}",
        "Payload": {"phase": phase, "job": "j", "bucket": "b", "t": t, "window_start": 0, "stage": stage, "replica": replica},
    }
    return _ev(
        i,
        "TaskScheduled",
        prev,
        taskScheduledEventDetails={"resourceType": "lambda", "resource": "invoke", "region": "us-east-1", "parameters": json.dumps(params)},
    )


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
    assert got[1].time == datetime(2025, 1, 1, tzinfo=UTC).timestamp()  # where the Gantt chart marks it
    assert got[1].cause.startswith("Runtime.OutOfMemory: RequestId: x")


def task_metrics(phase, t, stage, index, start, dur, compute, transfer, wait, loss=None, cold=False):
    """A task's metrics record as the handler writes it (core/records.py TaskMetrics)."""
    return TaskMetrics(
        phase=phase,
        t=t,
        stage=stage,
        index=index,
        start=start,
        end=start + dur,
        duration_s=dur,
        upload_s=transfer,
        download_s=transfer,
        transfer_s=transfer,
        wait_s=wait,
        bytes_up=1024,
        bytes_down=2048,
        puts=1,
        gets=2,
        compute_s=compute,
        container=f"c{stage}-{index}",
        container_started=100.0,
        invocation=t + 1,
        cold=cold,
        memory_mb=1024,
        max_rss_mb=300.0,
        loss=loss,
    )


def _metrics(iterations=4, gap=0.7):
    out = []
    for t in range(iterations):
        base = 100.0 + t * 5.0
        for phase, off, dur in (("forward", 0.0, 1.0), ("backward", 1.0 + gap, 1.5), ("sync", 2.5 + 2 * gap, 0.5)):
            for s in range(2):
                for i in range(2):
                    d = dur + 0.1 * i
                    loss = 1.0 / (t + 1) if phase == "backward" and s == 1 else None
                    out.append(task_metrics(phase, t, s, i, base + off, d, 0.5 * d, 0.2 * d, 0.3 * d, loss=loss, cold=t == 0))
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


def test_breakdown_counts_parallel_stages_once_and_uses_the_union_transfer_time():
    """BackwardSync runs the stages' branches in parallel: one stage's sync overlaps another's
    backward. Time in tasks is the union of the task intervals, not the sum of the phase spans."""

    def task(phase, t, stage, start, dur):
        # uploads and downloads overlap: each is dur / 2 long, their union (transfer_s) dur / 4
        m = task_metrics(phase, t, stage, 0, start, dur, compute=dur * 3 / 4, transfer=dur / 4, wait=0.0)
        return m.model_copy(update={"upload_s": dur / 2, "download_s": dur / 2})

    ms = []
    for t in range(2):
        b = 10.0 * t
        ms += [
            task("backward", t, 0, b + 0.0, 4.0),
            task("sync", t, 0, b + 4.0, 1.0),
            task("backward", t, 1, b + 0.0, 1.0),
            task("sync", t, 1, b + 1.0, 1.0),
        ]  # inside stage 0's backward
    (x,) = iteration_breakdown(ms)
    # busy 5 s (not backward span 4 + sync span 4 = 8); 5 s of the 10 s iteration is orchestration
    assert x["orchestration_s"] == pytest.approx(5.0)
    # transfer is the union of concurrent uploads and downloads (transfer_s), not their sum
    assert x["compute_s"] == pytest.approx(3 * x["transfer_s"]) and x["compute_s"] + x["transfer_s"] == pytest.approx(5.0)
    assert phase_timings(ms, skip_first=0)["sync"]["transfer_s"] == pytest.approx(0.25)


def test_phase_timings_skip_cold_iteration():
    # a cold start must not skew the means
    ms = [m.model_copy(update={"duration_s": 50.0, "compute_s": 50.0}) if m.t == 0 else m for m in _metrics()]
    pt = phase_timings(ms)
    assert pt["forward"]["span_s"] == pytest.approx(1.1)
    assert pt["backward"]["max_task_s"] == pytest.approx(1.6)
    assert pt["sync"]["tasks"] == 3 * 4


def test_plots_are_pngs(tmp_path):
    ms = _metrics()
    g = plot_gantt(ms, str(tmp_path / "g.png"))
    b = plot_breakdown(iteration_breakdown(ms), str(tmp_path / "b.png"))
    lo = plot_loss([2.3, 1.2, 0.7], str(tmp_path / "l.png"))
    for p in (g, b, lo):
        with open(p, "rb") as f:
            assert f.read(8) == PNG
    with pytest.raises(ValueError):
        plot_breakdown([], str(tmp_path / "none.png"))
    with pytest.raises(ValueError, match="no task metrics in iterations"):
        plot_gantt(ms, str(tmp_path / "none.png"), iterations=(50, 60))


def test_gantt_rows_follow_the_sync_tasks_that_ran():
    """K aggregators per stage (k_reduce), not one sync row per replica; no sync rows for a fused sync."""
    ms = [m for m in _metrics(iterations=2) if not (m.phase == "sync" and (m.stage == 1 or m.index == 1))]
    assert gantt_rows(ms) == [(0, False, 0), (0, False, 1), (0, True, 0), (1, False, 0), (1, False, 1)]


def test_inspect_a_local_run_through_the_daemon(tmp_path, monkeypatch):
    """`local start`, train a tiny job on it, then inspect (report and plots) and clean up via the CLI."""
    import torch
    from torch import nn

    from stagecoach import Job
    from stagecoach.cli.cleanup import cleanup_command
    from stagecoach.cli.inspect import inspect_command
    from stagecoach.cli.local import local_group
    from stagecoach.local.backend import LocalBackend
    from stagecoach.local.daemon_state import read_state

    monkeypatch.setenv("STAGECOACH_HOME", str(tmp_path / "home"))
    # the daemon's Lambda runtime kills stage 1's backward task of iteration 1 once: Step Functions
    # retries it (Runtime.ExitError), and inspect must trace the failed attempt to its worker
    monkeypatch.setenv("STAGECOACH_FAULTS", json.dumps({"once": [{"kind": "kill", "phase": "backward", "t": 1, "stage": 1}]}))
    monkeypatch.setattr(LocalBackend, "_shared", None)  # do not reuse this session's own stack
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
        job = Job(
            model=lambda: nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)),
            loss=nn.CrossEntropyLoss(),
            optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
            train=(x, y),
            global_batch=8,
            iterations=3,
            seed=0,
            name="insp",
            # the stored path, whose killed task a retry recovers (warm state would restart the
            # window: tests/test_warm_state.py); this test is about how inspect shows the retry
            warm_state=False,
        )
        run = job.run(plan=job.manual_plan(stages=2, replicas=1, memory_mb=1024, timeout_s=120), backend=backend)
        run.wait(progress=False, poll_s=0.2, timeout_s=240)

        out = runner.invoke(inspect_command, [run.execution_arn, "--backend", "local", "--plot", str(tmp_path / "plots")])
        assert out.exit_code == 0, out.output
        assert "SUCCEEDED" in out.output and "iteration 3/3 done" in out.output
        assert "window 1/1: iterations [0, 3) SUCCEEDED" in out.output and "sync none (1 replica)" in out.output
        assert "failed tasks (1):\n  backward s1 #0 t=1: Runtime.ExitError" in out.output, out.output
        assert "(retried, then succeeded)" in out.output
        assert sorted(os.listdir(tmp_path / "plots")) == sorted(f"{run.job_id}-{k}.png" for k in ("gantt", "breakdown", "loss"))
        out = runner.invoke(inspect_command, [run.execution_arn, "--backend", "local", "--json"])
        data = json.loads(out.output)
        assert len(data["losses"]) == 3 and data["losses"] == pytest.approx(run.losses())
        (failed,) = data["failed_tasks"]
        assert (failed["phase"], failed["stage"], failed["t"], failed["retried"]) == ("backward", 1, 1, True)
        assert failed["function"].endswith(f"{run.job_id}-s1") and failed["state"] == "Backward1Task"
        for x in data["breakdown"]:  # the four parts add up to each iteration
            assert sum(x[k] for k in ("orchestration_s", "compute_s", "transfer_s", "wait_s")) == pytest.approx(x["iteration_s"])

        out = runner.invoke(cleanup_command, [run.job_id, "--backend", "local"])
        assert out.exit_code == 0 and "removed 3 functions, 1 state machines" in out.output, out.output
    finally:
        r = runner.invoke(local_group, ["stop"])
        assert r.exit_code == 0, r.output
    assert read_state() is None
    out = runner.invoke(inspect_command, ["arn:aws:states:us-east-1:123456789012:execution:stagecoach-job:x", "--backend", "local"])
    assert out.exit_code != 0 and "stagecoach local start" in out.output
    out = runner.invoke(inspect_command, ["not-an-arn"])
    assert out.exit_code != 0 and "is not a job execution ARN" in out.output
