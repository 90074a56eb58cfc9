"""One local Lambda execution environment: a process that runs invocations one at a time.

Started by the local runtime; it imports the function's handler once (the cold start) and then
serves invocations from its parent over stdin/stdout, so module-level state survives between
invocations exactly as it does in a warm Lambda container.
"""

from __future__ import annotations

import importlib
import json
import os
import struct
import sys
import time
import traceback
from typing import Any


class LambdaContext:
    """The attributes of AWS Lambda's context object that handlers and Powertools read."""

    def __init__(self, request_id: str, deadline: float) -> None:
        self.function_name = os.environ["AWS_LAMBDA_FUNCTION_NAME"]
        self.function_version = "$LATEST"
        self.memory_limit_in_mb = int(os.environ["AWS_LAMBDA_FUNCTION_MEMORY_SIZE"])
        region = os.environ.get("AWS_REGION", "us-east-1")
        self.invoked_function_arn = f"arn:aws:lambda:{region}:123456789012:function:{self.function_name}"
        self.aws_request_id = request_id
        self.log_group_name = f"/aws/lambda/{self.function_name}"
        self.log_stream_name = f"local/{os.getpid()}"
        self._deadline = deadline

    def get_remaining_time_in_millis(self) -> int:
        return max(0, int((self._deadline - time.time()) * 1000))


def _read_exact(stream: Any, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = stream.read(n - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return data


def main() -> None:
    proto_in = sys.stdin.buffer
    proto_out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # anything the handler prints goes to the log, not into the protocol
    sys.stdout = sys.stderr
    module_name, _, func_name = os.environ["_HANDLER"].rpartition(".")
    handler = getattr(importlib.import_module(module_name), func_name)
    while True:
        try:
            (n,) = struct.unpack("<I", _read_exact(proto_in, 4))
            msg = json.loads(_read_exact(proto_in, n))
        except EOFError:
            return
        ctx = LambdaContext(msg["request_id"], msg["deadline"])
        try:
            result = handler(msg["event"], ctx)
            reply = {"payload": json.dumps(result), "errored": False}
        except Exception as e:  # the AWS Python runtime's error shape
            reply = {
                "payload": json.dumps(
                    {
                        "errorType": type(e).__name__,
                        "errorMessage": str(e),
                        "stackTrace": traceback.format_tb(e.__traceback__),
                    }
                ),
                "errored": True,
            }
        out = json.dumps(reply).encode()
        proto_out.write(struct.pack("<I", len(out)) + out)
        proto_out.flush()


if __name__ == "__main__":
    main()
