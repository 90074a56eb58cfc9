"""Express state machines on the embedded stack, answering as Step Functions does (docs/local-stack.md).

moto 5.2.1 accepts ``type="EXPRESS"`` but forgets it (every state machine describes as STANDARD and
runs as one) and has no StartSyncExecution. Here, as on AWS:

- CreateStateMachine keeps the type; DescribeStateMachine and ListStateMachines report it.
- An EXPRESS state machine takes only Request Response integrations: CreateStateMachine and
  UpdateStateMachine refuse a Task whose Resource is a ``.sync`` (Run a Job) or
  ``.waitForTaskToken`` (Wait for Callback) integration, or an activity, with InvalidDefinition
  (AWS: "Express Workflows do not support Run a Job (.sync) or Wait for Callback
  (.waitForTaskToken)", docs/local-stack.md). AWS does not publish the message; ours is the one of
  LocalStack's Express static analyser (which moto vendors unused, moto/stepfunctions/parser/asl/
  static_analyser/express_static_analyser.py), with the state's path added.
- StartSyncExecution runs an EXPRESS execution and answers when it has ended, HTTP 200 whether it
  succeeded or not (``status`` SUCCEEDED, FAILED or TIMED_OUT, ``output`` a JSON string only when
  it succeeded, ``error``/``cause`` when it failed, ``billingDetails``); on a STANDARD state
  machine it is refused (StateMachineTypeNotSupported). Its ARN is an ``:express:`` one.
- An Express execution runs at most ``Fidelity.express_max_s`` (AWS: five minutes); past it the
  execution is stopped and the call answers ``TIMED_OUT`` (error ``States.Timeout``).
- There is no history API for Express: DescribeExecution, GetExecutionHistory and StopExecution
  of an Express execution answer InvalidArn, and ListExecutions of an EXPRESS state machine
  StateMachineTypeNotSupported.
- An Express execution's history goes to CloudWatch Logs as its state machine's
  ``loggingConfiguration`` asks (AWS: "Express Workflows don't record execution history in AWS
  Step Functions. To see execution history and results for an Express Workflow, you must configure
  logging to Amazon CloudWatch Logs"): each event a JSON message with ``id``, ``type``,
  ``details`` (the history event's details, camelCase), ``previous_event_id``,
  ``event_timestamp`` (epoch ms, as strings) and ``execution_arn`` (the ``:express:`` one), of
  the types the level logs (``LOG_LEVELS``), without ``input``/``output`` when
  ``includeExecutionData`` is false, written when the execution ends to a stream ``states/
  <machine>/<date>/<id>`` of the destination log group (``ExpressLogs``; docs/local-stack.md).
- Synchronous Express is at-most-once: ``ExpressFaults`` (``STAGECOACH_EXPRESS_FAULTS``) loses a
  start before its execution runs, or its answer after it ran (the caller gets HTTP 500
  InternalFailure either way and cannot tell which), or runs an execution twice (what an
  at-least-once asynchronous start may do), so a test can show that a window lost, failed or
  repeated changes nothing.

boto3 sends StartSyncExecution to ``sync-<endpoint host>`` (its ``hostPrefix``): a local client
needs ``Config(inject_host_prefix=False)``, as the Step Functions interpreter's has
(stack.install_client_cache). Every moto import is inside the function that patches (moto is the
optional, heavy ``local`` extra, loaded only in the stack's own process).
"""

from __future__ import annotations

import datetime
import json
import math
import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from stagecoach.local.fidelity import Fidelity

ENV = "STAGECOACH_EXPRESS_FAULTS"
EXPRESS = "EXPRESS"
TIMEOUT_ERROR = "States.Timeout"
TIMEOUT_CAUSE = "The execution exceeded the maximum duration of an Express workflow ({limit:g} seconds)."
# Express duration is billed in 100 ms steps and memory in 64 MB steps (Step Functions pricing)
BILLED_STEP_MS = 100
BILLED_MEMORY_MB = 64
POLL_S = 0.02
KINDS = ("lose_before", "lose_after", "repeat")
UNSUPPORTED_PATTERNS = (".sync", ".waitForTaskToken")
UNSUPPORTED_MESSAGE = (
    "Invalid State Machine Definition: 'SCHEMA_VALIDATION_FAILED: Express state machine does not support {what} at {path}/Resource'"
)
ACTIVITY_ARN = ":activity:"
# the event types each log level writes (AWS's "Log levels" table, cloudwatch-log-level.html): ALL
# every type, OFF none
_FATAL_TYPES = frozenset({"ExecutionAborted", "ExecutionFailed", "ExecutionTimedOut"})
_ERROR_TYPES = _FATAL_TYPES | frozenset(
    {
        "FailStateEntered",
        "LambdaFunctionFailed",
        "LambdaFunctionScheduleFailed",
        "LambdaFunctionStartFailed",
        "LambdaFunctionTimedOut",
        "MapIterationAborted",
        "MapIterationFailed",
        "MapStateAborted",
        "MapStateFailed",
        "ParallelStateAborted",
        "ParallelStateFailed",
        "TaskFailed",
        "TaskStartFailed",
        "TaskStateAborted",
        "TaskSubmitFailed",
        "TaskTimedOut",
        "WaitStateAborted",
    }
)
LOG_LEVELS: dict[str, frozenset[str] | None] = {"ALL": None, "ERROR": _ERROR_TYPES, "FATAL": _FATAL_TYPES, "OFF": frozenset()}
EXECUTION_DATA = ("input", "inputDetails", "output", "outputDetails")  # what includeExecutionData=false leaves out


def express_arn(state_machine_arn: str, name: str) -> str:
    """An Express execution's ARN: ``arn:aws:states:<region>:<account>:express:<machine>:<name>:<id>``."""
    head, machine = state_machine_arn.split(":stateMachine:", 1)
    return f"{head}:express:{machine}:{name}:{uuid.uuid4()}"


def is_express_arn(arn: str) -> bool:
    return ":express:" in arn


def invalid_arn_message(arn: str) -> str:
    """What Step Functions answers for an ARN of a kind the action does not take."""
    kind = arn.split(":")[5] if arn.count(":") >= 6 else arn
    return f"Invalid Arn: 'Resource type not valid in this context: {kind}'"


def unsupported_in_express(definition: dict[str, Any], path: str = "") -> str | None:
    """The first Task (by its path, as AWS's definition errors name it) that an EXPRESS state
    machine cannot run: a ``.sync`` or ``.waitForTaskToken`` integration, also inside a Parallel's
    branches or a Map's processor; None if it has none."""
    for name, state in (definition.get("States") or {}).items():
        here = f"{path}/States/{name}"
        what = _unsupported(str(state.get("Resource", ""))) if state.get("Type") == "Task" else None
        if what is not None:
            return UNSUPPORTED_MESSAGE.format(what=what, path=here)
        inner = [(f"{here}/Branches[{i}]", b) for i, b in enumerate(state.get("Branches") or [])]
        for key in ("ItemProcessor", "Iterator"):
            if isinstance(state.get(key), dict):
                inner.append((f"{here}/{key}", state[key]))
        for inner_path, sub in inner:
            found = unsupported_in_express(sub, inner_path)
            if found is not None:
                return found
    return None


def _unsupported(resource: str) -> str | None:
    """What of a Task's Resource an EXPRESS machine cannot run, in LocalStack's words: an activity,
    or a ``.sync`` / ``.waitForTaskToken`` service integration (naming the resource)."""
    if resource.startswith("arn:aws:states:") and ACTIVITY_ARN in resource:
        return "Activity ARN"
    if resource.startswith("arn:aws:states:::"):
        pattern = next((p for p in UNSUPPORTED_PATTERNS if p in resource.split(":::", 1)[1]), None)
        if pattern is not None:
            return f"'{pattern}' service integration ({resource})"
    return None


def is_logged(level: str, event_type: str) -> bool:
    """Whether a state machine logging at ``level`` writes events of ``event_type`` (LOG_LEVELS)."""
    types = LOG_LEVELS.get(level, frozenset())
    return types is None or event_type in types


def log_record(event: dict[str, Any], execution_arn: str, include_data: bool) -> dict[str, Any]:
    """A history event as Step Functions logs it: ids and epoch milliseconds as strings, the
    event's details (whatever its ``...EventDetails`` key) under ``details`` ({} for an event
    without), without its input and output unless ``include_data``."""
    details = next((v for k, v in event.items() if k.endswith("EventDetails") and isinstance(v, dict)), {})
    if not include_data:
        details = {k: v for k, v in details.items() if k not in EXECUTION_DATA}
    when = event["timestamp"]  # moto's interpreter keeps it as ISO 8601 text, its API answers a datetime
    if not isinstance(when, datetime.datetime):
        when = datetime.datetime.fromisoformat(str(when))
    ms = round(when.timestamp() * 1000)
    return {
        "id": str(event["id"]),
        "type": event["type"],
        "details": details,
        "previous_event_id": str(event.get("previousEventId", 0)),
        "event_timestamp": str(ms),
        "execution_arn": execution_arn,
    }


def log_destination(logging: dict[str, Any] | None) -> tuple[str, str, str] | None:
    """(account, region, log group name) of a loggingConfiguration's CloudWatch Logs destination
    (its ARN ``arn:<partition>:logs:<region>:<account>:log-group:<name>:*``), None without one."""
    destinations = (logging or {}).get("destinations") or []
    arn = str((destinations[0].get("cloudWatchLogsLogGroup") or {}).get("logGroupArn", "")) if destinations else ""
    parts = arn.split(":")
    if len(parts) < 7 or parts[5] != "log-group":
        return None
    return parts[4], parts[3], parts[6]


class ExpressLogs:
    """Writes an ended Express execution's history to its machine's log group, through moto's
    CloudWatch Logs in this process: the group is created when missing (as the stack's worker log
    group is, local/runtime.py; template.yaml provisions WindowLogGroup on AWS), one stream per
    execution."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # moto's LogStream.put_log_events is not thread-safe

    def write(self, machine: Any, execution_arn: str, events: list[dict[str, Any]]) -> int:
        """Log ``events`` of ``execution_arn`` as ``machine``'s loggingConfiguration asks; how many."""
        # moto: the `local` extra, heavy and optional; imported on use, in the stack process only
        from moto.logs.exceptions import ResourceAlreadyExistsException
        from moto.logs.models import logs_backends

        logging = getattr(machine, "loggingConfiguration", None) or {}
        where = log_destination(logging)
        level = str(logging.get("level", "OFF"))
        records = [log_record(e, execution_arn, bool(logging.get("includeExecutionData"))) for e in events if is_logged(level, e["type"])]
        if where is None or not records:
            return 0
        account, region, group = where
        started = datetime.datetime.fromtimestamp(int(records[0]["event_timestamp"]) / 1000, tz=datetime.UTC)
        stream = f"states/{machine.name}/{started:%Y-%m-%d-%H-%M}/{uuid.uuid4().hex[:8]}"
        logs = logs_backends[account][region]
        with self._lock:
            try:
                logs.create_log_group(group, {})
            except ResourceAlreadyExistsException:
                pass
            logs.create_log_stream(group, stream)
            entries = [{"timestamp": int(r["event_timestamp"]), "message": json.dumps(r, separators=(",", ":"))} for r in records]
            logs.put_log_events(group, stream, entries)
        return len(records)


@dataclass
class ExpressFaults:
    """Scripted losses of synchronous Express starts: each entry an execution-name prefix (the
    job's windows are named ``w{start}-<uuid>``), firing on the first start it matches, once."""

    lose_before: list[str] = field(default_factory=list)
    lose_after: list[str] = field(default_factory=list)
    repeat: list[str] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> ExpressFaults:
        raw = (environ if environ is not None else os.environ).get(ENV)
        if not raw:
            return cls()
        try:
            spec = json.loads(raw)
            if not set(spec) <= set(KINDS):
                return cls._bad(raw)
            lists = {k: [str(p) for p in spec.get(k, [])] for k in KINDS}
            return cls(lose_before=lists["lose_before"], lose_after=lists["lose_after"], repeat=lists["repeat"])
        except (ValueError, TypeError, AttributeError):
            return cls._bad(raw)

    @staticmethod
    def _bad(raw: str) -> ExpressFaults:
        raise ValueError(f"{ENV}={raw!r}: expected a JSON object with lists of name prefixes under {', '.join(KINDS)}")

    def draw(self, name: str) -> str | None:
        """The fault for the start of execution ``name`` (a kind of KINDS), or None."""
        with self._lock:
            for kind in KINDS:
                prefixes: list[str] = getattr(self, kind)
                for i, prefix in enumerate(prefixes):
                    if name.startswith(prefix):
                        del prefixes[i]
                        return kind
        return None


class ExpressRunner:
    """Runs synchronous Express executions on moto's interpreter (see the module's docstring)."""

    def __init__(self, fidelity: Fidelity, faults: ExpressFaults, log_path: str | None = None) -> None:
        self.max_s = float(fidelity.express_max_s)
        self.faults = faults
        self.log_path = log_path
        self._log_lock = threading.Lock()
        self.logs = ExpressLogs()

    def log(self, line: str) -> None:
        """One line in the stack's workers.log (as the runtime notes injected faults)."""
        if self.log_path is None:
            return
        with self._log_lock, open(self.log_path, "a") as f:
            f.write(f"[express] {line}\n")

    def start_sync(self, backend: Any, state_machine_arn: str, name: str | None, execution_input: str) -> dict[str, Any]:
        """StartSyncExecution: the ended execution as the API answers it, or an error."""
        # moto: the `local` extra, heavy and optional; imported on use, in the stack process only
        from moto.stepfunctions.exceptions import AWSError

        machine = backend.describe_state_machine(state_machine_arn)
        if getattr(machine, "type", "STANDARD") != EXPRESS:
            raise AWSError("This operation is not supported by this type of state machine", "StateMachineTypeNotSupported")
        name = name or str(uuid.uuid4())
        fault = self.faults.draw(name)
        if fault == "lose_before":
            self.log(f"{name}: injected lose_before (the execution never ran)")
            raise _internal_failure()
        result = self._run(backend, state_machine_arn, name, execution_input)
        if fault == "repeat":
            self.log(f"{name}: injected repeat (ran {result['status']}, running it again)")
            result = self._run(backend, state_machine_arn, name, execution_input)
        if fault == "lose_after":
            self.log(f"{name}: injected lose_after (ran {result['status']}, its answer lost)")
            raise _internal_failure()
        return result

    def _run(self, backend: Any, state_machine_arn: str, name: str, execution_input: str) -> dict[str, Any]:
        """One execution to its end or to the Express limit. moto runs it as a STANDARD one under an
        internal name; nobody can reach it (no history API for EXPRESS)."""
        internal = f"{name[:40]}-{uuid.uuid4().hex[:16]}"
        started = time.monotonic()
        execution = backend.start_execution(state_machine_arn, internal, execution_input)
        while _running(execution) and time.monotonic() - started < self.max_s:
            time.sleep(POLL_S)
        timed_out = _running(execution)
        if timed_out:
            now = datetime.datetime.now(tz=datetime.UTC)
            execution.stop(stop_date=now, error=TIMEOUT_ERROR, cause=TIMEOUT_CAUSE.format(limit=self.max_s))
            while _running(execution) and time.monotonic() - started < self.max_s + 10:
                time.sleep(POLL_S)
        elapsed_ms = (time.monotonic() - started) * 1000.0
        arn = express_arn(state_machine_arn, name)
        logged = self._write_logs(backend, state_machine_arn, execution, arn)
        out = self._answer(execution, arn, state_machine_arn, name, execution_input, elapsed_ms, timed_out)
        self.log(f"{name}: {out['status']} after {elapsed_ms / 1000:.2f} s ({arn}, {logged} events logged)")
        return out

    def _write_logs(self, backend: Any, state_machine_arn: str, execution: Any, arn: str) -> int:
        """The ended execution's history to CloudWatch Logs (ExpressLogs), under its Express ARN;
        a failure to log is noted in workers.log, never the execution's (AWS: "Publishing logs
        doesn't block or slow down executions")."""
        try:
            history = backend.get_execution_history(execution.execution_arn)
            events = list(history["events"] if isinstance(history, dict) else history)
            return self.logs.write(backend.describe_state_machine(state_machine_arn), arn, events)
        except Exception as e:  # noqa: BLE001 - a log lost is a log lost, never a failed execution
            self.log(f"{arn}: history not logged: {e!r}")
            return 0

    def _answer(
        self, execution: Any, arn: str, sm_arn: str, name: str, execution_input: str, elapsed_ms: float, timed_out: bool
    ) -> dict[str, Any]:
        status = "TIMED_OUT" if timed_out else ("SUCCEEDED" if _status(execution) == "SUCCEEDED" else "FAILED")
        stop = getattr(execution, "stop_date", None) or datetime.datetime.now(tz=datetime.UTC)
        out: dict[str, Any] = {
            "executionArn": arn,
            "stateMachineArn": sm_arn,
            "name": name,
            "startDate": execution.start_date,
            "stopDate": stop,
            "status": status,
            "input": execution_input,
            "inputDetails": {"included": True},
            "billingDetails": {
                "billedMemoryUsedInMB": BILLED_MEMORY_MB,
                "billedDurationInMilliseconds": max(BILLED_STEP_MS, math.ceil(elapsed_ms / BILLED_STEP_MS) * BILLED_STEP_MS),
            },
        }
        if status == "SUCCEEDED":
            output = execution.output
            out["output"] = output if isinstance(output, str) else json.dumps(output, separators=(",", ":"))
            out["outputDetails"] = {"included": True}
        elif timed_out:
            out["error"], out["cause"] = TIMEOUT_ERROR, TIMEOUT_CAUSE.format(limit=self.max_s)
        else:
            for key in ("error", "cause"):
                if getattr(execution, key, None) is not None:
                    out[key] = getattr(execution, key)
        return out


def _status(execution: Any) -> str:
    status = getattr(execution, "exec_status", None)
    return str(getattr(status, "value", status))


def _running(execution: Any) -> bool:
    return _status(execution) in ("RUNNING", "None")


def _internal_failure() -> Exception:
    """The API's common error for a failure of unknown cause (HTTP 500 InternalFailure)."""
    # moto: the `local` extra, heavy and optional; imported on use, in the stack process only
    from moto.stepfunctions.exceptions import AWSError

    return AWSError("The request processing has failed because of an unknown error, exception or failure.", "InternalFailure", 500)


def install_express(fidelity: Fidelity, log_path: str | None = None, faults: ExpressFaults | None = None) -> ExpressRunner:
    """Patch moto's Step Functions as the module's docstring says; returns the runner."""
    runner = ExpressRunner(fidelity, faults if faults is not None else ExpressFaults.from_env(), log_path)
    _install_type()
    _install_no_history()
    _install_start_sync(runner)
    _install_sdk_integration()
    return runner


def _install_type() -> None:
    """CreateStateMachine keeps ``type``; Describe/ListStateMachines report it."""
    # moto: the `local` extra, heavy and optional; imported on use, in the stack process only
    from moto.core.responses import ActionResult
    from moto.stepfunctions.responses import StepFunctionResponse

    create = StepFunctionResponse.create_state_machine
    listing = StepFunctionResponse.list_state_machines
    update = StepFunctionResponse.update_state_machine

    def create_state_machine(self: StepFunctionResponse) -> ActionResult:
        kind = self._get_param("type") or "STANDARD"
        if kind not in ("STANDARD", EXPRESS):
            # moto: the `local` extra (see above)
            from moto.stepfunctions.exceptions import ValidationException

            raise ValidationException(
                f"Value '{kind}' at 'type' failed to satisfy constraint: Member must satisfy enum value set: [STANDARD, EXPRESS]"
            )
        if kind == EXPRESS:
            _refuse_unsupported(self._get_param("definition"))
        result = create(self)
        machine = self.stepfunction_backend.describe_state_machine(_result(result)["stateMachineArn"])
        machine.type = machine.sm_type = kind
        return result

    def list_state_machines(self: StepFunctionResponse) -> ActionResult:
        result = listing(self)
        for item in _result(result).get("stateMachines", []):
            item["type"] = getattr(self.stepfunction_backend.describe_state_machine(item["stateMachineArn"]), "type", "STANDARD")
        return result

    def update_state_machine(self: StepFunctionResponse) -> ActionResult:
        definition = self._get_param("definition")
        if definition is not None:
            machine = self.stepfunction_backend.describe_state_machine(self._get_param("stateMachineArn"))
            if getattr(machine, "type", "STANDARD") == EXPRESS:
                _refuse_unsupported(definition)
        return update(self)

    StepFunctionResponse.create_state_machine = create_state_machine  # type: ignore[method-assign]
    StepFunctionResponse.update_state_machine = update_state_machine  # type: ignore[method-assign]
    StepFunctionResponse.list_state_machines = list_state_machines  # type: ignore[method-assign]


def _refuse_unsupported(definition: str | None) -> None:
    """InvalidDefinition for an EXPRESS definition with a .sync or .waitForTaskToken Task (a
    definition that is no JSON is left to moto's own checks)."""
    # moto: the `local` extra, heavy and optional; imported on use, in the stack process only
    from moto.stepfunctions.exceptions import AWSError

    try:
        parsed = json.loads(definition or "")
    except ValueError:
        return
    found = unsupported_in_express(parsed) if isinstance(parsed, dict) else None
    if found is not None:
        raise AWSError(found, "InvalidDefinition")


def _result(result: Any) -> dict[str, Any]:
    """The dict an ActionResult answers with (moto 5.2.1 keeps it as ``result``)."""
    out: dict[str, Any] = result.result
    return out


def _install_no_history() -> None:
    """No ListExecutions of an EXPRESS machine, no Describe/GetExecutionHistory/Stop of an Express execution."""
    # moto: the `local` extra, heavy and optional; imported on use, in the stack process only
    from moto.stepfunctions.exceptions import AWSError, InvalidArn
    from moto.stepfunctions.models import StepFunctionBackend
    from moto.stepfunctions.parser.models import StepFunctionsParserBackend

    for cls in (StepFunctionBackend, StepFunctionsParserBackend):
        for action in ("describe_execution", "get_execution_history", "stop_execution", "describe_state_machine_for_execution"):
            original = cls.__dict__.get(action)
            if original is None:
                continue

            def refuse(self: Any, execution_arn: str, *a: Any, _original: Any = original, **kw: Any) -> Any:
                if is_express_arn(execution_arn):
                    raise InvalidArn(invalid_arn_message(execution_arn))
                return _original(self, execution_arn, *a, **kw)

            setattr(cls, action, refuse)
        list_executions = cls.__dict__.get("list_executions")
        if list_executions is None:
            continue

        def not_express(self: Any, state_machine_arn: str, *a: Any, _original: Any = list_executions, **kw: Any) -> Any:
            if getattr(self.describe_state_machine(state_machine_arn), "type", "STANDARD") == EXPRESS:
                raise AWSError("This operation is not supported by this type of state machine", "StateMachineTypeNotSupported")
            return _original(self, state_machine_arn, *a, **kw)

        cls.list_executions = not_express  # type: ignore[method-assign,assignment]


def _install_start_sync(runner: ExpressRunner) -> None:
    """The StartSyncExecution action on moto's Step Functions endpoint."""
    # moto: the `local` extra, heavy and optional; imported on use, in the stack process only
    from moto.core.responses import ActionResult
    from moto.stepfunctions.responses import StepFunctionResponse

    def start_sync_execution(self: StepFunctionResponse) -> ActionResult:
        arn = self._get_param("stateMachineArn")
        out = runner.start_sync(self.stepfunction_backend, arn, self._get_param("name"), self._get_param("input", if_none="{}"))
        return ActionResult(out)

    StepFunctionResponse.start_sync_execution = start_sync_execution  # type: ignore[attr-defined]


def pascal(value: Any) -> Any:
    """An API answer in Step Functions' casing, recursively (``executionArn`` -> ``ExecutionArn``);
    the execution's own ``Input``/``Output`` documents are user data and keep theirs. Dates become
    epoch milliseconds, as Step Functions writes them into a state's JSON."""
    if isinstance(value, datetime.datetime):
        return int(value.timestamp() * 1000)
    if not isinstance(value, dict):
        return value
    out = {}
    for k, v in value.items():
        key = k[:1].upper() + k[1:]
        out[key] = v if key in ("Input", "Output") else pascal(v)
    return out


def _install_sdk_integration() -> None:
    """The ``aws-sdk:sfn:*`` integration as Step Functions has it: its parameters in PascalCase
    (AWS: "Parameters in Step Functions are expressed in PascalCase, even if the native service API
    is in camelCase", naming startSyncExecution's StateMachineArn), an ``Input`` given as a JSON
    object sent as its JSON text, and the answer's fields in PascalCase (``$.Output``, ``$.Status``).
    moto 5.2.1 passes the parameters to boto3 as written and returns boto3's camelCase."""
    # moto: the `local` extra, heavy and optional; imported on use, in the stack process only
    from moto.stepfunctions.parser.asl.component.state.exec.state_task.service.state_task_service_aws_sdk import (
        StateTaskServiceAwsSdk,
    )

    params = StateTaskServiceAwsSdk._normalise_parameters
    response = StateTaskServiceAwsSdk._normalise_response

    def _normalise_parameters(self: Any, parameters: dict[str, Any], *a: Any, **kw: Any) -> None:
        params(self, parameters, *a, **kw)
        if self.resource.api_name != "sfn":
            return
        for key in list(parameters):
            value = parameters.pop(key)
            if key == "Input" and not isinstance(value, str):
                value = json.dumps(value, separators=(",", ":"))
            parameters[key[:1].lower() + key[1:]] = value

    def _normalise_response(self: Any, value: Any, *a: Any, **kw: Any) -> None:
        response(self, value, *a, **kw)
        if self.resource.api_name == "sfn" and isinstance(value, dict):
            cased = pascal(value)
            value.clear()
            value.update(cased)

    StateTaskServiceAwsSdk._normalise_parameters = _normalise_parameters  # type: ignore[method-assign]
    StateTaskServiceAwsSdk._normalise_response = _normalise_response  # type: ignore[method-assign,assignment]
