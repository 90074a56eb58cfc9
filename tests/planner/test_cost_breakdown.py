"""benchmarks/cost.py's breakdowns (issue 26, item 5): its parts add up to the predicted total, and
the Step Functions part agrees with the workflow choice's own arithmetic (planner/emit/workflow.py),
so the benchmark's table cannot drift from what ``stagecoach train`` predicts or ``auto`` picks."""

import math

import pytest

from stagecoach.core.cost import Usage
from stagecoach.planner.emit import asl


@pytest.fixture(scope="module")
def demo(bench):
    """The README demo's job and plan over 30 iterations, its predictions each way and auto's choice."""
    job, plan = bench.example_job("demo", 30, "auto")
    reports = {wf: job.predict_cost(plan, workflow=wf) for wf in bench.WORKFLOWS}
    return job, plan, reports, job.window_choice(plan, workflow="auto")


@pytest.mark.parametrize("wf", ["standard", "express"])
def test_components_and_phases_add_up_to_the_predicted_total(bench, demo, wf):
    _, _, reports, _ = demo
    r = reports[wf]
    assert sum(bench.components(r).values()) == pytest.approx(r.usd, rel=1e-12)
    assert sum(bench.phases(r).values()) == pytest.approx(r.usd, rel=1e-12)
    t = r.total
    orch = Usage(transitions=t.transitions, express_requests=t.express_requests, express_gb_s=t.express_gb_s, puts=t.puts, gets=t.gets)
    assert bench.orchestration_share(r) == pytest.approx(orch.usd(r.prices) / r.usd, rel=1e-12)
    assert 0 < bench.orchestration_share(r) < 1


def test_step_functions_part_is_the_workflow_choices_arithmetic(bench, demo):
    job, plan, reports, choice = demo
    job_fixed = asl.TRANSITIONS_JOB_FIXED * reports["standard"].prices.transition  # the job's start and end: not a window's
    # the choice leaves out the evaluation's and checkpoints' Map states (the same work either way)
    passes = sum(reports["standard"].phases.get(p, Usage()).transitions for p in ("evaluate", "checkpoint"))
    assert passes > 0  # the demo evaluates its test set after the last iteration
    std = bench.components(reports["standard"])
    assert std["SFN transitions"] == pytest.approx(
        choice.standard_usd + job_fixed + passes * reports["standard"].prices.transition, rel=1e-12
    )
    assert std["Express req"] == std["Express dur"] == 0.0
    exp = reports["express"]
    windows = math.ceil(30 / choice.window_length)
    assert choice.workflow == asl.EXPRESS and exp.total.express_requests == windows
    # the choice bounds a window's time with the evaluation pass's too: the prediction's durations are at most that
    parts = bench.components(exp)
    sfn = parts["SFN transitions"] + parts["Express req"] + parts["Express dur"]
    assert choice.express_usd is not None and job_fixed < sfn <= choice.express_usd + job_fixed + 1e-15
    # Express windows move no task's work: Lambda and S3 differ only by a gate per window (one before each iteration, one at each window's end)
    std_windows = math.ceil(30 / asl.window_length(plan, evals=job.eval_versions(), saves=job.checkpoint_versions()))
    assert exp.total.invocations - reports["standard"].total.invocations == windows - std_windows
    assert exp.total.gets - reports["standard"].total.gets == windows - std_windows  # the gate's GET of the stop request
    assert parts["S3 PUT/LIST"] == pytest.approx(std["S3 PUT/LIST"], rel=1e-12)
