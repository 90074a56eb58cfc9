"""The AWS backend: jobs run on a stack deployed from template.yaml (``sam build && sam deploy``).

The stack is found by its CloudFormation outputs; per job, the same code as the local backend
(stagecoach.deploy) uploads the job and creates the per-stage functions and the window state
machine, here through clients that make those creations idempotent (create, or update what
exists) and wait until an image function is Active (a Pending function rejects invocations).

Errors name what to do: a missing stack (and where it might be instead), a region mismatch, a
worker image built for another Python, and an AccessDenied that names the IAM action, the resource,
and the statement of the deployer policy (docs/deployer-policy.json) that grants it.
"""

from __future__ import annotations

from typing import Any

import boto3
from botocore.config import Config
from botocore.exceptions import ClientError

from stagecoach.aws.access import explain_access_denied
from stagecoach.aws.idempotent import IdempotentLambda, IdempotentStepFunctions
from stagecoach.aws.policy import deployer_policy
from stagecoach.aws.stack import RegionMismatch, StackError, _arn_account, _arn_part, _arn_region, python_version, stack_outputs
from stagecoach.backend import Backend
from stagecoach.deploy.resources import BotoClient, Clients, DeployError, StackResources

CONSOLE = "https://{region}.console.aws.amazon.com/states/home?region={region}#/v2/executions/details/{arn}"


class AwsBackend(Backend):
    """Runs jobs on a deployed Stagecoach stack, found by name through its CloudFormation outputs."""

    name = "aws"
    session: boto3.Session

    def __init__(self, stack: str, region: str | None = None, session: boto3.Session | None = None) -> None:
        if session is not None and region and session.region_name and session.region_name != region:
            raise RegionMismatch(f"the boto3 session is in {session.region_name} but region={region!r} was asked for")
        self.session = session or boto3.Session(region_name=region)
        self.region = region or self.session.region_name
        if not self.region:
            raise StackError("no AWS region: pass --region (or region=...), or set AWS_REGION / a profile's region")
        self.stack = stack
        cfn = self.session.client("cloudformation", region_name=self.region)
        explain_access_denied(cfn, stack, self.region, "*")
        self.outputs = stack_outputs(cfn, stack, self.region)
        self.account = _arn_account(self.outputs["ControlRoleArn"])
        self.partition = _arn_part(self.outputs["ControlRoleArn"], 1) or "aws"
        image_python = self.outputs.get("WorkerPython")
        if image_python and image_python != python_version():
            raise StackError(
                f"stack {stack!r}'s worker image runs Python {image_python} but this SDK runs Python {python_version()}: "
                "the job's model code travels as cloudpickle by value, which only loads on the same Python version. "
                f"Run the SDK with Python {image_python}, or rebuild the image for {python_version()} "
                "(template.yaml: DefaultWorker DockerBuildArgs PYTHON_VERSION and the WorkerPython output; then sam build && sam deploy)"
            )
        self.clients = Clients(
            s3=self._client("s3"), lambda_=self._client("lambda"), sfn=self._client("stepfunctions"), iam=self._client("iam")
        )
        self.resources = StackResources(
            prefix=stack,
            region=self.region,
            bucket=self.outputs["BucketName"],
            image_uri=self._image_uri(),
            control_role_arn=self.outputs["ControlRoleArn"],
            states_role_arn=self.outputs["StatesRoleArn"],
            job_state_machine_arn=self.outputs["JobStateMachineArn"],
            control_function=self.outputs["WorkerFunctionName"],
            job_boundary_arn=self.outputs["JobRoleBoundaryArn"],
            log_group_arn=f"arn:{self.partition}:logs:{self.region}:{self.account}:log-group:{self.outputs['WorkerLogGroupName']}:*",
            architecture=self.outputs.get("Architecture", "x86_64"),
            console=CONSOLE,
        )

    def available_concurrency(self) -> tuple[int | None, str]:
        """The account's unreserved concurrency in the stack's region (lambda:GetAccountSettings)."""
        try:
            limit = self.clients.lambda_.get_account_settings()["AccountLimit"]
        except ClientError as e:
            if e.response["Error"]["Code"] in ("AccessDenied", "AccessDeniedException"):
                raise DeployError(
                    "checking the account's Lambda concurrency before starting needs lambda:GetAccountSettings: grant "
                    "your identity the deployer policy (docs/deployer-policy.json, statement ListFunctionsAndStateMachines)"
                ) from None
            raise
        return int(limit["UnreservedConcurrentExecutions"]), f"account {self.account} in {self.region}"

    def job_commands(self, job_id: str, execution_arn: str) -> list[tuple[str, str]] | None:
        where = f"--stack {self.stack} --region {self.region}"
        return [
            ("stop it at the next iteration boundary:", f"stagecoach stop {job_id} {where}"),
            ("inspect it (status, phases, loss, cost):", f"stagecoach inspect {execution_arn}"),
            ("follow it from Python:", f"stagecoach.attach({job_id!r}, backend='aws:{self.stack}')"),
            ("continue it once stopped or failed:", f"stagecoach resume {job_id} {where}"),
            ("remove it when done:", f"stagecoach cleanup {job_id} {where}"),
        ]

    def long_call_client(self, service: str) -> BotoClient:
        """A client whose calls may wait up to Lambda's 15 minutes (a synchronous profile invocation)."""
        return self._client(service, read_timeout=905)

    def deployer_policy(self) -> dict[str, Any]:
        """The deployer policy rendered for this stack: its bucket, roles, region and account."""
        return deployer_policy(
            self.stack,
            self.region,
            self.account,
            self.partition,
            self.outputs["BucketName"],
            boundary=self.outputs["JobRoleBoundaryArn"],
        )

    def _client(self, service: str, read_timeout: int = 60) -> BotoClient:
        c = self.session.client(
            service,
            region_name=self.region,
            config=Config(retries={"mode": "standard", "max_attempts": 8}, max_pool_connections=20, read_timeout=read_timeout),
        )
        explain_access_denied(c, self.stack, self.region, self.account, policy=self.deployer_policy)
        return c

    def _image_uri(self) -> str:
        """WorkerImageUri if the stack outputs one; else the default worker's image (digest-pinned).

        CloudFormation cannot output a SAM-built image URI (AWS::Lambda::Function has no ImageUri
        attribute; ``sam deploy`` fills it in), so the template outputs the default worker's name.
        """
        if self.outputs.get("WorkerImageUri"):
            return self.outputs["WorkerImageUri"]
        code: dict[str, str] = self.clients.lambda_.get_function(FunctionName=self.outputs["WorkerFunctionName"])["Code"]
        return code.get("ResolvedImageUri") or code["ImageUri"]

    def check_arn(self, arn: str) -> None:
        """An ARN from another region or account cannot be read through this stack's clients."""
        region = _arn_region(arn)
        if region and region != self.region:
            raise RegionMismatch(f"{arn} is in {region} but stack {self.stack!r} is used in {self.region}: pass --region {region}")
        account = _arn_account(arn)
        if account and self.account and account != self.account:
            raise StackError(
                f"{arn} belongs to account {account}, but stack {self.stack!r} is in account {self.account}: "
                "use credentials of that account"
            )

    def deploy_clients(self) -> Clients:
        """Clients for deploy_and_start: idempotent creations, Active-waiting, the shared log group."""
        pending: list[str] = []
        return Clients(
            s3=self.clients.s3,
            lambda_=IdempotentLambda(self.clients.lambda_, log_group=self.outputs.get("WorkerLogGroupName"), pending=pending),
            sfn=IdempotentStepFunctions(self.clients.sfn, self.clients.lambda_, pending=pending),
            iam=self.clients.iam,
        )
