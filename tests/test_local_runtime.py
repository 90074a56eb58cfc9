"""The local Lambda runtime: memory and timeout enforced like Lambda's, warm processes reused."""

import json

from helpers import create_function, run_state_machine, task_failure, task_machine

from stagecoach.local.fidelity import OOM_SHAPES, TIMEOUT_SHAPES

LAMBDA_ERRORS_RETRY = [{"ErrorEquals": ["Lambda.ServiceException"], "MaxAttempts": 2}]


def test_over_memory_fails_the_task_with_an_out_of_memory_error(backend):
    fn = create_function(backend, "hog.handler", memory_mb=400)
    d, events = run_state_machine(backend, task_machine(fn, retry=LAMBDA_ERRORS_RETRY), {"allocate_mb": 600})
    assert d["status"] == "FAILED"
    det = task_failure(events)
    # reported in one of AWS's shapes (which one is drawn per invocation: tests/test_fidelity.py)
    assert det["error"] in OOM_SHAPES


def test_within_memory_succeeds(backend):
    fn = create_function(backend, "hog.handler", memory_mb=1024)
    d, _ = run_state_machine(backend, task_machine(fn, retry=LAMBDA_ERRORS_RETRY), {"allocate_mb": 100})
    assert d["status"] == "SUCCEEDED"


def test_over_timeout_fails_the_task_with_a_timeout(backend):
    fn = create_function(backend, "hog.handler", timeout_s=2)
    d, events = run_state_machine(backend, task_machine(fn, retry=LAMBDA_ERRORS_RETRY), {"sleep_s": 10})
    assert d["status"] == "FAILED"
    det = task_failure(events)
    assert det["error"] in TIMEOUT_SHAPES
    assert "timed out after 2.00 seconds" in det["cause"]


def test_warm_process_is_reused_and_keeps_module_state(backend):
    fn = create_function(backend, "hog.handler")
    lam = backend.clients.lambda_
    first = json.loads(lam.invoke(FunctionName=fn, Payload=b"{}")["Payload"].read())
    second = json.loads(lam.invoke(FunctionName=fn, Payload=b"{}")["Payload"].read())
    assert second["pid"] == first["pid"]
    assert (first["calls"], second["calls"]) == (1, 2)
    assert 0 < second["remaining_ms"] <= 30_000


def test_a_killed_process_is_replaced_by_a_cold_one(backend):
    fn = create_function(backend, "hog.handler", memory_mb=400)
    lam = backend.clients.lambda_
    first = json.loads(lam.invoke(FunctionName=fn, Payload=b"{}")["Payload"].read())
    oom = lam.invoke(FunctionName=fn, Payload=json.dumps({"allocate_mb": 600}))
    assert oom.get("FunctionError")  # AWS says "Unhandled"; moto says "Handled" (docs/local-stack.md)
    payload = json.loads(oom["Payload"].read())
    assert payload.get("errorType", "Lambda.Unknown") in OOM_SHAPES
    after = json.loads(lam.invoke(FunctionName=fn, Payload=b"{}")["Payload"].read())
    assert after["pid"] != first["pid"] and after["calls"] == 1
