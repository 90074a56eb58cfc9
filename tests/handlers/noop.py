def handler(event, context):
    # the window's iteration gate returns "stop" and the Maps' TimeoutSeconds (planner/emit/asl.py
    # Gate, lambdas/timeouts.py): 60 s for every Map a window may have, 0 s more for a re-run
    timeouts = {"f": 60, **{f"{p}{s}": 60 for p in "bs" for s in range(8)}, "cold": 0}
    # and no expectations for the phase watcher (lambdas/watcher.py), which then returns at once
    return {"ok": event.get("phase"), "stop": False, "timeouts": timeouts, "expect": {}}
