"""`stagecoach local start|stop|status`: this project's embedded stack as a background daemon."""

from __future__ import annotations

import json

import click

from stagecoach.local import daemon
from stagecoach.local.daemon_state import DaemonError, read_state, saved_state_dir, start, state_path


@click.group(name="local")
def local_group() -> None:
    """This project's embedded local stack as a background daemon (train and resume start it on
    demand; its jobs are kept across restarts)."""


@local_group.command(name="start")
@click.option("--timeout", default=120.0, show_default=True, help="seconds to wait for the stack")
def start_command(timeout: float) -> None:
    """Start this project's stack in the background (restoring its saved jobs); later commands attach to it."""
    try:
        st, started = start(timeout)
    except DaemonError as e:
        raise click.ClickException(str(e)) from None
    if started:
        click.echo(f"local stack running at {st['endpoint']} (pid {st['pid']}); state in {state_path()}, jobs kept in {saved_state_dir()}")
    else:
        click.echo(f"already running: {st['endpoint']} (pid {st['pid']})")


@local_group.command(name="stop")
@click.option("--timeout", default=daemon.STOP_TIMEOUT_S, show_default=True, help="seconds to wait for the stack to save and exit")
@click.option(
    "--drain",
    default=daemon.DRAIN_S,
    show_default=True,
    help="seconds to wait for running jobs to stop at an iteration boundary first (0: stop at once; they are kept as ABORTED)",
)
def stop_command(timeout: float, drain: float) -> None:
    """Stop this project's stack: its running jobs at their next iteration boundary (STOPPED, as
    `stagecoach stop` does), then the stack, which saves its jobs; `stagecoach resume JOB` continues one."""
    stopped = daemon.stop(timeout, drain)
    if stopped is None:
        click.echo("no local stack daemon is running")
        return
    pid, running = stopped
    if running:
        click.echo(f"still running, kept as ABORTED (resume them): {', '.join(running)}")
    click.echo(f"stopped the local stack (pid {pid}); its jobs are kept in {saved_state_dir()}")


@local_group.command(name="status")
def status_command() -> None:
    """Print this project's daemon's record (endpoint, code it serves), or that none is running."""
    st = read_state()
    click.echo(json.dumps(st, indent=2) if st else "no local stack daemon is running")
