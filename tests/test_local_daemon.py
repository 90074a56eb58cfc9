"""A local stack that never loses a job (issue 28 item 2): the CLI runs jobs on this project's stack
daemon, started on demand, so a run outlives the command that started it; the daemon's stack
saves its objects and records, so after `stagecoach local stop` and start `list` and `inspect`
find the jobs and `resume` continues one that was running; a daemon serves only the code it was
started from (another checkout, version or project name never attaches to it)."""

import json
import os
import re
import subprocess
import sys
import textwrap
import time

import click
import pytest
from click.testing import CliRunner

from stagecoach.local import daemon_state
from stagecoach.local.daemon_state import code_identity, project_key, read_state, running_stack, wants_daemon

JOB_FILE = textwrap.dedent(
    """
    import torch
    from torch import nn
    from stagecoach import Job

    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 4, generator=g)
    y = (x[:, 0] > 0).long()
    job = Job(model=lambda: nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)), loss=nn.CrossEntropyLoss(),
              optimizer=lambda p: torch.optim.SGD(p, lr=0.3), train=(x, y), global_batch=8, iterations=3, seed=0,
              name=NAME)
    """
)


def job_id(output: str) -> str:
    match = re.search(r"^job (\S+): execution", output, re.MULTILINE)
    assert match, output
    return match.group(1)


def iterations_done(run) -> int:
    run.metrics()  # reads the metrics written since the last call
    return run.iterations_done()


def stagecoach(*args, cwd, env):
    exe = os.path.join(os.path.dirname(sys.executable), "stagecoach")
    return subprocess.run([exe, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


# -- no stack: the project key, the on-demand policy, refusing other code -------------------------


def test_each_checkout_version_and_project_name_has_a_stack_of_its_own(monkeypatch, tmp_path):
    monkeypatch.setenv("STAGECOACH_HOME", str(tmp_path))
    monkeypatch.delenv(daemon_state.PROJECT_ENV, raising=False)
    mine = code_identity()
    assert mine["package"] == os.path.realpath(os.path.join(os.path.dirname(__file__), "..", "sdk"))
    keys = {
        project_key(mine),
        project_key({**mine, "package": "/elsewhere/checkout/sdk"}),
        project_key({**mine, "version": "0.0.0"}),
        project_key({**mine, "project": "other"}),
    }
    assert len(keys) == 4
    assert daemon_state.state_path() == str(tmp_path / "local" / project_key(mine) / "daemon.json")
    monkeypatch.setenv(daemon_state.PROJECT_ENV, "other")
    assert daemon_state.state_path() == str(tmp_path / "local" / project_key({**mine, "project": "other"}) / "daemon.json")


def test_the_cli_starts_a_stack_on_demand_a_python_program_does_not(monkeypatch, tmp_path):
    monkeypatch.setenv("STAGECOACH_HOME", str(tmp_path))
    monkeypatch.delenv(daemon_state.START_ENV)
    assert not wants_daemon()  # no click command: the SDK keeps a stack of its own

    def inside(name):
        with click.Context(click.Command(name)):
            return wants_daemon()

    assert inside("train") and inside("resume")
    assert not inside("list")  # nothing saved: nothing to serve
    os.makedirs(daemon_state.saved_state_dir())
    assert inside("list") and inside("inspect")
    monkeypatch.setenv(daemon_state.START_ENV, "0")
    assert not inside("train")
    monkeypatch.setenv(daemon_state.START_ENV, "1")
    assert wants_daemon()


# -- a daemon: the run outlives its client; a restart keeps the jobs; other code is refused --------


@pytest.mark.stack
def test_a_run_outlives_its_client_and_the_stack_keeps_jobs_across_a_restart(tmp_path, monkeypatch):
    from stagecoach.cli.inspect import inspect_command
    from stagecoach.cli.lifecycle import list_command
    from stagecoach.cli.local import local_group
    from stagecoach.deploy.resume import last_checkpoint
    from stagecoach.local.backend import LocalBackend

    monkeypatch.setenv("STAGECOACH_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(LocalBackend, "_shared", None)  # not this session's own stack
    runner = CliRunner()
    (tmp_path / "quick.py").write_text("NAME = 'quick'\n" + JOB_FILE)
    (tmp_path / "long.py").write_text("NAME = 'long'\n" + JOB_FILE)
    env = {k: v for k, v in os.environ.items() if k != daemon_state.START_ENV}  # the CLI's default
    try:
        # the client starts the project's stack on demand and returns; the job runs on without it
        p = stagecoach("train", "quick.py", "--stages", "1", "--replicas", "1", "--no-wait", cwd=tmp_path, env=env)
        assert p.returncode == 0, p.stdout + p.stderr
        assert "started this project's local stack in the background" in p.stderr, p.stderr
        assert "stagecoach local stop" in p.stdout
        st = read_state()
        assert st is not None and st["code"] == code_identity()
        quick = LocalBackend().attach(job_id(p.stdout))
        assert quick.wait(progress=False, poll_s=0.2, timeout_s=300) == "SUCCEEDED"
        p = stagecoach("train", "long.py", "--stages", "1", "--replicas", "1", "--iterations", "1000", "--no-wait", cwd=tmp_path, env=env)
        assert p.returncode == 0 and "started this project's local stack" not in p.stderr, p.stdout + p.stderr
        long_ = LocalBackend().attach(job_id(p.stdout))
        deadline = time.time() + 300
        while iterations_done(long_) < 2 and time.time() < deadline:
            time.sleep(0.2)
        assert iterations_done(long_) >= 2

        before = last_checkpoint(long_.backend.clients, long_.backend.resources.bucket, long_.job_id)
        other_project(monkeypatch, st)

        # the long job stops at its next iteration boundary, then the stack saves its state
        r = runner.invoke(local_group, ["stop"])
        assert r.exit_code == 0 and "its jobs are kept" in r.output and "ABORTED" not in r.output, r.output
        assert read_state() is None
        r = runner.invoke(local_group, ["start"])
        assert r.exit_code == 0, r.output
        monkeypatch.setattr(LocalBackend, "_shared", None)
        backend = LocalBackend()
        assert backend.stack.endpoint_url == read_state()["endpoint"] != st["endpoint"]  # a new stack

        r = runner.invoke(list_command, [])
        assert r.exit_code == 0, r.output
        rows = {line.split()[0]: line.split()[2] for line in r.output.splitlines()[1:]}
        assert rows == {quick.job_id: "SUCCEEDED", long_.job_id: "STOPPED"}, r.output
        r = runner.invoke(inspect_command, [quick.job_id, "--json"])
        assert r.exit_code == 0, r.output
        assert len(json.loads(r.output)["losses"]) == 3
        r = runner.invoke(inspect_command, [long_.job_id])
        assert r.exit_code == 0 and "STOPPED" in r.output, r.output

        # resume continues the job the stop cut short, from its last checkpoint, on the restored stack
        kept = last_checkpoint(backend.clients, backend.resources.bucket, long_.job_id)
        assert kept >= before  # its checkpoints came through the restart
        resumed = backend.resume(long_.job_id, iterations=kept + 2)
        assert resumed.execution_arn.endswith(f"{long_.job_id}-r1")
        assert resumed.wait(progress=False, poll_s=0.2, timeout_s=300) == "SUCCEEDED"
        assert len(resumed.losses()) == kept + 2  # the metrics written before the restart were kept

        # a stop that does not wait: the job running then is kept as ABORTED, as Step Functions shows
        # an execution stopped before it ended, and can be resumed again
        again = backend.resume(long_.job_id, iterations=1000)
        while iterations_done(again) < kept + 3 and time.time() < deadline + 300:
            time.sleep(0.2)
        r = runner.invoke(local_group, ["stop", "--drain", "0"])
        assert r.exit_code == 0 and f"kept as ABORTED (resume them): {long_.job_id}" in r.output, r.output
        assert runner.invoke(local_group, ["start"]).exit_code == 0
        monkeypatch.setattr(LocalBackend, "_shared", None)
        backend = LocalBackend()
        assert [(j.job, j.status) for j in backend.jobs() if j.job == long_.job_id] == [(long_.job_id, "ABORTED")]
        described = backend.clients.sfn.describe_execution(executionArn=again.execution_arn)
        assert described["status"] == "ABORTED" and described["error"] == "Stagecoach.LocalStackStopped"
        events = backend.clients.sfn.get_execution_history(executionArn=again.execution_arn)["events"]
        assert events[-1]["type"] == "ExecutionAborted" and events[0]["type"] == "ExecutionStarted"
    finally:
        r = runner.invoke(local_group, ["stop"])
        assert r.exit_code == 0, r.output


def other_project(monkeypatch, st):
    """Another project (here: another project name, as another checkout or version has another
    key) finds no daemon of its own, never this one; a record of it naming this daemon is refused."""
    from stagecoach.local.daemon_state import WrongCode

    with monkeypatch.context() as m:
        m.setenv(daemon_state.PROJECT_ENV, "another-checkout")
        assert read_state() is None and running_stack() is None
        os.makedirs(os.path.dirname(daemon_state.state_path()))
        with open(daemon_state.state_path(), "w") as f:
            json.dump(st, f)  # this daemon's record, as if it served the other project
        with pytest.raises(WrongCode, match="serves the stagecoach code of"):
            running_stack()


def test_an_execution_saved_running_is_restored_aborted_with_a_closing_event():
    import datetime

    from stagecoach.local.persist import STOPPED_ERROR, _aborted

    t0 = datetime.datetime(2026, 11, 28, 10, 0, tzinfo=datetime.UTC)
    record = {"executionArn": "arn:x", "status": "RUNNING", "startDate": t0}
    history = [
        {"id": 1, "previousEventId": 0, "type": "ExecutionStarted", "timestamp": t0},
        {"id": 2, "previousEventId": 1, "type": "TaskStateEntered", "timestamp": t0 + datetime.timedelta(seconds=5)},
    ]
    got, events = _aborted(record, history)
    assert got["status"] == "ABORTED" and got["error"] == STOPPED_ERROR and got["stopDate"] == t0 + datetime.timedelta(seconds=5)
    assert events[:2] == history and events[2]["type"] == "ExecutionAborted" and (events[2]["id"], events[2]["previousEventId"]) == (3, 2)
    assert events[2]["executionAbortedEventDetails"]["error"] == STOPPED_ERROR
    assert record["status"] == "RUNNING"  # the saved record itself is left as it was
