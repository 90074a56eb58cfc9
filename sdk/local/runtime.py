"""A local stand-in for the Lambda service: warm process pools with memory and timeout enforced.

moto would run a function's code in Docker, which is absent here; the local stack routes moto's
invocation into this runtime instead. It keeps what matters to a training run on Lambda:

- one pool of worker processes per function version: an invocation takes an idle process (warm
  start: module-level caches survive, as in a Lambda execution environment) or starts one (cold);
- the function's configured memory: a process whose resident set grows past it is killed and the
  invocation fails like Lambda's out-of-memory kill;
- the function's configured timeout: a process still busy then is killed and the invocation fails
  like Lambda's timeout;
- concurrency: the account's limit and the function's reserved concurrency, beyond which an
  invocation is throttled (HTTP 429) as Lambda throttles it.

Error payloads follow the AWS Python runtime's shape (errorType / errorMessage). Out-of-memory kills
and timeouts are reported in each of the shapes AWS has been seen to use (local/fidelity.py), so
Step Functions' Retry and Catch meet what they meet on AWS (docs/local-stack.md lists what differs).

Every invocation ends, as on Lambda, with its REPORT in CloudWatch Logs (the stack's moto Logs):
in the stack's log group, which every function of the stack logs to on AWS (template.yaml
WorkerLogGroup, LogFormat JSON), a "platform.report" record with the request id, the function's
Memory Size and, as Max Memory Used, the worker's peak resident set as measured here (the memory
size itself when it was killed for memory), in a stream named as Lambda names one in a custom log
group, ``YYYY/MM/DD/<function>[$LATEST]<environment>`` (docs.aws.amazon.com/lambda/latest/dg/
monitoring-cloudwatchlogs-loggroups.html). The remediation reads it (lambdas/remediate.py).
"""

from __future__ import annotations

import datetime
import json
import os
import queue
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from typing import IO, Any

import boto3

from stagecoach.core import keys
from stagecoach.errors import StagecoachError
from stagecoach.local.access import credentials_for
from stagecoach.local.faults import Fault, FaultInjector
from stagecoach.local.fidelity import ErrorShapes, Fidelity
from stagecoach.local.worker import recv_msg, send_msg
from stagecoach.planner.limits import POLL_BUDGET_ENV

POLL_S = 0.02
# GETs per second the waiting workers of a job may make between them on this stack: its S3 (moto in
# one Python process) served 320-354 GETs of 20 kB a second on one core, to 4 or 640 concurrent
# clients alike (measured 2026-11-28, docs/local-stack.md), and the transfers the waiters wait for
# need the rest
LOCAL_POLL_BUDGET_PER_S = 150
# The stack's log group, where every function's REPORT goes (local/backend.py provisions the stack
# as template.yaml does, WorkerLogGroup "/aws/lambda/${AWS::StackName}-workers", stack "stagecoach").
STACK_LOG_GROUP = "/aws/lambda/stagecoach-workers"


@dataclass(frozen=True)
class FunctionSpec:
    """What the runtime needs of a Lambda function's configuration."""

    name: str
    handler: str
    memory_mb: int
    timeout_s: float
    environment: tuple[tuple[str, str], ...] = ()
    version_key: str = ""
    reserved_concurrency: int | None = None
    role: str = ""


class _Worker:
    """One execution environment: a forked process and the socket the runtime talks to it on."""

    def __init__(self, pid: int, sock: socket.socket) -> None:
        self.pid = pid
        self.sock = sock
        self.guid = uuid.uuid4().hex  # the execution environment's, in its log stream's name
        self.invocations = 0
        self.idle_since = time.monotonic()

    def alive(self) -> bool:
        try:
            with open(f"/proc/{self.pid}/stat") as f:
                return f.read().split(") ")[1][0] not in "ZX"
        except FileNotFoundError:
            return False

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.sock.close()


class _Zygote:
    """A process that has imported a handler module and forks execution environments on request."""

    def __init__(self, handler: str, env: dict[str, str], log: IO[bytes] | int) -> None:
        ours, theirs = socket.socketpair()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "stagecoach.local.worker", str(theirs.fileno())],
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            env={**env, "_HANDLER": handler},
        )
        theirs.close()
        self.sock = ours
        self.lock = threading.Lock()
        if not recv_msg(self.sock).get("ready"):
            raise RuntimeError(f"the zygote for {handler} did not start")

    def fork(self, env: dict[str, str]) -> _Worker:
        ours, theirs = socket.socketpair()
        with self.lock:
            send_msg(self.sock, {"env": env}, fds=[theirs.fileno()])
            pid = recv_msg(self.sock)["pid"]
        theirs.close()
        return _Worker(pid, ours)

    def close(self) -> None:
        self.sock.close()
        try:
            self.proc.wait(timeout=5)
        except Exception:
            self.proc.kill()


class Throttled(StagecoachError):
    """Raised into moto's invoke: becomes HTTP 429 TooManyRequestsException (see stack.py); the
    reason is Lambda's (ConcurrentInvocationLimitExceeded, ReservedFunctionConcurrentInvocationLimitExceeded)."""

    def __init__(self, reason: str = "ConcurrentInvocationLimitExceeded") -> None:
        super().__init__(reason)
        self.reason = reason


_PAGE_MB = os.sysconf("SC_PAGE_SIZE") / 2**20


def _rss_mb(pid: int) -> float:
    """Resident set of a process in MB (Linux /proc: statm's second field, the resident pages that
    status shows as VmRSS; a third of the cost to read, and every running invocation reads it 50
    times a second); 0 if it is gone."""
    try:
        with open(f"/proc/{pid}/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE_MB
    except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
        return 0.0


@dataclass
class _Meter:
    """What an invocation's REPORT says: its environment, peak memory and how it ended."""

    environment: str = ""
    peak_mb: float = 0.0
    status: str = "success"  # platform.report's: success, error or timeout


def report_record(request_id: str, memory_mb: int, meter: _Meter, duration_ms: float) -> str:
    """An invocation's REPORT as Lambda writes it in the JSON log format: a "platform.report"
    event (docs.aws.amazon.com/lambda/latest/dg/telemetry-schema-reference.html#platform-report)."""
    metrics = {
        "durationMs": round(duration_ms, 2),
        "billedDurationMs": int(duration_ms) + 1,
        "memorySizeMB": memory_mb,
        "maxMemoryUsedMB": int(min(meter.peak_mb, memory_mb) + 0.5),
    }
    now = datetime.datetime.now(datetime.UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    record = {"requestId": request_id, "metrics": metrics, "status": meter.status}
    return json.dumps({"time": now, "type": "platform.report", "record": record})


def _error(error_type: str, message: str) -> str:
    return json.dumps({"errorType": error_type, "errorMessage": message})


def _untyped_error(message: str) -> str:
    """A failure payload with no error type: Step Functions reports it as ``Lambda.Unknown``."""
    return json.dumps({"errorMessage": message})


def out_of_memory_payload(shape: str, request_id: str) -> str:
    """An out-of-memory kill as AWS reports it in ``shape`` (fidelity.OOM_SHAPES). No shape names
    the memory used: AWS's do not either (only the REPORT log line does)."""
    if shape == "Lambda.Unknown":
        return _untyped_error(f"RequestId: {request_id} Process exited before completing request")
    return _error(shape, f"RequestId: {request_id} Error: Runtime exited with error: signal: killed")


def timeout_payload(shape: str, request_id: str, timeout_s: float) -> str:
    """A function timeout as AWS reports it in ``shape`` (fidelity.TIMEOUT_SHAPES)."""
    message = f"RequestId: {request_id} Task timed out after {timeout_s:.2f} seconds"
    return _untyped_error(message) if shape == "Lambda.Unknown" else _error(shape, message)


class LocalLambdaRuntime:
    """Runs Lambda invocations in warm pools of local worker processes."""

    # Variables that differ per function; everything else in a function's environment (PYTHONPATH
    # above all, which decides what the handler import finds) is part of its zygote's identity.
    # The role's credentials too: a job's functions share one zygote whatever their roles.
    PER_FUNCTION = (
        "AWS_LAMBDA_FUNCTION_NAME",
        "AWS_LAMBDA_FUNCTION_MEMORY_SIZE",
        "AWS_LAMBDA_FUNCTION_TIMEOUT",
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
    )

    def __init__(
        self,
        endpoint_url: str,
        log_path: str | None = None,
        faults: FaultInjector | None = None,
        fidelity: Fidelity | None = None,
        log_group: str = STACK_LOG_GROUP,
    ) -> None:
        self.endpoint_url = endpoint_url
        self.log_group = log_group
        self._reports: queue.Queue[tuple[str, dict[str, Any]] | None] = queue.Queue()
        threading.Thread(target=self._ship_reports, daemon=True).start()
        self.faults = faults
        self.fidelity = fidelity or Fidelity()
        self.shapes = ErrorShapes(self.fidelity)
        self._running: dict[str, int] = {}  # function name -> invocations in flight
        self._idle: dict[FunctionSpec, list[_Worker]] = {}
        self._zygotes: dict[tuple[str, tuple[tuple[str, str], ...]], _Zygote] = {}  # (handler, shared environment)
        self._lock = threading.Lock()
        self._all: list[_Worker] = []
        self._log: IO[bytes] | int = open(log_path, "ab") if log_path else subprocess.DEVNULL
        self._stopping = threading.Event()
        threading.Thread(target=self._reclaim_idle, daemon=True).start()

    # -- pool ------------------------------------------------------------------------------------
    def _env(self, spec: FunctionSpec) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("MOTO_")}
        env.update(dict(spec.environment))
        region = env.get("AWS_DEFAULT_REGION", "us-east-1")
        env.update(
            {
                "AWS_ENDPOINT_URL": self.endpoint_url,
                # the function's execution role, as Lambda hands it over (local/access.py enforces it)
                **credentials_for(spec.role, spec.name),
                "AWS_DEFAULT_REGION": region,
                "AWS_REGION": region,
                "AWS_LAMBDA_FUNCTION_NAME": spec.name,
                "AWS_LAMBDA_FUNCTION_MEMORY_SIZE": str(spec.memory_mb),
                "AWS_LAMBDA_FUNCTION_TIMEOUT": str(int(spec.timeout_s)),
                "AWS_LAMBDA_LOG_GROUP_NAME": self.log_group,
                "STAGECOACH_LOCAL_RUNTIME": "1",
                # this stack's S3 serves a few hundred requests a second in all: waiting workers
                # poll within a share of it, not within the job's budget on AWS (lambdas/channel.py)
                POLL_BUDGET_ENV: env.get(POLL_BUDGET_ENV, str(LOCAL_POLL_BUDGET_PER_S)),
                # one thread per worker: the workers of a phase share this machine's cores
                "OMP_NUM_THREADS": env.get("STAGECOACH_WORKER_THREADS", "1"),
            }
        )
        return env

    def _zygote(self, spec: FunctionSpec, env: dict[str, str]) -> _Zygote:
        shared = {k: v for k, v in env.items() if k not in self.PER_FUNCTION}
        key = (spec.handler, tuple(sorted(shared.items())))
        with self._lock:
            z = self._zygotes.get(key)
            if z is None or z.proc.poll() is not None:
                z = self._zygotes[key] = _Zygote(spec.handler, shared, self._log)
        return z

    def _start(self, spec: FunctionSpec) -> _Worker:
        self._make_room()
        env = self._env(spec)
        w = self._zygote(spec, env).fork(env)
        with self._lock:
            self._all.append(w)
        return w

    def _take(self, spec: FunctionSpec) -> tuple[_Worker, bool]:
        with self._lock:
            idle = self._idle.setdefault(spec, [])
            while idle:
                w = idle.pop()
                if w.alive():
                    return w, False
        return self._start(spec), True

    def _give_back(self, spec: FunctionSpec, w: _Worker) -> None:
        w.idle_since = time.monotonic()
        with self._lock:
            self._idle.setdefault(spec, []).append(w)

    def _make_room(self) -> None:
        """Before a new environment: shut down the longest-idle ones while the machine holds
        ``Fidelity.max_environments`` (Lambda may reclaim an idle environment at any time)."""
        cap = self.fidelity.environments_cap()
        with self._lock:
            excess = len(self._all) + 1 - cap
            idle = sorted((w for ws in self._idle.values() for w in ws), key=lambda w: w.idle_since)[: max(0, excess)]
            for ws in self._idle.values():
                ws[:] = [w for w in ws if w not in idle]
        for w in idle:
            self._kill(w)

    def _reclaim_idle(self) -> None:
        """Shut down execution environments idle for ``Fidelity.idle_reclaim_s``, as Lambda does
        with idle ones (after minutes; it promises no time): a warm container is never guaranteed,
        and the processes of finished jobs' functions do not pile up in a long session."""
        while not self._stopping.wait(min(10.0, self.fidelity.idle_reclaim_s / 2)):
            cutoff = time.monotonic() - self.fidelity.idle_reclaim_s
            with self._lock:
                old = [w for ws in self._idle.values() for w in ws if w.idle_since < cutoff]
                for ws in self._idle.values():
                    ws[:] = [w for w in ws if w.idle_since >= cutoff]
            for w in old:
                self._kill(w)

    def _kill(self, w: _Worker) -> None:
        w.kill()
        with self._lock:
            if w in self._all:
                self._all.remove(w)

    def _note(self, line: str) -> None:
        """What Lambda's REPORT line would show (e.g. the memory an invocation was killed at)."""
        if not isinstance(self._log, int):
            self._log.write(f"[runtime] {line}\n".encode())
            self._log.flush()

    def _report(self, spec: FunctionSpec, request_id: str, meter: _Meter, started: float) -> None:
        """Queue the invocation's REPORT for the stack's log group (written off the invocation's
        path: CloudWatch Logs, too, shows an event some time after it was written)."""
        day = time.strftime("%Y/%m/%d", time.gmtime())
        stream = f"{day}/{spec.name}[$LATEST]{meter.environment or uuid.uuid4().hex}"
        message = report_record(request_id, spec.memory_mb, meter, 1000 * (time.time() - started))
        self._reports.put((stream, {"timestamp": int(time.time() * 1000), "message": message}))

    def _ship_reports(self) -> None:
        logs: Any = None
        streams: set[str] = set()
        while (item := self._reports.get()) is not None:
            stream, event = item
            try:
                if logs is None:
                    logs = boto3.client(
                        "logs",
                        endpoint_url=self.endpoint_url,
                        region_name="us-east-1",
                        aws_access_key_id="local",
                        aws_secret_access_key="local",
                    )
                    try:
                        logs.create_log_group(logGroupName=self.log_group)
                    except logs.exceptions.ResourceAlreadyExistsException:
                        pass
                if stream not in streams:
                    logs.create_log_stream(logGroupName=self.log_group, logStreamName=stream)
                    streams.add(stream)
                logs.put_log_events(logGroupName=self.log_group, logStreamName=stream, logEvents=[event])
            except Exception as e:  # a REPORT lost is a log line lost, never a failed invocation
                self._note(f"REPORT not written to {self.log_group}: {e}")

    def shutdown(self) -> None:
        self._stopping.set()
        self._reports.put(None)
        with self._lock:
            workers, zygotes = list(self._all), list(self._zygotes.values())
        for w in workers:
            self._kill(w)
        for z in zygotes:
            z.close()

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"processes": len(self._all), "idle": sum(len(v) for v in self._idle.values())}

    # -- invocation --------------------------------------------------------------------------------
    def invoke(self, spec: FunctionSpec, event: Any) -> tuple[str, bool, str]:
        fault = self.faults.draw(event) if self.faults else None
        if fault is not None:  # in the log beside the workers' output: what was injected where
            where = {k: event.get(k) for k in ("phase", "t", "stage", "replica", "shard", "attempt") if k in event}
            self._note(f"{spec.name}: injected {fault.kind} {where}")
        if fault is not None and fault.kind == "throttle":
            raise Throttled()
        if fault is not None and fault.kind == "fail":
            return _error("Stagecoach.InjectedFailure", "injected: this task failed (sdk/local/faults.py)"), True, ""
        self._admit(spec)
        request_id, meter, started = str(uuid.uuid4()), _Meter(), time.time()
        try:
            result = self._invoke(spec, event, fault, request_id, meter)
        finally:
            with self._lock:
                self._running[spec.name] -= 1
        if result[1] and meter.status == "success":
            meter.status = "error"
        self._report(spec, request_id, meter, started)
        if fault is not None and fault.kind == "delete" and not result[1]:
            self._delete_an_activation(event)
        return result

    def _admit(self, spec: FunctionSpec) -> None:
        """Count the invocation in, or throttle it as Lambda does: the function's reserved
        concurrency first, then the account's limit."""
        with self._lock:
            mine = self._running.get(spec.name, 0)
            if spec.reserved_concurrency is not None and mine >= spec.reserved_concurrency:
                raise Throttled("ReservedFunctionConcurrentInvocationLimitExceeded")
            if sum(self._running.values()) >= self.fidelity.account_concurrency:
                raise Throttled("ConcurrentInvocationLimitExceeded")
            self._running[spec.name] = mine + 1

    def running(self) -> int:
        """Invocations in flight, account-wide."""
        with self._lock:
            return sum(self._running.values())

    def _delete_an_activation(self, event: dict[str, Any]) -> None:
        s3 = boto3.client(
            "s3", endpoint_url=self.endpoint_url, region_name="us-east-1", aws_access_key_id="local", aws_secret_access_key="local"
        )
        key = keys.act(event["job"], event["t"], event["stage"], event["replica"], 0)
        s3.delete_object(Bucket=event["bucket"], Key=key)

    def _invoke(self, spec: FunctionSpec, event: Any, fault: Fault | None, request_id: str, meter: _Meter) -> tuple[str, bool, str]:
        try:
            w, cold = self._take(spec)
        except Exception as e:  # the handler cannot even be imported
            return _error("Runtime.ImportModuleError", f"RequestId: {request_id} {e}"), True, ""
        meter.environment = w.guid
        deadline = time.time() + spec.timeout_s
        started = time.time()
        try:
            if fault is None or fault.kind != "hang":  # a hung worker never gets (or answers) its event
                send_msg(w.sock, {"event": event, "request_id": request_id, "deadline": deadline})
        except OSError:
            self._kill(w)
            return _error("Runtime.ExitError", f"RequestId: {request_id} worker process died"), True, ""
        w.invocations += 1
        buf = b""
        # poll, not select: select takes no descriptor past 1,023 (FD_SETSIZE), and a stack of a few
        # hundred workers and their S3 connections holds more than that
        ready = select.poll()
        ready.register(w.sock, select.POLLIN)
        while True:
            now = time.time()
            if now >= deadline:
                self._kill(w)
                meter.status = "timeout"
                return timeout_payload(self.shapes.timeout(), request_id, spec.timeout_s), True, ""
            if fault is not None and fault.kind == "kill" and now - started >= fault.delay_s:
                self._kill(w)
                return (
                    _error("Runtime.ExitError", f"RequestId: {request_id} Error: Runtime exited with error: signal: killed (injected)"),
                    True,
                    "",
                )
            rss = _rss_mb(w.pid)
            meter.peak_mb = max(meter.peak_mb, rss)
            if rss > spec.memory_mb:
                self._kill(w)
                meter.peak_mb = spec.memory_mb  # Lambda reports the memory size as Max Memory Used
                self._note(f"{spec.name} {request_id}: killed, memory {rss:.0f} MB > configured {spec.memory_mb} MB")
                return out_of_memory_payload(self.shapes.out_of_memory(), request_id), True, ""
            if not ready.poll(1000 * min(POLL_S, max(0.0, deadline - now))):
                continue
            chunk = w.sock.recv(1 << 20)
            if not chunk:
                self._kill(w)
                return _error("Runtime.ExitError", f"RequestId: {request_id} Error: Runtime exited with error"), True, ""
            buf += chunk
            if len(buf) >= 4:
                (n,) = struct.unpack("<I", buf[:4])
                if len(buf) >= 4 + n:
                    if fault is not None and fault.kind == "kill":
                        # the kill point fell after the task's work: the container dies before it
                        # can reply, its outputs already written (a retry must rewrite them alike)
                        self._kill(w)
                        return (
                            _error(
                                "Runtime.ExitError", f"RequestId: {request_id} Error: Runtime exited with error: signal: killed (injected)"
                            ),
                            True,
                            "",
                        )
                    reply = json.loads(buf[4 : 4 + n])
                    self._give_back(spec, w)
                    return reply["payload"], bool(reply["errored"]), ""
