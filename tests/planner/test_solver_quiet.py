"""The planner's MILP solves print nothing: no HiGHS log and no HiGHS banner (issue 28).

HiGHS prints its banner ("Running HiGHS ...: Copyright ...") at most once per process, so a solve
in this pytest process would print nothing whenever an earlier test had already solved: the solve
runs in a fresh interpreter, whose whole output is checked."""

import os
import subprocess
import sys
from pathlib import Path

from stagecoach.planner.solve.milp import _highs, _lin, _Model, _Var

ROOT = Path(__file__).resolve().parents[2]

# A small instance (4 layers, 3 tiers, 2 replicas, 4 micro-batches) solved by the exact MILP search,
# its profile test_milp's random one.
CHILD = f"""
import random, sys
sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
from test_milp import random_profile
from stagecoach.planner.model.platforms import aws_platform
from stagecoach.planner.solve.search import solve_fixed

prof = random_profile(random.Random(5), 4)
r = solve_fixed(prof, aws_platform(), 2, 2, 4, 1, 2**16, tiers=(2048, 4096, 10240), max_stages=3, time_limit=60)
print("RESULT", r.status, r.config is not None)
"""


def test_a_planner_solve_prints_no_highs_banner_or_log():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "RESULT optimal True" in out.stdout
    assert "HiGHS" not in out.stdout + out.stderr, out.stdout + out.stderr
    assert out.stdout.strip() == "RESULT optimal True", out.stdout


def test_the_quiet_solver_keeps_the_planners_options(capfd):
    """The quiet model still gets every option: limits, gaps, threads and the tuned MIP switches."""
    prob = _Model()
    x = _Var("x", 0, 3, integer=True)
    prob += _lin([(x, -1.0)])  # maximise x
    prob += _lin([(x, 1.0)]) <= 2.5, "cap"
    h = _highs(12.5, 1e-3, 2, None)
    prob.solve(h)
    assert x.value() == 2 and prob.value() == -2
    got = {k: h.getOptionValue(k)[1] for k in ("output_flag", "time_limit", "mip_rel_gap", "mip_abs_gap", "threads", "mip_allow_restart")}
    assert got == {
        "output_flag": False,
        "time_limit": 12.5,
        "mip_rel_gap": 1e-3,
        "mip_abs_gap": 0.0,
        "threads": 2,
        "mip_allow_restart": False,
    }
    out, err = capfd.readouterr()
    assert "HiGHS" not in out + err
