"""The phase watcher (lambdas/watcher.py) on a simulated clock: what it looks at and when, which
task it runs again and where, when it ends its phase, and the record of what it used. The
end-to-end case (a hung task ended by the watcher before its Task's timeout, bit-identical) is
tests/test_faults.py."""

import time

import pytest
from memory_s3 import MemoryS3

from stagecoach.core import keys
from stagecoach.core.cost import watcher_usage
from stagecoach.core.events import WatchEvent
from stagecoach.core.records import TaskMetrics, WatcherUsage
from stagecoach.lambdas import watcher
from stagecoach.lambdas.channel import ABORT_CHECK_S, Channel
from stagecoach.lambdas.gate import watchers_usage
from stagecoach.planner.emit import asl
from stagecoach.planner.limits import WATCH_GRACE_S
from stagecoach.planner.plan import Plan

JOB, ATTEMPT = "w-0123abcd", "w0-a"
PLAN = Plan(balance=[1, 1], replicas=2, micro_batches=1, global_batch=4)  # 2 stages x 2 replicas, a sync Map each
EXPECT = {"f": 0.4, "b0": 0.5, "b1": 0.5, "s0": 0.2, "s1": 0.2}


def event(watch: str, expect: dict | None = None, per_worker: bool = True) -> WatchEvent:
    return WatchEvent(
        phase="watch",
        watch=watch,
        job=JOB,
        bucket="bucket",
        t=3,
        window_start=0,
        attempt=ATTEMPT,
        functions=["fn-s0", "fn-s1"],
        per_worker=per_worker,
        timeouts={"f": 2, "b0": 2, "b1": 2, "s0": 2, "s1": 2, "cold": 1},
        expect=EXPECT if expect is None else expect,
    )


def metrics(phase: str, stage: int, index: int, attempt: str = ATTEMPT, t: int = 3, start: float = 0.0, end: float = 0.4) -> TaskMetrics:
    return TaskMetrics(
        phase=phase, t=t, stage=stage, index=index, start=start, end=end, duration_s=end - start,
        upload_s=0.0, download_s=0.0, transfer_s=0.0, wait_s=0.0, bytes_up=0, bytes_down=0, puts=1, gets=1,
        compute_s=end - start, container="c", container_started=0.0, invocation=1, cold=False,
        memory_mb=1024, max_rss_mb=100.0, attempt=attempt,
    )  # fmt: skip


class Clock:
    """Simulated time: ``sleep`` advances it, and writes each task's metrics when its time comes."""

    def __init__(self, s3: MemoryS3, ends: dict[tuple[str, int, int], float]) -> None:
        self.now, self.s3, self.ends, self.sleeps = 0.0, s3, dict(ends), []

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        time.sleep(0.005)  # real time for the watcher's re-run threads to run in
        self.now += s
        for (phase, stage, index), end in list(self.ends.items()):
            if end <= self.now:
                self.write(phase, stage, index)
                del self.ends[(phase, stage, index)]

    def write(self, phase: str, stage: int, index: int, attempt: str = ATTEMPT) -> None:
        body = metrics(phase, stage, index, attempt).model_dump_json().encode()
        self.s3.put_object(Bucket="bucket", Key=keys.metrics(JOB, 3, phase, stage, index), Body=body)


def tasks_of(watch: str) -> list[tuple[str, int, int]]:
    if watch == "forward":
        return [("forward", 0, r) for r in range(2)]
    return [(p, s, i) for s in range(2) for p in ("backward", "sync") for i in range(2)]


def test_nothing_is_watched_before_the_gate_has_learnt_what_to_expect():
    s3 = MemoryS3()
    calls = []
    assert watcher.watch(event("backward", expect={}), Channel(s3, "bucket"), PLAN, lambda f, p: calls.append(f)) == {"again": 0}
    assert calls == [] and s3.puts == 0


def test_a_fault_free_phase_is_looked_at_when_it_usually_ends_and_left_to_end_itself():
    """Every task done by its expected time: one look each, no re-run, and after the grace the
    watcher raises PhaseDone (which the phase's own end has usually made moot)."""
    s3 = MemoryS3()
    clock = Clock(s3, {t: 0.3 for t in tasks_of("backward")})
    calls = []
    with pytest.raises(watcher.PhaseDone, match="every task is done"):
        watcher.watch(event("backward"), Channel(s3, "bucket"), PLAN, lambda f, p: calls.append(f), clock=clock, sleep=clock.sleep)
    assert calls == []
    assert clock.now == pytest.approx(0.5 + 0.2 + WATCH_GRACE_S)  # the sync tasks' look (b + y), then the grace


def test_a_task_late_past_its_due_runs_again_on_an_idle_siblings_function_and_ends_the_phase():
    s3 = MemoryS3()
    ends = {t: 0.3 for t in tasks_of("forward")}
    del ends[("forward", 0, 1)]  # hung: never writes its metrics
    clock = Clock(s3, ends)
    calls = []

    def rerun(function, payload):
        calls.append((clock.now, function, payload))
        clock.write(payload["phase"], payload["stage"], payload["replica"])  # the re-run's work

    with pytest.raises(watcher.PhaseDone, match=r"1 task\(s\) ran again.*\('forward', 0, 1\)"):
        watcher.watch(event("forward"), Channel(s3, "bucket"), PLAN, rerun, clock=clock, sleep=clock.sleep)
    ((when, function, payload),) = calls
    due = watcher.LATE_FACTOR * EXPECT["f"] + watcher.LATE_SLACK_S
    assert due <= when < due + 2 * watcher.POLL_S
    # replica 0's function is idle (its task is done) and warm; replica 1's is busy with the hang
    assert function == "fn-s0"
    assert payload == {
        "phase": "forward", "job": JOB, "bucket": "bucket", "t": 3, "window_start": 0, "attempt": ATTEMPT,
        "stage": 0, "replica": 1, "timeout": 2 + 1,
    }  # fmt: skip


def test_a_failed_window_attempts_watcher_runs_nothing_again_and_stops():
    """A task that failed outright fails its Map and the window writes its abort marker; Step
    Functions does not stop the watcher's invocation with the Parallel, so the watcher looks for
    the marker before running a late task again (a re-run would feed the window's waiting tasks,
    which must stop on the marker: test_faults) and then every ABORT_CHECK_S."""
    s3 = MemoryS3()
    clock = Clock(s3, {("forward", 0, 0): 0.3})  # replica 1's task failed: no metrics, ever
    s3.put_object(Bucket="bucket", Key=keys.window_abort(JOB, ATTEMPT), Body=b"{}")
    calls = []
    out = watcher.watch(event("forward"), Channel(s3, "bucket"), PLAN, lambda f, p: calls.append(f), clock=clock, sleep=clock.sleep)
    assert out == {"again": 0, "aborted": True} and calls == []
    assert clock.now < watcher.LATE_FACTOR * EXPECT["f"] + watcher.LATE_SLACK_S + 2 * watcher.POLL_S
    # a marker written while the watcher polls a task not yet due is seen within ABORT_CHECK_S
    s3b = MemoryS3()
    clock_b = Clock(s3b, {("forward", 0, 0): 0.3})
    marked = 5.5  # replica 1 is looked at from 5.0 s and due at 10.3 s

    def sleep(s: float) -> None:
        clock_b.sleep(s)
        if clock_b.now >= marked and keys.window_abort(JOB, ATTEMPT) not in s3b.objects:
            s3b.put_object(Bucket="bucket", Key=keys.window_abort(JOB, ATTEMPT), Body=b"{}")

    ev = event("forward", expect={"f": 5.0}).model_copy(update={"timeouts": {"f": 60, "cold": 1}})
    out = watcher.watch(ev, Channel(s3b, "bucket"), PLAN, lambda f, p: calls.append(f), clock=clock_b, sleep=sleep)
    assert out["aborted"] and calls == [] and marked <= clock_b.now <= marked + ABORT_CHECK_S + watcher.POLL_S


def test_metrics_of_an_earlier_window_attempt_do_not_count_as_done():
    s3 = MemoryS3()
    clock = Clock(s3, {})
    for _, s, r in tasks_of("forward"):
        clock.write("forward", s, r, attempt="w0-old")
    calls = []
    out = watcher.watch(
        event("forward"), Channel(s3, "bucket"), PLAN, lambda f, p: calls.append(p["replica"]), clock=clock, sleep=clock.sleep
    )
    # nothing of this attempt ever came: both ran again once (on the watcher's threads, which it
    # does not wait for), and the watcher gave up by the Map's own timeout and cold allowance
    deadline = time.monotonic() + 5
    while len(calls) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sorted(calls) == [0, 1] and out == {"again": 2} and clock.now >= 2 + 1


def test_with_a_function_per_stage_a_rerun_goes_to_the_stages_function():
    w = watcher.Watched("sync", 1, 1, 0.7, 1.7)
    assert watcher.plan_function(event("backward", per_worker=False), w, set()) == "fn-s1"
    done = {watcher.Watched("sync", 1, 0, 0.7, 1.7), watcher.Watched("backward", 1, 0, 0.5, 1.3)}
    assert watcher.plan_function(event("backward"), w, done) == "fn-s1-k0"  # the idle sync sibling's
    assert watcher.plan_function(event("backward"), w, set()) == "fn-s1-k1"  # none idle: its own


def test_the_watcher_records_what_it_used_also_when_it_ends_the_phase():
    s3 = MemoryS3()
    Clock(s3, {}).write("forward", 0, 0)
    Clock(s3, {}).write("forward", 0, 1)
    ev = event("forward", expect={"f": 0.01})
    with pytest.raises(watcher.PhaseDone):
        watcher.watch_and_record(ev, Channel(s3, "bucket"), PLAN, lambda f, p: None, memory_mb=1536)
    got = WatcherUsage.model_validate_json(s3.objects[keys.watcher_usage(JOB, 3, "forward", ATTEMPT)])
    assert (got.t, got.watch, got.attempt, got.memory_mb, got.again) == (3, "forward", ATTEMPT, 1536, 0)
    assert got.gets == 2 and got.puts == 1 and got.duration_s >= WATCH_GRACE_S
    u = watcher_usage(got)
    assert u.invocations == 1 and u.puts == 1 and u.gets == 2 and u.gb_s == pytest.approx(got.duration_s * 1.5, rel=0.01)


def test_the_gate_meters_an_iterations_watchers_from_its_tasks_metrics():
    ms = [metrics("forward", 0, r, start=10.0, end=10.4) for r in range(2)]
    ms += [metrics("backward", s, r, start=10.5, end=11.0) for s in range(2) for r in range(2)]
    ms += [metrics("sync", s, k, start=11.0, end=11.3) for s in range(2) for k in range(2)]
    u = watchers_usage(PLAN, ms)
    assert asl.watched_phases(PLAN) == 2 and u.invocations == 2 and u.puts == 2 and u.gets == len(ms)
    assert u.gb_s == pytest.approx((0.4 + WATCH_GRACE_S) + (0.8 + WATCH_GRACE_S))  # at stage 0's 1,024 MB
    assert watchers_usage(Plan(balance=[2], replicas=41, micro_batches=1, global_batch=41), ms).invocations == 0  # groups: none


def test_tasks_are_due_from_when_their_inputs_were_seen_done():
    """Stage 1's sync task 0 hangs: due its own 2 x 0.2 + 0.3 s after stage 1's backward tasks were
    seen done (at their first look, 0.5 s), not from the phase's start. Stage 0's backward replica 1
    hangs: due 2 x 0.05 (its own part: b0 - b1, at least MIN_OWN_S) + 0.3 s after stage 1's
    backward tasks were seen done; and as its Map still waits on the hung invocation, stage 0's
    sync Map never starts: its sync tasks run again as soon as stage 0's backward tasks are done."""
    s3 = MemoryS3()
    ends = {t: 0.3 for t in tasks_of("backward")}
    for gone in (("sync", 1, 0), ("backward", 0, 1), ("sync", 0, 0), ("sync", 0, 1)):
        del ends[gone]
    clock = Clock(s3, ends)
    calls = []

    def rerun(function, payload):
        index = payload.get("replica", payload.get("shard"))
        calls.append((round(clock.now, 2), payload["phase"], payload["stage"], index))
        clock.write(payload["phase"], payload["stage"], index)

    with pytest.raises(watcher.PhaseDone, match="4 task"):
        watcher.watch(event("backward"), Channel(s3, "bucket"), PLAN, rerun, clock=clock, sleep=clock.sleep)
    backward_due = 0.5 + watcher.LATE_FACTOR * watcher.MIN_OWN_S + watcher.LATE_SLACK_S
    sync_due = 0.5 + watcher.LATE_FACTOR * 0.2 + watcher.LATE_SLACK_S
    assert [c[1:] for c in calls] == [("backward", 0, 1), ("sync", 0, 0), ("sync", 0, 1), ("sync", 1, 0)]
    assert backward_due <= calls[0][0] < backward_due + 2 * watcher.POLL_S
    assert calls[1][0] == calls[2][0] < calls[0][0] + 3 * watcher.POLL_S  # at once, once backward is done
    assert sync_due <= calls[3][0] < sync_due + 2 * watcher.POLL_S
    # both well before the phase-start rules (2 x 0.5 + 0.3 s; the sync tasks' had no bound at all)
    assert calls[0][0] < watcher.LATE_FACTOR * 0.5 + watcher.LATE_SLACK_S - 0.3


def test_a_plan_without_phase_watchers_emits_none_and_is_counted_and_billed_without_them():
    """Plan(phase_watchers=False), what Job(phase_watchers=False) runs: no watcher Task in the
    window, no watcher function, and the counts every reader uses (events, transitions, the
    watchers' usage) without them; a watched plan's JSON reads as it always did."""
    import dataclasses
    import json

    from helpers import recovery_job

    from stagecoach.planner.plan import Plan as P
    from stagecoach.planner.plan import stage_functions

    off = dataclasses.replace(PLAN, phase_watchers=False)
    fns = ["fn-s0", "fn-s1"]
    on_def = json.dumps(asl.window_definition(PLAN, fns, per_worker=True, abort_key_format="a/{}"))
    off_def = json.dumps(asl.window_definition(off, fns, per_worker=True, abort_key_format="a/{}"))
    assert "fn-s0-w" in on_def and asl.PHASE_DONE in on_def
    assert "fn-s0-w" not in off_def and asl.PHASE_DONE not in off_def
    assert asl.watched_phases(PLAN) == 2 and asl.watched_phases(off) == 0
    assert asl.events_per_iteration(PLAN) - asl.events_per_iteration(off) == 2 * asl.EV_WATCHED_PHASE
    assert asl.transitions_per_iteration(PLAN) > asl.transitions_per_iteration(off)
    assert "fn-s0-w" in stage_functions(PLAN, 0, "fn-s0", True) and "fn-s0-w" not in stage_functions(off, 0, "fn-s0", True)
    assert "phase_watchers" not in PLAN.to_dict() and P.from_dict(off.to_dict()) == off
    with pytest.raises(Exception, match="phase_watchers"):
        P.from_dict({**PLAN.to_dict(), "phase_watchers": "no"})
    job = recovery_job("unwatched")
    assert job.as_run(PLAN) is PLAN  # watched by default
    job.phase_watchers = False
    assert job.as_run(PLAN) == off


def test_a_job_without_phase_watchers_trains_exactly_with_no_watcher_function_or_task(backend):
    """Job(phase_watchers=False) on the local stack: stage 0 gets no watcher function, the windows
    schedule no watcher Task and no watcher writes a usage record, and the job trains what plain
    PyTorch trains."""
    from helpers import max_diff, recovery_job

    from stagecoach.reference import train_reference
    from stagecoach.run import phase_watchers

    job = recovery_job("unwatched", warm=False)
    job.phase_watchers = False
    r = job.run(stages=2, replicas=2, micro_batches=2, backend=backend)
    r.wait(progress=False, poll_s=0.2, timeout_s=600)
    names = [f["FunctionName"] for f in backend.clients.lambda_.list_functions()["Functions"] if r.job_id in f["FunctionName"]]
    assert names and not any(n.endswith("-w") for n in names), names
    scheduled = [e for e in r.history(windows=True) if e["type"] == "TaskScheduled"]
    assert scheduled and not any('"watch"' in e["taskScheduledEventDetails"]["parameters"] for e in scheduled)
    assert r.plan.phase_watchers is False and phase_watchers(backend.clients.s3, r.bucket, r.job_id) == []
    assert max_diff(r.trained_model(), train_reference(job, replicas=2, micro_batches=2)) < 1e-5
