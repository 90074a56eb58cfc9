import time


def handler(event, context):
    # the window's iteration gate returns "stop" and the Maps' TimeoutSeconds (planner/emit/asl.py
    # Gate, lambdas/timeouts.py): 60 s for every Map a window may have, 0 s more for a re-run
    timeouts = {"f": 60, **{f"{p}{s}": 60 for p in "bs" for s in range(8)}, "cold": 0}
    # and no expectations for the phase watcher (lambdas/watcher.py), which then returns at once
    return {"ok": event.get("phase"), "stop": False, "timeouts": timeouts, "expect": {}}


def phase_after_watcher(event, context):
    """``handler``, but a phase's task takes a second: the phase's watcher (``handler``, which
    returns at once) ends before its phase on a busy machine too, the order the emitter's event
    count assumes (planner/emit/asl.py EV_WATCHED_PHASE: the watcher's five events)."""
    if event.get("phase") in ("forward", "backward", "sync"):
        time.sleep(1.0)
    return handler(event, context)
