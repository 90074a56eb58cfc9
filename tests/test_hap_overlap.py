"""FasDL's HAP overlapped (issue 27): a non-aggregator's gradient of iteration t+1 needs only version
t, so the window computes it beside iteration t's aggregators' backward tasks and sync Map
(planner/emit/asl.py ``_hap_backward_sync``). On the local stack the overlap really happens (the
tasks' own metrics: a non-aggregator's backward task of t+1 starts before iteration t's sync tasks
end, and after iteration t-1's, which made the version it reads), across windows of three
iterations (each window's first iteration computes its own non-aggregators' gradient, its last
none ahead) and across a window restarted after a failure in the ahead branch; the model and the
losses still equal stagecoach.reference_hap's (float64, <= 1e-10), and the window's states are
those the emitter counts."""

import json
import subprocess

import pytest
import torch
from torch import nn

from stagecoach import Job
from stagecoach.core import keys
from stagecoach.local.backend import LocalBackend
from stagecoach.planner.emit import asl
from stagecoach.planner.emit.asl_check import check_definition
from stagecoach.planner.hap import HAP_SYNC, HapSplit
from stagecoach.planner.plan import Plan
from stagecoach.reference_hap import train_reference_hap

SPLIT = HapSplit(4, 2, 12, 2, 2)  # d = 4, K = 2, B^a = 2, B^n = 4, two micro-batches each
ITERATIONS = 7
WINDOW = 3  # windows [0, 3), [3, 6), [6, 7): the last has one iteration, first and last at once
# a non-aggregator's backward task of iteration 3 fails once: it runs in iteration 2's ahead branch
AHEAD_FAILURE = {"kind": "fail", "phase": "backward", "t": 3, "stage": 0, "replica": 3}


def make_job(name: str) -> Job:
    g = torch.Generator().manual_seed(11)
    x = torch.randn(60, 6, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (60,), generator=g)
    return Job(
        model=lambda: nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)),
        loss=nn.CrossEntropyLoss(),
        optimizer=lambda p: torch.optim.Adam(p, lr=0.02),
        train=(x, y),
        global_batch=SPLIT.global_batch,
        iterations=ITERATIONS,
        seed=5,
        dtype=torch.float64,
        name=name,
    )


def run_hap(job: Job, backend):
    s = SPLIT
    return job.run(
        backend=backend, replicas=s.replicas, aggregators=s.aggregators, micro_batches=s.micro_batches, sync=HAP_SYNC, hap_extra=s.extra
    )


def plan_of(sync: str = HAP_SYNC) -> Plan:
    hap = {"hap_extra": SPLIT.extra} if sync == HAP_SYNC else {}
    return Plan(balance=[3], replicas=4, micro_batches=2, global_batch=12, sync=[sync], aggregators=[2], **hap)


# -- the emitted window ----------------------------------------------------------------------------------
@pytest.mark.parametrize("per_worker", [False, True])
def test_a_hap_window_runs_the_next_non_aggregators_beside_the_aggregation(per_worker):
    d = asl.window_definition(plan_of(), ["f0"], per_worker=per_worker, abort_key_format=keys.WINDOW_ABORT)
    assert check_definition(d) == []
    states = d["States"]
    lead, ahead = states["BackwardSync"]["Branches"]
    assert lead["StartAt"] == "Lead?" and ahead["StartAt"] == "Ahead?"
    assert list(lead["States"]["Lead?"]["Choices"][0].items()) == [("Variable", "$.lead"), ("BooleanEquals", True), ("Next", "Backward0")]
    assert lead["States"]["Backward0"]["ItemsPath"] == ("$.bw.s0" if per_worker else "$.ranks")  # every replica of t
    assert lead["States"]["Backward0Aggregators"]["ItemsPath"] == "$.hap.a"
    assert lead["States"]["Backward0"]["Next"] == lead["States"]["Backward0Aggregators"]["Next"] == "Sync0"
    nxt = ahead["States"]["Backward0Ahead"]
    assert (nxt["ItemsPath"], nxt["ItemSelector"]["t.$"]) == ("$.hap.n", "$.ahead")  # the non-aggregators, of t+1
    assert ahead["States"]["Ahead?"]["Choices"][0]["NumericLessThanPath"] == "$.end"  # none past the window's end
    hap = states["Init"]["Parameters"]["hap"]
    assert [x["replica"] if per_worker else x for x in hap["a"] + hap["n"]] == [0, 1, 2, 3]
    assert states["Advance"]["Parameters"]["lead"] is False and states["Advance"]["Parameters"]["ahead.$"] == "States.MathAdd($.t, 2)"
    assert "lead.$" not in states["Advance"]["Parameters"]
    assert not asl.watchable(plan_of())  # the watcher knows one iteration's tasks


def test_a_bsp_window_is_unchanged():
    bsp = Plan(balance=[3], replicas=4, micro_batches=2, global_batch=16, sync=["k_reduce"], aggregators=[2])
    assert not asl.hap_overlap(bsp)
    states = asl.window_definition(bsp, ["f0"], abort_key_format=keys.WINDOW_ABORT)["States"]
    assert [b["StartAt"] for b in asl.phase_parallel(states, "BackwardSync")["Branches"]] == ["Backward0"]
    assert "hap" not in states["Init"]["Parameters"] and "lead" not in states["Init"]["Parameters"]


def test_a_steady_hap_iteration_has_the_transitions_the_gate_meters():
    d, k = SPLIT.replicas, SPLIT.aggregators
    got = asl.phase_transitions(plan_of())
    assert got == {"forward": 0, "backward": 1 + (1 + k) + (1 + d - k), "sync": 1 + k, "orchestration": 3 + 2}


# -- on the local stack ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def runs(backend):
    """A HAP run in windows of WINDOW iterations, and one whose ahead branch fails once (its
    window restarts), started together."""
    faulty = LocalBackend(faults={"once": [AHEAD_FAILURE]})
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(asl, "window_length", lambda plan, limit=asl.HISTORY_LIMIT, **kw: WINDOW)
            windowed = run_hap(make_job("hap-overlap"), backend)
        restarted = run_hap(make_job("hap-overlap-restart"), faulty)
        for r in (windowed, restarted):
            r.wait(progress=False, poll_s=1.0, timeout_s=900)
        yield {"windowed": windowed, "restarted": restarted, "faulty": faulty}
    finally:
        faulty.stack.close()


def max_diff(a: nn.Module, b: nn.Module) -> float:
    return max(float((p.detach() - q.detach()).abs().max()) for p, q in zip(a.parameters(), b.parameters(), strict=True))


@pytest.mark.parametrize("name", ["windowed", "restarted"])
def test_the_overlapped_run_equals_the_hap_reference(runs, name):
    run = runs[name]
    losses: list[float] = []
    want = train_reference_hap(run.job, SPLIT, losses)
    assert max_diff(run.trained_model(), want) <= 1e-10
    assert run.losses() == pytest.approx(losses, abs=1e-10)


def _ends(ms, phase: str, t: int) -> list[float]:
    return [m.end for m in ms if m.phase == phase and m.t == t]


def test_a_non_aggregator_of_t_plus_1_runs_during_iteration_ts_aggregation(runs):
    """Inside a window, each non-aggregator's backward task of t+1 starts before every sync task of
    t ends; it starts after iteration t-1's sync tasks end (version t, which it reads, is complete)."""
    ms = runs["windowed"].metrics()
    overlapped = 0
    for t in range(ITERATIONS - 1):
        for r in range(SPLIT.aggregators, SPLIT.replicas):
            (b,) = [m for m in ms if m.phase == "backward" and m.t == t + 1 and m.index == r]
            if t >= 1:
                assert b.start >= max(_ends(ms, "sync", t - 1)), (t, r)
            if (t + 1) % WINDOW:  # not a window's first iteration: computed ahead, in iteration t
                assert b.start < min(_ends(ms, "sync", t)), (t, r)
                overlapped += 1
            else:  # the next window computes it, after this window's last sync
                assert b.start >= max(_ends(ms, "sync", t)), (t, r)
    assert overlapped == 2 * (ITERATIONS - 1 - (ITERATIONS - 1) // WINDOW)


def _entered(events, name: str) -> int:
    return sum(1 for e in events if e["type"].endswith("StateEntered") and e["stateEnteredEventDetails"]["name"] == name)


def test_each_window_leads_once_runs_ahead_until_its_end_and_has_the_counted_transitions(runs):
    run = runs["windowed"]
    spans = []
    for arn in run.window_executions():
        d = run._c.sfn.describe_execution(executionArn=arn)
        given = json.loads(d["input"])
        spans.append((given["start"], given["end"], run.history(execution_arn=arn)))
    assert sorted((a, b) for a, b, _ in spans) == [(0, 3), (3, 6), (6, 7)]
    per = asl.transitions_per_iteration(plan_of())
    for a, b, events in spans:
        assert (_entered(events, "Backward0"), _entered(events, "Backward0Ahead"), _entered(events, "NoneAhead")) == (1, b - a - 1, 1)
        entered = sum(1 for e in events if e["type"].endswith("StateEntered"))
        assert entered == asl.TRANSITIONS_WINDOW_FIXED + (b - a) * per  # the lead's extra tasks = the last's missing ones


def test_a_failure_in_the_ahead_branch_restarts_the_window_which_leads_again(runs):
    run, faulty = runs["restarted"], runs["faulty"]
    windows = sorted((faulty.clients.sfn.describe_execution(executionArn=a) for a in run.window_executions()), key=lambda d: d["startDate"])
    assert [d["status"] for d in windows] == ["FAILED", "SUCCEEDED"]
    first = json.loads(windows[1]["input"])["first"]
    assert 0 <= first <= 3
    events = run.history(execution_arn=windows[1]["executionArn"])
    assert _entered(events, "Backward0") == 1  # the restarted attempt's first iteration: every replica's gradient


def test_asl_validator_accepts_the_hap_window(asl_validator, tmp_path):
    paths = []
    for per_worker in (False, True):
        p = tmp_path / f"hap-{per_worker}.json"
        p.write_text(
            json.dumps(
                asl.window_definition(plan_of(), ["f0"], per_worker=per_worker, evals=[2], saves=[3], abort_key_format=keys.WINDOW_ABORT)
            )
        )
        paths += ["--json-path", str(p)]
    r = subprocess.run([asl_validator, *paths], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    verdicts = [line for line in (r.stdout + r.stderr).splitlines() if "State machine definition" in line]
    assert len(verdicts) == 2 and all(line.endswith("is valid") for line in verdicts), r.stdout + r.stderr
