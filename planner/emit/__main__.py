"""Regenerate statemachines/job.asl.json (deployed by SAM) from the emitter: ``python -m stagecoach.planner.emit``."""

import json
import sys

from stagecoach.planner.emit.asl import job_definition

if __name__ == "__main__":
    path = sys.argv[1] if len(sys.argv) > 1 else "statemachines/job.asl.json"
    with open(path, "w") as f:
        f.write(json.dumps(job_definition(), indent=2) + "\n")
