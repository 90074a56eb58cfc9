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


BATCH_NORM = """
import torch
from torch import nn
from stagecoach import Job

job = Job(model=lambda: nn.Sequential(nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU()),
                                      nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.BatchNorm2d(4), nn.Flatten()), nn.Linear(4, 3)),
          loss=nn.CrossEntropyLoss(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
          train=(torch.randn(32, 1, 6, 6), torch.randint(0, 3, (32,))), global_batch=8, iterations=2, name="bn")
"""


def test_plan_meta_sizes_a_batch_norm_model_and_explains_every_column(tmp_path):
    """--meta sizes batches of 2 and 3 for a model that normalises over the batch (a BatchNorm over a
    1 x 1 map refuses a batch of one: examples/amoebanet.py crashed there), and the legend explains
    every column once, 8x8 and (1,2^16) included."""
    f = tmp_path / "bn.py"
    f.write_text(BATCH_NORM)
    r = CliRunner().invoke(plan_command, [str(f), "--meta", "--time-limit", "2", "--plot", str(tmp_path / "p.png")])
    assert r.exit_code == 0, r.output
    assert "micro-batches per replica x samples per micro-batch (8x8: 8 micro-batches of 8)" in r.output
    assert "(a1,a2) of the objective" in r.output and "orchestration" in r.output
    assert "1x8" in r.output  # BatchNorm keeps the global batch together: one micro-batch of 8


def test_plan_and_job_plan_time_the_same_micro_batch_sizes(tmp_path, monkeypatch):
    """One rule (sweep.default_micro_batch_sizes) for `stagecoach plan` and Job.plan: the sizes
    timed are the sizes planned, 1, 2, 4, 8 for a model without batch coupling."""
    import stagecoach.cli.plan as cli_plan
    import stagecoach.job as job_module
    from stagecoach.cli.jobfile import load_job_file
    from stagecoach.planner.solve.sweep import default_micro_batch_sizes

    timed = []

    def spy(real):
        def measure(model, sample, micro_batch_sizes, **kw):
            timed.append(tuple(micro_batch_sizes))
            return real(model, sample, micro_batch_sizes, **kw)

        return measure

    monkeypatch.setattr(cli_plan, "measure_model", spy(cli_plan.measure_model))
    monkeypatch.setattr(job_module, "measure_model", spy(job_module.measure_model))
    f = tmp_path / "m.py"
    f.write_text(MODEL)
    r = CliRunner().invoke(plan_command, [str(f), "--time-limit", "2", "--plot", str(tmp_path / "p.png")])
    assert r.exit_code == 0, r.output
    res = load_job_file(str(f)).job.plan(time_limit=2)
    assert timed == [(1, 2, 4, 8), (1, 2, 4, 8)] == [default_micro_batch_sizes()] * 2
    assert {c.config.micro_batch for c in res.candidates} <= set(timed[1])
    assert default_micro_batch_sizes(batch_coupled=True) == (2, 4, 8)
