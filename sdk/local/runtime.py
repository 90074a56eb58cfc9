"""A local stand-in for the Lambda service: warm process pools with memory and timeout enforced.

moto would run a function's code in Docker, which is absent here; the local stack routes moto's
invocation into this runtime instead. It keeps what matters to a training run on Lambda:

- one pool of worker processes per function version: an invocation takes an idle process (warm
  start: module-level caches survive, as in a Lambda execution environment) or starts one (cold);
- the function's configured memory: a process whose resident set grows past it is killed and the
  invocation fails like Lambda's out-of-memory (``Runtime.OutOfMemory``);
- the function's configured timeout: a process still busy then is killed and the invocation fails
  like Lambda's (``Sandbox.Timedout``).

Error payloads follow the AWS Python runtime's shape (errorType / errorMessage), so Step Functions'
Retry and Catch see the same error names as on AWS (see docs/local-stack.md for the differences).
"""

from __future__ import annotations

import json
import os
import select
import struct
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

POLL_S = 0.02


@dataclass(frozen=True)
class FunctionSpec:
    """What the runtime needs of a Lambda function's configuration."""

    name: str
    handler: str
    memory_mb: int
    timeout_s: float
    environment: tuple[tuple[str, str], ...] = ()
    version_key: str = ""


@dataclass
class _Worker:
    proc: subprocess.Popen
    started: float = field(default_factory=time.time)
    invocations: int = 0


def _rss_mb(pid: int) -> float:
    """Resident set of a process in MB (Linux /proc); 0 if it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0.0


def _error(error_type: str, message: str) -> str:
    return json.dumps({"errorType": error_type, "errorMessage": message})


class LocalLambdaRuntime:
    """Runs Lambda invocations in warm pools of local worker processes."""

    def __init__(self, endpoint_url: str, log_path: str | None = None) -> None:
        self.endpoint_url = endpoint_url
        self._idle: dict[FunctionSpec, list[_Worker]] = {}
        self._lock = threading.Lock()
        self._all: list[_Worker] = []
        self._log = open(log_path, "ab") if log_path else subprocess.DEVNULL

    # -- pool ------------------------------------------------------------------------------------
    def _start(self, spec: FunctionSpec) -> _Worker:
        env = {k: v for k, v in os.environ.items() if not k.startswith("MOTO_")}
        env.update(dict(spec.environment))
        env.update(
            {
                "_HANDLER": spec.handler,
                "AWS_ENDPOINT_URL": self.endpoint_url,
                "AWS_ACCESS_KEY_ID": "local",
                "AWS_SECRET_ACCESS_KEY": "local",
                "AWS_DEFAULT_REGION": env.get("AWS_DEFAULT_REGION", "us-east-1"),
                "AWS_REGION": env.get("AWS_DEFAULT_REGION", "us-east-1"),
                "AWS_LAMBDA_FUNCTION_NAME": spec.name,
                "AWS_LAMBDA_FUNCTION_MEMORY_SIZE": str(spec.memory_mb),
                "AWS_LAMBDA_FUNCTION_TIMEOUT": str(int(spec.timeout_s)),
                "STAGECOACH_LOCAL_RUNTIME": "1",
                # one thread per worker: Lambda's vCPU share is modelled by the platform, and the
                # workers of a phase share this machine's cores
                "OMP_NUM_THREADS": env.get("STAGECOACH_WORKER_THREADS", "1"),
            }
        )
        proc = subprocess.Popen(
            [sys.executable, "-m", "stagecoach.local.worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=env,
        )
        w = _Worker(proc)
        with self._lock:
            self._all.append(w)
        return w

    def _take(self, spec: FunctionSpec) -> tuple[_Worker, bool]:
        with self._lock:
            idle = self._idle.setdefault(spec, [])
            while idle:
                w = idle.pop()
                if w.proc.poll() is None:
                    return w, False
        return self._start(spec), True

    def _give_back(self, spec: FunctionSpec, w: _Worker) -> None:
        with self._lock:
            self._idle.setdefault(spec, []).append(w)

    def _kill(self, w: _Worker) -> None:
        try:
            w.proc.kill()
            w.proc.wait(timeout=5)
        except Exception:
            pass
        with self._lock:
            if w in self._all:
                self._all.remove(w)

    def shutdown(self) -> None:
        with self._lock:
            workers = list(self._all)
        for w in workers:
            self._kill(w)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"processes": len(self._all), "idle": sum(len(v) for v in self._idle.values())}

    # -- invocation --------------------------------------------------------------------------------
    def invoke(self, spec: FunctionSpec, event: Any) -> tuple[str, bool, str]:
        request_id = str(uuid.uuid4())
        w, cold = self._take(spec)
        deadline = time.time() + spec.timeout_s
        msg = json.dumps(
            {"event": event, "request_id": request_id, "deadline": deadline, "cold": cold}
        ).encode()
        try:
            w.proc.stdin.write(struct.pack("<I", len(msg)) + msg)
            w.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            self._kill(w)
            return _error("Runtime.ExitError", f"RequestId: {request_id} worker process died"), True, ""
        w.invocations += 1
        fd = w.proc.stdout.fileno()
        buf = b""
        peak = 0.0
        while True:
            now = time.time()
            if now >= deadline:
                self._kill(w)
                return (
                    _error("Sandbox.Timedout", f"RequestId: {request_id} Task timed out after {spec.timeout_s:.2f} seconds"),
                    True,
                    "",
                )
            rss = _rss_mb(w.proc.pid)
            peak = max(peak, rss)
            if rss > spec.memory_mb:
                self._kill(w)
                return (
                    _error(
                        "Runtime.OutOfMemory",
                        f"RequestId: {request_id} Error: Runtime exited with error: signal: killed "
                        f"(memory {rss:.0f} MB > configured {spec.memory_mb} MB)",
                    ),
                    True,
                    "",
                )
            r, _, _ = select.select([fd], [], [], min(POLL_S, max(0.0, deadline - now)))
            if not r:
                continue
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                code = w.proc.poll()
                self._kill(w)
                return (
                    _error("Runtime.ExitError", f"RequestId: {request_id} Error: Runtime exited with error: exit status {code}"),
                    True,
                    "",
                )
            buf += chunk
            if len(buf) >= 4:
                (n,) = struct.unpack("<I", buf[:4])
                if len(buf) >= 4 + n:
                    reply = json.loads(buf[4 : 4 + n])
                    self._give_back(spec, w)
                    return reply["payload"], bool(reply["errored"]), ""
