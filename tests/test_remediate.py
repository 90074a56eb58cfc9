"""What killed a worker, decided from what AWS reports and the evidence the stage left (lambdas/remediate.py)."""

import pytest

from stagecoach.lambdas.remediate import classify
from stagecoach.local.runtime import out_of_memory_payload, timeout_payload
from stagecoach.local.stack import UNKNOWN_CAUSE


def _as_step_functions_reports(payload: str) -> tuple[str, str]:
    """(Error, Cause) of a failed lambda:invoke task, as tests/test_fidelity.py shows the stack reports them."""
    import json

    body = json.loads(payload)
    if "errorType" in body:
        return body["errorType"], payload
    return "Lambda.Unknown", UNKNOWN_CAUSE.format(payload=payload)


@pytest.mark.parametrize("shape", ["Runtime.OutOfMemory", "Runtime.ExitError", "Lambda.Unknown"])
def test_an_out_of_memory_kill_with_evidence_is_out_of_memory_in_every_shape(shape):
    error, cause = _as_step_functions_reports(out_of_memory_payload(shape, "r-1"))
    assert classify(error, cause, memory_pressure=True) == "out_of_memory"


def test_without_evidence_only_the_explicit_name_counts_as_out_of_memory():
    for shape, expected in (("Runtime.OutOfMemory", "out_of_memory"), ("Runtime.ExitError", "crash"), ("Lambda.Unknown", "crash")):
        error, cause = _as_step_functions_reports(out_of_memory_payload(shape, "r-1"))
        assert classify(error, cause, memory_pressure=False) == expected, shape


@pytest.mark.parametrize("shape", ["Sandbox.Timedout", "Lambda.Unknown"])
def test_a_timeout_is_never_taken_for_out_of_memory_even_under_memory_pressure(shape):
    error, cause = _as_step_functions_reports(timeout_payload(shape, "r-1", 30.0))
    assert classify(error, cause, memory_pressure=True) == "timeout"
    assert classify("States.Timeout", "", memory_pressure=True) == "timeout"
