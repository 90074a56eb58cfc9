"""Test handlers for the local Lambda runtime."""

import os
import time

_calls = 0


def handler(event, context):
    global _calls
    _calls += 1
    if event.get("allocate_mb"):
        block = bytearray(event["allocate_mb"] * 1024 * 1024)
        block[::4096] = b"x" * len(block[::4096])  # touch every page so it is resident
        time.sleep(2)
    if event.get("sleep_s"):
        time.sleep(event["sleep_s"])
    return {"pid": os.getpid(), "calls": _calls, "remaining_ms": context.get_remaining_time_in_millis()}
