"""Cost (predicted and measured) and stopping at an iteration boundary (on request, at a cost cap),
through the real state machines on the local stack; the billing arithmetic checked by hand."""

import copy
import dataclasses
import json
import math
import re
import textwrap
import time

import pytest
import torch
from click.testing import CliRunner
from helpers import max_diff
from torch import nn

from stagecoach import Job
from stagecoach.core import keys
from stagecoach.core.cost import Prices, Usage, billed_ms, gb_seconds, watcher_usage
from stagecoach.cost import history_usage, state_phase
from stagecoach.job import JobError
from stagecoach.lambdas.gate import watchers_usage
from stagecoach.reference import train_reference
from stagecoach.run import phase_watchers, recorded_watching

# us-east-1 list prices, written out here rather than read from the code under test
GB_S, REQUEST, TRANSITION, PUT, GET = 0.0000166667, 0.20 / 1e6, 0.025 / 1000, 0.005 / 1000, 0.0004 / 1000


def tiny_job(name, iterations, dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 4, generator=g)
    y = (x[:, 0] > 0).long()
    return Job(
        model=lambda: nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)),
        loss=nn.CrossEntropyLoss(),
        optimizer=lambda p: torch.optim.SGD(p, lr=0.3, momentum=0.9),
        train=(x, y),
        global_batch=8,
        iterations=iterations,
        seed=0,
        name=name,
        dtype=dtype,
    )


def iterations_done(run):
    run.metrics()  # reads the metrics written since the last call
    return run.iterations_done()


# ------------------------------------------------------------------------------ arithmetic (no stack)
def test_lambda_bills_milliseconds_rounded_up_and_gb_as_mb_over_1024():
    assert billed_ms(0.0271) == 28 and billed_ms(0.028) == 28 and billed_ms(0.0280001) == 29 and billed_ms(0.0) == 0
    assert billed_ms(0.3) == 300  # 0.3 * 1000 is 300.00000000000006 in floats: not a millisecond more
    assert gb_seconds(1.0, 1024) == 1.0 and gb_seconds(2.0, 512) == 1.0 and gb_seconds(0.0105, 1769) == pytest.approx(0.011 * 1769 / 1024)
    prices = Prices(gb_s=GB_S, request=REQUEST, transition=TRANSITION, put=PUT, get=GET)
    u = Usage(gb_s=3.0, invocations=10, transitions=40, puts=7, gets=100)
    assert u.usd(prices) == pytest.approx(3 * GB_S + 10 * REQUEST + 40 * TRANSITION + 7 * PUT + 100 * GET)


def test_history_transitions_are_states_entered_plus_retries_by_phase():
    def entered(kind, name):
        return {"type": f"{kind}StateEntered", "stateEnteredEventDetails": {"name": name}}

    gate_out = {"Payload": {"phase": "gate", "stop": False, "work": {"duration_s": 0.0104, "memory_mb": 2048, "puts": 0, "gets": 1}}}
    events = [
        entered("Pass", "Init"),
        entered("Task", "Gate"),
        {"type": "TaskScheduled"},
        {"type": "TaskSucceeded", "taskSucceededEventDetails": {"output": json.dumps(gate_out)}},
        entered("Choice", "Go?"),
        entered("Map", "Forward"),
        entered("Task", "ForwardTask"),
        {"type": "TaskScheduled"},
        {"type": "TaskFailed"},
        {"type": "TaskScheduled"},  # a retry: billed as a transition
        {"type": "TaskSucceeded", "taskSucceededEventDetails": {"output": json.dumps({"Payload": {"phase": "forward"}})}},
        entered("Parallel", "BackwardSync"),
        entered("Map", "Backward1"),
        entered("Task", "Backward1Task"),
        {"type": "TaskScheduled"},
        entered("Map", "Sync1"),
        entered("Task", "Sync1Task"),
        {"type": "TaskScheduled"},
    ]
    out = history_usage(events)
    assert out["forward"] == Usage(transitions=2)
    assert out["backward"] == Usage(transitions=3)
    assert out["sync"] == Usage(transitions=2)
    # Init, Gate, Go?, the retry; the gate's own invocation: 11 ms at 2 GB, one GET
    assert out["orchestration"] == Usage(gb_s=0.011 * 2, invocations=1, transitions=4, gets=1)
    assert [state_phase(n) for n in ("Forward", "ForwardKilled", "BackwardSync", "Sync0", "Gate", "RunWindow")] == [
        "forward",
        "forward",
        "backward",
        "sync",
        "orchestration",
        "orchestration",
    ]


def test_a_cost_cap_must_be_a_positive_number_of_dollars():
    job = tiny_job("cap", 2)
    for bad in (-1.0, 0, float("nan"), float("inf"), True, "1"):
        with pytest.raises(JobError, match="positive number of US dollars"):
            job.run(stages=1, max_cost=bad)
    from stagecoach.cli import main

    r = CliRunner().invoke(main, ["train", "nonexistent.py", "--max-cost", "-0.5"])
    assert r.exit_code == 2 and "positive number of US dollars" in r.output, r.output


# ------------------------------------------------------------------------------ on the local stack
def test_measured_cost_is_what_the_metrics_and_histories_add_up_to(backend):
    """A 1-stage, 1-replica run: every number computed here from the raw records, independently."""
    n = 3
    run = tiny_job("cost-hand", n).run(stages=1, backend=backend)
    # read at once: the last phase's watcher may write its record just after the job ended, and the
    # cost waits for it (Run._settled_watchers)
    assert run.wait(progress=False, poll_s=0.05, timeout_s=300) == "SUCCEEDED"
    report = run.cost()
    metrics = run.metrics()
    assert len(metrics) == n and {m.phase for m in metrics} == {"backward"}
    lam_gbs = sum(math.ceil(m.duration_s * 1000 - 1e-6) / 1000 * m.memory_mb / 1024 for m in metrics)
    task_usd = lam_gbs * GB_S + n * REQUEST + sum(m.puts + 1 for m in metrics) * PUT + sum(m.gets for m in metrics) * GET
    # the states, counted from the ASL by hand: per iteration Gate, Go?, BackwardSync, Backward0,
    # Backward0Task, Advance, and the phase's watcher (BackwardSyncPhase, BackwardSyncEnded,
    # WatchBackwardSync); the window's Init, last Gate, last Go?, Done; the job's Next?,
    # Bounds, Clamp, LastWindow, WindowType?, RunWindow, Advance, the last Next?, Done
    transitions = 9 * n + 4 + 9
    gates = []
    for ev in run.history(windows=True):
        if ev["type"] == "TaskSucceeded":
            payload = json.loads(ev["taskSucceededEventDetails"]["output"]).get("Payload") or {}
            if payload.get("phase") == "gate":
                gates.append(payload["work"])
    assert len(gates) == n + 1  # before each iteration, and at the window's end
    gate_usd = sum(
        math.ceil(w["duration_s"] * 1000 - 1e-6) / 1000 * w["memory_mb"] / 1024 * GB_S + REQUEST + w["puts"] * PUT + w["gets"] * GET
        for w in gates
    )
    # the phase watchers, one an iteration, each as its record says (read here by hand)
    s3, bucket = backend.clients.s3, backend.resources.bucket
    listed = s3.list_objects_v2(Bucket=bucket, Prefix=f"jobs/{run.job_id}/cost/phase-watcher/").get("Contents", [])
    watchers = [json.loads(s3.get_object(Bucket=bucket, Key=o["Key"])["Body"].read()) for o in listed]
    assert sorted(w["t"] for w in watchers) == list(range(n)) and all(w["watch"] == "backward" for w in watchers)
    watcher_usd = sum(
        math.ceil(w["duration_s"] * 1000 - 1e-6) / 1000 * w["memory_mb"] / 1024 * GB_S + REQUEST + w["puts"] * PUT + w["gets"] * GET
        for w in watchers
    )
    spec = run.spec()
    client_usd = (spec.launch_requests["puts"] + report.phases["client"].puts - spec.launch_requests["puts"]) * PUT
    client_usd += report.phases["client"].gets * GET
    # the launch's uploads: the code, the plan, the data set, version 0's chunks, the spec
    assert spec.launch_requests["puts"] >= 5
    expected = task_usd + transitions * TRANSITION + gate_usd + watcher_usd + client_usd
    assert report.total.transitions == transitions
    assert report.usd == pytest.approx(expected, rel=1e-9)
    assert report.phases["sync"] == Usage() and report.phases["forward"] == Usage()
    assert report.iterations == n
    # a succeeded execution's history never changes: read once (the local console asks every 2 s)
    calls = []
    sfn = run._c.sfn
    event = "before-parameter-build.sfn.GetExecutionHistory"
    sfn.meta.events.register(event, lambda params, **kw: calls.append(params["executionArn"]), unique_id="count-histories")
    try:
        run._ended_histories.clear()
        first = run.cost()
        read = len(calls)
        assert read >= 2 and set(calls) == set(run.job_executions() + run.window_executions())  # job and window
        assert run.cost().to_dict() == first.to_dict() == report.to_dict()
        assert len(calls) == read, calls[read:]
    finally:
        sfn.meta.events.unregister(event, unique_id="count-histories")


def test_predicted_cost_counts_the_evaluations_checkpoints_and_due_checks_it_measures(backend):
    """A job that evaluates (after iterations 2 and 4) and checkpoints (after 3): the prediction has
    every state and invocation the run is billed for — the passes' Maps and tasks, the Due and
    Choice states each iteration enters, the shorter window — and each pass's PUTs."""
    g = torch.Generator().manual_seed(1)
    xt = torch.randn(13, 4, generator=g)
    job = dataclasses.replace(tiny_job("cost-passes", 4), test=(xt, (xt[:, 0] > 0).long()), eval_every=2, checkpoint_every=3)
    assert job.eval_versions() == [2, 4] and job.checkpoint_versions() == [3]
    run = job.run(stages=2, replicas=2, micro_batches=2, backend=backend)
    assert run.wait(progress=False, timeout_s=300) == "SUCCEEDED"
    measured, predicted = run.cost(), run.predicted_cost()
    for phase in ("forward", "backward", "sync", "evaluate", "checkpoint", "orchestration"):
        m, p = measured.phases[phase], predicted.phases[phase]
        assert (m.invocations, m.transitions) == (p.invocations, p.transitions), (phase, m, p)
    assert predicted.phases["evaluate"].invocations == 2 * 2 * 2 and predicted.phases["checkpoint"].invocations == 2
    # hand-offs (micro-batches of 2: replica 0 has 7 samples, 4 of them; replica 1 has 6, 3), each last-stage record,
    # and every task's metrics object
    for phase in ("evaluate", "checkpoint"):
        assert measured.phases[phase].puts == predicted.phases[phase].puts, phase
    assert predicted.phases["evaluate"].puts == 2 * ((4 + 3) + 2 + 4)
    assert measured.total.transitions == predicted.total.transitions


def test_a_cost_cap_stops_the_job_at_an_iteration_boundary_with_its_checkpoint(backend):
    """The cap is passed after a few iterations: the gate stops the job before the next one, with
    status STOPPED and the parameters of the version reached equal to plain PyTorch's."""
    iterations = 12
    # the stored path (every version in S3) keeps the very version it stopped at; with warm state
    # a stopped job keeps its window's checkpoint instead (tests/test_lifecycle.py)
    job = dataclasses.replace(tiny_job("cost-cap", iterations), warm_state=False)
    # the launch and the job's first states cost about $0.0004, each iteration 6 transitions
    # ($0.00015) and a little Lambda time: the cap falls after two or three iterations
    cap = 0.00078
    run = job.run(stages=1, backend=backend, max_cost=cap)
    assert run.wait(progress=False, timeout_s=300) == "STOPPED"
    record = run.stopped()
    assert record is not None and record.reason == "max_cost" and "would pass the cap" in record.detail
    v = record.version
    assert 1 <= v < iterations and run.version() == v
    assert run.iterations_done() == v and len(run.losses()) == v
    d = run.describe()
    assert d["status"] == "FAILED" and d["error"] == "Stagecoach.Stopped" and f"before iteration {v}" in d["cause"]
    s3 = backend.clients.s3
    tally = json.loads(s3.get_object(Bucket=backend.resources.bucket, Key=keys.cost_tally(run.job_id))["Body"].read())
    # stopped before the iteration that would pass the cap: within it, the next one's cost over it
    assert tally["usd"] <= cap < tally["usd"] + (tally["usd"] - tally["previous_usd"]) and tally["through"] == v
    # the checkpoint: version v is what single-process PyTorch reaches after v iterations
    ref_job = copy.copy(job)
    ref_job.iterations = v
    assert max_diff(run.trained_model(), train_reference(ref_job)) < 1e-9
    assert max_diff(run.trained_model(), job.build_model()) > 1e-3
    # the engine's tally and the client's measurement agree on what was used (the client adds
    # its own reading while it watched; retries: none here)
    measured = run.cost()
    assert measured.usd >= tally["usd"] * 0.98
    from stagecoach.inspect.report import format_report, inspect_execution

    report = format_report(inspect_execution(backend, run.execution_arn))
    assert f"job {run.job_id}: STOPPED" in report and f"stopped before iteration {v} (cost cap: measured $" in report
    assert f"cap ${cap:.4f}, the engine's meter ${tally['usd']:.4f}" in report


def test_the_cap_meters_every_state_and_task_the_run_is_billed_for(backend):
    """A capped job that evaluates and checkpoints, under a cap it never reaches: the engine's
    tally has every state transition and invocation the client measures (the Due and Choice states
    each iteration enters, the Evaluate and Checkpoint passes: before issue 28 it missed them, so a
    job that evaluates ran past its cap by more than an iteration's cost); what it does not have is
    the watching client's own reading (and the gate's last PUTs), a few requests."""
    g = torch.Generator().manual_seed(1)
    xt = torch.randn(13, 4, generator=g)
    job = dataclasses.replace(tiny_job("cost-tally", 4), test=(xt, (xt[:, 0] > 0).long()), eval_every=2, checkpoint_every=3)
    run = job.run(stages=2, replicas=2, micro_batches=2, backend=backend, max_cost=1000.0)
    assert run.wait(progress=False, timeout_s=300) == "SUCCEEDED"
    measured = run.cost()
    s3 = backend.clients.s3
    tally = json.loads(s3.get_object(Bucket=backend.resources.bucket, Key=keys.cost_tally(run.job_id))["Body"].read())
    assert tally["through"] == 4
    assert tally["usage"]["transitions"] == measured.total.transitions
    assert tally["usage"]["invocations"] == measured.total.invocations
    # the rest: the client's watching (recorded when wait() ended), and what each gate does after
    # it metered (learning its timeouts: a GET, and when it samples, 12 GETs and a PUT, and their time)
    watched = recorded_watching(s3, backend.resources.bucket, run.job_id)
    gates = len([ev for ev in run.history(windows=True) if ev["type"] == "TaskSucceeded" and '"gate"' in str(ev)])
    assert gates >= 4 + 1  # before each iteration and at each window's end
    # the phase watchers: the gate meters each from its phase's span and grace, before its record
    # exists (lambdas/gate.py watchers_usage), which errs high: a watcher with nothing to expect yet
    # ends at once; the measured cost has their records
    records = phase_watchers(s3, backend.resources.bucket, run.job_id)
    assert len(records) == 4 * 2 and all(r.attempt for r in records)
    by_t = {t: [m for m in run.metrics() if m.t == t] for t in range(4)}
    metered = sum(watchers_usage(run.plan, ms).gb_s for ms in by_t.values())
    recorded = sum(watcher_usage(r).gb_s for r in records)
    assert metered >= recorded
    late_gb_s = (measured.total.gb_s - recorded) - (tally["usage"]["gb_s"] - metered)
    assert 0 <= late_gb_s <= gates * 0.25  # under 250 ms at 1 GB a gate, on this busy machine
    unmetered = watched["puts"] * PUT + watched["gets"] * GET + gates * (PUT + 13 * GET) + late_gb_s * GB_S
    overmetered = (metered - recorded) * GB_S
    assert tally["usd"] - overmetered <= measured.usd <= tally["usd"] - overmetered + unmetered + 1e-9


def test_run_stop_ends_the_job_at_the_next_iteration_boundary(backend):
    iterations = 1000  # far more than run before the stop
    job = dataclasses.replace(tiny_job("cost-stop", iterations), warm_state=False)  # every version stored
    run = job.run(stages=1, backend=backend)
    deadline = time.time() + 120
    while iterations_done(run) < 2 and time.time() < deadline:
        time.sleep(0.2)
    run.stop()
    run.stop()  # a second request changes nothing
    assert run.wait(progress=False, timeout_s=300) == "STOPPED"
    record = run.stopped()
    assert record is not None and record.reason == "requested"
    v = record.version
    assert 2 <= v < iterations and run.status() == "STOPPED" and len(run.losses()) == v
    ref_job = copy.copy(job)
    ref_job.iterations = v
    assert max_diff(run.trained_model(), train_reference(ref_job)) < 1e-9
    # nothing of iteration v ran: no task metrics beyond the boundary
    assert max(m.t for m in run.metrics()) == v - 1


def test_stop_command_and_inspect_show_a_stopped_job_and_its_cost(backend, monkeypatch):
    from stagecoach.cli import main, options

    monkeypatch.setattr(options, "running_stack", lambda: object())  # the session's stack stands in for the daemon
    job = tiny_job("cost-cli", 1000)
    run = job.run(stages=1, backend=backend)
    deadline = time.time() + 120
    while iterations_done(run) < 1 and time.time() < deadline:
        time.sleep(0.2)
    r = CliRunner().invoke(main, ["stop", run.job_id])
    assert r.exit_code == 0 and "stop requested" in r.output, r.output
    assert run.wait(progress=False, timeout_s=300) == "STOPPED"
    r = CliRunner().invoke(main, ["stop", run.execution_arn])  # the ARN names the (local) stack
    assert r.exit_code == 0 and "already ended (STOPPED)" in r.output, r.output
    r = CliRunner().invoke(main, ["stop", "nosuch-0123abcd"])
    assert r.exit_code == 1 and "no job nosuch-0123abcd" in r.output, r.output
    r = CliRunner().invoke(main, ["inspect", run.execution_arn])
    assert r.exit_code == 0, r.output
    v = run.stopped().version
    assert f"job {run.job_id}: STOPPED" in r.output
    assert f"stopped before iteration {v} (on request); checkpoint: version {v}" in r.output
    assert "cost: measured $" in r.output and "state transitions" in r.output
    r = CliRunner().invoke(main, ["inspect", run.execution_arn, "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert d["status"] == "STOPPED" and d["stop"]["version"] == v and d["stop"]["reason"] == "requested"
    assert d["cost"]["usd"] > 0 and set(d["cost"]["phase_usd"]) == {"forward", "backward", "sync", "orchestration", "client"}


JOB_FILE = textwrap.dedent(
    """
    import torch
    from torch import nn
    from stagecoach import Job

    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 4, generator=g)
    y = (x[:, 0] > 0).long()
    job = Job(model=lambda: nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)), loss=nn.CrossEntropyLoss(),
              optimizer=lambda p: torch.optim.SGD(p, lr=0.3), train=(x, y), test=(x, y), global_batch=8, iterations=3,
              seed=0, name="costcli")
    """
)


def test_train_prints_the_predicted_cost_of_a_manual_plan_and_the_measured_one(backend, tmp_path, monkeypatch):
    from stagecoach.cli import main

    (tmp_path / "job.py").write_text(JOB_FILE)
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(main, ["train", "job.py", "--stages", "2", "--replicas", "2", "--memory", "512"])
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    predicted = next(line for line in lines if line.startswith("cost on AWS: predicted $"))
    measured = next(line for line in lines if line.startswith("cost on AWS: measured $"))
    # before the job starts, per phase; after, next to the prediction
    assert lines.index(predicted) < next(i for i, line in enumerate(lines) if line.startswith("job costcli-"))
    for phase in ("forward", "backward", "sync", "orchestration", "S3 requests"):
        assert phase in predicted and phase in measured, (phase, predicted, measured)
    assert "for 3 iterations" in predicted and "; predicted $" in measured
    assert "GB-s" in r.output and "state transitions" in r.output
    # one cost and one status wherever shown: `inspect` and `list` say what `train` said (the
    # client's watching included: the Run that watched recorded it, run.py record_watching)
    from stagecoach.cli import options

    monkeypatch.setattr(options, "running_stack", lambda: object())  # the session's stack stands in for the daemon
    job_id = next(line.split()[1].rstrip(":") for line in lines if line.startswith("job costcli-"))
    r = CliRunner().invoke(main, ["inspect", job_id])
    assert r.exit_code == 0 and f"job {job_id}: SUCCEEDED" in r.output, r.output
    assert "cost: measured " + measured.removeprefix("cost on AWS: measured ").split("; predicted")[0] in r.output, (measured, r.output)
    listed = CliRunner().invoke(main, ["list"]).output
    assert next(line for line in listed.splitlines() if line.startswith(job_id)).split()[2] == "SUCCEEDED", listed


def test_train_with_a_tiny_cap_stops_early_and_says_so(backend, tmp_path, monkeypatch):
    from stagecoach.cli import main

    (tmp_path / "job.py").write_text(JOB_FILE.replace("iterations=3", "iterations=20"))
    monkeypatch.chdir(tmp_path)
    # the launch and the first states cost about $0.0004, an iteration of this plan about $0.00016
    r = CliRunner().invoke(main, ["train", "job.py", "--stages", "1", "--max-cost", "0.0006"])
    assert r.exit_code == 0, r.output
    assert "; cap $0.0006" in r.output and "the cap is predicted to stop the job after about" in r.output
    # (CliRunner may glue the progress bar, written to stderr, to the line)
    found = re.search(r"stopped before iteration (\d+) \(its next iteration would pass the cost cap\)", r.output)
    assert found, r.output
    v = int(found.group(1))
    assert 1 <= v < 20
    assert f"after {v} iterations" in r.output and "measured $" in r.output


@pytest.mark.parametrize(
    "manual",
    [
        dict(stages=1),
        dict(stages=3, replicas=2, micro_batches=2),
        dict(stages=2, replicas=4, sync="pipelined_scatter_reduce"),
        dict(stages=3, replicas=4, sync="k_reduce", aggregators=2),
    ],
    ids=lambda m: "-".join(f"{k}{v}" for k, v in m.items()),
)
def test_the_performance_model_counts_the_transitions_and_invocations_the_emitter_emits(manual):
    from stagecoach.planner.emit import asl

    job = tiny_job("model-tr", 1)
    plan = job.manual_plan(**manual)
    est = job.predict(plan)
    # the phase watchers' own states: the cost prediction's (sdk/cost.py watcher_usage_predicted)
    watchers = asl.watched_phases(plan) * (asl.TRANSITIONS_WATCHED_PHASE + asl.TRANSITIONS_WATCHER)
    assert est.transitions + watchers == asl.transitions_per_iteration(plan) and watchers == 3 * (1 + (plan.stages > 1))
    tasks = (plan.stages - 1) * plan.replicas + plan.stages * plan.replicas + sum(plan.sync_tasks(s) for s in range(plan.stages))
    assert est.invocations == tasks


@pytest.mark.slow  # `stagecoach stop`: test_stop_command_and_inspect_show_a_stopped_job_and_its_cost; the daemon: test_local_daemon.py
def test_stop_from_another_process_through_the_local_daemon(tmp_path, monkeypatch):
    """`stagecoach local start`; a job on it; `stagecoach stop JOB` run as a separate process (as
    from another shell) ends it at a boundary; Ctrl-C's message names exactly that command."""
    import os
    import subprocess
    import sys

    from stagecoach.cli.local import local_group
    from stagecoach.local.backend import LocalBackend

    monkeypatch.setenv("STAGECOACH_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(LocalBackend, "_shared", None)  # not this session's own stack
    runner = CliRunner()
    r = runner.invoke(local_group, ["start"])
    assert r.exit_code == 0, r.output
    try:
        daemon = LocalBackend()
        run = tiny_job("cost-daemon", 1000).run(stages=1, backend=daemon)  # far more than run before the stop
        assert f"stagecoach stop {run.job_id}" in run.interrupted_message()
        deadline = time.time() + 120
        while iterations_done(run) < 1 and time.time() < deadline:
            time.sleep(0.2)
        exe = os.path.join(os.path.dirname(sys.executable), "stagecoach")
        p = subprocess.run([exe, "stop", run.job_id], capture_output=True, text=True, timeout=120)
        assert p.returncode == 0 and "stop requested" in p.stdout, p.stdout + p.stderr
        assert run.wait(progress=False, timeout_s=300) == "STOPPED"
        assert 1 <= run.stopped().version < 1000
    finally:
        r = runner.invoke(local_group, ["stop"])
        assert r.exit_code == 0, r.output
