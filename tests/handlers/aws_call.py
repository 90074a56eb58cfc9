"""Makes one AWS call with the function's own credentials and reports what AWS answered."""

import boto3


def handler(event, context):
    client = boto3.client(event["service"])
    try:
        getattr(client, event["method"])(**event.get("kwargs", {}))
    except Exception as e:
        error = getattr(e, "response", {}).get("Error", {})
        return {"code": error.get("Code", type(e).__name__), "message": error.get("Message", str(e))}
    return {"code": "ok"}
