"""`stagecoach local start|stop|status`: the embedded stack as a background daemon."""

from __future__ import annotations

import json

import click

from stagecoach.local import daemon
from stagecoach.local.daemon_state import read_state, state_path


@click.group(name="local")
def local_group() -> None:
    """The embedded local stack as a background daemon (for `stagecoach inspect` across commands)."""


@local_group.command(name="start")
@click.option("--timeout", default=120.0, show_default=True, help="seconds to wait for the stack")
def start_command(timeout: float) -> None:
    """Start the embedded stack in the background; later commands attach to it."""
    try:
        st, started = daemon.start(timeout)
    except daemon.DaemonError as e:
        raise click.ClickException(str(e)) from None
    if started:
        click.echo(f"local stack running at {st['endpoint']} (pid {st['pid']}); state in {state_path()}")
    else:
        click.echo(f"already running: {st['endpoint']} (pid {st['pid']})")


@local_group.command(name="stop")
@click.option("--timeout", default=30.0, show_default=True)
def stop_command(timeout: float) -> None:
    """Stop the daemon started by `stagecoach local start` (its runs are lost)."""
    pid = daemon.stop(timeout)
    click.echo("no local stack daemon is running" if pid is None else f"stopped the local stack (pid {pid})")


@local_group.command(name="status")
def status_command() -> None:
    """Print the daemon's endpoint, or that none is running."""
    st = read_state()
    click.echo(json.dumps(st, indent=2) if st else "no local stack daemon is running")
