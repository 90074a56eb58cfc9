"""A loss that is NaN or infinite (issue 24 item 2) is reported as such — in the task metrics
written to S3, in Run.losses() and the progress bar, in `stagecoach inspect` — and the mean over
replicas is NaN when any replica's is; ``Job(stop_on_nonfinite_loss=True)`` ends the job at the
next iteration boundary (lambdas/gate.py), keeping its checkpoint."""

import json
import math
import types

import pytest
import torch
from torch import nn

from stagecoach import Job
from stagecoach.core.records import DatasetRef, EvalResult, JobSpec, TaskMetrics
from stagecoach.core.training import batch_indices, micro_batch
from stagecoach.inspect.report import Inspection, format_report
from stagecoach.metrics import _losses
from stagecoach.planner.plan import Plan
from stagecoach.run import Run

NAN, INF = float("nan"), float("inf")
# 2 stages x 2 replicas: the last stage's backward task of each replica reports its loss
PLAN = Plan(balance=[1, 1], replicas=2, micro_batches=1, global_batch=4, memory_mb=[1024, 1024])


def strict_json(body: bytes | str) -> object:
    """JSON as RFC 8259 and Step Functions read it: no NaN or Infinity constants."""

    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} is not JSON")

    return json.loads(body, parse_constant=refuse)


def strict_json_bytes(body: str) -> str:
    """``body``, once checked to be strict JSON."""
    strict_json(body)
    return body


def task(phase: str, t: int, stage: int, index: int, loss: float | None = None) -> TaskMetrics:
    return TaskMetrics(
        phase=phase, t=t, stage=stage, index=index, start=float(t), end=t + 0.5, duration_s=0.5,
        upload_s=0.0, download_s=0.0, transfer_s=0.0, wait_s=0.0, bytes_up=0, bytes_down=0, puts=1, gets=1,
        compute_s=0.5, container="c", container_started=0.0, invocation=1, cold=False, memory_mb=1024,
        max_rss_mb=100.0, loss=loss,
    )  # fmt: skip


def iteration(t: int, losses: tuple[float, float]) -> list[TaskMetrics]:
    """Every task of iteration t, as the workers write them (handler.py) and a reader parses them."""
    tasks = [task("forward", t, 0, r) for r in range(2)]
    tasks += [task("backward", t, 0, r) for r in range(2)] + [task("backward", t, 1, r, losses[r]) for r in range(2)]
    tasks += [task("sync", t, s, k) for s in range(2) for k in range(2)]
    return [TaskMetrics.model_validate_json(m.model_dump_json(exclude_none=True)) for m in tasks]


@pytest.mark.parametrize("value", [NAN, INF, -INF])
def test_a_nonfinite_loss_round_trips_through_the_task_metrics_as_valid_json(value):
    body = task("backward", 3, 1, 0, value).model_dump_json(exclude_none=True)  # as handler.py writes it
    assert strict_json(body)["loss"] == ("NaN" if math.isnan(value) else "Infinity" if value > 0 else "-Infinity")
    back = TaskMetrics.model_validate_json(body).loss
    assert back is not None and (math.isnan(back) if math.isnan(value) else back == value)


def test_every_record_reads_back_a_nonfinite_value_as_the_float_it_was():
    ev = EvalResult(version=4, replica=1, samples=10, loss_sum=NAN, metric_sums={"accuracy": INF})
    back = EvalResult.model_validate_json(strict_json_bytes(ev.model_dump_json()))
    assert math.isnan(back.loss_sum) and back.metric_sums == {"accuracy": INF}
    # the spec's untyped hyperparameters: an infinite one comes back a float, not a string or None
    spec = JobSpec(
        job="nf-0123abcd", name="nf", seed=0, iterations=2, global_batch=4, dtype="float32", layers=2,
        dataset=DatasetRef(id="d", n_train=4), plan=PLAN.to_dict(), created=0.0,
        optimizer_groups=[{"lr": 0.1, "max_norm": INF}, {"lr": 0.01, "max_norm": 1.0}], param_groups=[0, 1],
    )  # fmt: skip
    assert JobSpec.model_validate_json(spec.model_dump_json()).optimizer_groups == spec.optimizer_groups


def test_the_mean_over_replicas_is_nan_when_one_replicas_loss_is():
    metrics = iteration(0, (1.0, 1.16)) + iteration(1, (1.0, NAN)) + iteration(2, (INF, 1.0)) + iteration(3, (INF, -INF))
    got = _losses(metrics, 4)  # what `stagecoach inspect` shows
    assert got[0] == pytest.approx(1.08) and math.isnan(got[1]) and got[2] == INF and math.isnan(got[3])


def run_of(metrics: list[TaskMetrics], monkeypatch) -> Run:
    """A Run whose metrics are these (nothing read from a stack)."""
    job = types.SimpleNamespace(iterations=len(metrics) // 10, eval_versions=lambda: [])
    run = Run(types.SimpleNamespace(), job, PLAN, "nf-0123abcd", "arn:aws:states:r:1:execution:s-job:nf-0123abcd")  # type: ignore[arg-type]
    run._metrics = list(metrics)
    monkeypatch.setattr(run, "_fetch_metrics", lambda: None)
    return run


def test_run_losses_and_the_progress_bar_show_the_nan(monkeypatch, capsys):
    run = run_of(iteration(0, (1.0, 1.16)) + iteration(1, (1.0, NAN)), monkeypatch)
    losses = run.losses()
    assert losses[0] == pytest.approx(1.08) and math.isnan(losses[1])
    assert math.isnan(run.iteration_summary(1)["loss"])
    monkeypatch.setattr(run, "status", lambda: "STOPPED")
    assert run.wait(progress=True) == "STOPPED"
    assert "loss nan" in capsys.readouterr().err  # tqdm's postfix shows the last finished iteration's loss


def test_inspect_names_the_first_iteration_whose_loss_is_not_finite():
    ins = Inspection(
        execution_arn="arn", job_id="nf-0123abcd", status="RUNNING", console_url="", started="", stopped=None, error=None,
        plan={"balance": [1, 1], "replicas": 2, "micro_batches": 1, "memory_mb": [1024, 1024], "sync": ["scatter_reduce"] * 2},
        iterations=4, iterations_done=4, windows=1, window=None, phase_timings={}, losses=[NAN, 2.0, 1.0, INF], breakdown=[],
    )  # fmt: skip
    report = format_report(ins)
    assert "loss: first nan, last inf, min 1.0000 (finite); not finite in 2 of 4 iterations, first at iteration 0" in report
    assert "[0] nan [1] 2.0000 [2] 1.0000 [3] inf" in report


# ------------------------------------------------------------------------------ on the local stack
G = torch.Generator().manual_seed(7)
X, Y = torch.randn(32, 5, generator=G), torch.randint(0, 3, (32,), generator=G)
SEED, BATCH = 3, 8


def with_a_nan_sample(t: int, replica: int) -> torch.Tensor:
    """The training inputs with one sample of replica ``replica``'s slice of iteration t set to NaN
    (a bad row in the data: that replica's loss is NaN, the other's finite)."""
    i = int(micro_batch(batch_indices(SEED, t, len(X), BATCH), 2, 1, replica, 0)[0])
    assert i >= 4  # not among the samples Job.validate runs the model on
    x = X.clone()
    x[i] = NAN
    return x


def nan_job(name: str, iterations: int, stop: bool) -> Job:
    return Job(
        name=name,
        model=lambda: nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)),
        loss=nn.CrossEntropyLoss(),
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        train=(with_a_nan_sample(1, 1), Y),
        global_batch=BATCH,
        iterations=iterations,
        seed=SEED,
        stop_on_nonfinite_loss=stop,
    )


def test_a_nan_on_one_replica_is_a_nan_loss_and_the_option_stops_the_job(backend):
    plan = dict(stages=2, replicas=2, micro_batches=1)
    plain = nan_job("nf-plain", 4, stop=False).run(backend=backend, **plan)
    stopping = nan_job("nf-stop", 20, stop=True).run(backend=backend, **plan)
    assert plain.wait(progress=False, poll_s=0.2, timeout_s=600) == "SUCCEEDED"
    losses = plain.losses()
    assert math.isfinite(losses[0]) and all(math.isnan(v) for v in losses[1:])
    one = {m.index: m.loss for m in plain.metrics() if m.t == 1 and m.phase == "backward" and m.stage == 1}
    assert one[0] is not None and math.isfinite(one[0]) and one[1] is not None and math.isnan(one[1])
    # what the workers returned to Step Functions is JSON it can read (no NaN constant)
    outputs = [e["taskSucceededEventDetails"]["output"] for e in plain.history(windows=True) if e["type"] == "TaskSucceeded"]
    assert outputs and all(strict_json(o) for o in outputs)

    assert stopping.wait(progress=False, poll_s=0.2, timeout_s=600) == "STOPPED"
    record = stopping.stopped()
    assert record is not None and record.reason == "nonfinite_loss" and record.version == 2
    assert "iteration 1" in record.detail and "replica 1" in record.detail
    assert stopping.iterations_done() == 2 and math.isnan(stopping.losses()[1])
    assert {j.job: j.status for j in backend.jobs()}[stopping.job_id] == "STOPPED"
