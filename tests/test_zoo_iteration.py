"""benchmarks/zoo_iteration.py plans every zoo model and estimates its run without running it
(--dry-run); the runs themselves take minutes each and are in docs/zoo.md, not in the test run."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_dry_run_plans_every_zoo_model_and_runs_nothing():
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "zoo_iteration.py"), "--dry-run", "--stages", "3", "--batch", "4"],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    ).stdout
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]] for line in out.splitlines() if line.startswith("| ")}
    assert set(rows) == {"model", "resnet101", "amoebanet_d18", "amoebanet_d36", "bert_large"}
    for name in ("resnet101", "amoebanet_d18", "amoebanet_d36", "bert_large"):
        params, stages, batch, per_stage = rows[name][:4]
        assert (stages, batch) == ("3", "4") and rows[name][-1] == "dry run"
        assert abs(sum(float(p) for p in per_stage.split(" / ")) - float(params)) <= 3  # the stages add up to the model
    assert "cores" in out.splitlines()[0]  # the date and the machine head the table
