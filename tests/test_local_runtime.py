"""The local Lambda runtime: memory and timeout enforced like Lambda's, warm processes reused."""

import json
import os
from concurrent.futures import ThreadPoolExecutor

from helpers import HANDLERS, create_function, run_state_machine, task_failure, task_machine

from stagecoach.local.fidelity import OOM_SHAPES, TIMEOUT_SHAPES
from stagecoach.local.runtime import FunctionSpec, LocalLambdaRuntime

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


# A worker's own memory after a light task (tests/handlers/light.py), measured on this machine: 12
# MB unique (private pages) with the zygote's gc.freeze before every fork (sdk/local/worker.py);
# 93 MB before it, when the worker's first full garbage collection wrote to every object the
# zygote held. The bound leaves room for other versions of torch, boto3 and CPython.
LIGHT_WORKER_USS_MB = 30


def test_concurrent_workers_share_the_zygote_memory(backend):
    """Hundreds of workers fit this machine only if a forked worker keeps sharing what its zygote
    imported (docs/local-stack.md "How workers stay light"): each of N concurrent invocations runs
    in a process of its own, whose unique memory stays small."""
    runtime = LocalLambdaRuntime(backend.stack.endpoint_url)
    spec = FunctionSpec(name="light", handler="light.handler", memory_mb=1024, timeout_s=120, environment=(("PYTHONPATH", HANDLERS),))
    n = 8
    try:
        with ThreadPoolExecutor(n) as pool:
            replies = list(pool.map(lambda _: runtime.invoke(spec, {"hold_s": 3}), range(n)))
    finally:
        runtime.shutdown()
    assert not any(errored for _, errored, _ in replies), replies
    memory = [json.loads(payload) for payload, _, _ in replies]
    assert len({m["pid"] for m in memory}) == n
    assert max(m["uss"] for m in memory) < LIGHT_WORKER_USS_MB, memory


def test_an_invocation_past_descriptor_1023_is_served(backend):
    """A stack of hundreds of workers holds more than 1,024 descriptors (a socket per worker, their
    S3 connections): the runtime waits on a worker's socket with poll, which select cannot do."""
    spare = [os.dup(0) for _ in range(1100)]  # the worker's socket gets a descriptor past 1,023
    runtime = LocalLambdaRuntime(backend.stack.endpoint_url)
    spec = FunctionSpec(name="hog", handler="hog.handler", memory_mb=1024, timeout_s=60, environment=(("PYTHONPATH", HANDLERS),))
    try:
        payload, errored, _ = runtime.invoke(spec, {})
    finally:
        runtime.shutdown()
        for fd in spare:
            os.close(fd)
    assert not errored, payload
    assert json.loads(payload)["calls"] == 1
