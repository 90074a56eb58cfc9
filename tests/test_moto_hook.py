"""Guards: the moto internals the local stack hooks must be exactly where and what we expect.

If any of these fail after a moto upgrade, the local stack would silently stop executing Lambda
code (or break executions): re-check stagecoach/local/stack.py against the new moto before pinning it.
"""

import inspect
import sys

import moto

from stagecoach.local.stack import MOTO_VERSION


def test_moto_is_the_pinned_version():
    assert moto.__version__ == MOTO_VERSION


def test_lambda_invocation_hook_is_where_we_patch_it():
    from moto.awslambda.models import LambdaFunction

    sig = inspect.signature(LambdaFunction._invoke_lambda)
    assert list(sig.parameters) == ["self", "event"]
    # invoke() must route through _invoke_lambda and consume (payload, errored, logs)
    src = inspect.getsource(LambdaFunction.invoke)
    assert "res, errored, logs = self._invoke_lambda(event=body)" in src
    assert 'response_headers["x-amz-function-error"] = "Handled"' in src
    # the attributes the runtime reads off a function
    init = inspect.getsource(LambdaFunction.__init__)
    for attr in ("self.memory_size", "self.timeout", "self.environment_vars", "self.image_config", "self.handler"):
        assert attr in init, attr


def test_execution_snapshot_deepcopies_the_state_machine():
    from moto.stepfunctions.parser.models import StepFunctionsParserBackend

    src = inspect.getsource(StepFunctionsParserBackend.start_execution)
    assert "copy.deepcopy(state_machine)" in src


def test_sfn_integration_still_passes_asl_names_to_boto():
    from moto.stepfunctions.parser.asl.component.state.exec.state_task.service import state_task_service as sts
    from moto.stepfunctions.parser.asl.component.state.exec.state_task.service.state_task_service_sfn import (
        StateTaskServiceSfn,
    )

    assert "pass" in inspect.getsource(sts.StateTaskService._normalise_parameters)
    assert 'submission_output["ExecutionArn"]' in inspect.getsource(StateTaskServiceSfn._build_sync2_resolver)
    assert "env.stack.append(response)" in inspect.getsource(StateTaskServiceSfn._eval_service_task)


def test_jsonpath_parse_is_a_module_global_we_can_cache():
    from moto.stepfunctions.parser.asl.component.common.path import result_path
    from moto.stepfunctions.parser.asl.utils import json_path

    assert "parse(path)" in inspect.getsource(json_path.extract_json)
    assert callable(result_path.parse)


def test_the_interpreter_s_lambda_tasks_share_one_client_once_cached(monkeypatch):
    """moto builds a client per Task in ``boto_client_for``, which ignores the Task's credentials;
    after install_client_cache every module that calls it gets one shared client per service."""
    import moto.stepfunctions.parser.asl.component.state.exec.state_task.lambda_eval_utils as lambda_utils
    from moto.stepfunctions.parser.asl.utils import boto_client

    from stagecoach.local.stack import install_client_cache

    src = inspect.getsource(boto_client.boto_client_for)
    assert "state_credentials" in src and src.count("state_credentials") == 1  # a parameter, never read
    monkeypatch.setenv("MOTO_PORT", "5999")
    for name, module in list(sys.modules.items()):  # put back after the test: it patches them all
        if name.startswith("moto.stepfunctions") and hasattr(module, "boto_client_for"):
            monkeypatch.setattr(module, "boto_client_for", module.boto_client_for)
    install_client_cache()
    first = lambda_utils.boto_client_for(region="us-east-1", service="lambda", state_credentials=None)
    assert lambda_utils.boto_client_for(region="us-east-1", service="lambda", state_credentials=object()) is first
    assert first.meta.endpoint_url == "http://localhost:5999"


def test_moto_s_error_tables_are_built_once_per_service(monkeypatch):
    from moto.core import errors

    from stagecoach.local.stack import install_error_lookup_cache

    monkeypatch.setattr(errors.ErrorLookupFactory, "__init__", errors.ErrorLookupFactory.__init__)
    assert "ErrorLookupFactory().for_service" in inspect.getsource(errors.get_error_model)
    install_error_lookup_cache()
    import botocore.session

    model = botocore.session.get_session().get_service_model("s3")
    assert errors.ErrorLookupFactory().for_service(model) is errors.ErrorLookupFactory().for_service(model)


def test_the_stack_routes_invocations_into_the_local_runtime(backend):
    """End to end: a function invoked through moto's Lambda API runs in a local worker process."""
    import json

    from helpers import create_function

    fn = create_function(backend, "hog.handler")
    out = backend.clients.lambda_.invoke(FunctionName=fn, Payload=json.dumps({}))
    body = json.loads(out["Payload"].read())
    assert body["calls"] == 1 and body["pid"] > 0
