"""The embedded local stack: a moto server (S3, IAM, Lambda, Step Functions) in its own process.

Step Functions' interpreter is switched on, so state machines really execute, and moto's Lambda
invocation (which would need Docker) is routed into the local Lambda runtime. The process exits
when its parent closes stdin, taking its worker processes with it.

Run as ``python -m stagecoach.local.stack``; it prints ``READY <port>`` once it serves.

Every moto import that loads moto is inside the function that patches it: moto is the optional,
heavy `local` extra, imported on use and only in the stack's own process (the imports under
TYPE_CHECKING only name moto's types for the patches' annotations).
"""

from __future__ import annotations

import copy
import functools
import json
import logging
import os
import socket
import sys
import threading
import uuid
from typing import TYPE_CHECKING, Any

import boto3
from botocore.config import Config

from stagecoach.local.access import AccessControl, moto_lookups
from stagecoach.local.express import install_express, pascal
from stagecoach.local.faults import FaultInjector
from stagecoach.local.fidelity import Fidelity
from stagecoach.local.persist import ENV as STATE_ENV
from stagecoach.local.persist import StackArchive
from stagecoach.local.runtime import FunctionSpec, LocalLambdaRuntime, Throttled

if TYPE_CHECKING:
    from moto.awslambda.models import LambdaFunction
    from moto.stepfunctions.models import StateMachine
    from moto.stepfunctions.parser.asl.component.common.error_name.failure_event import FailureEvent
    from moto.stepfunctions.parser.asl.component.state.exec.state_task.service.state_task_service_lambda import (
        StateTaskServiceLambda,
    )
    from moto.stepfunctions.parser.asl.component.state.exec.state_task.service.state_task_service_sfn import (
        StateTaskServiceSfn,
    )
    from moto.stepfunctions.parser.asl.eval.environment import Environment

MOTO_VERSION = "5.2.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]  # (host, port) of an AF_INET socket
        return port


def _function_spec(fn: Any) -> FunctionSpec:
    """Read what the runtime needs off moto's LambdaFunction (image functions: ImageConfig.Command)."""
    cmd = getattr(getattr(fn, "image_config", None), "cmd", None) or []
    handler = cmd[0] if cmd else fn.handler
    env = tuple(sorted((fn.environment_vars or {}).items()))
    return FunctionSpec(
        name=fn.function_name,
        handler=handler,
        memory_mb=int(fn.memory_size),
        timeout_s=float(fn.timeout),
        environment=env,
        version_key=f"{fn.code_sha_256}:{fn.last_modified}",
        reserved_concurrency=None if fn.reserved_concurrency is None else int(fn.reserved_concurrency),
        role=fn.role,
    )


def install_lambda_hook(runtime: LocalLambdaRuntime) -> None:
    """Route moto's Lambda invocation into ``runtime``.

    moto.awslambda.models.LambdaFunction._invoke_lambda(self, event) -> (payload, errored, logs) is
    a moto internal; moto is pinned exactly and tests/test_moto_hook.py fails loudly if it moves.
    """
    # moto is the `local` extra, heavy and optional: imported on use, in the stack process only
    import moto
    from moto.awslambda.models import LambdaFunction

    if moto.__version__ != MOTO_VERSION:
        raise RuntimeError(
            f"stagecoach's local stack needs moto=={MOTO_VERSION} (found {moto.__version__}): pip install 'moto[server]=={MOTO_VERSION}'"
        )

    from moto.awslambda.exceptions import LambdaClientError

    class TooManyRequests(LambdaClientError):
        """Lambda's throttle: HTTP 429, message "Rate Exceeded.", and a Reason field."""

        code = 429

        def __init__(self, reason: str) -> None:
            super().__init__("TooManyRequestsException", "Rate Exceeded.")
            body = json.loads(self.description)
            body["Reason"] = reason
            self.description = json.dumps(body)

    def _invoke_lambda(self: LambdaFunction, event: Any = None) -> tuple[str, bool, str]:
        try:
            return runtime.invoke(_function_spec(self), event if event is not None else {})
        except Throttled as e:
            raise TooManyRequests(e.reason) from None

    LambdaFunction._invoke_lambda = _invoke_lambda  # type: ignore[method-assign]


def install_execution_snapshot_fix() -> None:
    """Make moto snapshot a state machine without deep-copying its whole backend.

    moto 5.2.1's start_execution deep-copies the StateMachine, which references its backend and
    every earlier Execution (holding thread locks), so any second execution in a server fails with
    "cannot pickle '_thread.RLock'". Real Step Functions has no such limit; the snapshot only needs
    the definition and configuration, which are immutable values, so a shallow copy with its own
    (empty) executions list is equivalent. Guarded by tests/test_moto_hook.py.
    """
    # moto: the `local` extra, heavy and optional; imported on use, in the stack process only
    from moto.stepfunctions.models import StateMachine

    def __deepcopy__(self: StateMachine, memo: dict[int, object]) -> StateMachine:
        clone = copy.copy(self)
        clone.executions = []
        return clone

    StateMachine.__deepcopy__ = __deepcopy__  # type: ignore[attr-defined]


def install_sfn_integration_fix() -> None:
    """Make moto's states:startExecution integration speak boto3's parameter names.

    moto 5.2.1 passes the ASL field names (StateMachineArn, Input, Name) to boto3 unchanged, which
    expects stateMachineArn, input, name, and reads the submission's ``ExecutionArn`` from a boto3
    response that says ``executionArn``. Step Functions on AWS does this translation itself; here we
    add it, and the generated name of an unnamed execution. Guarded by tests/test_moto_hook.py.
    """
    # moto: the `local` extra, heavy and optional; imported on use, in the stack process only
    from moto.stepfunctions.parser.asl.component.state.exec.state_task.service.state_task_service_sfn import (
        StateTaskServiceSfn,
    )

    normalise = StateTaskServiceSfn._normalise_parameters
    evaluate = StateTaskServiceSfn._eval_service_task

    def _normalise_parameters(self: StateTaskServiceSfn, parameters: dict[str, Any], *args: Any, **kwargs: Any) -> None:
        normalise(self, parameters, *args, **kwargs)
        for key in list(parameters):
            if key[:1].isupper():
                parameters[key[0].lower() + key[1:]] = parameters.pop(key)
        # "If you don't provide a name for the execution, Step Functions automatically generates a
        # universally unique identifier (UUID) as the execution name" (API reference,
        # StartExecution); moto names every such child "None", and the second one fails with
        # ExecutionAlreadyExists (the group executions of planner/emit/groups.py are unnamed)
        if parameters.get("name") is None and "stateMachineArn" in parameters:
            parameters["name"] = str(uuid.uuid4())

    def _eval_service_task(self: StateTaskServiceSfn, env: Environment, *args: Any, **kwargs: Any) -> None:
        evaluate(self, env, *args, **kwargs)
        response = env.stack[-1]
        if isinstance(response, dict):
            env.stack[-1] = {k[0].upper() + k[1:]: v for k, v in response.items()}

    StateTaskServiceSfn._normalise_parameters = _normalise_parameters  # type: ignore[method-assign]
    StateTaskServiceSfn._eval_service_task = _eval_service_task  # type: ignore[method-assign]


def install_jsonpath_cache() -> None:
    """Parse each JSONPath once: moto's interpreter builds a new LR parser per path evaluation.

    That rebuild (jsonpath_ng's yacc tables) took ~80% of the stack's CPU and ~0.5 s per state;
    parsed paths are immutable, so caching them changes nothing but speed.
    """
    # moto: the `local` extra, heavy and optional; imported on use, in the stack process only
    from moto.stepfunctions.parser.asl.component.common.path import result_path
    from moto.stepfunctions.parser.asl.utils import json_path

    for module in (json_path, result_path):
        if not hasattr(module.parse, "cache_info"):
            module.parse = functools.lru_cache(maxsize=4096)(module.parse)  # type: ignore[attr-defined]  # `parse` is jsonpath_ng's, re-bound in moto's module namespace, invisible to mypy


def install_client_cache() -> None:
    """One Lambda (and Step Functions) client per region for the interpreter's Tasks, not one per Task.

    moto's interpreter builds a new boto3 client for every Task it runs (``boto_client_for``): at a
    few hundred tasks a phase that took a sixth of the stack's one core (py-spy, a 2 x 64 job).
    boto3 clients are thread-safe; this one has moto's settings and a connection pool as large as
    the tasks that run at once.
    """
    # moto: the `local` extra, heavy and optional; imported on use, in the stack process only
    import moto.stepfunctions.parser.asl.component.state.exec.state_task.lambda_eval_utils  # noqa: F401
    from moto.stepfunctions.parser.asl.utils import boto_client

    original = boto_client.boto_client_for
    if getattr(original, "stagecoach_cached", False):  # installed already
        return

    @functools.lru_cache(maxsize=32)
    def shared(region: str, service: str) -> Any:
        return boto3.client(
            service,
            region_name=region,
            endpoint_url=f"http://localhost:{os.environ['MOTO_PORT']}",
            aws_access_key_id="ak",
            aws_secret_access_key="sk",
            config=Config(
                parameter_validation=False,
                retries={"max_attempts": 0, "total_max_attempts": 1},
                connect_timeout=boto_client.TimeoutSeconds.DEFAULT_TIMEOUT_SECONDS,
                read_timeout=boto_client.TimeoutSeconds.DEFAULT_TIMEOUT_SECONDS,
                max_pool_connections=2_000,
                # StartSyncExecution's hostPrefix ("sync-") would name a host that does not resolve
                # locally; on AWS it is the same service behind another name
                inject_host_prefix=False,
            ),
        )

    def cached(region: str, service: str, state_credentials: Any = None) -> Any:
        return shared(region, service)  # moto's own ignores the credentials too (fixed "ak"/"sk")

    cached.stagecoach_cached = True  # type: ignore[attr-defined]
    for name, module in list(sys.modules.items()):
        if name.startswith("moto.stepfunctions") and getattr(module, "boto_client_for", None) is original:
            module.boto_client_for = cached  # type: ignore[attr-defined]


def install_error_lookup_cache() -> None:
    """Build moto's table of a service's error shapes once, not for every error it answers.

    moto makes a new ``ErrorLookupFactory`` (and so a new table) per error response; waiting
    workers' GETs of objects not yet written are mostly 404s, and building the table took a twentieth
    of the stack's one core (py-spy, a 2 x 64 job). The tables are read-only once built.
    """
    # moto: the `local` extra, heavy and optional; imported on use, in the stack process only
    from moto.core import errors

    shared: dict[str, Any] = {}

    def init(self: Any) -> None:
        self._error_lut_cache = shared

    errors.ErrorLookupFactory.__init__ = init  # type: ignore[method-assign]


def install_sync_casing() -> None:
    """.sync/.sync:2 results and failure Causes in AWS's PascalCase (fidelity.sync_casing).

    moto 5.2.1 returns boto3's camelCase DescribeExecution (``executionArn``, ``error``, ``cause``)
    both as the task's result and, JSON-encoded, as the Cause of its States.TaskFailed; Step
    Functions on AWS uses ``ExecutionArn``, ``Error``, ``Cause``. Guarded by tests/test_fidelity.py.
    """
    # moto: the `local` extra, heavy and optional; imported on use, in the stack process only
    from moto.stepfunctions.parser.asl.component.state.exec.state_task.service.state_task_service_sfn import (
        StateTaskServiceSfn,
    )

    normalise = StateTaskServiceSfn._normalise_response

    def _normalise_response(self: Any, response: Any, *args: Any, **kwargs: Any) -> None:
        normalise(self, response, *args, **kwargs)
        if kwargs.get("service_action_name") == "describe_execution" and isinstance(response, dict):
            cased = pascal(response)
            response.clear()
            response.update(cased)

    StateTaskServiceSfn._normalise_response = _normalise_response  # type: ignore[method-assign]


UNKNOWN_CAUSE = "The cause could not be determined because Lambda did not return an error type. Returned payload: {payload}"


def install_unknown_lambda_error() -> None:
    """A Lambda failure whose payload names no error type fails the task as ``Lambda.Unknown``
    (as Step Functions reports unhandled errors such as timeouts and some out-of-memory kills);
    moto would call it ``Exception``."""
    # moto: the `local` extra, heavy and optional; imported on use, in the stack process only
    from moto.stepfunctions.parser.asl.component.state.exec.state_task import lambda_eval_utils
    from moto.stepfunctions.parser.asl.component.state.exec.state_task.service.state_task_service_lambda import (
        StateTaskServiceLambda,
    )

    from_error = StateTaskServiceLambda._from_error

    def _from_error(self: StateTaskServiceLambda, env: Environment, ex: Exception) -> FailureEvent:
        if isinstance(ex, lambda_eval_utils.LambdaFunctionErrorException):
            try:
                typed = "errorType" in json.loads(ex.payload)
            except (ValueError, TypeError):
                typed = False
            if not typed:
                named = lambda_eval_utils.LambdaFunctionErrorException(ex.function_error, json.dumps({"errorType": "Lambda.Unknown"}))
                event = from_error(self, env, named)
                details: Any = event.event_details  # moto's TypedDicts: the failure's details are set above
                details["taskFailedEventDetails"]["cause"] = UNKNOWN_CAUSE.format(payload=ex.payload)
                return event
        return from_error(self, env, ex)

    StateTaskServiceLambda._from_error = _from_error  # type: ignore[method-assign]


HISTORY_LIMIT_CAUSE = "The execution reached the maximum number of history events ({limit})."


def install_history_limit(limit: int) -> None:
    """Fail an execution as Step Functions does when its history would pass ``limit`` events: the
    limit-th event is ExecutionFailed (States.Runtime), nothing is recorded after it, and no Catch
    sees it. moto records events without bound."""
    # moto: the `local` extra, heavy and optional; imported on use, in the stack process only
    from moto.stepfunctions.parser.api import ExecutionFailedEventDetails, HistoryEventType
    from moto.stepfunctions.parser.asl.eval.environment import Environment
    from moto.stepfunctions.parser.asl.eval.event.event_manager import EventManager

    init = Environment.__init__
    add_event = EventManager.add_event

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        # frames replace their manager by their parent's, so the manager keeps the root's env
        self.event_manager.stagecoach_root = self

    def _add_event(self: Any, context: Any, event_type: Any, *args: Any, **kwargs: Any) -> int:
        if getattr(self, "stagecoach_full", False):
            return limit
        if len(self._history_event_list) < limit - 1:
            return add_event(self, context, event_type, *args, **kwargs)
        self.stagecoach_full = True
        details = ExecutionFailedEventDetails(error="States.Runtime", cause=HISTORY_LIMIT_CAUSE.format(limit=limit))
        failed: Any = {"executionFailedEventDetails": details}  # an EventDetails TypedDict with one key set
        event_id = add_event(self, context, HistoryEventType.ExecutionFailed, failed)
        self.stagecoach_root.set_error(details)
        return event_id

    Environment.__init__ = __init__  # type: ignore[method-assign]
    EventManager.add_event = _add_event  # type: ignore[method-assign]


def install_input_limit(limit: int) -> None:
    """StartExecution refuses an input over ``limit`` bytes, as the API's length constraint does."""
    # moto: the `local` extra, heavy and optional; imported on use, in the stack process only
    from moto.stepfunctions.exceptions import ValidationException
    from moto.stepfunctions.models import StepFunctionBackend
    from moto.stepfunctions.parser.models import StepFunctionsParserBackend

    for cls in (StepFunctionBackend, StepFunctionsParserBackend):
        start = cls.start_execution

        def start_execution(
            self: Any, state_machine_arn: str, name: Any = None, execution_input: Any = None, *a: Any, _start: Any = start, **kw: Any
        ) -> Any:
            if execution_input is not None and len(str(execution_input).encode()) > limit:
                raise ValidationException(
                    f"1 validation error detected: Value at 'input' failed to satisfy constraint: Member must have length less than or equal to {limit}"
                )
            return _start(self, state_machine_arn, name, execution_input, *a, **kw)

        cls.start_execution = start_execution  # type: ignore[method-assign]


def install_moto_fixes(runtime: LocalLambdaRuntime, fidelity: Fidelity, log_path: str | None = None) -> None:
    install_lambda_hook(runtime)
    install_jsonpath_cache()
    install_client_cache()
    install_error_lookup_cache()
    install_execution_snapshot_fix()
    install_sfn_integration_fix()
    if fidelity.sync_casing:
        install_sync_casing()
    install_unknown_lambda_error()
    install_history_limit(fidelity.history_limit)
    install_input_limit(fidelity.input_limit)
    install_express(fidelity, log_path)  # EXPRESS state machines, StartSyncExecution (local/express.py)


LISTEN_BACKLOG = 4096


def serve(port: int, fidelity: Fidelity) -> None:
    """moto's server (as its ThreadedMotoServer runs it) behind the stack roles' access control."""
    # moto and its werkzeug are the `local` extra, heavy and optional: imported on use
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import make_server

    app = AccessControl(
        DomainDispatcherApplication(create_backend_app),
        enforce=fidelity.enforce_iam,
        role_propagation_s=fidelity.role_propagation_s,
        **moto_lookups(),
    )
    server = make_server("127.0.0.1", port, app, threaded=True)
    # werkzeug listens with a backlog of 128: a few hundred workers, each with several S3 connections
    # in flight, overflowed it (the kernel's ListenOverflows counted 29,656 dropped SYNs in a 2 x 128
    # job) and each dropped connection waited out TCP's SYN retransmissions (after 1 s, then 2, 4 ... s), holding
    # tasks for minutes; a second listen() raises the backlog (capped by net.core.somaxconn)
    server.socket.listen(LISTEN_BACKLOG)
    threading.Thread(target=server.serve_forever, daemon=True).start()


def main() -> None:
    port = (int(sys.argv[1]) if len(sys.argv) > 1 else 0) or free_port()
    log_path = sys.argv[2] if len(sys.argv) > 2 else None
    # The Step Functions interpreter calls Lambda and Step Functions at localhost:MOTO_PORT.
    os.environ["MOTO_PORT"] = str(port)
    # moto: the `local` extra, heavy and optional; imported on use, in the stack process only
    from moto.core.config import default_user_config

    default_user_config["stepfunctions"] = {"execute_state_machine": True}
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no access log line per S3 request

    fidelity = Fidelity.from_env()
    runtime = LocalLambdaRuntime(f"http://127.0.0.1:{port}", log_path=log_path, faults=FaultInjector.from_env(), fidelity=fidelity)
    install_moto_fixes(runtime, fidelity, log_path)
    serve(port, fidelity)
    state_dir = os.environ.get(STATE_ENV)
    archive = StackArchive(state_dir, f"http://127.0.0.1:{port}") if state_dir else None
    restored = archive.restore() if archive else False
    saving = archive.save_periodically() if archive else None
    print(f"READY {port}" + (" restored" if restored else ""), flush=True)
    try:
        sys.stdin.read()  # until the parent closes the pipe (or dies)
    finally:
        if archive and saving:
            saving.set()
            archive.save_final(stop_workers=runtime.shutdown)
        else:
            runtime.shutdown()
        os._exit(0)


if __name__ == "__main__":
    main()
