"""The worker handler refuses malformed events up front, naming the field (Powertools Parser),
before it touches S3."""

import pytest

from stagecoach.lambdas import handler as handler_module
from stagecoach.lambdas.handler import BadEvent, handler


class NoS3:
    """An S3 client that fails the test on any use: refusals must come before any S3 call."""

    def __getattr__(self, name):
        raise AssertionError(f"the handler called S3 ({name}) before refusing a malformed event")


@pytest.fixture(autouse=True)
def no_s3(monkeypatch):
    monkeypatch.setattr(handler_module, "_client", lambda: NoS3())


GOOD = {"phase": "backward", "job": "j-1", "bucket": "stagecoach-local", "t": 0, "stage": 0, "replica": 0}


class Ctx:
    function_name = "f"
    function_version = "$LATEST"
    memory_limit_in_mb = 1024
    invoked_function_arn = "arn:aws:lambda:us-east-1:123456789012:function:f"
    aws_request_id = "r"

    def get_remaining_time_in_millis(self):
        return 10_000


@pytest.mark.parametrize(
    "change, field",
    [
        ({"phase": "dance"}, "phase"),
        ({"t": -1}, "t"),
        ({"stage": "one"}, "stage"),
        ({"bucket": "Not_A_Bucket"}, "bucket"),
        ({"job": "../etc"}, "job"),
        ({"replica": None}, "replica"),
        ({"extra": 1}, "extra"),
    ],
)
def test_malformed_events_are_refused(change, field):
    with pytest.raises(BadEvent, match=field):
        handler({**GOOD, **change}, Ctx())


def test_sync_event_needs_a_shard():
    ev = {**GOOD, "phase": "sync"}
    del ev["replica"]
    with pytest.raises(BadEvent, match="shard"):
        handler(ev, Ctx())


def test_missing_fields_are_named():
    with pytest.raises(BadEvent, match="bucket"):
        handler({"phase": "forward", "job": "j", "t": 0, "stage": 0, "replica": 0}, Ctx())


def test_a_well_formed_event_does_reach_s3():
    """The guard above is real: an event that parses goes on to S3 (and meets the failing client)."""
    with pytest.raises(AssertionError, match="called S3"):
        handler(GOOD, Ctx())


@pytest.mark.parametrize(
    "change, field", [({"micro_batch_sizes": []}, "micro_batch_sizes"), ({"repeats": 0}, "repeats"), ({"replica": 0}, "replica")]
)
def test_malformed_profile_events_are_refused(change, field):
    ev = {"phase": "profile", "job": "j-1", "bucket": "stagecoach-local", **change}
    with pytest.raises(BadEvent, match=field):
        handler(ev, Ctx())
