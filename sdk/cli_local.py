"""`stagecoach local start|stop|status`: the embedded stack as a background daemon.

The SDK normally starts the embedded stack inside its own process and stops it on exit, so a run
cannot be inspected afterwards. A daemon keeps one stack alive across commands: ``local start``
launches it and records its endpoint in ~/.stagecoach/local.json (``STAGECOACH_HOME`` overrides
the directory); ``LocalBackend`` then attaches to it (see :func:`running_stack`) instead of
starting its own, so ``stagecoach train`` and ``stagecoach inspect`` see the same runs.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import click

STATE_FILE = "local.json"


def state_path() -> str:
    home = os.environ.get("STAGECOACH_HOME") or os.path.join(os.path.expanduser("~"), ".stagecoach")
    return os.path.join(home, STATE_FILE)


def _alive(pid: int) -> bool:
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


def read_state() -> dict[str, Any] | None:
    """The daemon's record, if a live daemon wrote it (a stale file from a killed one is ignored)."""
    try:
        with open(state_path()) as f:
            st = json.load(f)
    except (OSError, ValueError):
        return None
    if not _alive(int(st.get("pid", -1))) or not _serving(st.get("endpoint", "http://127.0.0.1:1")):
        return None
    return st


class _DaemonProcess:
    """Stands in for LocalStack.proc: poll() says whether the daemon still runs."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def poll(self) -> int | None:
        return None if _alive(self.pid) else 1


class RunningStack:
    """A stack owned by the `stagecoach local start` daemon; this process attaches, never stops it."""

    def __init__(self, state: dict[str, Any]) -> None:
        self.endpoint_url: str = state["endpoint"]
        self.port = int(self.endpoint_url.rsplit(":", 1)[-1])
        self.log_dir: str = state.get("log_dir", "")
        self.log_path = os.path.join(self.log_dir, "workers.log")
        self.proc = _DaemonProcess(int(state["pid"]))

    def client(self, service: str) -> Any:
        from stagecoach.local.backend import LocalStack

        return LocalStack.client(self, service)  # type: ignore[arg-type]  # needs only endpoint_url

    def close(self) -> None:
        """Nothing: the daemon outlives this process (`stagecoach local stop` ends it)."""


def running_stack() -> RunningStack | None:
    """The daemon's stack if one is running (and STAGECOACH_LOCAL_ATTACH is not "0")."""
    if os.environ.get("STAGECOACH_LOCAL_ATTACH", "1") == "0":
        return None
    st = read_state()
    return RunningStack(st) if st else None


def _daemon_main() -> None:
    """The daemon: own a provisioned local stack until SIGTERM/SIGINT, then close it."""
    os.environ["STAGECOACH_LOCAL_ATTACH"] = "0"  # never attach to ourselves
    from stagecoach.local.backend import LocalBackend

    backend = LocalBackend()
    stack = backend.stack
    path = state_path()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    state = {"pid": os.getpid(), "endpoint": stack.endpoint_url, "log_dir": stack.log_dir,
             "region": backend.resources.region, "bucket": backend.resources.bucket,
             "job_state_machine": backend.resources.job_state_machine_arn, "started": time.time()}
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(state, f, indent=2)
    os.replace(tmp, path)
    stopping = False

    def stop(_sig: int, _frm: Any) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        while not stopping and stack.proc.poll() is None:
            time.sleep(0.5)
    finally:
        try:
            with open(path) as f:
                if json.load(f).get("pid") == os.getpid():
                    os.remove(path)
        except (OSError, ValueError):
            pass
        stack.close()


@click.group(name="local")
def local_group() -> None:
    """The embedded local stack as a background daemon (for `stagecoach inspect` across commands)."""


@local_group.command(name="start")
@click.option("--timeout", default=120.0, show_default=True, help="seconds to wait for the stack")
def start_command(timeout: float) -> None:
    """Start the embedded stack in the background; later commands attach to it."""
    st = read_state()
    if st:
        click.echo(f"already running: {st['endpoint']} (pid {st['pid']})")
        return
    path = state_path()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    log = open(os.path.join(os.path.dirname(path), "local-daemon.log"), "ab")
    proc = subprocess.Popen([sys.executable, "-c", "from stagecoach.cli_local import _daemon_main; _daemon_main()"],
                            stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
    deadline = time.time() + timeout
    while time.time() < deadline:
        st = read_state()
        if st and st["pid"] == proc.pid:
            click.echo(f"local stack running at {st['endpoint']} (pid {proc.pid}); state in {path}")
            return
        if proc.poll() is not None:
            raise click.ClickException(f"the local stack daemon exited (code {proc.returncode}); see {log.name}")
        time.sleep(0.3)
    proc.terminate()
    raise click.ClickException(f"the local stack did not come up within {timeout} s; see {log.name}")


@local_group.command(name="stop")
@click.option("--timeout", default=30.0, show_default=True)
def stop_command(timeout: float) -> None:
    """Stop the daemon started by `stagecoach local start` (its runs are lost)."""
    st = read_state()
    if not st:
        click.echo("no local stack daemon is running")
        return
    pid = int(st["pid"])
    os.kill(pid, signal.SIGTERM)
    deadline = time.time() + timeout
    while time.time() < deadline and _alive(pid):
        time.sleep(0.2)
    if _alive(pid):
        os.kill(pid, signal.SIGKILL)
    click.echo(f"stopped the local stack (pid {pid})")


@local_group.command(name="status")
def status_command() -> None:
    """Print the daemon's endpoint, or that none is running."""
    st = read_state()
    click.echo(json.dumps(st, indent=2) if st else "no local stack daemon is running")
