"""`stagecoach plan FILE` (a job file, as `stagecoach train` reads) prints the table and writes the Pareto PNG and the plan JSON."""

from click.testing import CliRunner

from stagecoach.cli.plan import plan_command
from stagecoach.planner.plan import Plan

MODEL = """
import torch
from stagecoach import Job

job = Job(model=lambda: torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)),
          loss=torch.nn.CrossEntropyLoss(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
          train=(torch.randn(64, 32), torch.randint(0, 4, (64,))), global_batch=16, iterations=10, name="m")
"""


def test_plan_command_writes_table_png_and_plan(tmp_path):
    f = tmp_path / "m.py"
    f.write_text(MODEL)
    png, js = tmp_path / "p.png", tmp_path / "plan.json"
    r = CliRunner().invoke(plan_command, [str(f), "--time-limit", "2", "--plot", str(png), "--json", str(js)])
    assert r.exit_code == 0, r.output
    header = next(line for line in r.output.splitlines() if "s/iter" in line)
    for col in ("stages", "tier MB/stage", "d", "micro-batches", "sync/stage", "$/iter", "$/epoch", "orch. $ share"):
        assert col in header
    assert "*" in r.output and "sync per stage:" in r.output
    assert png.stat().st_size > 1000
    plan = Plan.from_json(js.read_text())
    assert sum(plan.balance) == 3 and plan.global_batch == 16
    assert len(plan.sync) == len(plan.aggregators) == plan.stages  # the sync algorithm of every stage


def test_plan_command_refuses_bad_micro_batch_sizes(tmp_path):
    f = tmp_path / "m.py"
    f.write_text(MODEL)
    r = CliRunner().invoke(plan_command, [str(f), "--micro-batch-sizes", "4,x"])
    assert r.exit_code != 0 and "--micro-batch-sizes" in r.output


def test_plan_command_explains_a_bad_file(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("x = 1\n")
    r = CliRunner().invoke(plan_command, [str(f)])
    assert r.exit_code != 0 and "defines no `job`" in r.output
