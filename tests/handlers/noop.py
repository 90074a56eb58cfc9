def handler(event, context):
    # the window's iteration gate reads "stop" (planner/emit/asl.py Gate)
    return {"ok": event.get("phase"), "stop": False}
