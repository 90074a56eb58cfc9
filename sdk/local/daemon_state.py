"""Where a `stagecoach local start` daemon records its stack, and attaching to it.

The SDK normally starts the embedded stack inside its own process and stops it on exit, so a run
cannot be inspected afterwards. A daemon keeps one stack alive across commands: it records its
endpoint in ~/.stagecoach/local.json (``STAGECOACH_HOME`` overrides the directory); ``LocalBackend``
then attaches to it (:func:`running_stack`) instead of starting its own.
"""

from __future__ import annotations

import json
import os
import socket
from typing import TypedDict

from stagecoach.local.process import StackProcess

STATE_FILE = "local.json"


class DaemonState(TypedDict):
    """The daemon's record in :func:`state_path` (written by stagecoach.local.daemon.serve)."""

    pid: int
    endpoint: str
    log_dir: str
    region: str
    bucket: str
    job_state_machine: str
    started: float


def state_path() -> str:
    home = os.environ.get("STAGECOACH_HOME") or os.path.join(os.path.expanduser("~"), ".stagecoach")
    return os.path.join(home, STATE_FILE)


def pid_alive(pid: int) -> bool:
    try:  # reap it if it is our own child (start and stop in one process), else it stays a zombie
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return False
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _serving(endpoint: str) -> bool:
    host, port = endpoint.rsplit("/", 1)[-1].rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=1.0):
            return True
    except OSError:
        return False


def read_state() -> DaemonState | None:
    """The daemon's record, if a live daemon wrote it (a stale file from a killed one is ignored)."""
    try:
        with open(state_path()) as f:
            st: DaemonState = json.load(f)
    except (OSError, ValueError):
        return None
    if not pid_alive(int(st.get("pid", -1))) or not _serving(st.get("endpoint", "http://127.0.0.1:1")):
        return None
    return st


class AttachedStack(StackProcess):
    """A stack owned by the `stagecoach local start` daemon; this process attaches, never stops it."""

    def __init__(self, state: DaemonState) -> None:
        self.endpoint_url = str(state["endpoint"])
        self.log_dir = str(state.get("log_dir", ""))
        self.pid = int(state["pid"])

    def alive(self) -> bool:
        return pid_alive(self.pid)

    def close(self) -> None:
        """Nothing: the daemon outlives this process (`stagecoach local stop` ends it)."""


def running_stack() -> AttachedStack | None:
    """The daemon's stack if one is running (and STAGECOACH_LOCAL_ATTACH is not "0")."""
    if os.environ.get("STAGECOACH_LOCAL_ATTACH", "1") == "0":
        return None
    st = read_state()
    return AttachedStack(st) if st else None
