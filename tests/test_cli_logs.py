"""`stagecoach logs JOB [--task ...] [-t T]`: a job's worker output, per task (sdk/inspect/logs.py)."""

import json
import time

import pytest
from helpers import tiny_job

from stagecoach.inspect.logs import LogLine, LogsError, TaskFilter, function_stage, select, workers_log_lines

PREFIX = "stagecoach-lg-0123abcd-s"


def record(function, phase, t, stage, message="task done", rid="r", **extra):
    """A Powertools record as the handler writes it (lambdas/handler.py)."""
    return json.dumps(
        {
            "level": "INFO",
            "message": message,
            "timestamp": f"2026-11-28 09:54:0{t},163+0000",
            "function_name": function,
            "function_request_id": rid,
            "job": "lg-0123abcd",
            "phase": phase,
            "t": t,
            "stage": stage,
            **extra,
        }
    )


def test_a_task_is_named_as_its_metrics_are_and_anything_else_is_refused():
    assert TaskFilter.parse("backward-s1-0", 3) == TaskFilter("backward", 1, 0, 3)
    assert TaskFilter.parse("sync", None) == TaskFilter("sync")
    assert TaskFilter.parse(None, 2) == TaskFilter(t=2)
    for bad in ("backwards", "backward-1", "s1", "backward-s1-"):
        with pytest.raises(LogsError, match="PHASE\\[-sSTAGE\\[-INDEX\\]\\]"):
            TaskFilter.parse(bad, None)
    assert function_stage(PREFIX + "2") == (2, None)
    assert function_stage(PREFIX + "0-r3") == (0, 3) and function_stage(PREFIX + "1-k0") == (1, 0)


def test_the_workers_log_gives_the_jobs_records_and_counts_what_names_no_job(tmp_path):
    log = tmp_path / "workers.log"
    log.write_text(
        "\n".join(
            [
                record(PREFIX + "0", "forward", 0, 0, rid="a"),
                record("stagecoach-other-89abcdef-s0", "forward", 0, 0, rid="b").replace("lg-0123abcd", "other-89abcdef"),
                "Traceback (most recent call last):",
                f"[runtime] {PREFIX}1: injected kill {{'phase': 'backward'}}",
                record(PREFIX + "1", "backward", 1, 1, message="task failed", rid="c", error="ValueError", detail="boom"),
            ]
        )
        + "\n"
    )
    lines, unlabelled = workers_log_lines(str(log), "lg-0123abcd", PREFIX)
    assert [x.function for x in lines] == [PREFIX + "0", PREFIX + "1", PREFIX + "1"]
    assert unlabelled == 1  # the traceback: the local runtime writes every worker's output to the one file
    assert lines[0].task == {"phase": "forward", "t": 0, "stage": 0} and lines[0].request_id == "a"
    assert "WARNING" not in lines[2].message and "task failed error=ValueError detail=boom" in lines[2].message
    assert "injected kill" in lines[1].message


def test_the_local_runtimes_notes_belong_to_the_task_they_name(tmp_path):
    """An injected fault's note names where it struck; a kill for memory, its invocation's request
    id: a task filter keeps both with the task's own records (the console's failed-task panel)."""
    log = tmp_path / "workers.log"
    log.write_text(
        "\n".join(
            [
                record(PREFIX + "0", "forward", 0, 0, rid="a"),
                f"[runtime] {PREFIX}0: injected fail {{'phase': 'forward', 't': 1, 'stage': 0, 'replica': 0}}",
                record(PREFIX + "0", "forward", 1, 0, rid="b", message="task started"),
                f"[runtime] {PREFIX}0 b: killed, memory 300 MB > configured 128 MB",
                f"[runtime] {PREFIX}0: injected hang {{'phase': 'backward', 't': 1, 'stage': 0}}",
            ]
        )
        + "\n"
    )
    lines, _ = workers_log_lines(str(log), "lg-0123abcd", PREFIX)
    assert {x.function for x in lines} == {PREFIX + "0"}
    got = select(lines, TaskFilter("forward", 0, None, 1), per_worker=False)
    assert [x.message.split(":", 1)[-1].split("{")[0].strip() for x in got if x.message.startswith("[runtime]")] == [
        "injected fail",
        "killed, memory 300 MB > configured 128 MB",
    ]
    assert [x.request_id for x in got] == [None, "b", "b"]


def test_a_task_filter_keeps_the_tasks_records_and_their_reports():
    report = json.dumps({"type": "platform.report", "record": {"requestId": "b", "status": "success", "metrics": {"durationMs": 12.5}}})
    lines = [
        LogLine(1.0, PREFIX + "0", "INFO task done", {"phase": "forward", "t": 0, "stage": 0}, "a"),
        LogLine(2.0, PREFIX + "1", "INFO task done", {"phase": "backward", "t": 0, "stage": 1}, "b"),
        LogLine(2.1, PREFIX + "1", "REPORT success: 12.5 ms", {}, "b"),
        LogLine(3.0, PREFIX + "1-r1", "INFO task done", {"phase": "backward", "t": 1, "stage": 1}, "c"),
        LogLine(4.0, PREFIX + "1", "a line the job's code printed"),
    ]
    assert report  # (what group_lines turns into the REPORT line above: inspect/logs.py describe)
    got = select(lines, TaskFilter("backward", t=0), per_worker=True)
    assert [x.request_id for x in got] == ["b", "b"]  # the task's record and its invocation's REPORT
    got = select(lines, TaskFilter(stage=1), per_worker=True)
    assert len(got) == 4  # by the function's name: the printed line too
    got = select(lines, TaskFilter("backward", 1, 1), per_worker=True)
    assert [x.request_id for x in got] == ["c"]
    with pytest.raises(LogsError, match="replicas share their stage's function"):
        select(lines, TaskFilter("backward", 1, 1), per_worker=False)


def test_logs_shows_a_finished_jobs_tasks_on_the_local_stack(backend, monkeypatch):
    """A real run: its backward task of stage 1 at iteration 1 has its record and its REPORT
    (from the stack's log group), and no other task's line."""
    from click.testing import CliRunner

    from stagecoach.cli import main, options

    monkeypatch.setattr(options, "running_stack", lambda: object())  # the session's stack stands in for the daemon
    job = tiny_job("cli-logs")
    run = job.run(stages=2, backend=backend)
    assert run.wait(progress=False, poll_s=0.2, timeout_s=240) == "SUCCEEDED"
    r = CliRunner().invoke(main, ["logs", run.job_id])
    assert r.exit_code == 0, r.output
    assert r.output.count("task done") == 2 * 3  # per iteration: forward s0, backward s0 and s1
    r = CliRunner().invoke(main, ["logs", run.execution_arn, "--task", "backward-s1", "-t", "1"])
    assert r.exit_code == 0, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) >= 1 and all(" s1 " in line and "backward t=1" in line for line in lines if "task done" in line), r.output
    assert sum("task done" in line for line in lines) == 1, r.output
    # the invocation's REPORT, from the stack's log group (written off the invocation's path: give it a moment)
    deadline = time.time() + 15
    while "REPORT" not in r.output and time.time() < deadline:
        time.sleep(0.5)
        r = CliRunner().invoke(main, ["logs", run.job_id, "--task", "backward-s1", "-t", "1"])
    assert any("REPORT success" in line and "backward t=1" in line for line in r.output.splitlines()), r.output
    r = CliRunner().invoke(main, ["logs", run.job_id, "--task", "backward-s1-1"])
    assert r.exit_code == 1 and "replicas share their stage's function" in r.output, r.output
    r = CliRunner().invoke(main, ["logs", run.job_id, "--task", "nonsense"])
    assert r.exit_code == 2 and "PHASE[-sSTAGE[-INDEX]]" in r.output, r.output
