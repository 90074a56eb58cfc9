"""The embedded local stack as a background daemon: `stagecoach local start|stop|status`.

``start`` launches a process (:func:`serve`) that owns a provisioned stack and records it
(stagecoach.local.daemon_state); later SDK processes attach to it instead of starting their own,
so `stagecoach train` and `stagecoach inspect` see the same runs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from types import FrameType

from stagecoach.errors import StagecoachError
from stagecoach.local.backend import LocalBackend
from stagecoach.local.daemon_state import DaemonState, pid_alive, read_state, state_path


class DaemonError(StagecoachError, RuntimeError):
    """The daemon could not be started; the message says where its log is."""


def serve() -> None:
    """The daemon: own a provisioned local stack until SIGTERM/SIGINT, then close it."""
    os.environ["STAGECOACH_LOCAL_ATTACH"] = "0"  # never attach to ourselves
    backend = LocalBackend()
    stack = backend.stack
    path = state_path()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    state: DaemonState = {
        "pid": os.getpid(),
        "endpoint": stack.endpoint_url,
        "log_dir": stack.log_dir,
        "region": backend.resources.region,
        "bucket": backend.resources.bucket,
        "job_state_machine": backend.resources.job_state_machine_arn,
        "started": time.time(),
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


def start(timeout: float = 120.0) -> tuple[DaemonState, bool]:
    """Start the daemon unless one runs; returns its state and whether this call started it."""
    st = read_state()
    if st:
        return st, False
    path = state_path()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    log = open(os.path.join(os.path.dirname(path), "local-daemon.log"), "ab")
    proc = subprocess.Popen(
        [sys.executable, "-c", "from stagecoach.local.daemon import serve; serve()"],
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=log,
        start_new_session=True,
    )
    deadline = time.time() + timeout
    while time.time() < deadline:
        st = read_state()
        if st and st["pid"] == proc.pid:
            return st, True
        if proc.poll() is not None:
            raise DaemonError(f"the local stack daemon exited (code {proc.returncode}); see {log.name}")
        time.sleep(0.3)
    proc.terminate()
    raise DaemonError(f"the local stack did not come up within {timeout} s; see {log.name}")


def stop(timeout: float = 30.0) -> int | None:
    """Stop the running daemon; returns its pid, or None if none was running."""
    st = read_state()
    if not st:
        return None
    pid = int(st["pid"])
    os.kill(pid, signal.SIGTERM)
    deadline = time.time() + timeout
    while time.time() < deadline and pid_alive(pid):
        time.sleep(0.2)
    if pid_alive(pid):
        os.kill(pid, signal.SIGKILL)
    return pid
