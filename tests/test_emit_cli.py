"""``python -m stagecoach.planner.emit``: writes the job state machine where asked, and ``--help``
prints usage and writes nothing (it used to write the definition to a file named ``--help``)."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHECKED_IN = ROOT / "statemachines" / "job.asl.json"


def emit(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "stagecoach.planner.emit", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


def test_help_prints_usage_and_writes_nothing(tmp_path):
    for flag in ("--help", "-h"):
        out = emit(tmp_path, flag)
        assert out.returncode == 0, out.stderr
        assert out.stdout.startswith("usage: python -m stagecoach.planner.emit [-h] [output]")
        assert "statemachines/job.asl.json" in out.stdout
    assert list(tmp_path.iterdir()) == []


def test_an_unknown_option_is_refused_and_writes_nothing(tmp_path):
    out = emit(tmp_path, "--out", "x.json")
    assert out.returncode == 2 and "unrecognized arguments" in out.stderr
    assert list(tmp_path.iterdir()) == []


def test_it_writes_the_checked_in_definition_to_the_path_given(tmp_path):
    out = emit(tmp_path, "job.json")
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "job.json").read_text() == CHECKED_IN.read_text()
    assert list(tmp_path.iterdir()) == [tmp_path / "job.json"]


def test_by_default_it_writes_statemachines_job_asl_json(tmp_path):
    (tmp_path / "statemachines").mkdir()
    out = emit(tmp_path)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "statemachines" / "job.asl.json").read_text() == CHECKED_IN.read_text()


def test_a_dash_prints_the_definition(tmp_path):
    out = emit(tmp_path, "-")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == json.loads(CHECKED_IN.read_text())
    assert list(tmp_path.iterdir()) == []
