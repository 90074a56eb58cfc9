"""A consumer whose wait for a late producer ran out waits again at once, through its Map's re-run
loop (planner/emit/tasks.py ``WAIT_AGAIN_AT_ONCE``), not after a Retry's interval; the result is
bit-identical to a fault-free run and no window restarts (docs/reliability.md)."""

import json

import pytest
from helpers import recovery_job, same_parameters, task_errors

from stagecoach.local.backend import LocalBackend


def _item_events(events, failed_id):
    """The events of the Map item the failure at ``failed_id`` belongs to, after it (by their
    previousEventId chain, which Step Functions keeps per item)."""
    chain, ids = [], {failed_id}
    for e in events:
        if e.get("previousEventId") in ids and e["type"] not in ("MapStateSucceeded", "MapStateExited", "MapStateFailed"):
            chain.append(e)
            ids.add(e["id"])
    return chain


@pytest.mark.slow  # a hung producer re-run and waited for: tests/test_faults.py's hang tests, by default
def test_a_consumer_whose_producer_hung_twice_waits_again_at_once_and_the_result_is_bit_identical(backend):
    """Stage 1's backward task of replica 0 hangs at t = 2, and so does its first re-run: stage 0's
    backward task, waiting for its input gradient, gives up just before its learnt timeout
    (ObjectWaitTimeout) and runs again through its Map's loop (Again? and Again), at once. The
    phase's watcher is killed, so the Maps' own timeouts and loops are what recover it."""
    hang = {"kind": "hang", "phase": "backward", "t": 2, "stage": 1, "replica": 0}
    # the phase's watcher killed (it fails quietly): else it would run the hung task again before
    # the consumer's wait ran out (tests/test_faults.py has the watcher's own case)
    killed_watcher = {"kind": "kill", "phase": "watch", "watch": "backward", "t": 2}
    faulty = LocalBackend(faults={"once": [hang, dict(hang), killed_watcher]})
    try:
        runs = []
        for stack, name in ((backend, "waits-clean"), (faulty, "waits")):
            r = recovery_job(name, warm=False).run(stages=2, replicas=2, micro_batches=2, timeout_s=60, backend=stack)
            r.wait(progress=False, poll_s=0.2, timeout_s=900)
            runs.append(r)
        r = runs[1]
        errors = task_errors(r)
        assert errors.count("States.Timeout") >= 2 and "ObjectWaitTimeout" in errors, errors
        assert len(r.window_executions()) == 1, "the Maps' loops, not a window restart, recovered it"
        events = r.history(execution_arn=r.window_executions()[0])
        failed = [e for e in events if e["type"] == "TaskFailed" and e["taskFailedEventDetails"]["error"] == "ObjectWaitTimeout"]
        for f in failed:
            after = _item_events(events, f["id"])
            kinds = [(e["type"], e.get("stateEnteredEventDetails", {}).get("name")) for e in after[:8]]
            # the loop's states, then the task again: a Retry would schedule it with no state between
            assert ("PassStateEntered", "Backward0Again") in kinds, kinds
            again = next(e for e in after if e["type"] == "TaskScheduled")
            payload = json.loads(again["taskScheduledEventDetails"]["parameters"])["Payload"]
            assert payload["phase"] == "backward" and payload["stage"] == 0 and payload["t"] == 2
        assert same_parameters(r.trained_model(), runs[0].trained_model())
    finally:
        faulty.stack.close()
