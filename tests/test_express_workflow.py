"""Which workflow type a job's windows run as (planner/emit/workflow.py), and the job definition's
two ways of running a window (planner/emit/asl.py): unit tests, no stack."""

from __future__ import annotations

import math

import pytest

from stagecoach import Job
from stagecoach.planner.emit import asl, workflow
from stagecoach.planner.emit.job_input import JobInput
from stagecoach.planner.limits import EXPRESS_MAX_DURATION_S
from stagecoach.planner.model.platforms import aws_platform
from stagecoach.planner.plan import Plan, PlanError

AWS = aws_platform()


def small(replicas: int = 1) -> Plan:
    return Plan(balance=[1, 1], replicas=replicas, micro_batches=1, global_batch=8 * replicas)


def test_auto_picks_express_when_its_windows_fit_and_cost_less():
    c = workflow.choose("auto", small(), 1000, 1.5, AWS)
    assert c.workflow == asl.EXPRESS
    # 1.5 s an iteration, with 2x to spare: 100 iterations in 300 s
    assert c.window_length == min(asl.window_length(small()), int(EXPRESS_MAX_DURATION_S // (1.5 * workflow.EXPRESS_SAFETY))) == 100
    assert c.express_usd is not None and c.express_usd < c.standard_usd


def test_a_window_never_plans_past_the_express_limit_with_room_to_spare():
    for seconds in (0.01, 0.3, 2.0, 7.0, 40.0, 149.0):
        c = workflow.choose("express", small(), 500, seconds, AWS)
        assert c.window_length * seconds * workflow.EXPRESS_SAFETY <= EXPRESS_MAX_DURATION_S
        assert c.window_length <= asl.window_length(small())


def test_auto_keeps_standard_when_one_iteration_does_not_fit_and_express_is_refused():
    c = workflow.choose("auto", small(), 10, 200.0, AWS)
    assert (c.workflow, c.express_usd) == (asl.STANDARD, None) and "300 s" in c.why_not
    with pytest.raises(PlanError, match="workflow='express' cannot run"):
        workflow.choose("express", small(), 10, 200.0, AWS)


def test_express_is_refused_for_a_plan_whose_phases_run_in_groups():
    wide = small(replicas=41)  # a phase Map of 41 tasks runs in groups, started with .sync:2
    assert workflow.needs_groups(wide)
    with pytest.raises(PlanError, match=r"cannot run a \.sync integration"):
        workflow.choose("express", wide, 100, 1.0, AWS)
    assert workflow.choose("auto", wide, 100, 1.0, AWS).workflow == asl.STANDARD


def test_standard_needs_no_prediction_and_is_the_jobs_default():
    c = workflow.choose("standard", small(), 100, None, AWS)
    assert (c.workflow, c.window_length) == (asl.STANDARD, asl.window_length(small()))
    assert JobInput.model_fields["windowType"].default == asl.STANDARD
    assert Job.__dataclass_fields__["workflow"].default == "standard"
    with pytest.raises(PlanError):
        workflow.choose("fast", small(), 100, 1.0, AWS)
    with pytest.raises(PlanError):
        Plan(balance=[1], workflow="fast")


def test_the_costs_are_the_billed_quantities_at_the_list_prices():
    plan, n, seconds, length = small(), 250, 0.55, 100
    std = workflow.standard_usd(plan, n, length, AWS)
    transitions = asl.transitions_per_iteration(plan) * n + 3 * (asl.TRANSITIONS_WINDOW_FIXED + asl.TRANSITIONS_JOB_PER_WINDOW)
    assert std == pytest.approx(transitions * 0.025 / 1000)
    exp = workflow.express_usd(n, length, seconds, 64, AWS)
    billed_s = 2 * math.ceil(100 * seconds * 10 - 1e-9) / 10 + math.ceil(50 * seconds * 10 - 1e-9) / 10  # 55.0 + 55.0 + 27.5
    want = 3 * 1.00 / 1e6 + billed_s * 64 / 1024 * 0.00001667 + 3 * asl.TRANSITIONS_JOB_PER_EXPRESS_WINDOW * 0.025 / 1000
    assert exp == pytest.approx(want)


def test_express_memory_is_billed_in_64_mb_chunks_from_50_mb():
    tiny = {"StartAt": "P", "States": {"P": {"Type": "Pass", "End": True}}}
    assert workflow.express_memory_mb(tiny, 100) == 64
    maps = {"States": {f"M{i}": {"Type": "Map"} for i in range(100)}}
    assert workflow.express_memory_mb(maps, 200_000) == 128  # 50 MB + 100 x 200 KB


def test_the_job_runs_an_express_window_with_start_sync_execution_and_reads_its_status():
    states = asl.job_definition()["States"]
    assert states["WindowType?"]["Choices"] == [{"Variable": "$.windowType", "StringEquals": "EXPRESS", "Next": "RunExpressWindow"}]
    run = states["RunExpressWindow"]
    assert run["Resource"] == "arn:aws:states:::aws-sdk:sfn:startSyncExecution"
    assert run["Parameters"] == states["RunWindow"]["Parameters"]
    assert run["TimeoutSeconds"] > EXPRESS_MAX_DURATION_S
    assert states["ExpressEnded?"]["Choices"][0] == {"Variable": "$.run.Status", "StringEquals": "SUCCEEDED", "Next": "Advance"}
    # a failed Express window reaches the same reading as a failed Standard one: its Error and Cause
    assert states["ExpressFailed"]["Parameters"]["child.$"] == "$.run" and states["ExpressFailed"]["Next"] == "Killed?"
    for name in ("LastWindow", "FullWindow", "NextAttempt"):
        assert states[name]["Next"] == "WindowType?"


def test_train_takes_a_workflow_and_plan_prints_both_costs():
    from click.testing import CliRunner

    from stagecoach.cli.train import train_command

    option = next(p for p in train_command.params if p.name == "workflow")
    assert list(option.type.choices) == ["auto", "standard", "express"] and option.default is None
    result = CliRunner().invoke(train_command, ["job.py", "--workflow", "fast"])
    assert result.exit_code == 2 and "'fast' is not one of" in result.output


def test_plan_prints_standard_against_express_for_the_recommended_plan():
    from stagecoach.cli.plan import workflow_line
    from stagecoach.planner.profile.zoo import zoo_profile
    from stagecoach.planner.solve.sweep import plan_model

    res = plan_model(zoo_profile("resnet101"), 64, AWS, max_layers=6, max_stages=2, micro_batch_sizes=(8,), time_limit=5)
    line = workflow_line(res)
    c = workflow.choose("auto", res.recommended.to_plan(), 1000, res.recommended.time_s, AWS)
    assert f"Standard ${c.standard_usd:.4f}" in line and line.endswith(f"auto: {c.workflow.title()}")
    if c.express_usd is not None:
        assert f"Express ${c.express_usd:.4f}" in line
