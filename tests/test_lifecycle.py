"""Attach, resume and list (issue 15 item 5): a finished job continued to more iterations ends
bit-identical to one that ran them all at once (data order, dropout masks, the schedule and Adam's
state are all functions of the seed and the iteration); a job is found from anywhere by its id.
"""

import time

import pytest
import torch
from torch import nn

from stagecoach import Job
from stagecoach.deploy.resources import DeployError
from stagecoach.deploy.resume import last_checkpoint

G = torch.Generator().manual_seed(23)
X, Y = torch.randn(48, 6, generator=G), torch.randint(0, 3, (48,), generator=G)


def make_job(name: str, iterations: int) -> Job:
    return Job(
        name=name,
        model=lambda: nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Dropout(0.1), nn.Linear(16, 3)),
        loss=nn.CrossEntropyLoss(),
        optimizer=lambda p: torch.optim.Adam(p, lr=0.01),
        scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5),
        train=(X, Y),
        global_batch=12,
        iterations=iterations,
        seed=5,
    )


PLAN = dict(stages=2, replicas=2, micro_batches=2)


@pytest.mark.slow  # three runs; the default set resumes a stopped job (below)
def test_a_resumed_job_ends_bit_identical_to_an_uninterrupted_one(backend):
    """One replica, warm state: the resumed tasks land in the first run's warm containers, which
    must read the rewritten spec (8 iterations) to store version 8 as the final checkpoint."""
    one = dict(stages=2, micro_batches=2)
    whole = make_job("life-whole", 8).run(backend=backend, **one)
    first = make_job("life-part", 4).run(backend=backend, **one)
    for run in (whole, first):
        run.wait(progress=False, poll_s=0.2, timeout_s=600)
    assert last_checkpoint(backend.clients, backend.resources.bucket, first.job_id) == 4
    with pytest.raises(DeployError, match="already: give --iterations above 4"):
        backend.resume(first.job_id)
    resumed = backend.resume(first.job_id, iterations=8, job=make_job("life-part", 4))
    assert resumed.execution_arn.endswith(f"{first.job_id}-r1") and resumed.job.iterations == 8
    resumed.wait(progress=False, poll_s=0.2, timeout_s=600)
    got, want = resumed.trained_model().state_dict(), whole.trained_model().state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)  # bit for bit
    assert resumed.losses() == whole.losses()  # iterations 0-3 from the first execution, 4-7 from the resumption
    # attach finds it from its id alone; list shows both jobs
    attached = backend.attach(first.job_id)
    assert attached.status() == "SUCCEEDED" and len(attached.losses()) == 8
    got = attached.trained_model().state_dict()  # without its Job: from the job's uploaded code
    assert all(torch.equal(got[k], want[k]) for k in want)
    listed = {j.job: j for j in backend.jobs()}
    assert listed[first.job_id].status == "SUCCEEDED" and listed[first.job_id].iterations == 8
    assert listed[whole.job_id].name == "life-whole"
    with pytest.raises(DeployError, match="no job life-none-1a2b3c4d"):
        backend.attach("life-none-1a2b3c4d")


def test_a_stopped_job_resumes_to_the_parameters_of_an_uninterrupted_one(backend):
    """Stopped at an iteration boundary (Run.stop: the iteration gate), listed as STOPPED, then
    resumed to 3 iterations past the checkpoint it kept: bit-identical to those iterations at once."""
    long = make_job("life-stop", 1000).run(backend=backend, **PLAN)  # far more than it runs before the stop
    while not long.metrics() or long.iterations_done() < 2:  # metrics() reads what the tasks wrote so far
        time.sleep(0.2)
    long.stop()
    assert long.wait(progress=False, poll_s=0.2, timeout_s=600) == "STOPPED"
    assert {j.job: j.status for j in backend.jobs()}[long.job_id] == "STOPPED"
    kept = long.version()
    assert 0 <= kept <= long.iterations_done()
    total = kept + 3
    whole = make_job("life-whole2", total).run(backend=backend, **PLAN)
    resumed = backend.resume(long.job_id, iterations=total, job=make_job("life-stop", 1000))
    assert resumed.wait(progress=False, poll_s=0.2, timeout_s=600) == "SUCCEEDED"
    whole.wait(progress=False, poll_s=0.2, timeout_s=600)
    got, want = resumed.trained_model().state_dict(), whole.trained_model().state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_a_stopped_and_resumed_job_has_one_status_and_one_cost_everywhere(backend, monkeypatch, tmp_path):
    """Issue 28: stopped, then resumed by `stagecoach resume` (no Job: the model comes from the
    job's uploaded code), the job is SUCCEEDED in `list`, in `inspect` of its first execution (which
    itself ended STOPPED) and of its id; `resume` reports and saves it as `train` does, at the cost
    `inspect` shows; and a stopped job cleaned up is still listed as STOPPED, not FAILED."""
    from click.testing import CliRunner
    from safetensors.torch import load_file

    from stagecoach.cli import main, options

    monkeypatch.setattr(options, "running_stack", lambda: object())  # the session's stack stands in for the daemon
    cli = CliRunner()
    run = make_job("life-one", 1000).run(backend=backend, **PLAN)
    while not run.metrics() or run.iterations_done() < 1:
        time.sleep(0.2)
    run.stop()
    assert run.wait(progress=False, poll_s=0.2, timeout_s=600) == "STOPPED"
    total = run.version() + 2
    r = cli.invoke(main, ["resume", run.job_id, "--iterations", str(total), "--out", str(tmp_path)])
    assert r.exit_code == 0, r.output
    assert f"after {total} iterations" in r.output and "cost on AWS: measured $" in r.output, r.output
    resumed_cost = next(line for line in r.output.splitlines() if line.startswith("cost on AWS: measured $"))
    resumed_report = r.output
    saved = load_file(str(tmp_path / run.job_id / "model.safetensors"))
    attached = backend.attach(run.job_id)  # no Job either
    assert attached.job is None and all(torch.equal(v, attached.trained_model().state_dict()[k]) for k, v in saved.items())
    with_job = backend.attach(run.job_id, job=make_job("life-one", 1000)).trained_model().state_dict()
    assert all(torch.equal(v, with_job[k]) for k, v in saved.items())
    # one status: list, inspect by id, inspect of the first execution (which ended STOPPED)
    assert run.status() == "STOPPED"  # that execution's own chain
    listed = {line.split()[0]: line.split()[2] for line in cli.invoke(main, ["list"]).output.splitlines()[1:]}
    assert listed[run.job_id] == "SUCCEEDED"
    for ref in (run.job_id, run.execution_arn):
        r = cli.invoke(main, ["inspect", ref])
        assert r.exit_code == 0 and f"job {run.job_id}: SUCCEEDED" in r.output, r.output
        # one cost: what resume reported ("cost on AWS: measured ...; predicted" where train predicts)
        lines = r.output.splitlines()
        at = next((i for i, line in enumerate(lines) if line.startswith("cost: measured ")), 0)
        shown = "\n".join(lines[at : at + 2])
        assert shown.startswith("cost: measured " + resumed_cost.removeprefix("cost on AWS: measured ")), (ref, resumed_report, shown)
    assert f"the job went on as {run.execution_arn}-r1" in cli.invoke(main, ["inspect", run.execution_arn]).output
    # the cost counts both chains (the stopped first and the resumed), whichever Run asks: each
    # Run's own chain alone made the two inspects above agree only when the chains had as many states
    assert run.job_executions() == [run.execution_arn, run.execution_arn + "-r1"]
    events = [e for arn in run.job_executions() + run.window_executions() for e in run.history(execution_arn=arn)]
    entered = sum(e["type"].endswith("StateEntered") for e in events)
    retries = sum(e["type"] == "TaskScheduled" for e in events) - sum(e["type"] == "TaskStateEntered" for e in events)
    assert run.cost().total.transitions == attached.cost().total.transitions == entered + retries
    # a stopped job cleaned up: its stop record is gone, its execution's error is not
    gone = make_job("life-gone", 1000).run(backend=backend, stages=1)
    while not gone.metrics():
        time.sleep(0.2)
    gone.stop()
    assert gone.wait(progress=False, poll_s=0.2, timeout_s=600) == "STOPPED"
    assert cli.invoke(main, ["cleanup", gone.job_id]).exit_code == 0
    listed = {line.split()[0]: line.split()[-4] for line in cli.invoke(main, ["list"]).output.splitlines()[1:]}
    assert listed[gone.job_id] == "STOPPED", listed


def test_a_run_without_its_job_rebuilds_the_model_from_the_uploaded_code(backend):
    """Issue 28: ``attach(job_id)`` without ``job=`` gives the trained model from the job's code
    as the launch uploaded it: for a model cut at ``blocks=``, the user's own module back; for
    frozen weights that ``init_from`` gave, those (uploaded with the buffers), not the factory's."""
    import dataclasses

    from test_any_model import make_job as bert_job

    frozen = lambda: nn.Sequential(nn.Linear(6, 16).requires_grad_(False), nn.Tanh(), nn.Linear(16, 3))  # noqa: E731
    pretrained = {k: torch.randn(v.shape, generator=torch.Generator().manual_seed(3)) for k, v in frozen().state_dict().items()}
    jobs = {
        "blocks": (dataclasses.replace(bert_job("life-blocks", lambda p: torch.optim.SGD(p, lr=0.05)), iterations=2), dict(stages=2)),
        "init_from": (dataclasses.replace(make_job("life-init", 2), model=frozen, init_from=pretrained), dict(stages=1)),
    }
    runs = {k: job.run(backend=backend, **plan) for k, (job, plan) in jobs.items()}
    for name, run in runs.items():
        assert run.wait(progress=False, poll_s=0.2, timeout_s=600) == "SUCCEEDED", name
        want = run.trained_model()
        got = backend.attach(run.job_id).trained_model()
        assert type(got) is type(want), name
        assert got.state_dict().keys() == want.state_dict().keys(), name
        assert all(torch.equal(got.state_dict()[k], v) for k, v in want.state_dict().items()), name
    assert torch.equal(backend.attach(runs["init_from"].job_id).trained_model()[0].weight, pretrained["0.weight"])


def test_a_run_nobody_waited_on_is_learnt_from_by_the_first_inspect(backend, monkeypatch):
    """`train --no-wait`: no Run.wait records the run's task durations for the job's next run;
    the first `stagecoach inspect` that finds it SUCCEEDED does, and an older run never replaces a
    newer one's record."""
    from click.testing import CliRunner

    from stagecoach import history
    from stagecoach.cli import main, options

    monkeypatch.setattr(options, "running_stack", lambda: object())  # the session's stack stands in for the daemon
    s3, bucket = backend.clients.s3, backend.resources.bucket
    older, newer = make_job("life-learn", 2).run(backend=backend, stages=1), make_job("life-learn", 2).run(backend=backend, stages=1)
    deadline = time.time() + 300
    while {older.status(), newer.status()} != {"SUCCEEDED"} and time.time() < deadline:  # not wait(): it would learn
        time.sleep(0.2)
    assert history.recorded_job(s3, bucket, "life-learn") is None
    r = CliRunner().invoke(main, ["inspect", newer.job_id])
    assert r.exit_code == 0 and "SUCCEEDED" in r.output, r.output
    assert history.recorded_job(s3, bucket, "life-learn") == newer.job_id
    assert CliRunner().invoke(main, ["inspect", older.job_id]).exit_code == 0
    assert history.recorded_job(s3, bucket, "life-learn") == newer.job_id  # the newer run's stays
