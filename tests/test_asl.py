"""Every emitted definition passes asl-validator and the structural check, and runs on moto's interpreter."""

import json
import os
import subprocess

import pytest

from stagecoach.core import keys
from stagecoach.planner.emit import asl, groups
from stagecoach.planner.emit.asl_check import check_definition
from stagecoach.planner.emit.tasks import WAIT_RETRY
from stagecoach.planner.plan import Plan, watcher_function

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLANS = [
    Plan(balance=[3], replicas=1, micro_batches=1, global_batch=4),
    Plan(balance=[1, 2], replicas=1, micro_batches=4, global_batch=8),
    Plan(balance=[3], replicas=3, micro_batches=2, global_batch=12),
    Plan(balance=[1, 1, 1], replicas=2, micro_batches=4, global_batch=16),
    Plan(balance=[1] * 5, replicas=10, micro_batches=1, global_batch=10),
    Plan(balance=[1, 2], replicas=2, micro_batches=2, global_batch=8, sync=["lambdaml_scatter_reduce", "scatter_reduce"]),
]


def definitions():
    out = {"job": asl.job_definition()}
    for p in PLANS:
        out[f"window-{p.stages}x{p.replicas}"] = asl.window_definition(
            p, [f"fn-s{s}" for s in range(p.stages)], abort_key_format=keys.WINDOW_ABORT
        )
    # past 40 workers a phase runs in groups of child executions (planner/emit/groups.py)
    wide = Plan(balance=[1, 1], replicas=100, micro_batches=1, global_batch=100)
    group_arn = "arn:aws:states:us-east-1:123456789012:stateMachine:sc-j-0123abcd-group"
    for per_worker in (False, True):
        out[f"window-2x100-{per_worker}"] = asl.window_definition(
            wide, ["fn-s0", "fn-s1"], per_worker, evals=[2], saves=[3], abort_key_format=keys.WINDOW_ABORT, group_arn=group_arn
        )
        out[f"group-{per_worker}"] = groups.group_definition(per_worker)
    return out


@pytest.mark.parametrize("name", list(definitions()))
def test_structure(name):
    assert check_definition(definitions()[name]) == []


def test_structural_check_catches_broken_graphs():
    d = asl.window_definition(PLANS[3], ["a", "b", "c"], abort_key_format=keys.WINDOW_ABORT)
    d["States"]["Go?"]["Default"] = "Nowhere"
    d["States"]["Orphan"] = {"Type": "Pass", "End": True}
    del asl.phase_parallel(d["States"], "BackwardSync")["Branches"][0]["States"]["Backward0"]["ItemProcessor"]["States"]["Backward0Task"][
        "TimeoutSecondsPath"
    ]
    problems = "\n".join(check_definition(d))
    assert "'Nowhere' does not exist" in problems
    assert "Orphan: unreachable" in problems
    assert "Backward0Task: Task without TimeoutSeconds" in problems


def test_asl_validator_accepts_every_definition(asl_validator, tmp_path):
    paths = []
    for name, d in definitions().items():
        p = tmp_path / f"{name}.json"
        p.write_text(json.dumps(d))
        paths += ["--json-path", str(p)]
    paths += ["--json-path", os.path.join(ROOT, "statemachines", "job.asl.json")]
    r = subprocess.run([asl_validator, *paths], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    verdicts = [line for line in (r.stdout + r.stderr).splitlines() if "State machine definition" in line]
    assert len(verdicts) == len(paths) // 2 and all(line.endswith("is valid") for line in verdicts), r.stdout + r.stderr


def test_asl_validator_rejects_a_broken_definition(asl_validator, tmp_path):
    d = asl.window_definition(PLANS[1], ["a", "b"], abort_key_format=keys.WINDOW_ABORT)
    d["States"]["Advance"]["Next"] = "Missing"
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(d))
    r = subprocess.run([asl_validator, "--json-path", str(p)], capture_output=True, text=True)
    out = r.stdout + r.stderr
    assert r.returncode != 0 and "is invalid" in out
    assert "MISSING_TRANSITION_TARGET" in out and "target: Missing" in out, out


def test_statemachines_job_file_is_the_emitted_definition():
    with open(os.path.join(ROOT, "statemachines", "job.asl.json")) as f:
        assert json.load(f) == asl.job_definition(), "regenerate with: python -m stagecoach.planner.emit"


def test_every_task_retries_lambda_service_errors_and_has_a_timeout():
    d = asl.window_definition(PLANS[3], ["a", "b", "c"], abort_key_format=keys.WINDOW_ABORT)
    tasks = []

    def walk(states):
        for st in states.values():
            if st["Type"] == "Task":
                tasks.append(st)
            if st["Type"] == "Map":
                walk(st["ItemProcessor"]["States"])
            if st["Type"] == "Parallel":
                for b in st["Branches"]:
                    walk(b["States"])

    walk(d["States"])
    tasks = [t for t in tasks if t["Resource"] == "arn:aws:states:::lambda:invoke"]  # not the Abort marker's PUT
    gate = d["States"]["Gate"]
    tasks.remove(gate)  # the iteration gate: no task of the window runs while it does
    assert gate["TimeoutSeconds"] == asl.GATE_TIMEOUT_S and gate["Retry"][0] == asl.LAMBDA_RETRY
    assert gate["Catch"] == [{"ErrorEquals": ["States.ALL"], "ResultPath": "$.caught", "Next": "Failed"}]
    # the phase watchers (lambdas/watcher.py): no Retry (a watcher that fails leaves the phase to its
    # own timeouts: quietly), a timeout, and PhaseDone ends its phase
    watchers = [t for t in tasks if t["Parameters"]["Payload"]["phase"] == "watch"]
    assert [w["Parameters"]["Payload"]["watch"] for w in watchers] == ["forward", "backward"]
    for w in watchers:
        tasks.remove(w)
        assert "Retry" not in w and w["TimeoutSeconds"] >= max(max(p.values()) for p in PLANS[3].timeouts_s)
        assert [c["ErrorEquals"] for c in w["Catch"]] == [[asl.PHASE_DONE], ["States.ALL"]]
    assert len(tasks) == 2 + 3 * 2  # forward per stage but the last, and backward + sync per stage
    for t in tasks:
        # the gate's learnt timeout (lambdas/timeouts.py; the plan's 300 s its ceiling), handed on
        assert t["TimeoutSecondsPath"] == "$.timeout" and t["Parameters"]["Payload"]["timeout.$"] == "$.timeout"
        # a wait in vain, like a kill or a timeout, runs again at once (the loop below), not after a Retry's wait
        assert len(t["Retry"]) == 1 and all("States.Timeout" not in r["ErrorEquals"] for r in t["Retry"])
        assert all(WAIT_RETRY["ErrorEquals"][0] not in r["ErrorEquals"] for r in t["Retry"])
        # the retrier AWS's Step Functions guide recommends ("Handle Lambda service exceptions")
        assert {"Lambda.TooManyRequestsException", "Lambda.ClientExecutionTimeoutException"} <= set(t["Retry"][0]["ErrorEquals"])
        assert t["Retry"][0]["JitterStrategy"] == "FULL"
        # every name AWS reports a killed worker under is caught for the remediation step, and a
        # timeout, like an ambiguous kill, first runs the task again at once
        caught = {e for c in t.get("Catch", []) for e in c["ErrorEquals"]}
        killed = {"Runtime.OutOfMemory", "Runtime.ExitError", "Lambda.Unknown", "States.Timeout", "Sandbox.Timedout"}
        assert caught == killed | {"ObjectWaitTimeout"}  # and a wait in vain, like a timeout, runs again at once


@pytest.mark.parametrize("fused", ["pipelined_scatter_reduce", "lambdaml_scatter_reduce"])
def test_a_stage_whose_backward_tasks_reduce_among_themselves_has_no_sync_map(fused):
    plan = Plan(balance=[1, 2], replicas=2, micro_batches=2, global_batch=8, sync=[fused, "scatter_reduce"])
    branches = asl.phase_parallel(asl.window_definition(plan, ["a", "b"], abort_key_format=keys.WINDOW_ABORT)["States"], "BackwardSync")[
        "Branches"
    ]
    assert set(branches[0]["States"]) == {"Backward0"} and branches[0]["States"]["Backward0"]["End"]
    assert set(branches[1]["States"]) == {"Backward1", "Sync1"}
    assert plan.sync_tasks(0) == 0 and plan.sync_tasks(1) == 2


def test_window_length_keeps_history_under_the_limit():
    """Its iterations and its redos (each an iteration's events, Redo? and Redo) fit the budget."""
    for p in PLANS:
        n, per, redos = asl.window_length(p), asl.events_per_iteration(p), asl.redo_limit(p)
        used = asl.EV_WINDOW_FIXED + n * per + redos * (per + 2 * asl.EV_PASS)
        assert used <= asl.HISTORY_LIMIT * asl.HISTORY_BUDGET < used + per
        assert 0 <= redos <= asl.REDO_LIMIT and redos * asl.REDO_SHARE <= n + redos


def test_a_lost_object_runs_the_iteration_again_up_to_the_windows_redos_then_aborts():
    """Forward's and BackwardSync's Catch send ObjectLost to Redo? (before the abort): Redo keeps
    t and the gate's timeouts, renames the attempt and counts; past the limit, Abort. A window too
    short to afford a redo has none (a 100-event history holds no twentieth of an iteration)."""
    d = asl.window_definition(PLANS[3], ["a", "b", "c"], abort_key_format=keys.WINDOW_ABORT)
    st = d["States"]
    for phase, nxt in (("Forward", "BackwardSync"), ("BackwardSync", "Advance")):
        # the watcher's PhaseDone first (a phase catch of States.ALL would take it), then the phase's own
        assert st[phase]["Catch"][0] == {"ErrorEquals": [asl.PHASE_DONE], "ResultPath": None, "Next": nxt}
        assert st[phase]["Catch"][1] == {"ErrorEquals": ["ObjectLost"], "ResultPath": "$.caught", "Next": "Redo?"}
        assert st[phase]["Catch"][-1]["Next"] == "Abort"
    assert st["Redo?"]["Choices"][0]["NumericLessThan"] == asl.redo_limit(PLANS[3]) and st["Redo?"]["Default"] == "Abort"
    redo = st["Redo"]["Parameters"]
    assert redo["t.$"] == "$.t" and redo["gate.$"] == "$.gate" and st["Redo"]["Next"] == "Forward"
    assert redo["attempt.$"] == "States.Format('{}-r{}', $$.Execution.Name, $.redo)"
    assert asl.redo_limit(PLANS[3], limit=100) == 0


def _chain(iterations: int, length: int, per_execution: int) -> list[list[tuple[int, int]]]:
    """The windows each job execution runs, by the job definition's own rules (Next?, Bounds,
    Clamp, Advance, NextLink): a pure replay, so a million iterations can be counted."""
    links, start = [], 0
    while start < iterations:
        here = []
        while start < iterations and len(here) < per_execution:
            end = min(start + length, iterations)
            here.append((start, end))
            start = end
        links.append(here)
    return links


@pytest.mark.parametrize("plan", [*PLANS, Plan(balance=[1, 1], replicas=40, micro_batches=1, global_batch=40)])
def test_a_million_iterations_fit_every_limit_of_every_execution(plan):
    """Counted, not run: the window executions, each job execution of the chain, and the job's
    input stay within Step Functions' limits however long the job (the issue's 2 x 40 plan at
    50,000 iterations needed ~28,600 job events and 348 KiB of input before)."""
    from stagecoach.planner.emit.job_input import JobInput
    from stagecoach.planner.limits import EXECUTION_INPUT_MAX_BYTES, HISTORY_MAX_EVENTS

    iterations, length, per = 1_000_000, asl.window_length(plan), asl.windows_per_execution()
    links = _chain(iterations, length, per)
    windows = [w for link in links for w in link]
    assert windows[0][0] == 0 and windows[-1][1] == iterations
    assert all(a == b for (_, a), (b, _) in zip(windows, windows[1:])) and all(0 < e - s <= length for s, e in windows)
    worst_link = asl.EV_JOB_FIXED + per * (
        asl.EV_JOB_WINDOW + asl.WINDOW_RESTARTS * asl.EV_JOB_RESTART
    )  # every window restarted all it may
    assert max(len(link) for link in links) == per and worst_link <= HISTORY_MAX_EVENTS
    assert asl.EV_WINDOW_FIXED + length * asl.events_per_iteration(plan) <= HISTORY_MAX_EVENTS
    last = JobInput(
        job="a-thirty-character-job-name-x-0123abcd",
        bucket="stagecoach-123456789012-eu-central-1-artifacts",
        windowStateMachineArn="arn:aws:states:eu-central-1:123456789012:stateMachine:" + "s" * 80,
        iterations=iterations,
        windowLength=length,
        windowTimeout=365 * 24 * 3600,
        windowsPerExecution=per,
        functionPrefix="f" * 62,
        controlFunction="f" * 64,
        link=len(links) - 1,
        start=windows[-1][0],
        windowsHere=per - 1,
    )
    assert len(last.model_dump_json().encode()) < EXECUTION_INPUT_MAX_BYTES // 100


def test_window_runs_on_motos_interpreter_with_the_history_the_emitter_predicts(backend):
    """A window over a no-op function: the interpreter executes it and records exactly the predicted events."""
    from helpers import create_function, run_state_machine

    plan = Plan(balance=[1, 1], replicas=2, micro_batches=1, global_batch=2)
    fn = create_function(backend, "noop.phase_after_watcher")
    create_function(backend, "noop.handler", name=watcher_function(fn))  # the phase watcher's, done first
    d, events = run_state_machine(
        backend,
        asl.window_definition(plan, [fn] * 2, abort_key_format=keys.WINDOW_ABORT),
        {"job": "j", "bucket": "b", "start": 0, "end": 3, "first": 0},
    )
    assert d["status"] == "SUCCEEDED", d
    assert len(events) == asl.EV_WINDOW_FIXED + 3 * asl.events_per_iteration(plan)


def _input_paths(value, out):
    """JSONPaths (``$.x...``) a definition fragment reads, from its ``*.$`` fields and ``*Path`` fields."""
    if isinstance(value, dict):
        for k, v in value.items():
            if k in ("ResultPath", "ResultSelector"):  # where a result goes, and what is read from it
                continue
            if isinstance(v, str) and (k.endswith(".$") or k.endswith("Path")) and v.startswith("$."):
                out.add(v[2:].split(".")[0].split("[")[0])
            _input_paths(v, out)
    elif isinstance(value, list):
        for v in value:
            _input_paths(v, out)
    return out


def test_the_job_definition_reads_from_its_input_only_fields_of_job_input():
    """The job execution's input is written as a JobInput (sdk/deploy/start.py) and carried from
    state to state; every path a state reads is a JobInput field or one a state added."""
    from stagecoach.planner.emit.job_input import JobInput

    states = asl.job_definition()["States"]
    read = _input_paths(states, set())
    fields = set(JobInput.model_fields)
    # what the states add along the way (Bounds: end, first, attempt, restarts; an Express window: run;
    # the Catch path: failure, child, ...)
    added = {"end", "first", "attempt", "restarts", "failure", "run", "child", "killed", "resumed", "next"}
    assert read - added <= fields, read - added - fields
    assert fields <= read, f"JobInput fields no state reads: {fields - read}"
    # every state that reshapes the input carries every JobInput field on
    for name in ("Bounds", "Advance", "NextLink", "FullWindow", "ReadFailure", "ExpressFailed", "NextAttempt"):
        carried = {k.removesuffix(".$") for k in states[name]["Parameters"]}
        assert fields <= carried, (name, fields - carried)
