"""Express windows train exactly as Standard ones, and a lost, failed or repeated window changes nothing.

A job's windows run as EXPRESS state machines when it asks (Job(workflow="express"); planner/emit/
workflow.py): its Standard job execution starts each with aws-sdk:sfn:startSyncExecution and reads
the answer's Status. A synchronous Express start is at-most-once (it may be lost, before or after
its execution ran: local/express.py injects both), and a window may run twice; each restarts from
the window's checkpoint (lambdas/resumepoint.py), so the trained parameters are bit-identical to a
Standard run's, which the exactness tests hold equal to plain PyTorch.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from helpers import recovery_job, same_parameters

from stagecoach.core import keys
from stagecoach.core.cost import Usage, watcher_usage
from stagecoach.cost import express_gates
from stagecoach.deploy.resources import read_json
from stagecoach.inspect.express import express_windows
from stagecoach.inspect.report import inspect_execution
from stagecoach.local.backend import LocalBackend
from stagecoach.local.express import ENV as FAULTS_ENV
from stagecoach.planner import plan as plan_module
from stagecoach.planner.emit import asl
from stagecoach.reference import train_reference
from stagecoach.run import phase_watchers

WINDOW = 2  # windows [0, 2), [2, 4), [4, 5)
TIMEOUT_S = 20


@pytest.fixture(scope="module", autouse=True)
def short_windows():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(asl, "window_length", lambda plan, limit=asl.HISTORY_LIMIT, **kw: WINDOW)
        mp.setattr(plan_module, "WRITE_THROUGH_BYTES", 0)  # warm state: parameters only at window checkpoints
        yield


def run(backend, name: str, workflow: str):
    job = dataclasses.replace(recovery_job(name), workflow=workflow)
    r = job.run(stages=2, replicas=1, micro_batches=2, timeout_s=TIMEOUT_S, backend=backend)
    status = r.wait(progress=False, poll_s=1.0, timeout_s=900)
    assert status == "SUCCEEDED", r.failure()
    return r


def job_history(r) -> list[dict]:
    return [ev for arn in r.executions() for ev in r.history(execution_arn=arn)]


def window_runs(r) -> list[dict]:
    """What each of the job's startSyncExecution tasks answered (its Status, ...), in order."""
    return [
        json.loads(ev["taskSucceededEventDetails"]["output"])
        for ev in job_history(r)
        if ev["type"] == "TaskSucceeded" and ev["taskSucceededEventDetails"].get("resource") == "startSyncExecution"
    ]


@pytest.fixture(scope="module")
def standard(backend):
    return run(backend, "std", "standard")


def test_express_windows_train_bit_identically_to_standard_ones(backend, standard):
    r = run(backend, "expr", "express")
    assert same_parameters(r.trained_model(), standard.trained_model())
    # and plain PyTorch's (as tests/test_exactness.py compares: the same sums, up to float32 rounding)
    want = r.job.user_model(train_reference(r.job, micro_batches=2)).state_dict()
    got = r.trained_model().state_dict()
    assert max(float((got[k].double() - want[k].double()).abs().max()) for k in want) < 1e-6
    window = r.spec().window_state_machine
    described = r._c.sfn.describe_state_machine(stateMachineArn=window)
    assert described["type"] == "EXPRESS"
    # its events go to the stack's log group, with their data (level ALL: what the console shows)
    logging = described["loggingConfiguration"]
    assert (logging["level"], logging["includeExecutionData"]) == ("ALL", True)
    assert logging["destinations"][0]["cloudWatchLogsLogGroup"]["logGroupArn"].endswith(
        ":log-group:/aws/vendedlogs/states/stagecoach-windows:*"
    )
    assert r.window_executions() == []  # no ListExecutions for Express: the job's history has the windows
    runs = window_runs(r)
    assert [w["Status"] for w in runs] == ["SUCCEEDED"] * 3
    assert [json.loads(w["Input"])["start"] for w in runs] == [0, 2, 4]
    assert all(":express:" in w["ExecutionArn"] for w in runs)
    entered = [ev["stateEnteredEventDetails"]["name"] for ev in job_history(r) if ev["type"].endswith("StateEntered")]
    assert entered.count("RunExpressWindow") == 3 and "RunWindow" not in entered
    assert read_json(r._c.s3, r.bucket, keys.job_spec(r.job_id))["window_length"] == WINDOW
    # measured: the windows' requests and billed duration x memory, from their answers; no window
    # state is a billed transition, only the job's states are
    cost, billing = r.cost(), [w["BillingDetails"] for w in runs]
    assert cost.total.express_requests == 3
    assert cost.total.express_gb_s == pytest.approx(
        sum(b["BilledDurationInMilliseconds"] / 1000 * b["BilledMemoryUsedInMB"] / 1024 for b in billing)
    )
    assert all(cost.phases[p].transitions == 0 for p in ("forward", "backward", "sync"))
    # the windows' events, from the stack's window log group (no history API for Express): one run
    # of each, its 8 gates (one before each of the 5 iterations, one at each window's end) counted
    # as in the Standard run, whose windows' histories show them
    runs = r.express_window_histories()
    assert [ev[0]["type"] for ev in runs] == ["ExecutionStarted"] * 3
    assert [ev[-1]["type"] for ev in runs] == ["ExecutionSucceeded"] * 3
    gates = sum((express_gates(ev) for ev in runs), Usage())
    print(f"measured Express gates: {gates.invocations} invocations, {gates.gb_s:.4f} GB-s; {cost.quantities()}")
    assert gates.invocations == 5 + 3
    assert cost.phases["orchestration"].invocations == standard.cost().phases["orchestration"].invocations
    job_states = sum(ev["type"].endswith("StateEntered") for ev in job_history(r))
    assert cost.total.transitions == job_states < standard.cost().total.transitions / 3
    # predicted alike: 3 windows, each a request and 8 of the job's transitions, and its 2 fixed ones
    predicted = r.job.predict_cost(r.plan, workflow="express")
    assert predicted.total.express_requests == 3
    assert predicted.total.transitions == 3 * asl.TRANSITIONS_JOB_PER_EXPRESS_WINDOW + asl.TRANSITIONS_JOB_FIXED == job_states


def _express_log(backend) -> list[str]:
    with open(backend.stack.log_path) as f:
        return [line.strip() for line in f if line.startswith("[express]")]


def test_a_lost_failed_or_repeated_window_changes_nothing(standard):
    """Window [0, 2) runs and its answer is lost (the job restarts it: its resume point is its end);
    [2, 4) is lost before it runs (restarted from 2); [4, 5) runs twice (the second run, a window
    already past, fails on its warm state and is restarted from its end): the job completes with
    the parameters of the fault-free Standard run."""
    mp = pytest.MonkeyPatch()
    mp.setenv(FAULTS_ENV, json.dumps({"lose_after": ["w0-"], "lose_before": ["w2-"], "repeat": ["w4-"]}))
    try:
        faulty = LocalBackend(faults={"seed": 0})  # a stack of its own, which reads the env when it starts
    finally:
        mp.undo()
    try:
        r = run(faulty, "lossy", "express")
        assert same_parameters(r.trained_model(), standard.trained_model())
        log = _express_log(faulty)
        for kind in ("lose_after", "lose_before", "repeat"):
            assert sum(f"injected {kind}" in line for line in log) == 1, log
        # [0, 2) ran to its end before its answer was lost; [4, 5) ran twice
        assert any(line.startswith("[express] w0-") and "SUCCEEDED after" in line for line in log), log
        assert sum(line.startswith("[express] w4-") and " after " in line for line in log) >= 2, log
        # the job saw two failed starts and restarted both: [0, 2) from its end (its resume point),
        # [2, 4) from its start; the repeated [4, 5) answered once, for its second run
        failed = [ev for ev in job_history(r) if ev["type"] == "TaskFailed"]
        assert len([ev for ev in failed if ev["taskFailedEventDetails"].get("resource") == "startSyncExecution"]) == 2
        inputs = [json.loads(w["Input"]) for w in window_runs(r)]
        assert [(i["start"], i["first"]) for i in inputs] == [(0, 2), (2, 2), (4, 4)]
        # `inspect` reads the windows from the job's history: no history API for Express
        seen = inspect_execution(faulty, r.execution_arn)
        assert seen.status == "SUCCEEDED" and seen.iterations_done == 5
        assert seen.window is not None and (seen.window["start"], seen.window["status"]) == (4, "SUCCEEDED")
        assert len(seen.failed_tasks) == 2 and all(f.state == "RunExpressWindow" for f in seen.failed_tasks)
        assert {json.loads(w["input"])["start"] for w in express_windows(r.history()) if w["status"] == "FAILED"} == {0, 2}
        # measured: the answered starts (the lost [0, 2) run and the repeat's first run of [4, 5)
        # are billed on AWS too, but nothing the job keeps says so: docs/cost.md)
        assert seen.cost is not None and seen.cost.total.express_requests == 3
        # the windows' logged runs (docs/local-stack.md): also [0, 2)'s whose answer was lost, with
        # its 3 gates, and both runs of [4, 5); [2, 4)'s first start never ran, so never logged
        runs = r.express_window_histories()
        inputs = [json.loads(ev[0]["executionStartedEventDetails"]["input"]) for ev in runs]
        assert [(i["start"], i["first"]) for i in inputs] == [(0, 0), (0, 2), (2, 2), (4, 4), (4, 4)]
        assert all(ev[-1]["type"] == "ExecutionSucceeded" for ev in runs)
        assert express_gates(runs[0]).invocations == 3  # before iterations 0 and 1, and at the window's end
        gates = sum((express_gates(ev) for ev in runs), Usage())
        watchers = sum(watcher_usage(w).invocations for w in phase_watchers(r._c.s3, r.bucket, r.job_id))
        assert seen.cost.phases["orchestration"].invocations == gates.invocations + watchers
    finally:
        faulty.stack.close()


def test_a_capped_express_job_is_metered_as_express(backend):
    """The gate's cost cap prices Express windows per request and duration (lambdas/gate.py): the
    tally of a capped Express job holds one Express request per window, the job's own states only
    (2 + 8 per Express window), and a duration no longer than the windows' billed one; no window
    state is counted as a Standard transition, so a cap the run fits does not stop it."""
    job = dataclasses.replace(recovery_job("cap"), workflow="express")
    r = job.run(stages=2, replicas=1, micro_batches=2, timeout_s=TIMEOUT_S, backend=backend, max_cost=1.0)
    assert r.wait(progress=False, poll_s=1.0, timeout_s=900) == "SUCCEEDED", r.failure()
    assert r.stopped() is None and r.spec().express_memory_mb is not None
    tally = read_json(r._c.s3, r.bucket, keys.cost_tally(r.job_id))
    windows = len(window_runs(r))
    assert windows == 3  # [0, 2), [2, 4), [4, 5): none lost here
    usage = tally["usage"]
    assert usage["express_requests"] == windows
    assert usage["transitions"] == asl.TRANSITIONS_JOB_FIXED + windows * asl.TRANSITIONS_JOB_PER_EXPRESS_WINDOW
    billed = r.cost().total
    assert billed.express_requests == windows
    assert 0 < usage["express_gb_s"] <= billed.express_gb_s
    # every invocation the tally counts, the measured cost counts: the tasks' from their metrics,
    # the 8 gates from the windows' logged events
    gates = sum((express_gates(ev) for ev in r.express_window_histories()), Usage())
    print(f"capped: tally {usage['invocations']} invocations, measured {billed.invocations} ({gates.invocations} gates)")
    assert gates.invocations == 5 + windows
    assert usage["invocations"] == billed.invocations
