"""This project's local stack daemon seen from its clients: where it records itself, which code it
serves, starting it (:func:`start`) and attaching to it.

The SDK normally starts the embedded stack inside its own process and stops it on exit, so a run
ends with its terminal. A daemon keeps one stack alive across commands. There is one per user and
project (as `sam local` is per project): its record lives in ``~/.stagecoach/local/<key>/``
(``STAGECOACH_HOME`` overrides ``~/.stagecoach``), where ``<key>`` hashes the code it serves — the
resolved directory of the ``stagecoach`` package and its version (:func:`code_identity`). Another
checkout or version has another key, so it never attaches to this stack (whose workers would import
this checkout's code); it starts its own. ``LocalBackend`` attaches to the project's daemon
(:func:`running_stack`) instead of starting a stack of its own, and the CLI starts one on demand.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import json
import os
import socket
import subprocess
import sys
import time
from typing import TypedDict

import click

from stagecoach.deploy.resources import DeployError
from stagecoach.local.process import StackProcess

STATE_FILE = "daemon.json"
START_ENV = "STAGECOACH_LOCAL_START"  # "1": start on demand everywhere, "0": never; unset: the CLI's commands
PROJECT_ENV = "STAGECOACH_LOCAL_PROJECT"  # a name that gives the same code a stack of its own


class CodeIdentity(TypedDict):
    """The code a daemon serves: its workers import the ``stagecoach`` package from ``package``."""

    package: str
    version: str
    project: str


class DaemonState(TypedDict):
    """The daemon's record in :func:`state_path` (written by stagecoach.local.daemon.serve)."""

    pid: int
    endpoint: str
    log_dir: str
    region: str
    bucket: str
    job_state_machine: str
    started: float
    code: CodeIdentity
    state_dir: str


class DaemonError(DeployError):
    """The daemon could not be started; the message says where its log is."""


class WrongCode(DeployError):
    """The daemon recorded for this project serves other code: refused rather than attached to (a
    DeployError, so the CLI says it as an error of the backend its options name)."""


def code_identity() -> CodeIdentity:
    """This process's code: where ``stagecoach`` resolves to (a symlinked checkout counts as the
    directory it links to), its installed version, and the optional project name of PROJECT_ENV."""
    try:
        version = importlib.metadata.version("stagecoach")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    # this file is stagecoach/local/daemon_state.py: two levels up is the package the process imported
    package = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
    return {"package": package, "version": version, "project": os.environ.get(PROJECT_ENV, "")}


def project_key(code: CodeIdentity | None = None) -> str:
    code = code or code_identity()
    return hashlib.sha256("\0".join((code["package"], code["version"], code["project"])).encode()).hexdigest()[:16]


def home() -> str:
    return os.environ.get("STAGECOACH_HOME") or os.path.join(os.path.expanduser("~"), ".stagecoach")


def project_dir() -> str:
    """This project's directory: the daemon's record, its log and its saved stack (``state/``)."""
    return os.path.join(home(), "local", project_key())


def state_path() -> str:
    return os.path.join(project_dir(), STATE_FILE)


def saved_state_dir() -> str:
    """Where the daemon's stack keeps its objects and records across restarts (local/persist.py)."""
    return os.path.join(project_dir(), "state")


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
    """This project's daemon's record, if a live daemon wrote it (a stale file from a killed one is
    ignored). Raises WrongCode if the daemon serves other code than this process's."""
    try:
        with open(state_path()) as f:
            st: DaemonState = json.load(f)
    except (OSError, ValueError):
        return None
    if not pid_alive(int(st.get("pid", -1))) or not _serving(st.get("endpoint", "http://127.0.0.1:1")):
        return None
    mine = code_identity()
    if st.get("code") != mine:
        raise WrongCode(
            f"the local stack recorded in {state_path()} (pid {st['pid']}) serves the stagecoach code of "
            f"{st.get('code')}, not this process's {mine}: its workers would run the other code. Stop it "
            f"(kill {st['pid']}) or run from the checkout it serves"
        )
    return st


class AttachedStack(StackProcess):
    """A stack owned by this project's daemon; this process attaches, never stops it."""

    def __init__(self, state: DaemonState) -> None:
        self.endpoint_url = str(state["endpoint"])
        self.log_dir = str(state.get("log_dir", ""))
        self.pid = int(state["pid"])

    def alive(self) -> bool:
        return pid_alive(self.pid)

    def close(self) -> None:
        """Nothing: the daemon outlives this process (`stagecoach local stop` ends it)."""


def _command() -> tuple[list[str], dict[str, str]]:
    """The daemon's command line and environment: it must import this process's ``stagecoach``,
    not whatever the working directory holds (``-P``: no script directory or cwd on sys.path,
    https://docs.python.org/3/using/cmdline.html#cmdoption-P), so the package's parent directory
    goes first on PYTHONPATH."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    code = f"from stagecoach.local.daemon import serve; serve({state_path()!r})"
    return [sys.executable, "-P", "-c", code], env


def start(timeout: float = 120.0) -> tuple[DaemonState, bool]:
    """Start this project's daemon unless one runs; returns its state and whether this call
    started it. Refused (DaemonError) if the daemon it starts would serve other code. One start at
    a time per project (an exclusive lock): two commands started at once share one daemon, never
    two stacks saving to one directory."""
    os.makedirs(project_dir(), exist_ok=True)
    with open(os.path.join(project_dir(), "start.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        st = read_state()
        if st:
            return st, False
        return _spawn(timeout), True


def _spawn(timeout: float) -> DaemonState:
    """Launch the daemon and wait for its record."""
    path = os.path.join(project_dir(), "daemon.log")
    command, env = _command()
    with open(path, "ab") as log:
        proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env, start_new_session=True)
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            st = read_state()
        except WrongCode as e:
            proc.terminate()
            raise DaemonError(f"{e}; see {path}") from None
        if st and st["pid"] == proc.pid:
            return st
        if proc.poll() is not None:
            raise DaemonError(f"the local stack daemon exited (code {proc.returncode}); see {path}")
        time.sleep(0.3)
    proc.terminate()
    raise DaemonError(f"the local stack did not come up within {timeout} s; see {path}")


def wants_daemon() -> bool:
    """Whether to start this project's daemon when none runs (START_ENV decides if set).

    By default only inside the ``stagecoach`` command: `train` and `resume` always (a run must
    outlive its terminal), the others (list, inspect, stop, cleanup) when the project's stack has
    saved state to serve. A Python program keeps a stack of its own that ends with it, as before,
    unless START_ENV is "1": a script or notebook that starts no background process it did not
    ask for. Tests set START_ENV=0 (tests/conftest.py)."""
    setting = os.environ.get(START_ENV, "")
    if setting in ("0", "1"):
        return setting == "1"
    ctx = click.get_current_context(silent=True)
    if ctx is None:
        return False
    return ctx.command.name in ("train", "resume") or os.path.isdir(saved_state_dir())


def running_stack() -> AttachedStack | None:
    """This project's daemon's stack if one is running or :func:`wants_daemon` starts one (never
    when STAGECOACH_LOCAL_ATTACH is "0", as in the daemon itself)."""
    if os.environ.get("STAGECOACH_LOCAL_ATTACH", "1") == "0":
        return None
    st = read_state()
    if st is None and wants_daemon():
        st, _ = start()
        click.echo(
            f"started this project's local stack in the background (pid {st['pid']}): it keeps runs after this "
            f"command ends; `stagecoach local stop` stops it (its jobs are kept in {st['state_dir']})",
            err=True,
        )
        sys.stderr.flush()
    return AttachedStack(st) if st else None
