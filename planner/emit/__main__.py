"""Regenerate statemachines/job.asl.json (deployed by SAM) from the emitter: ``python -m stagecoach.planner.emit``.

A real command line, so that ``--help`` prints usage instead of being taken for the output path
(it used to write the state machine to a file named ``--help``)."""

import argparse
import json
import sys

from stagecoach.planner.emit.asl import job_definition

DEFAULT_PATH = "statemachines/job.asl.json"


def main(argv: list[str] | None = None) -> int:
    """Write the job state machine's definition (ASL JSON) to the path given, or print it for ``-``."""
    parser = argparse.ArgumentParser(
        prog="python -m stagecoach.planner.emit",
        description="Write the job state machine's definition (Amazon States Language JSON), which SAM deploys from statemachines/job.asl.json.",
    )
    parser.add_argument(
        "output",
        nargs="?",
        default=DEFAULT_PATH,
        help=f"file to write, relative to the current directory (default: {DEFAULT_PATH}); '-' prints it instead",
    )
    args = parser.parse_args(argv)
    text = json.dumps(job_definition(), indent=2) + "\n"
    if args.output == "-":
        sys.stdout.write(text)
    else:
        with open(args.output, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
