"""Evaluation on Lambda (issue 15 item 4): forward only, eval mode, the user's loss and metrics.

A regression job (nothing assumes classification) with dropout, evaluated every 2 iterations and
after the last on a validation set whose size the plan does not divide: each evaluation equals
the model at that version (as the single-process reference trains it, dropout masks included),
in eval mode, on the whole set, by plain PyTorch — in float64.
"""

import dataclasses

import pytest
import torch
from torch import nn

from stagecoach import Job, JobError
from stagecoach.core import keys
from stagecoach.lambdas.evaluation import eval_batches
from stagecoach.planner.emit import asl
from stagecoach.reference import train_reference

G = torch.Generator().manual_seed(8)
X, XV = torch.randn(48, 6, generator=G, dtype=torch.float64), torch.randn(19, 6, generator=G, dtype=torch.float64)
W = torch.randn(6, 2, generator=G, dtype=torch.float64)
Y, YV = X @ W, XV @ W


def mae(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (output - target).abs().mean()


def model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Dropout(0.2), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2))


def regression_job(**kw) -> Job:
    base = dict(
        name="eval-reg",
        model=model,
        loss=nn.MSELoss(),
        optimizer=lambda p: torch.optim.Adam(p, lr=0.02),
        train=(X, Y),
        validation=(XV, YV),
        eval_every=2,
        metrics={"mae": mae},
        global_batch=12,
        iterations=5,
        seed=4,
        dtype=torch.float64,
    )
    return Job(**{**base, **kw})


def test_versions_batches_and_the_state_machine():
    job = regression_job()
    assert job.eval_versions() == [2, 4, 5]
    assert regression_job(eval_every=None).eval_versions() == [5]  # only the end of the run
    assert regression_job(validation=None, eval_every=None).eval_versions() == []
    # 19 samples over 2 replicas in micro-batches of 3: every sample once, the last batches shorter
    got = [b.tolist() for r in range(2) for b in eval_batches(19, 2, r, 3)]
    assert got == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9], [10, 11, 12], [13, 14, 15], [16, 17, 18]]
    plan = job.manual_plan(stages=2, replicas=2, micro_batches=2)
    d = asl.window_definition(plan, ["f0", "f1"], evals=job.eval_versions(), abort_key_format=keys.WINDOW_ABORT)
    assert d["States"]["Init"]["Parameters"]["evals"] == [2, 4, 5]
    assert d["States"]["Advance"]["Next"] == "EvaluateDue" and d["States"]["Evaluate"]["Next"] == "Gate"
    assert d["States"]["EvaluateDue"]["Parameters"]["due.$"] == "States.ArrayContains($.evals, $.t)"
    assert asl.window_length(plan, evals=[5]) < asl.window_length(plan)  # the history budget counts it


def test_bad_evaluation_settings_are_refused():
    with pytest.raises(JobError, match="eval_every is set but there is nothing to evaluate on"):
        regression_job(validation=None).validate()
    with pytest.raises(JobError, match="eval_every=0: must be a positive number"):
        regression_job(eval_every=0).validate()
    with pytest.raises(JobError, match="over a quarter of Step Functions' 256 KB payload"):
        regression_job(eval_every=1, iterations=20_000).validate()
    with pytest.raises(JobError, match=r"job.metrics\['mae'\] returned Tensor: it must return a scalar"):
        regression_job(metrics={"mae": lambda o, t: (o - t).abs()}).validate()


def reference_evaluations(job: Job, replicas: int, micro_batches: int) -> dict[int, tuple[float, float]]:
    """At each evaluated version: the single-process reference trained that far (it draws the
    runtime's dropout masks: stagecoach.reference), in eval mode on the whole validation set."""
    out = {}
    for v in job.eval_versions():
        net = train_reference(dataclasses.replace(job, iterations=v), replicas=replicas, micro_batches=micro_batches).eval()
        with torch.no_grad():
            pred = net(XV)
        out[v] = (float(job.loss(pred, YV)), float(mae(pred, YV)))
    return out


def test_evaluations_on_lambda_equal_plain_pytorch_in_eval_mode(backend):
    job = regression_job()
    run = job.run(stages=2, replicas=2, micro_batches=2, backend=backend)
    run.wait(progress=False, poll_s=0.2, timeout_s=600)
    got = run.evaluations()
    want = reference_evaluations(job, 2, 2)
    assert [e.version for e in got] == [2, 4, 5] and all(e.samples == 19 for e in got)
    for e in got:
        loss, err = want[e.version]
        assert abs(e.loss - loss) < 1e-10 and abs(e.metrics["mae"] - err) < 1e-10, (e, want[e.version])
    assert got[0].loss != got[-1].loss  # evaluated at different versions
    # the evaluate tasks are reported apart from the iterations they run between
    phases = {m.phase for m in run.metrics()}
    assert "evaluate" in phases and len(run.losses()) == job.iterations
    # each last-stage evaluate task reports its replica's means in its metrics (Run.metrics())
    last = [m for m in run.metrics() if m.phase == "evaluate" and m.t == 5 and m.loss is not None]
    assert len(last) == 2 and set(last[0].eval_metrics) == {"mae"}
    by_replica = {m.index: m.loss for m in last}  # replica 0 holds samples 0-9, replica 1 samples 10-18
    assert (10 * by_replica[0] + 9 * by_replica[1]) / 19 == pytest.approx(got[-1].loss, rel=1e-12)
    # and `stagecoach inspect` reports them
    from stagecoach.inspect.report import format_report, inspect_execution

    report = format_report(inspect_execution(backend, run.execution_arn))
    assert f"evaluation after 5 iterations (19 samples): validation loss {got[-1].loss:.4f}, validation mae" in report
