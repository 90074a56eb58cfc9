"""Every emitted definition passes asl-validator and the structural check, and runs on moto's interpreter."""

import json
import os
import subprocess

import pytest

from stagecoach.planner.emit import asl
from stagecoach.planner.emit.asl_check import check_definition
from stagecoach.planner.plan import Plan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLANS = [
    Plan(balance=[3], replicas=1, micro_batches=1, global_batch=4),
    Plan(balance=[1, 2], replicas=1, micro_batches=4, global_batch=8),
    Plan(balance=[3], replicas=3, micro_batches=2, global_batch=12),
    Plan(balance=[1, 1, 1], replicas=2, micro_batches=4, global_batch=16),
    Plan(balance=[1] * 5, replicas=10, micro_batches=1, global_batch=10),
]


def definitions():
    out = {"job": asl.job_definition()}
    for p in PLANS:
        out[f"window-{p.stages}x{p.replicas}"] = asl.window_definition(p, [f"fn-s{s}" for s in range(p.stages)])
    return out


@pytest.mark.parametrize("name", list(definitions()))
def test_structure(name):
    assert check_definition(definitions()[name]) == []


def test_structural_check_catches_broken_graphs():
    d = asl.window_definition(PLANS[3], ["a", "b", "c"])
    d["States"]["Loop"]["Default"] = "Nowhere"
    d["States"]["Orphan"] = {"Type": "Pass", "End": True}
    del d["States"]["BackwardSync"]["Branches"][0]["States"]["Backward0"]["ItemProcessor"]["States"]["Backward0Task"]["TimeoutSeconds"]
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
    d = asl.window_definition(PLANS[1], ["a", "b"])
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
    d = asl.window_definition(PLANS[3], ["a", "b", "c"])
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
    assert len(tasks) == 1 + 3 * 2  # forward, and backward + sync per stage
    for t in tasks:
        assert t["TimeoutSeconds"] == 300
        assert "Lambda.TooManyRequestsException" in t["Retry"][0]["ErrorEquals"]
        assert t["Retry"][0]["JitterStrategy"] == "FULL"


def test_window_length_keeps_history_under_the_limit():
    for p in PLANS:
        n = asl.window_length(p)
        assert asl.EV_WINDOW_FIXED + n * asl.events_per_iteration(p) <= asl.HISTORY_LIMIT * asl.HISTORY_BUDGET
        assert asl.EV_WINDOW_FIXED + (n + 1) * asl.events_per_iteration(p) > asl.HISTORY_LIMIT * asl.HISTORY_BUDGET
    assert asl.windows(10, 4) == [{"start": 0, "end": 4}, {"start": 4, "end": 8}, {"start": 8, "end": 10}]


def test_window_runs_on_motos_interpreter_with_the_history_the_emitter_predicts(backend):
    """A window over a no-op function: the interpreter executes it and records exactly the predicted events."""
    from helpers import create_function, run_state_machine

    plan = Plan(balance=[1, 1], replicas=2, micro_batches=1, global_batch=2)
    fn = create_function(backend, "noop.handler")
    d, events = run_state_machine(backend, asl.window_definition(plan, [fn] * 2), {"job": "j", "bucket": "b", "start": 0, "end": 3})
    assert d["status"] == "SUCCEEDED", d
    assert len(events) == asl.EV_WINDOW_FIXED + 3 * asl.events_per_iteration(plan)


def _input_paths(value, out):
    """JSONPaths (``$.x...``) a definition fragment reads, from its ``*.$`` fields and ``*Path`` fields."""
    if isinstance(value, dict):
        for k, v in value.items():
            if isinstance(v, str) and (k.endswith(".$") or k.endswith("Path")) and v.startswith("$."):
                out.add(v[2:].split(".")[0].split("[")[0])
            _input_paths(v, out)
    elif isinstance(value, list):
        for v in value:
            _input_paths(v, out)
    return out


def test_the_job_definition_reads_from_its_input_only_fields_of_job_input():
    """The job execution's input is written as a JobInput (sdk/deploy/start.py); the states that
    read it are the ones before any Parameters/ItemSelector reshaped it: the Windows Map's
    ItemsPath and ItemSelector, and each window item's fields through $$.Map.Item.Value."""
    from stagecoach.planner.emit.job_input import JobInput, Window

    windows = asl.job_definition()["States"]["Windows"]
    read = _input_paths({"ItemsPath": windows["ItemsPath"], "ItemSelector": windows["ItemSelector"]}, set())
    assert read and read <= set(JobInput.model_fields), read - set(JobInput.model_fields)
    assert read == set(JobInput.model_fields), "a JobInput field no state reads"
    item_fields = {
        v.removeprefix("$$.Map.Item.Value.")
        for v in windows["ItemSelector"].values()
        if isinstance(v, str) and v.startswith("$$.Map.Item.Value.")
    }
    assert item_fields == set(Window.model_fields)
