"""The ``stagecoach`` command: train and plan a job file, inspect, stop and clean up runs, run a local stack.

Each command lives in a module of its own; this module only assembles the group.
"""

from __future__ import annotations

import click

from stagecoach.cli.cleanup import cleanup_command
from stagecoach.cli.console import console_command
from stagecoach.cli.inspect import inspect_command
from stagecoach.cli.lifecycle import list_command, resume_command
from stagecoach.cli.local import local_group
from stagecoach.cli.logs import logs_command
from stagecoach.cli.plan import plan_command
from stagecoach.cli.stop import stop_command
from stagecoach.cli.train import train_command


@click.group()
@click.version_option(package_name="stagecoach")
def main() -> None:
    """Pipelined, data-parallel PyTorch training on AWS Lambda and Step Functions."""


main.add_command(train_command, name="train")
main.add_command(plan_command, name="plan")
main.add_command(inspect_command, name="inspect")
main.add_command(stop_command, name="stop")
main.add_command(cleanup_command, name="cleanup")
main.add_command(local_group, name="local")
main.add_command(resume_command, name="resume")
main.add_command(list_command, name="list")
main.add_command(logs_command, name="logs")
main.add_command(console_command, name="console")

__all__ = ["main"]
