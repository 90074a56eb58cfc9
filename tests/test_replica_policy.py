"""A replica policy (issue 27 item 1, docs/runtime.md "Dynamic workers"):
``job.run(stages=2, replicas=ReplicaPolicy(choose, choices=(1, 2)))``: the gate calls ``choose``
in the cloud, on the job's stage-0 function, at each window's first iteration with the run's
metrics so far, records the decision in the job's prefix, and the window runs the chosen d. With a
fixed global batch the run trains what plain PyTorch trains (float64, 1e-5) whatever d it picks;
a window that restarts reuses the recorded decision."""

import json
import math
import subprocess
import time

import pytest
from helpers import max_diff
from test_dynamic_workers import backward_tasks, make_job

from stagecoach import dynamic
from stagecoach.dynamic import PolicyMetrics, ReplicaPolicy
from stagecoach.planner.emit import asl
from stagecoach.planner.emit.asl_check import check_definition
from stagecoach.planner.plan import Plan, PlanError
from stagecoach.planner.segments import choice_plan, decided_plan
from stagecoach.reference import train_reference


def grow_then_shrink(m: PolicyMetrics) -> int:
    """d 1 for the first window; then 2 after a window of 1 whose loss was seen, else 1. It checks
    what the gate hands it: a loss per iteration so far, finite, the iteration's epoch (4
    iterations an epoch) and the d of the iteration before."""
    if len(m.losses) != m.iteration or not all(math.isfinite(x) for x in m.losses) or m.epoch != m.iteration // 4:
        raise ValueError(f"unexpected metrics {m}")
    if m.replicas is None:
        return 1
    return 2 if m.replicas == 1 and m.losses[-1] > 0 else 1


POLICY = ReplicaPolicy(choose=grow_then_shrink, choices=(1, 2))


def _policy_plan(job, **manual) -> Plan:
    return job.as_run(dynamic.manual_scheduled_plan(job, {"stages": 2, "replicas": POLICY, **manual}, job.manual_plan))


def test_a_policy_plan_is_its_largest_choice_s_with_its_choices_and_every_choice_s_window():
    plan = _policy_plan(make_job("policy-plan"))
    assert (plan.replicas, plan.choices, plan.segments, plan.aggregators) == (2, (1, 2), (), (1, 1))
    assert Plan.from_dict(plan.to_dict()) == plan and "choices" not in choice_plan(plan, 1).to_dict()
    definition = asl.window_definition(plan, ["f0", "f1"], abort_key_format="jobs/{}/abort/{}")
    assert check_definition(definition) == []
    states = definition["States"]
    assert states["Init"]["Next"] == "Enter_s1" and states["Gate_s0"]["ResultSelector"]["segment.$"] == "$.Payload.segment"
    assert {"Variable": "$.gate.segment", "NumericEquals": 1, "Next": "Segment"} in states["Go?_s0"]["Choices"]
    assert states["Segment"]["Choices"] == [{"Variable": "$.gate.segment", "NumericEquals": 0, "Next": "Switch_s0"}]
    assert states["Switch_s0"]["Parameters"]["ranks"] == [0] and states["Switch_s0"]["Next"] == "Go?_s0"
    decided = decided_plan(plan, [(0, 2, 1), (2, 4, 2), (4, 6, 2)])  # as the gate materializes decisions
    assert [(f, p.replicas) for f, p in decided.segments] == [(0, 1), (2, 2)] and decided.decided == 6
    assert Plan.from_dict(decided.to_dict()) == decided


def test_the_joined_policy_window_is_valid_asl(asl_validator, tmp_path):
    plan = _policy_plan(make_job("policy-asl"))
    path = tmp_path / "window.json"
    path.write_text(json.dumps(asl.window_definition(plan, ["f0", "f1"], abort_key_format="jobs/{}/abort/{}")))
    r = subprocess.run([asl_validator, "--json-path", str(path)], capture_output=True, text=True)
    assert r.returncode == 0 and "is valid" in r.stdout + r.stderr, r.stdout + r.stderr


@pytest.mark.parametrize(
    "run_options, words",
    [
        ({"replicas": lambda m: 2}, "choices"),
        ({"replicas": POLICY, "global_batch": {0: 24, 2: 48}}, "fixed global batch"),
        ({"replicas": POLICY, "max_cost": 1.0}, "max_cost"),
        ({"replicas": POLICY, "aggregators": 2}, "aggregators"),
        ({"replicas": POLICY, "sync": "scatter_reduce"}, "re-cutting"),
    ],
)
def test_what_a_policy_does_not_run_is_refused_up_front(run_options, words):
    with pytest.raises(PlanError, match=words):
        make_job("policy-refused").run(stages=2, backend="no-such-backend", **run_options)


def test_a_policy_s_choices_and_its_plan_are_checked_and_its_cost_is_not_predicted():
    for choices in ((), (0, 1), (2, 2)):
        with pytest.raises(PlanError, match="distinct d values"):
            ReplicaPolicy(choose=grow_then_shrink, choices=choices)
    job = make_job("policy-plan-only")
    plan = _policy_plan(job)
    with pytest.raises(PlanError, match="runs with the policy itself"):
        job.run(plan=plan, backend="no-such-backend")
    with pytest.raises(PlanError, match="decided at run time"):
        job.predict_cost(plan)
    with pytest.raises(PlanError, match="decided at run time"):
        job.predict(plan)


def _decisions(run) -> dict:
    body = run._c.s3.get_object(Bucket=run.bucket, Key=f"jobs/{run.job_id}/policy/decisions.json")["Body"].read()
    return json.loads(body)


def test_a_policy_s_changing_d_trains_what_plain_pytorch_trains(backend, monkeypatch):
    """Windows of 2 iterations ([0, 2) [2, 4) [4, 6)): the policy picks 1, then 2 (after a window of
    d = 1), then 1 again; each decision is recorded before its window runs and materialized in the
    job's spec, and the model equals plain PyTorch's."""
    monkeypatch.setattr(asl, "window_length", lambda plan, limit=asl.HISTORY_LIMIT, **kw: 2)
    job = make_job("policy-run", iterations=6)
    run = job.run(backend=backend, stages=2, replicas=POLICY)
    assert run.wait(progress=False, poll_s=0.2, timeout_s=600) == "SUCCEEDED"
    assert backward_tasks(run) == [1, 1, 2, 2, 1, 1]
    record = _decisions(run)
    assert record["decisions"] == [[0, 2, 1], [2, 4, 2], [4, 6, 1]]
    assert record["losses"] == pytest.approx(run.losses()[:4], rel=1e-12)  # what the policy saw at iteration 4
    spec_plan = Plan.from_dict(run.spec().plan)
    assert [spec_plan.plan_at(t).replicas for t in range(6)] == [1, 1, 2, 2, 1, 1] and spec_plan.decided == 6
    assert max_diff(run.trained_model(), job.build_model()) > 1e-3
    assert max_diff(run.trained_model(), train_reference(job)) < 1e-5


@pytest.mark.slow  # its own stack: a window restarted at its resume point
def test_a_restarted_window_reuses_the_recorded_decision(monkeypatch):
    """The window [2, 4) fails at t = 3 (backward): its next attempt starts at 3, where the gate
    finds the decision recorded at 2 and does not call the policy again."""
    from stagecoach.local.backend import LocalBackend  # the embedded stack: moto and a local Lambda runtime

    monkeypatch.setattr(asl, "window_length", lambda plan, limit=asl.HISTORY_LIMIT, **kw: 2)
    faulty = LocalBackend(faults={"once": [{"kind": "fail", "phase": "backward", "t": 3, "stage": 0, "replica": 0}]})
    try:
        job = make_job("policy-restart", iterations=6)
        run = job.run(backend=faulty, stages=2, replicas=POLICY, timeout_s=12)
        assert run.wait(progress=False, poll_s=0.2, timeout_s=600) == "SUCCEEDED"
        firsts = sorted(
            json.loads(faulty.clients.sfn.describe_execution(executionArn=a)["input"])["first"] for a in run.window_executions()
        )
        assert firsts == [0, 2, 3, 4]
        assert _decisions(run)["decisions"] == [[0, 2, 1], [2, 4, 2], [4, 6, 1]]
        assert backward_tasks(run) == [1, 1, 2, 2, 1, 1]
        assert max_diff(run.trained_model(), train_reference(job)) < 1e-5
    finally:
        faulty.stack.close()


@pytest.mark.slow  # stop and resume on the stack
def test_a_job_with_a_policy_stopped_and_resumed_keeps_its_decisions_and_trains_what_plain_pytorch_trains(backend, monkeypatch):
    """Stopped after a few windows of 2, then resumed to more iterations: the iterations already
    decided run the recorded d (the policy is not asked again for them), later windows are decided
    as they come, and the model equals plain PyTorch's."""
    monkeypatch.setattr(asl, "window_length", lambda plan, limit=asl.HISTORY_LIMIT, **kw: 2)
    long = make_job("policy-stop", iterations=1000).run(backend=backend, stages=2, replicas=POLICY)
    while not long.metrics() or long.iterations_done() < 3:
        time.sleep(0.2)
    long.stop()
    assert long.wait(progress=False, poll_s=0.2, timeout_s=600) == "STOPPED"
    before = _decisions(long)["decisions"]
    total = long.version() + 3
    resumed = backend.resume(long.job_id, iterations=total, job=make_job("policy-stop", iterations=1000))
    assert resumed.wait(progress=False, poll_s=0.2, timeout_s=600) == "SUCCEEDED"
    after = _decisions(resumed)["decisions"]
    assert [d for _, _, d in after[: len(before)]] == [d for _, _, d in before]  # the decisions made before the stop kept
    assert all(a[0] == b[0] for a, b in zip(after, before)) and len(after) > len(before)
    plan = Plan.from_dict(resumed.spec().plan)
    assert backward_tasks(resumed)[:total] == [plan.plan_at(t).replicas for t in range(total)]
    assert {plan.plan_at(t).replicas for t in range(total)} == {1, 2}
    assert max_diff(resumed.trained_model(), train_reference(make_job("policy-ref", iterations=total))) < 1e-5
