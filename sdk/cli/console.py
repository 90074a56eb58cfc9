"""`stagecoach console`: the stack's jobs in the browser (stagecoach.console, docs/console.md)."""

from __future__ import annotations

import webbrowser

import click

from stagecoach.cli.options import backend_for, backend_option, region_option, stack_option
from stagecoach.console import create_app, missing_libraries, serve
from stagecoach.console.app import missing_message
from stagecoach.local.backend import CONSOLE_PORT


@click.command(name="console")
@click.option(
    "--port", type=click.IntRange(0, 65535), default=CONSOLE_PORT, show_default=True, help="the port to serve on (0: any free one)"
)
@click.option("--host", default="127.0.0.1", show_default=True, help="the address to listen on (the console has no login: keep it local)")
@click.option("--open/--no-open", "open_browser", default=True, help="open the page in the default browser")
@backend_option
@stack_option
@region_option
def console_command(port: int, host: str, open_browser: bool, backend: str | None, stack: str | None, region: str | None) -> None:
    """Serve a page with the stack's jobs and follow them as they run: executions and windows, the
    window state machine's graph, events, the tasks' Gantt chart, loss, learning-rate and
    evaluation curves, predicted and measured cost, failed tasks with their worker's log.

    Locally it attaches to the `stagecoach local start` daemon's stack (jobs started in other
    commands live there); with --stack, to a SAM stack on AWS. Ctrl-C stops the server, not the jobs."""
    missing = missing_libraries()
    if missing:
        raise click.ClickException(missing_message(missing))
    b = backend_for(backend, stack, region, need_daemon=True)
    try:
        server = serve(create_app(b), host, port)
    except OSError as e:
        raise click.ClickException(f"cannot listen on {host}:{port}: {e} (choose another --port)") from None
    url = f"http://{host}:{server.server_port}/"
    click.echo(f"console: {url} ({b.name} stack {b.resources.prefix}); Ctrl-C stops it")
    if open_browser:
        webbrowser.open(url)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
