"""The embedded local stack as a background daemon: the process itself, and stopping it.

``stagecoach.local.daemon_state.start`` (`stagecoach local start`, or the CLI's on-demand start)
launches a process running :func:`serve`, which owns a provisioned stack and records it in this
project's directory (stagecoach.local.daemon_state); later processes of the same project attach to
it instead of starting their own, so `stagecoach train` and `stagecoach inspect` see the same runs.
Its stack saves its objects and execution records in the project's ``state/`` directory and
restores them when a daemon starts again (stagecoach.local.persist), so a job outlives a restart.
"""

from __future__ import annotations

import json
import os
import signal
import time
from types import FrameType

from stagecoach.local.backend import LocalBackend
from stagecoach.local.daemon_state import AttachedStack, DaemonState, code_identity, pid_alive, read_state, saved_state_dir
from stagecoach.run import request_stop

# the daemon stops its stack, which saves its state first (local/persist.py): give it that long
STOP_TIMEOUT_S = 120.0
# how long `stagecoach local stop` waits for the running jobs to reach an iteration boundary
DRAIN_S = 60.0


def serve(path: str) -> None:
    """The daemon: own a provisioned local stack until SIGTERM/SIGINT, then close it (which saves
    its state); its record goes to ``path`` (the starting process's project's)."""
    os.environ["STAGECOACH_LOCAL_ATTACH"] = "0"  # never attach to ourselves
    logs = os.path.join(os.path.dirname(path), "logs")
    os.makedirs(logs, exist_ok=True)
    backend = LocalBackend(state_dir=saved_state_dir(), log_dir=logs)
    stack = backend.stack
    state: DaemonState = {
        "pid": os.getpid(),
        "endpoint": stack.endpoint_url,
        "log_dir": stack.log_dir,
        "region": backend.resources.region,
        "bucket": backend.resources.bucket,
        "job_state_machine": backend.resources.job_state_machine_arn,
        "started": time.time(),
        "code": code_identity(),
        "state_dir": saved_state_dir(),
    }
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(state, f, indent=2)
    os.replace(tmp, path)
    stopping = False

    def stop(_sig: int, _frm: FrameType | None) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        while not stopping and stack.alive():
            time.sleep(0.5)
    finally:
        try:
            with open(path) as f:
                if json.load(f).get("pid") == os.getpid():
                    os.remove(path)
        except (OSError, ValueError):
            pass
        stack.close()


def stop(timeout: float = STOP_TIMEOUT_S, drain_s: float = DRAIN_S) -> tuple[int, list[str]] | None:
    """Stop this project's daemon: first its running jobs at their next iteration boundary (for up
    to ``drain_s``: :func:`stop_jobs`), then the daemon, whose stack saves its state. Returns its
    pid and the jobs still running when it stopped (restored as ABORTED), or None if none ran."""
    st = read_state()
    if not st:
        return None
    running = stop_jobs(st, drain_s) if drain_s > 0 else running_jobs(st)
    pid = int(st["pid"])
    os.kill(pid, signal.SIGTERM)
    deadline = time.time() + timeout
    while time.time() < deadline and pid_alive(pid):
        time.sleep(0.2)
    if pid_alive(pid):
        os.kill(pid, signal.SIGKILL)
    return pid, running


def running_jobs(st: DaemonState) -> list[str]:
    """The jobs whose job execution runs on the daemon's stack."""
    sfn = AttachedStack(st).client("stepfunctions")
    pages = sfn.get_paginator("list_executions").paginate(stateMachineArn=st["job_state_machine"], statusFilter="RUNNING")
    return sorted(
        {json.loads(sfn.describe_execution(executionArn=e["executionArn"])["input"])["job"] for p in pages for e in p["executions"]}
    )


def stop_jobs(st: DaemonState, drain_s: float) -> list[str]:
    """Ask every running job to stop at its next iteration boundary, as `stagecoach stop` does (the
    job ends STOPPED with a complete checkpoint and every finished iteration's metrics, and
    `stagecoach resume` continues it), and wait up to ``drain_s`` for them; the jobs still running."""
    s3 = AttachedStack(st).client("s3")
    running = running_jobs(st)
    for job in running:
        request_stop(s3, st["bucket"], job)
    deadline = time.time() + drain_s
    while running and time.time() < deadline:
        time.sleep(0.5)
        running = running_jobs(st)
    return running
