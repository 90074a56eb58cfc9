"""Local Lambda execution environments: a zygote per handler, and the worker processes it forks.

The zygote imports the function's handler module (torch included) once; every cold start is a
fork of it — a new process with empty module-level caches, like a new Lambda execution environment,
without paying the import again. A worker then serves invocations one at a time over its socket,
so module-level state survives between invocations exactly as in a warm Lambda container.

Workers stay light by sharing the zygote's pages copy-on-write (docs/local-stack.md "How workers
stay light"): the zygote freezes everything it holds before each fork (gc.freeze, whose
documentation recommends it for fork without exec: docs.python.org/3/library/gc.html#gc.freeze),
so a worker's collections never write to the objects it inherited. Before that, a worker's first
full collection copied ~88 MB of the zygote's pages into the worker (measured with smaps_rollup).
The zygote imports with the collector on, as Lambda's Init does: turning it off there (the rest
of that recipe) left the imports' garbage resident, 7 MB more RSS per worker than on Lambda, and
no less unique memory.

Protocol (length-prefixed JSON): zygote control socket receives {"env": {...}} plus the worker's
socket as an SCM_RIGHTS fd and answers {"pid": n}; a worker receives {"event", "request_id",
"deadline"} and answers {"payload": str, "errored": bool}.
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import signal
import socket
import struct
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any


def send_msg(sock: socket.socket, obj: object, fds: list[int] | None = None) -> None:
    data = json.dumps(obj).encode()
    frame = struct.pack("<I", len(data)) + data
    if fds:
        socket.send_fds(sock, [frame], fds)
    else:
        sock.sendall(frame)


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return buf


def recv_msg(sock: socket.socket) -> Any:
    (n,) = struct.unpack("<I", recv_exact(sock, 4))
    return json.loads(recv_exact(sock, n))


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


def serve(sock: socket.socket, handler: Callable[[Any, LambdaContext], object]) -> None:
    """A worker: run invocations until the runtime closes the socket."""
    while True:
        try:
            msg = recv_msg(sock)
        except (EOFError, ConnectionError):
            os._exit(0)
        ctx = LambdaContext(msg["request_id"], msg["deadline"])
        try:
            reply = {"payload": json.dumps(handler(msg["event"], ctx)), "errored": False}
        except Exception as e:  # the AWS Python runtime's error shape
            reply = {
                "payload": json.dumps(
                    {"errorType": type(e).__name__, "errorMessage": str(e), "stackTrace": traceback.format_tb(e.__traceback__)}
                ),
                "errored": True,
            }
        send_msg(sock, reply)


def zygote(control_fd: int) -> None:
    control = socket.socket(fileno=control_fd)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # forked workers are reaped automatically
    module_name, _, func_name = os.environ["_HANDLER"].rpartition(".")
    handler = getattr(importlib.import_module(module_name), func_name)
    send_msg(control, {"ready": True})
    while True:
        # the fd travels with the frame's first bytes: receive them with recv_fds, not recv
        data, fds, _, _ = socket.recv_fds(control, 1 << 16, 1)
        if not data:
            os._exit(0)
        (n,) = struct.unpack("<I", data[:4])
        while len(data) < 4 + n:
            data += recv_exact(control, 4 + n - len(data))
        msg = json.loads(data[4 : 4 + n])
        gc.freeze()  # everything the zygote holds: a collection in a worker never touches (dirties) it
        pid = os.fork()
        if pid == 0:  # the new execution environment
            control.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            os.environ.update(msg["env"])
            serve(socket.socket(fileno=fds[0]), handler)
        os.close(fds[0])
        send_msg(control, {"pid": pid})


if __name__ == "__main__":
    sys.stdout = sys.stderr  # anything the handler prints goes to the log
    zygote(int(sys.argv[1]))
