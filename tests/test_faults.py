"""Reliability: killed workers, throttling, hung tasks and lost objects are recovered by Step Functions
retries and window restarts, and the trained parameters are bit-identical to a fault-free run."""

import json
from datetime import datetime

import pytest
from helpers import max_diff, recovery_job, same_parameters, task_errors, window_statuses

from stagecoach.core.records import LearntMemory, Remediation
from stagecoach.local.backend import LocalBackend
from stagecoach.planner.emit import asl
from stagecoach.reference import train_reference

TIMEOUT_S = 12  # a hung task and a lost object are waited out this long


def run(backend, name: str, warm: bool = True, **plan):
    r = recovery_job(name, warm).run(stages=2, replicas=2, micro_batches=2, timeout_s=TIMEOUT_S, backend=backend, **plan)
    r.wait(progress=False, poll_s=0.2, timeout_s=900)
    return r


@pytest.fixture(scope="module")
def clean(backend):
    return run(backend, "clean")


def test_killed_and_throttled_tasks_are_retried_and_the_result_is_bit_identical(clean):
    faulty = LocalBackend(faults={"seed": 3, "kill": 0.25, "throttle": 0.05})
    try:
        r = run(faulty, "killed")
        errors = task_errors(r)
        tasks = r.job.iterations * (1 * 2 + 2 * 2 + 2 * 2)  # forward, backward and sync tasks
        assert errors.count("Runtime.ExitError") >= 0.1 * tasks, errors
        assert "Lambda.TooManyRequestsException" in errors, errors
        assert same_parameters(r.trained_model(), clean.trained_model())
    finally:
        faulty.stack.close()


def test_killed_tasks_mid_exchange_of_the_fused_pipelined_sync_are_retried_bit_identically(clean):
    """The backward tasks exchange shards among themselves: a retried one rewrites what it wrote,
    its peers keep waiting for it, and the result equals the fault-free run of another algorithm."""
    faulty = LocalBackend(faults={"seed": 8, "kill": 0.3, "kill_within_s": 1.0})
    try:
        r = run(faulty, "killed-fused", sync="pipelined_scatter_reduce")
        errors = task_errors(r)
        tasks = r.job.iterations * (1 * 2 + 2 * 2)  # forward and backward tasks: no sync Map
        assert errors.count("Runtime.ExitError") >= 0.1 * tasks, errors
        assert same_parameters(r.trained_model(), clean.trained_model())
    finally:
        faulty.stack.close()


HANG = {"kind": "hang", "phase": "sync", "t": 1, "stage": 1, "shard": 0}


def _entered(events, name):
    return [e for e in events if (e.get("stateEnteredEventDetails") or {}).get("name") == name]


def test_a_hung_task_is_ended_by_its_phase_watcher_before_its_timeout(clean):
    """The phase watcher (lambdas/watcher.py) sees the sync task hung in iteration 1 late past what
    the gate learnt, runs it again beside its Map and ends the phase (PhaseDone) before the Task's
    own learnt timeout fires; the window goes on, and the result is bit-identical."""
    faulty = LocalBackend(faults={"once": [HANG]})
    try:
        r = recovery_job("watched", warm=False).run(stages=2, replicas=2, micro_batches=2, timeout_s=60, backend=faulty)
        r.wait(progress=False, poll_s=0.2, timeout_s=900)
        assert len(r.window_executions()) == 1
        events = r.history(execution_arn=r.window_executions()[0])
        (ended,) = _entered(events, "WatchBackwardSyncEnded")
        phase = max((e for e in _entered(events, "BackwardSync") if e["id"] < ended["id"]), key=lambda e: e["id"])
        cause = next(e for e in events if e["type"] == "TaskFailed" and "ran again" in e["taskFailedEventDetails"]["cause"])
        assert "('sync', 1, 0)" in cause["taskFailedEventDetails"]["cause"]
        # the hung task's own timeout (at least 2 s, from its start after the backward tasks) never
        # came first (moto goes on running a Parallel's abandoned branch and records its timeout
        # after the Parallel failed; AWS stops it: docs/local-stack.md)
        timed_out = [e for e in events if e["type"] == "TaskTimedOut"]
        assert all(e["id"] > ended["id"] for e in timed_out)
        assert (ended["timestamp"] - phase["timestamp"]).total_seconds() < 2 + 1
        assert same_parameters(r.trained_model(), clean.trained_model())
    finally:
        faulty.stack.close()


def test_a_hung_task_is_timed_out_after_the_learnt_timeout_and_retried(clean):
    """The plan gives each Task 60 s; after iteration 0 the gate has learnt how long the tasks take
    (lambdas/timeouts.py), so the task hung in iteration 1 is timed out within seconds. Its phase's
    watcher is killed (scripted), and fails quietly: the Task's timeout is what ends the hang. Without
    warm state (every version through S3) the retry recovers it in another container. With it, that
    container would not hold the shard's state: a window restart (tests/test_warm_state.py)."""
    killed_watcher = {"kind": "kill", "phase": "watch", "watch": "backward", "t": 1}
    faulty = LocalBackend(faults={"once": [HANG, killed_watcher]})
    try:
        r = recovery_job("hung", warm=False).run(stages=2, replicas=2, micro_batches=2, timeout_s=60, backend=faulty)
        r.wait(progress=False, poll_s=0.2, timeout_s=900)
        assert "States.Timeout" in task_errors(r)
        assert len(_entered(r.history(execution_arn=r.window_executions()[0]), "WatchBackwardSyncQuiet")) == 1
        assert len(r.window_executions()) == 1, "the task retry, not a window restart, recovered it"
        events = r.history(execution_arn=r.window_executions()[0])
        scheduled = [e["taskScheduledEventDetails"] for e in events if e["type"] == "TaskScheduled"]
        training = [d["timeoutInSeconds"] for d in scheduled if json.loads(d["parameters"])["Payload"].get("phase") == "sync"]
        assert training[0] == 60 and max(training[4:]) < 12, str(training)  # iteration 0 under the plan's, then learnt
        timed_out = next(e for e in events if e["type"] == "TaskTimedOut")
        started = max(e["timestamp"] for e in events if e["type"] == "TaskStarted" and e["id"] < timed_out["id"])
        assert (timed_out["timestamp"] - started).total_seconds() < 12
        assert same_parameters(r.trained_model(), clean.trained_model())
    finally:
        faulty.stack.close()


def test_a_lost_activation_past_the_windows_redos_restarts_the_window_from_its_checkpoint(clean, monkeypatch):
    """One redo per window (REDO_LIMIT patched from 3): the activation lost at t = 1 is written
    again by iteration 1's redo inside the window; the one lost at t = 3 fails the window, which
    restarts from its latest complete version. Bit-identical either way."""
    monkeypatch.setattr(asl, "REDO_LIMIT", 1)
    once = [{"kind": "delete", "phase": "forward", "t": t, "stage": 0, "replica": 1} for t in (1, 3)]
    faulty = LocalBackend(faults={"once": once})
    try:
        r = run(faulty, "lost")
        statuses = window_statuses(r)
        assert statuses.count("FAILED") == 1 and statuses.count("SUCCEEDED") == 1, statuses
        assert task_errors(r).count("ObjectLost") == 2  # its consumer saw its producer done and the object gone
        assert same_parameters(r.trained_model(), clean.trained_model())
    finally:
        faulty.stack.close()


def test_a_stage_planned_with_too_little_memory_is_raised_a_tier_and_completes(backend, clean):
    from stagecoach import Plan
    from stagecoach.history import memory_key

    job = recovery_job("oom")
    plan = Plan(
        balance=[2, 2],
        replicas=2,
        micro_batches=2,
        global_batch=16,
        memory_mb=(1024, 256),
        timeouts_s=[{"forward": TIMEOUT_S, "backward": TIMEOUT_S, "sync": TIMEOUT_S}] * 2,
    )
    r = job.run(plan=plan, backend=backend)
    r.wait(progress=False, poll_s=0.2, timeout_s=900)
    c = backend.clients
    fn = r.spec().window_state_machine.split(":")[-1].replace("-window", "-s1")
    # warm state with d = 2: a function per replica and per sync task, every one of stage 1's raised
    for name in (fn, fn + "-r1", fn + "-k0", fn + "-k1"):
        assert c.lambda_.get_function_configuration(FunctionName=name)["MemorySize"] == 512
    assert c.lambda_.get_function_configuration(FunctionName=fn.replace("-s1", "-s0-r1"))["MemorySize"] == 1024
    steps = [e["stateEnteredEventDetails"]["name"] for e in r.history() if e["type"].endswith("StateEntered")]
    assert "Remediate" in steps and steps.count("RunWindow") == 2
    records = c.s3.list_objects_v2(Bucket=r.bucket, Prefix=f"jobs/{r.job_id}/remediations/")["Contents"]
    assert len(records) == 1
    record = Remediation.model_validate_json(c.s3.get_object(Bucket=r.bucket, Key=records[0]["Key"])["Body"].read())
    assert record.kind == "out_of_memory" and (record.from_mb, record.to_mb) == (256, 512)
    # AWS's explicit Runtime.OutOfMemory needs no evidence (a worker can be killed while still
    # importing, before its watchdog runs); an ambiguous shape counts as out-of-memory only with
    # the stage's memory-pressure record, which the watchdog wrote first
    assert record.evidence is not None or record.error == "Runtime.OutOfMemory", record
    assert record.evidence is None or record.evidence.stage == 1
    assert same_parameters(r.trained_model(), clean.trained_model())
    # the next run of the job starts stage 1 at the memory that worked
    learnt = LearntMemory.model_validate_json(c.s3.get_object(Bucket=r.bucket, Key=memory_key("oom"))["Body"].read())
    assert learnt.memory_mb == {"1": 512} and learnt.fits(plan)
    from stagecoach.history import refine

    assert refine(plan, "oom", c.s3, r.bucket).memory_mb == (1024, 512)


def test_a_worker_killed_for_memory_before_its_watchdog_wrote_anything_is_recognised_by_its_report():
    """Issue 24 item 10: AWS's untyped shape (Lambda.Unknown) on every kill, and a stage whose
    workers are killed as they start (128 MB: a worker's process is past that before its task
    begins), before their watchdog can write its record: the
    invocation's REPORT in the stack's log group (Max Memory Used at the memory size, as Lambda
    writes it) is the evidence, so the stage goes one tier up and the job completes."""
    from stagecoach import Plan
    from stagecoach.lambdas.remediate import parse_report, request_id
    from stagecoach.local.fidelity import Fidelity
    from stagecoach.local.runtime import STACK_LOG_GROUP

    faulty = LocalBackend(fidelity=Fidelity(error_shapes="Lambda.Unknown"))
    try:
        plan = Plan(
            balance=[2, 2],
            replicas=2,
            micro_batches=2,
            global_batch=16,
            memory_mb=(1024, 128),
            timeouts_s=[{"forward": TIMEOUT_S, "backward": TIMEOUT_S, "sync": TIMEOUT_S}] * 2,
        )
        r = recovery_job("oom-unknown").run(plan=plan, backend=faulty)
        assert r.wait(progress=False, poll_s=0.2, timeout_s=900) == "SUCCEEDED"
        c = faulty.clients
        records = c.s3.list_objects_v2(Bucket=r.bucket, Prefix=f"jobs/{r.job_id}/remediations/")["Contents"]
        record = Remediation.model_validate_json(c.s3.get_object(Bucket=r.bucket, Key=records[0]["Key"])["Body"].read())
        assert record.error == "Lambda.Unknown" and record.kind == "out_of_memory" and (record.from_mb, record.to_mb) == (128, 512)
        # the evidence is the REPORT's: Max Memory Used at the memory size (the watchdog never wrote)
        assert record.evidence is not None and (record.evidence.rss_mb, record.evidence.memory_mb) == (128, 128)
        logs = faulty.stack.client("logs")
        rid = request_id(record.cause)
        events = logs.filter_log_events(logGroupName=STACK_LOG_GROUP, filterPattern=f'"{rid}"')["events"]
        reports = [parse_report(e["message"]) for e in events]
        assert [(x.memory_size_mb, x.max_memory_used_mb, x.status) for x in reports if x] == [(128, 128, "error")]
        assert max_diff(r.trained_model(), train_reference(r.job, replicas=2, micro_batches=2)) < 1e-5
    finally:
        faulty.stack.close()


def test_when_a_window_fails_its_waiting_tasks_stop_within_seconds():
    """Stage 0's forward task for replica 1 fails outright at t = 1: the forward Map fails, and the
    stage-1 forward task waiting for that activation would wait out its Task timeout (TIMEOUT_S).
    The window's Abort state writes the abort marker instead, the waiter stops within seconds
    (WindowAborted), and the restarted window trains exactly what the fault-free run trained."""
    faulty = LocalBackend(faults={"once": [{"kind": "fail", "phase": "forward", "t": 1, "stage": 0, "replica": 1}]})
    try:
        r = recovery_job("aborted").run(stages=3, replicas=2, micro_batches=2, timeout_s=TIMEOUT_S, backend=faulty)
        r.wait(progress=False, poll_s=0.2, timeout_s=900)
        assert "Stagecoach.InjectedFailure" in task_errors(r)
        c = faulty.clients
        markers = c.s3.list_objects_v2(Bucket=r.bucket, Prefix=f"jobs/{r.job_id}/abort/")["Contents"]
        assert len(markers) == 1
        marked = markers[0]["LastModified"].timestamp()
        with open(faulty.stack.log_path) as f:
            aborted = [json.loads(line) for line in f if '"WindowAborted"' in line]
        assert aborted, "no waiting task stopped on the abort marker"
        stopped = datetime.fromisoformat(aborted[0]["timestamp"].replace(",", ".")).timestamp()
        assert stopped - marked < 5.0 < TIMEOUT_S  # within seconds, not at the Task's timeout
        expected = train_reference(r.job, replicas=2, micro_batches=2)
        assert max_diff(r.trained_model(), expected) < 1e-5
    finally:
        faulty.stack.close()


def test_a_window_that_fails_again_restarts_from_its_last_complete_iteration_not_its_first(clean):
    """Issue 24 item 11: the window (all 5 iterations) fails at t = 1 in its first, warm attempt,
    whose small state is written through (every version stored: planner/plan.py
    ``writes_through``): the second attempt starts at 1 and stores every version; it fails at
    t = 3, and the third starts at 3 (the job state machine's ResumePoint, lambdas/resumepoint.py),
    not at 0. The result is bit-identical to the fault-free run. (A warm attempt that keeps its
    state only in memory restarts at its first version: tests/test_warm_state.py.)"""
    once = [{"kind": "fail", "phase": "backward", "t": t, "stage": 0, "replica": 0} for t in (1, 3)]
    faulty = LocalBackend(faults={"once": once})
    try:
        r = run(faulty, "resumed")
        c = faulty.clients
        windows = sorted((c.sfn.describe_execution(executionArn=a) for a in r.window_executions()), key=lambda d: d["startDate"])
        assert [json.loads(d["input"])["first"] for d in windows] == [0, 1, 3]
        assert [d["status"] for d in windows] == ["FAILED", "FAILED", "SUCCEEDED"]
        # the third attempt ran iterations 3 and 4 only
        gates = [
            json.loads(e["taskScheduledEventDetails"]["parameters"])["Payload"]["t"]
            for e in r.history(execution_arn=windows[2]["executionArn"])
            if e["type"] == "TaskScheduled" and '"gate"' in e["taskScheduledEventDetails"]["parameters"]
        ]
        assert gates == [3, 4, 5], gates
        assert same_parameters(r.trained_model(), clean.trained_model())
    finally:
        faulty.stack.close()
