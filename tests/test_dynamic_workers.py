"""Dynamic workers (issue 27 item 1, docs/runtime.md "Dynamic workers"): the data-parallel degree
changes at given iterations, with the global batch fixed, and the run still ends with the
parameters of plain single-process PyTorch (float64, 1e-5); or the global batch grows with a
learning-rate rule (Hydrozoa's AdaBatch policy), and the run ends with the parameters of the
single-process reference of the same schedule (sdk/reference.py train_reference_schedule). What
is not run yet is refused before anything is deployed, naming what is not supported."""

import dataclasses
import json
import subprocess
import time
from collections import Counter

import pytest
import torch
from helpers import max_diff, selected
from torch import nn

from stagecoach import Job, dynamic
from stagecoach import cost as costs
from stagecoach.core.cost import Usage
from stagecoach.core.records import JobSpec
from stagecoach.planner import segments
from stagecoach.planner.emit import asl
from stagecoach.planner.emit.asl_check import check_definition
from stagecoach.planner.model.platforms import aws_platform
from stagecoach.planner.plan import Plan, PlanError
from stagecoach.planner.segments import scheduled_plan, segment_bounds
from stagecoach.reference import train_reference

ITERATIONS = 5
GLOBAL_BATCH = 24
# (schedule, micro-batches): grow from one replica (no sync Map) to two, shrink from two to one, and
# 1 -> 4 -> 2 (one aggregator, K = 1, reduces all four replicas' gradients)
SCHEDULES = [({0: 1, 2: 2}, 1), ({0: 2, 3: 1}, 2), ({0: 1, 2: 4, 4: 2}, 1)]


def model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4))


def make_job(name: str, **options) -> Job:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(96, 10, generator=g, dtype=torch.float64)
    y = torch.randint(0, 4, (96,), generator=g)
    opts = {"warm_state": False, "iterations": ITERATIONS, **options}
    return Job(
        model=model,
        loss=nn.CrossEntropyLoss(),
        optimizer=lambda p: torch.optim.Adam(p, lr=0.01),
        train=(x, y),
        global_batch=GLOBAL_BATCH,
        seed=3,
        dtype=torch.float64,
        name=name,
        **opts,
    )


def _plan(schedule: dict) -> Plan:
    return scheduled_plan(
        schedule, ITERATIONS, lambda d: Plan(balance=(3, 2), replicas=d, global_batch=GLOBAL_BATCH, sync="k_reduce", aggregators=1)
    )


def test_a_schedule_is_one_plan_whose_segments_run_by_iteration():
    plan = _plan({0: 1, 2: 2, 4: 2})
    assert plan.replicas == 2 and [(f, p.replicas) for f, p in plan.segments] == [(0, 1), (2, 2)]  # 4: no change
    assert [plan.plan_at(t).replicas for t in range(ITERATIONS)] == [1, 1, 2, 2, 2]
    assert Plan.from_dict(plan.to_dict()) == plan
    spec_plan = JobSpec.model_fields["plan"]  # the spec carries the plan dict as is
    assert spec_plan is not None
    assert "segments" not in Plan(balance=(3, 2), replicas=2, global_batch=GLOBAL_BATCH).to_dict()  # a fixed d's plan unchanged


def test_the_window_picks_the_segment_of_its_first_iteration_and_switches_at_the_change():
    plan = _plan({0: 1, 3: 2})
    definition = asl.window_definition(plan, ["f0", "f1"], abort_key_format="jobs/{}/abort/{}")
    assert check_definition(definition) == []
    states = definition["States"]
    assert definition["StartAt"] == "Init" and states["Init"]["Next"] == "Start"
    assert states["Start"]["Choices"] == [{"Variable": "$.t", "NumericGreaterThanEquals": 3, "Next": "Enter_s1"}]
    assert states["Start"]["Default"] == "Enter_s0" and states["Enter_s1"]["Next"] == "Gate_s1"
    assert states["Enter_s0"]["Parameters"]["ranks"] == [0] and states["Switch_s1"]["Parameters"]["ranks"] == [0, 1]
    assert {"Variable": "$.t", "NumericGreaterThanEquals": 3, "Next": "Segment"} in states["Go?_s0"]["Choices"]
    assert states["Switch_s1"]["Next"] == "Go?_s1" and states["Switch_s1"]["Parameters"]["gate.$"] == "$.gate"


def test_the_joined_window_is_valid_asl(asl_validator, tmp_path):
    definition = asl.window_definition(_plan({0: 2, 2: 1, 4: 3}), ["f0", "f1"], abort_key_format="jobs/{}/abort/{}")
    path = tmp_path / "window.json"
    path.write_text(json.dumps(definition))
    r = subprocess.run([asl_validator, "--json-path", str(path)], capture_output=True, text=True)
    assert r.returncode == 0 and "is valid" in r.stdout + r.stderr, r.stdout + r.stderr


def backward_tasks(run) -> list[int]:
    """Per iteration, how many backward tasks of the last stage ran: that iteration's d."""
    counts = Counter(m.t for m in run.metrics() if m.phase == "backward" and m.stage == 1)
    return [counts[t] for t in range(run.job.iterations)]


@pytest.mark.parametrize(
    "options, run_options, words",
    [
        ({}, {"replicas": lambda metrics: 2}, "policy"),
        ({}, {"replicas": {"epoch:1": 2, 0: 1}}, "by-epoch"),
        ({}, {"replicas": {1: 2}}, "key 0"),
        ({}, {"replicas": {0: 1, 2: 2}, "sync": "pipelined_scatter_reduce"}, "not supported with a replica schedule"),
        ({}, {"replicas": {0: 2, 2: 4}, "aggregators": 4}, "aggregators"),
        ({"warm_state": True}, {"replicas": {0: 1, 2: 2}}, "warm state"),
        ({"workflow": "express"}, {"replicas": {0: 1, 2: 2}}, "Express"),
    ],
)
def test_what_the_first_slice_does_not_run_is_refused_up_front(options, run_options, words):
    with pytest.raises(PlanError, match=words):
        make_job("dyn-refused", **options).run(stages=2, backend="no-such-backend", **run_options)


@pytest.fixture(scope="module")
def runs(backend, request):
    """The selected schedules' runs, started together on the session's stack (tests/conftest.py: a
    LocalBackend() is the process's one shared stack, which no test may close)."""
    calls = [getattr(i, "callspec", None) for i in request.session.items if i.path == request.path]
    wanted = {str(c.params["schedule"]) for c in calls if c and "schedule" in c.params}  # dicts: not hashable for helpers.selected
    started = {
        str(s): make_job(f"dyn-{i}").run(backend=backend, stages=2, replicas=s, micro_batches=m)
        for i, (s, m) in enumerate(SCHEDULES)
        if str(s) in wanted
    }
    for run in started.values():
        run.wait(progress=False, poll_s=2.0, timeout_s=900)
    return started


# the default run changes d once; the rest (a shrink, two changes) are `-m slow`
@pytest.mark.parametrize(
    "schedule", [pytest.param(s, id=str(s), marks=() if i == 0 else pytest.mark.slow) for i, (s, _) in enumerate(SCHEDULES)]
)
def test_a_changing_d_trains_what_plain_pytorch_trains(runs, schedule):
    run = runs[str(schedule)]
    expected = train_reference(run.job)  # the whole global batch at once: knows nothing of replicas
    assert max_diff(run.trained_model(), run.job.build_model()) > 1e-3  # it trained
    assert max_diff(run.trained_model(), expected) < 1e-5
    assert backward_tasks(run) == [Plan.from_dict(run.spec().plan).plan_at(t).replicas for t in range(ITERATIONS)]


def test_a_change_at_a_window_boundary_and_one_inside_a_window(backend, monkeypatch):
    # windows of 2 iterations: [0, 2) [2, 4) [4, 6) [6, 7); d changes at 2 (a boundary) and at 5 (inside)
    monkeypatch.setattr(asl, "window_length", lambda plan, limit=asl.HISTORY_LIMIT, **kw: 2)
    job = make_job("dyn-windows", iterations=7)
    run = job.run(backend=backend, stages=2, replicas={0: 1, 2: 3, 5: 2}, micro_batches=2)
    assert run.wait(progress=False, poll_s=1.0, timeout_s=600) == "SUCCEEDED"
    assert len(run.window_executions()) == 4
    assert backward_tasks(run) == [1, 1, 3, 3, 3, 2, 2]
    assert max_diff(run.trained_model(), train_reference(job)) < 1e-5


def test_a_job_stopped_and_resumed_across_a_change_trains_what_plain_pytorch_trains(backend):
    """Stopped at an iteration boundary with a schedule (checkpoints kept every 2 versions), then
    resumed to more iterations: the change and the checkpoints' Map run from the resumed window."""
    long = make_job("dyn-stop", iterations=1000, checkpoint_every=2).run(backend=backend, stages=2, replicas={0: 1, 3: 2})
    while not long.metrics() or long.iterations_done() < 2:
        time.sleep(0.5)
    long.stop()
    assert long.wait(progress=False, poll_s=1.0, timeout_s=600) == "STOPPED"
    total = max(long.version() + 3, 6)
    resumed = backend.resume(long.job_id, iterations=total, job=make_job("dyn-stop", iterations=1000, checkpoint_every=2))
    assert resumed.wait(progress=False, poll_s=2.0, timeout_s=600) == "SUCCEEDED"
    assert backward_tasks(resumed)[:total] == [1, 1, 1] + [2] * (total - 3)
    assert max_diff(resumed.trained_model(), train_reference(make_job("dyn-ref", iterations=total))) < 1e-5
    assert resumed.checkpoints() == list(range(2, total + 1, 2))


def test_a_failed_window_restarts_in_the_segment_of_its_resume_point():
    """The window fails at t = 2, d's first iteration at 1, and again at t = 3, back at 2: each
    next attempt starts where the failed one left every object stored (ResumePoint), entering the
    segment of that iteration (Start, Enter_s{j})."""
    from stagecoach.local.backend import LocalBackend  # the embedded stack: moto and a local Lambda runtime

    once = [{"kind": "fail", "phase": "backward", "t": t, "stage": 0, "replica": 0} for t in (2, 3)]
    faulty = LocalBackend(faults={"once": once})
    try:
        job = make_job("dyn-restarts")
        r = job.run(backend=faulty, stages=2, replicas={0: 2, 2: 1, 3: 2}, timeout_s=12)
        r.wait(progress=False, poll_s=1.0, timeout_s=600)
        windows = sorted(
            (faulty.clients.sfn.describe_execution(executionArn=a) for a in r.window_executions()), key=lambda d: d["startDate"]
        )
        assert [json.loads(d["input"])["first"] for d in windows] == [0, 2, 3]
        assert [d["status"] for d in windows] == ["FAILED", "FAILED", "SUCCEEDED"]
        assert backward_tasks(r) == [2, 2, 1, 2, 2]
        assert max_diff(r.trained_model(), train_reference(job)) < 1e-5
    finally:
        faulty.stack.close()


def _scheduled(job: Job, **manual) -> Plan:
    """The plan ``job.run(stages=2, **manual)`` runs."""
    return job.as_run(dynamic.manual_scheduled_plan(job, {"stages": 2, **manual}, job.manual_plan))


@pytest.fixture
def timed_once(monkeypatch):
    """The model's layers timed once per micro-batch size and reused: every prediction here reads
    the same profile (Job._model_of times them anew each call, and timings vary between calls)."""
    import stagecoach.job

    profiles: dict[tuple, object] = {}
    real = stagecoach.job.measure_model

    def measure(model, sample, micro_batch_sizes, name):
        key = (tuple(micro_batch_sizes), name)
        if key not in profiles:
            profiles[key] = real(model, sample, micro_batch_sizes=micro_batch_sizes, name=name)
        return profiles[key]

    monkeypatch.setattr(stagecoach.job, "measure_model", measure)


@pytest.mark.usefixtures("timed_once")
@pytest.mark.parametrize(
    "manual", [{"replicas": {0: 1, 3: 2}}, dynamic.adabatch({0: 1, 2: 2, 4: 4}, GLOBAL_BATCH)], ids=["fixed-batch", "adabatch"]
)
def test_a_schedule_s_predicted_cost_is_its_segments_predictions_in_one_joined_window(manual):
    """Each segment predicted as an ordinary plan for its iterations (its d, global batch and
    micro-batch size), summed; the windows' orchestration is one joined window and one job instead
    of a window and a job per segment, plus the joined window's Start and Enter and, per change
    inside the window, its Segment, Switch and second Go? (planner/segments.py)."""
    job = make_job("dyn-predict", iterations=6)
    plan = _scheduled(job, **manual)
    assert job.window_choice(plan).window_length >= 6  # one window: every change is inside it
    parts = segment_bounds(plan, 6)
    alone = [dataclasses.replace(job, iterations=end - first).predict_cost(seg) for first, end, seg in parts]
    predicted = job.predict_cost(plan)
    assert predicted.iterations == 6 and set(predicted.phases) == set(alone[0].phases)
    for phase in ("forward", "backward", "sync"):
        expected = sum((r.phases[phase] for r in alone), Usage())
        assert dataclasses.replace(predicted.phases[phase], gb_s=0.0) == dataclasses.replace(expected, gb_s=0.0), phase
        assert predicted.phases[phase].gb_s == pytest.approx(expected.gb_s, rel=1e-12), phase
    assert predicted.unsplit == sum((r.unsplit for r in alone), Usage())
    changes = len(parts) - 1
    gate = costs.gate_usage(plan.plan_at(0), aws_platform(), capped=False)  # a window's last gate
    job_window = asl.TRANSITIONS_WINDOW_FIXED + asl.TRANSITIONS_JOB_PER_WINDOW + asl.TRANSITIONS_JOB_FIXED
    overhead = segments.TRANSITIONS_SEGMENT_ENTRY + changes * (segments.TRANSITIONS_SEGMENT_SWITCH - job_window)
    orchestration = [r.phases["orchestration"] for r in alone]
    p = predicted.phases["orchestration"]
    assert p.transitions == sum(u.transitions for u in orchestration) + overhead
    assert (p.invocations, p.puts, p.gets) == tuple(
        sum(getattr(u, f) for u in orchestration) - changes * getattr(gate, f) for f in ("invocations", "puts", "gets")
    )
    assert p.gb_s == pytest.approx(sum(u.gb_s for u in orchestration) - changes * gate.gb_s, rel=1e-12)
    assert predicted.usd > max(r.usd for r in alone)


@pytest.mark.usefixtures("timed_once")
def test_a_schedule_predicts_each_segment_and_refuses_one_iteration_s_estimate():
    job = make_job("dyn-predict", iterations=6)
    plan = _scheduled(job, **dynamic.adabatch({0: 1, 2: 2, 4: 4}, GLOBAL_BATCH))
    segs = job.predict_schedule(plan)
    assert [(s.first, s.iterations, s.replicas, s.global_batch, s.micro_batch_size) for s in segs] == [
        (0, 2, 1, 24, 24),
        (2, 2, 2, 48, 24),
        (4, 2, 4, 96, 24),
    ]
    for s in segs:
        assert s.estimate == job.predict(plan.plan_at(s.first))  # as an ordinary plan of its d and batch
        assert s.cold_s == 0.0 and s.time_s == pytest.approx(2 * s.estimate.time_s)  # d <= 1,000: no scaling ramp
    with pytest.raises(PlanError, match="predict_schedule"):
        job.predict(plan)
    with pytest.raises(PlanError, match="Express"):
        job.predict_cost(plan, workflow="express")


def test_the_joined_window_enters_the_states_its_prediction_counts():
    """The states planner/segments.py's TRANSITIONS_SEGMENT_* count: Start and Enter_s{j} once per
    window; at a change inside one, Segment, Switch_s{j}, and Go?_s{j} once more."""
    states = asl.window_definition(_plan({0: 1, 3: 2}), ["f0", "f1"], abort_key_format="jobs/{}/abort/{}")["States"]
    assert [states["Init"]["Next"], states["Start"]["Default"], states["Enter_s0"]["Next"]] == ["Start", "Enter_s0", "Gate_s0"]
    assert segments.TRANSITIONS_SEGMENT_ENTRY == len(["Start", "Enter_s0"])
    assert {"Variable": "$.t", "NumericGreaterThanEquals": 3, "Next": "Segment"} in states["Go?_s0"]["Choices"]
    assert states["Segment"]["Choices"][0]["Next"] == "Switch_s1" and states["Switch_s1"]["Next"] == "Go?_s1"
    assert segments.TRANSITIONS_SEGMENT_SWITCH == len(["Segment", "Switch_s1", "Go?_s1"])


def test_a_schedule_s_measured_invocations_and_transitions_are_its_predicted_ones(backend, monkeypatch):
    """On the stack, windows of 2 iterations ([0, 2) [2, 4) [4, 6)): d changes at 2 (a window
    boundary) and at 5 (inside a window), and versions 2, 4 and 6 are kept (each in its segment): the
    prediction has every invocation and state transition the run is billed for, per phase."""
    monkeypatch.setattr(asl, "window_length", lambda plan, limit=asl.HISTORY_LIMIT, **kw: 2)
    job = make_job("dyn-cost", iterations=6, checkpoint_every=2)
    assert job.checkpoint_versions() == [2, 4, 6]
    run = job.run(backend=backend, stages=2, replicas={0: 1, 2: 2, 5: 1})
    assert run.wait(progress=False, poll_s=1.0, timeout_s=600) == "SUCCEEDED"
    measured, predicted = run.cost(), run.predicted_cost()
    assert predicted.iterations == 6 and len(run.window_executions()) == 3
    for phase in ("forward", "backward", "sync", "checkpoint", "orchestration"):
        m, p = measured.phases[phase], predicted.phases[phase]
        assert (m.invocations, m.transitions) == (p.invocations, p.transitions), (phase, m, p)
    assert predicted.phases["backward"].invocations == 2 * (1 + 1 + 2 + 2 + 2 + 1)
    assert measured.total.transitions == predicted.total.transitions


def test_a_plan_with_segments_given_whole_is_checked_as_a_schedule_is():
    plan = _plan({0: 1, 2: 2})
    job = make_job("dyn-plan")
    with pytest.raises(PlanError, match="largest d"):
        job.run(plan=dataclasses.replace(plan.segments[0][1], segments=plan.segments), backend="no-such-backend")
    with pytest.raises(PlanError, match="warm state"):
        make_job("dyn-plan-warm", warm_state=True).run(plan=plan, backend="no-such-backend")


# -- a growing global batch with a learning-rate rule (Hydrozoa's AdaBatch policy) -----------------------
# (replicas, global batch, lr_scale, iterations): d 1 -> 2 with G 8 -> 16 and lr x 0.75; and d 1 -> 2
# -> 4 with G 8 -> 16 -> 32 and lr x 0.75 twice over 7 iterations, whose last batches cross an epoch
# (96 samples: offsets 0, 8, 16, 32, 48, then 80 + 32 > 96 starts epoch 1 at 0, then 32)
ADABATCH = [
    ({0: 1, 2: 2}, {0: 8, 2: 16}, {2: 0.75}, 5),
    ({0: 1, 2: 2, 4: 4}, {0: 8, 2: 16, 4: 32}, {2: 0.75, 4: 0.75}, 7),
]


def test_a_growing_batch_takes_the_samples_after_the_previous_iteration_s():
    from stagecoach.core.training import batch_indices, batch_position, derive_seed, epoch_of

    n, sizes = 96, [(0, 8), (2, 16), (4, 32)]
    perm = [torch.randperm(n, generator=torch.Generator().manual_seed(derive_seed(3, "data", e))) for e in (0, 1)]
    batches = [batch_indices(3, t, n, 0, sizes) for t in range(7)]
    assert torch.equal(torch.cat(batches[:5]), perm[0][:80])  # the cumulative offset, not t * G
    assert torch.equal(torch.cat(batches[5:]), perm[1][:64])  # 16 samples left < 32: epoch 1
    assert [epoch_of(t, n, 0, sizes) for t in range(7)] == [0, 0, 0, 0, 0, 1, 1]
    for g in (7, 24, 96):  # a fixed batch: the same samples as ever, through either path
        for t in range(30):
            assert torch.equal(batch_indices(3, t, n, g), batch_indices(3, t, n, g, [(0, g)]))
            assert batch_position(t, n, [(0, g), (10**6, g + 1)])[:2] == (t // (n // g), (t % (n // g)) * g)


def test_a_growing_batch_s_plan_carries_each_segment_s_batch_and_learning_rate_factor():
    plan = scheduled_plan(
        {0: 1, 2: 2, 4: 4},
        8,
        lambda d: Plan(balance=(3, 2), replicas=d, global_batch=8, sync="k_reduce", aggregators=1),
        global_batch={0: 8, 2: 16, 4: 32},
        lr_scale={2: 0.75, 4: 0.75, 6: 0.5},
    )
    got = [(f, p.replicas, p.global_batch, p.lr_scale) for f, p in plan.segments]
    assert got == [(0, 1, 8, 1.0), (2, 2, 16, 0.75), (4, 4, 32, 0.5625), (6, 4, 32, 0.28125)]
    assert plan.batch_sizes() == ((0, 8), (2, 16), (4, 32)) and plan.lr_scale == 1.0
    assert Plan.from_dict(plan.to_dict()) == plan
    assert "lr_scale" not in _plan({0: 1, 2: 2}).to_dict()["segments"][1][1]  # a fixed batch's JSON as before


def test_adabatch_doubles_the_batch_with_d_and_decays_the_learning_rate_by_0_75_per_doubling():
    from stagecoach.dynamic import adabatch

    got = adabatch({0: 1, 300: 2, 600: 8, 900: 4}, 16)
    assert got == {
        "replicas": {0: 1, 300: 2, 600: 8, 900: 4},
        "global_batch": {0: 16, 300: 32, 600: 128, 900: 64},
        "lr_scale": {300: 0.75, 600: 0.75**2, 900: 1 / 0.75},
    }
    with pytest.raises(PlanError, match="power of two"):
        adabatch({0: 2, 10: 6}, 16)


@pytest.mark.parametrize(
    "options, run_options, words",
    [
        ({"epochs": 2, "iterations": None}, {"global_batch": {0: 24, 2: 48}}, "iterations="),
        ({"scheduler": lambda o: torch.optim.lr_scheduler.StepLR(o, 2)}, {"replicas": {0: 1, 2: 2}, "lr_scale": {2: 0.75}}, "scheduler"),
        ({}, {"replicas": {0: 1, 2: 2}, "global_batch": {0: 16, 2: 32}}, "starts at 16"),
        ({}, {"global_batch": {0: 24, 2: 192}}, "larger than the training set"),
        ({}, {"replicas": {0: 1, 2: 2}, "lr_scale": {2: -1}}, "positive"),
        ({}, {"global_batch": {"epoch:1": 48, 0: 24}}, "by-epoch"),
        ({}, {"lr_scale": {0: 0.5}}, "optimizer factory"),
        ({}, {"replicas": {0: 1, 2: 2}, "global_batch": {0: 24, 2: 36}, "micro_batches": 4}, "not divisible"),
    ],
)
def test_what_a_growing_batch_does_not_run_is_refused_up_front(options, run_options, words):
    with pytest.raises(PlanError, match=words):
        make_job("dyn-grow-refused", **options).run(stages=2, backend="no-such-backend", **run_options)


@pytest.fixture(scope="module")
def growing_runs(backend, request):
    """As ``runs``: on the session's shared stack, which no test may close."""
    wanted = selected(request, "case")
    started = {}
    for i, (replicas, batches, scales, iterations) in enumerate(ADABATCH):
        if i not in wanted:
            continue
        job = dataclasses.replace(make_job(f"dyn-grow-{i}", iterations=iterations), global_batch=8)
        started[i] = job.run(backend=backend, stages=2, replicas=replicas, global_batch=batches, lr_scale=scales)
    for run in started.values():
        run.wait(progress=False, poll_s=2.0, timeout_s=900)
    return started


@pytest.mark.parametrize("case", [pytest.param(i, id=str(c[1]), marks=() if i == 0 else pytest.mark.slow) for i, c in enumerate(ADABATCH)])
def test_a_growing_batch_with_a_learning_rate_rule_trains_what_its_reference_trains(growing_runs, case):
    from stagecoach.reference import train_reference_schedule

    run = growing_runs[case]
    replicas, batches, scales, iterations = ADABATCH[case]
    assert run.status() == "SUCCEEDED"
    expected = train_reference_schedule(run.job, batches, scales)  # the whole batch at once, no replicas
    assert max_diff(run.trained_model(), expected) < 1e-5
    assert max_diff(run.trained_model(), train_reference_schedule(run.job, batches)) > 1e-4  # the lr rule was applied
    assert max_diff(run.trained_model(), train_reference(run.job)) > 1e-4  # and the batch grew
    d = [[v for f, v in sorted(replicas.items()) if f <= t][-1] for t in range(iterations)]
    assert backward_tasks(run) == d


@pytest.mark.slow  # a window restarted in its segment: test_a_failed_window_restarts_in_the_segment_of_its_resume_point
def test_a_window_restarted_at_a_learning_rate_change_steps_with_the_same_rate():
    """The window fails at t = 2 (the first iteration of G 16 and lr x 0.75) and at t = 3: each next
    attempt starts at its resume point and takes the factor from the plan of that iteration
    (Plan.lr_scale of its segment, in job.json), so it trains what the reference trains."""
    from stagecoach.local.backend import LocalBackend  # the embedded stack: moto and a local Lambda runtime
    from stagecoach.reference import train_reference_schedule

    once = [{"kind": "fail", "phase": "backward", "t": t, "stage": 0, "replica": 0} for t in (2, 3)]
    faulty = LocalBackend(faults={"once": once})
    try:
        replicas, batches, scales, _ = ADABATCH[0]
        job = dataclasses.replace(make_job("dyn-grow-restarts"), global_batch=8)
        r = job.run(backend=faulty, stages=2, replicas=replicas, global_batch=batches, lr_scale=scales, timeout_s=12)
        assert r.wait(progress=False, poll_s=1.0, timeout_s=600) == "SUCCEEDED"
        windows = [json.loads(faulty.clients.sfn.describe_execution(executionArn=a)["input"])["first"] for a in r.window_executions()]
        assert sorted(windows) == [0, 2, 3]
        assert max_diff(r.trained_model(), train_reference_schedule(job, batches, scales)) < 1e-5
    finally:
        faulty.stack.close()


@pytest.mark.slow  # stop/resume across a change: test_a_job_stopped_and_resumed_across_a_change_trains_what_plain_pytorch_trains
def test_a_job_with_a_growing_batch_stopped_and_resumed_across_the_change_trains_what_its_reference_trains(backend):
    """Stopped at an iteration boundary around the change (at 3), resumed to more iterations: the
    resumed window continues the data order at the cumulative offset and steps with its segment's rate."""
    from stagecoach.reference import train_reference_schedule

    def grow_job(iterations: int) -> Job:
        return dataclasses.replace(make_job("dyn-grow-stop", iterations=iterations, checkpoint_every=2), global_batch=8)

    batches, scales = {0: 8, 3: 16}, {3: 0.75}
    long = grow_job(1000).run(backend=backend, stages=2, replicas={0: 1, 3: 2}, global_batch=batches, lr_scale=scales)
    while not long.metrics() or long.iterations_done() < 2:
        time.sleep(0.5)
    long.stop()
    assert long.wait(progress=False, poll_s=1.0, timeout_s=600) == "STOPPED"
    total = max(long.version() + 3, 6)
    resumed = backend.resume(long.job_id, iterations=total, job=grow_job(1000))
    assert resumed.wait(progress=False, poll_s=2.0, timeout_s=600) == "SUCCEEDED"
    assert backward_tasks(resumed)[:total] == [1, 1, 1] + [2] * (total - 3)
    assert max_diff(resumed.trained_model(), train_reference_schedule(grow_job(total), batches, scales)) < 1e-5
