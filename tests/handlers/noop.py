def handler(event, context):
    return {"ok": event.get("phase")}
