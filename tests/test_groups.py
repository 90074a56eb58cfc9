"""Phases past 40 workers (issue 25): a phase Map of more tasks than a group runs them as child
executions of the job's group state machine (planner/emit/groups.py). On the local stack the group
size is lowered to 3, so a 2-stage x 4-replica job has groups; it must train exactly what the same
plan trains without groups, be billed what the model predicts, and be remediated through a group."""

import dataclasses
import json

import pytest
import torch
from helpers import recovery_job, same_parameters

from stagecoach.core import keys
from stagecoach.core.records import Remediation
from stagecoach.planner import limits
from stagecoach.planner.emit import asl, groups
from stagecoach.planner.emit.asl_check import check_definition
from stagecoach.planner.emit.tasks import KILLED_ERROR
from stagecoach.planner.plan import Plan, PlanError

SMALL_GROUP = 3
TIMEOUT_S = 12


@pytest.fixture
def small_groups(monkeypatch):
    monkeypatch.setattr(limits, "GROUP_SIZE", SMALL_GROUP)
    monkeypatch.setattr(groups, "GROUP_SIZE", SMALL_GROUP)


def _plan(d: int, stages: int = 2, **kw) -> Plan:
    return Plan(balance=[1] * stages, replicas=d, micro_batches=1, global_batch=d, **kw)


# ------------------------------------------------------------------------------ the definitions
def test_groups_cover_every_task_once_in_at_most_a_maps_concurrency():
    for n in (41, 80, 1000, limits.MAP_MAX_TASKS):
        bounds = groups.group_bounds(n)
        covered = [i for g in bounds for i in range(g["first"], g["last"] + 1)]
        assert covered == list(range(n)) and all(g["last"] - g["first"] < limits.GROUP_SIZE for g in bounds)
        assert len(bounds) <= limits.INLINE_MAP_MAX_CONCURRENCY
    assert groups.group_bounds(40) == [] and limits.map_groups(40) == 0
    with pytest.raises(ValueError, match="more than a Map runs at once"):
        groups.group_bounds(limits.MAP_MAX_TASKS + 1)
    with pytest.raises(PlanError, match="use fewer replicas"):
        _plan(limits.MAP_MAX_TASKS + 1, stages=1)


def test_no_state_grows_with_the_workers_beyond_their_groups():
    """The window's Init (what every iteration carries) and the definition hold group bounds, not
    items: 1,000 workers a phase cost about what 41 do."""
    arn = "arn:aws:states:us-east-1:123456789012:stateMachine:sc-j-0123abcd-group"
    sizes = {}
    for d in (41, 1000):
        for per_worker in (False, True):
            w = asl.window_definition(_plan(d), ["f-s0", "f-s1"], per_worker, abort_key_format=keys.WINDOW_ABORT, group_arn=arn)
            assert not check_definition(w)
            sizes[d, per_worker] = (len(json.dumps(w["States"]["Init"])), len(json.dumps(w)))
    for per_worker in (False, True):
        (init41, def41), (init1000, def1000) = sizes[41, per_worker], sizes[1000, per_worker]
        assert init41 < init1000 < 6_000 and def1000 < 2 * def41, sizes  # 2 groups a Map against 25
    assert not check_definition(groups.group_definition(True)) and not check_definition(groups.group_definition(False))


def test_a_window_of_1000_workers_a_phase_holds_many_iterations():
    """Each group adds its start Task's 6 events and its Map item's 2 to the window's history."""
    per = {d: asl.events_per_iteration(_plan(d)) for d in (40, 160, 1000)}
    assert per[160] < per[40]  # 4 groups of 40 against 40 tasks of 7 events
    # Gate and Go? 7; Forward: Parallel 4 + a Map of 25 groups (4 + 25 x 8); BackwardSync 4 + 2 such
    # backward Maps and 2 sync Maps (scatter-reduce: K = d = 1,000); Advance 2
    assert per[1000] == 7 + (4 + 204) + 4 + 4 * 204 + 2 == 1037
    assert asl.window_length(_plan(1000)) == 19  # (0.8 x 25,000 - 13 - its redos' room) // 1,037


def test_a_group_fails_with_its_workers_own_error_and_cause():
    m = groups.grouped_map("Backward1", 1, "backward", "f-s1", "$.groups.r", "$.gate.timeouts.b1", None, "arn:g")
    st = m["ItemProcessor"]["States"]
    assert st["Backward1Group"]["Catch"][0]["ErrorEquals"] == ["States.TaskFailed"]
    assert st["Backward1GroupRethrow"] == {"Type": "Fail", "ErrorPath": "$.child.Error", "CausePath": "$.child.Cause"}
    assert st["Backward1Group"]["Parameters"]["Input"]["phase"] == "backward" and st["Backward1Group"]["ResultPath"] is None


def test_a_group_executions_transitions_count_to_the_phase_it_runs():
    """Histories come one after the other; a child's states (Items, Kind?, Shards, ...) say nothing
    of the phase, its input does (sdk/cost.py history_usage)."""
    from stagecoach.cost import Usage, history_usage

    def started(given):
        return {"type": "ExecutionStarted", "executionStartedEventDetails": {"input": json.dumps(given)}}

    def entered(kind, name):
        return {"type": f"{kind}StateEntered", "stateEnteredEventDetails": {"name": name}}

    group = {"job": "j", "phase": "sync", "stage": 1, "first": 0, "last": 39}
    events = [
        started({"job": "j", "first": 0, "end": 5, "start": 0}),  # a window: by its states' names
        entered("Map", "Forward0"),
        entered("Task", "Forward0Group"),
        started(group),
        *(
            entered(k, n)
            for k, n in (("Pass", "Items"), ("Choice", "Kind?"), ("Map", "Shards"), ("Task", "ShardTask"), ("Task", "ShardTask"))
        ),
        started({**group, "phase": "evaluate"}),
        entered("Pass", "Items"),
    ]
    out = history_usage(events)
    assert out["forward"] == Usage(transitions=2) and out["sync"] == Usage(transitions=5) and out["evaluate"] == Usage(transitions=1)


def test_starting_a_group_retries_only_the_names_aws_gives_a_refused_start():
    """A refused StartExecution is "StepFunctions.<code>Exception" (AWS-recorded; the guide's own
    example says "StepFunctions.ExecutionLimitExceeded"), throttling and other service errors the
    SDK's base exception, client-side failures SdkClientException (groups.GROUP_START_RETRY's
    sources); a child that ran and failed is States.TaskFailed, caught and never retried."""
    start = groups.grouped_map("Forward0", 0, "forward", "f-s0", "$.groups.r", "$.gate.timeouts.f", None, "arn:g")
    task = start["ItemProcessor"]["States"]["Forward0Group"]
    assert task["Retry"] == [groups.GROUP_START_RETRY]
    assert task["Retry"][0]["ErrorEquals"] == [
        "StepFunctions.ExecutionLimitExceeded",
        "StepFunctions.ExecutionLimitExceededException",
        "StepFunctions.AWSStepFunctionsException",
        "StepFunctions.SdkClientException",
    ]
    assert [c["ErrorEquals"] for c in task["Catch"]] == [["States.TaskFailed"]]


def _child_task_bound_s(child: dict) -> int:
    """The longest one task of a group's child can take, read off the emitted child: (1 + its kill
    loop's re-runs) runs of its Task, each of 1 + its Retriers' MaxAttempts attempts of at most
    Lambda's 900 s (a function's timeout ends an invocation whatever the Task's timeout says)."""
    processor = child["States"]["Replicas"]["ItemProcessor"]["States"]
    task = processor["ReplicaTask"]
    reruns = processor["ReplicaAgain?"]["Choices"][0]["NumericLessThan"]
    attempts = 1 + sum(r["MaxAttempts"] for r in task["Retry"])
    return (1 + reruns) * attempts * limits.LAMBDA_MAX_TIMEOUT_S


def test_a_group_never_times_out_before_its_child_can_end_on_its_own():
    """The child's tasks have their own (learnt) timeouts, retries and kill loop, which end the
    child; the group Task's timeout outlasts their worst case, so a group fails with its worker's
    error (Stagecoach.WorkerKilled, ObjectLost) as the inline Map does, never States.Timeout."""
    for per_worker in (False, True):
        child = groups.group_definition(per_worker)
        assert (
            child["States"]["Shards"]["ItemProcessor"]["States"]["ShardTask"]["Retry"]
            == (child["States"]["Replicas"]["ItemProcessor"]["States"]["ReplicaTask"]["Retry"])
        )
        for timeout in ("$.gate.timeouts.b1", 300):
            m = groups.grouped_map("Backward1", 1, "backward", "f-s1", "$.groups.r", timeout, None, "arn:g")
            limit = m["ItemProcessor"]["States"]["Backward1Group"]["TimeoutSeconds"]
            assert isinstance(limit, int) and _child_task_bound_s(child) < limit < 99_999_999  # ASL's default
    assert groups.GROUP_TIMEOUT_S < 12 * 3600  # a backstop, not a year


@pytest.fixture
def on_moto(monkeypatch):
    """Run a small definition on moto's Step Functions interpreter, in this process: returns
    DescribeExecution of one execution of it on ``given`` input."""
    import time

    import boto3
    from moto import mock_aws
    from moto.stepfunctions.models import StateMachine

    # moto deep-copies a state machine with its backend per execution (sdk/local/stack.py
    # install_execution_snapshot_fix): a shallow copy, as the stack makes, for this test only
    monkeypatch.setattr(StateMachine, "__deepcopy__", lambda self, memo: _shallow(self), raising=False)
    mock = mock_aws(config={"stepfunctions": {"execute_state_machine": True}})
    mock.start()
    sfn = boto3.client("stepfunctions", region_name="us-east-1")
    role = boto3.client("iam", region_name="us-east-1").create_role(RoleName="r", AssumeRolePolicyDocument="{}")["Role"]["Arn"]
    count = iter(range(1_000))

    def run(definition: dict, given: dict) -> dict:
        arn = sfn.create_state_machine(name=f"m{next(count)}", definition=json.dumps(definition), roleArn=role)["stateMachineArn"]
        execution = sfn.start_execution(stateMachineArn=arn, input=json.dumps(given))["executionArn"]
        deadline = time.monotonic() + 30
        while (out := sfn.describe_execution(executionArn=execution))["status"] == "RUNNING" and time.monotonic() < deadline:
            time.sleep(0.02)
        return out

    yield run
    mock.stop()


def _shallow(machine):
    import copy

    clone = copy.copy(machine)
    clone.executions = []
    return clone


def test_a_replicas_function_name_is_computed_by_nested_intrinsics(on_moto):
    """Replica 0 runs on the stage's function, replica r on "{stage}-r{r}" (plan.worker_function),
    through 7 nested intrinsics in a Task's Parameters (AWS allows 10 in a field)."""
    nested = groups._replica_function(True)
    assert nested.count("States.") <= 10 and groups._replica_function(False) == "$.fn"
    machine = {"StartAt": "Name", "States": {"Name": {"Type": "Pass", "Parameters": {"fn.$": nested}, "End": True}}}
    for r, name in ((0, "f-s1"), (1, "f-s1-r1"), (3, "f-s1-r3"), (39, "f-s1-r39")):
        out = on_moto(machine, {"fn": "f-s1", "replica": r})
        assert (out["status"], json.loads(out["output"])) == ("SUCCEEDED", {"fn": name}), out
    shard = {"StartAt": "Name", "States": {"Name": {"Type": "Pass", "Parameters": {"fn.$": groups._shard_function(True)}, "End": True}}}
    assert json.loads(on_moto(shard, {"fn": "f-s1", "shard": 2})["output"]) == {"fn": "f-s1-k2"}


def test_a_group_rethrows_its_workers_error_and_loses_one_a_fail_state_may_not_raise(on_moto):
    """GroupRethrow? sends a child's own error to the Fail state with ErrorPath/CausePath, and a
    States.* error (reserved by the States Language; moto fails such a Fail state with
    States.Runtime) or none (a child stopped or timed out) to GroupLost, whose CausePath is
    States.JsonToString of the whole DescribeExecution."""
    states = groups._rethrow_states("B")
    machine = {"StartAt": "BGroupFailed", "States": states}
    killed = {"Error": KILLED_ERROR, "Cause": '{"stage":1}', "Status": "FAILED"}
    for child, error, cause in (
        (killed, KILLED_ERROR, '{"stage":1}'),
        ({"Error": "ObjectLost", "Cause": "x"}, "ObjectLost", "x"),
        ({"Error": "States.Runtime", "Cause": "bad path", "Status": "FAILED"}, groups.GROUP_LOST_ERROR, None),
        ({"Status": "TIMED_OUT"}, groups.GROUP_LOST_ERROR, None),
    ):
        out = on_moto(machine, {"caught": {"Error": "States.TaskFailed", "Cause": json.dumps(child)}})
        assert (out["status"], out.get("error")) == ("FAILED", error), out
        assert out.get("cause") == cause if cause is not None else json.loads(out["cause"]) == child
    raw = {"StartAt": "F", "States": {"F": {"Type": "Fail", "ErrorPath": "$.e", "Cause": "c"}}}
    assert on_moto(raw, {"e": "States.TaskFailed"})["error"] == "States.Runtime"  # what the guard avoids


# ------------------------------------------------------------------------------ on the local stack
def _job(name: str):
    g = torch.Generator().manual_seed(2)
    xt = torch.randn(12, 6, generator=g)
    return dataclasses.replace(recovery_job(name), test=(xt, (xt[:, 0] > 0).long()), eval_every=2)


@pytest.fixture(scope="module")
def inline(backend):
    r = _job("inline").run(stages=2, replicas=4, micro_batches=2, timeout_s=TIMEOUT_S, backend=backend)
    assert r.wait(progress=False, poll_s=1.0, timeout_s=900) == "SUCCEEDED"
    return r


def test_a_phase_in_groups_trains_bit_identically_and_is_billed_as_predicted(backend, inline, small_groups):
    r = _job("grouped").run(stages=2, replicas=4, micro_batches=2, timeout_s=TIMEOUT_S, backend=backend)
    assert r.wait(progress=False, poll_s=1.0, timeout_s=900) == "SUCCEEDED"
    assert same_parameters(r.trained_model(), inline.trained_model())
    assert [e.loss for e in r.evaluations()] == [e.loss for e in inline.evaluations()] and len(r.evaluations()) == 3
    # 5 iterations: forward (stage 0), backward (2 stages), sync (2 stages of 4 shards), each in 2
    # groups; 3 evaluations (versions 2, 4 and the last) of 2 stages
    assert len(r.group_executions()) == 5 * (2 + 2 * 2 + 2 * 2) + 3 * 2 * 2
    measured, predicted = r.cost(), r.predicted_cost()
    for phase in ("forward", "backward", "sync", "evaluate", "orchestration"):
        m, p = measured.phases[phase], predicted.phases[phase]
        assert (m.invocations, m.transitions) == (p.invocations, p.transitions), (phase, m, p)


def _short_of_memory(backend, name: str):
    """A run whose stage 1 is planned at 256 MB (killed for memory, remediated to 512 MB), in
    groups; returns it with its one remediation record."""
    from stagecoach import Plan

    timeouts = [{"forward": TIMEOUT_S, "backward": TIMEOUT_S, "sync": TIMEOUT_S}] * 2
    plan = Plan(balance=[2, 2], replicas=4, micro_batches=2, global_batch=16, memory_mb=(1024, 256), timeouts_s=timeouts)
    r = _job(name).run(plan=plan, backend=backend)
    assert r.wait(progress=False, poll_s=1.0, timeout_s=900) == "SUCCEEDED"
    s3 = backend.clients.s3
    records = s3.list_objects_v2(Bucket=r.bucket, Prefix=f"jobs/{r.job_id}/remediations/")["Contents"]
    record = Remediation.model_validate_json(s3.get_object(Bucket=r.bucket, Key=records[0]["Key"])["Body"].read())
    assert record.kind == "out_of_memory" and (record.stage, record.from_mb, record.to_mb) == (1, 256, 512)
    return r, record


@pytest.mark.slow  # remediation: tests/test_faults.py; a group's worker error reaching the job: test_a_group_fails_with_its_workers_own_error_and_cause
def test_a_stage_short_of_memory_in_a_group_is_remediated(backend, inline, small_groups):
    r, _ = _short_of_memory(backend, "grouped-oom")
    assert same_parameters(r.trained_model(), inline.trained_model())
    # inspect finds the killed worker in its group's own history
    from stagecoach.inspect.report import inspect_execution

    failed = inspect_execution(backend, r.execution_arn).failed_tasks
    assert any(f.execution_arn.split(":")[-2].endswith("-group") and f.stage == 1 for f in failed), failed


@pytest.mark.slow
@pytest.mark.parametrize("shape", ["Runtime.OutOfMemory", "Runtime.ExitError", "Lambda.Unknown"])
def test_each_of_awss_out_of_memory_shapes_is_remediated_through_a_group(inline, small_groups, shape):
    """Every kill arrives in one of AWS's three shapes (docs/local-stack.md): each crosses the
    group's child execution with its own name and cause, and the remediation raises stage 1."""
    from stagecoach.local.backend import LocalBackend
    from stagecoach.local.fidelity import Fidelity

    faulty = LocalBackend(fidelity=Fidelity(error_shapes=shape))
    try:
        r, record = _short_of_memory(faulty, f"grouped-{shape.split('.')[-1].lower()}")
        assert record.error == shape
        assert same_parameters(r.trained_model(), inline.trained_model())
    finally:
        faulty.stack.close()
