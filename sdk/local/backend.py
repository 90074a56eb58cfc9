"""The local backend: the embedded stack (moto + the local Lambda runtime) provisioned like SAM would.

Provisioning creates what template.yaml creates on AWS — the bucket (encrypted), the worker and
state-machine roles, the job state machine — so the job deployment code that follows is the same
as on AWS.
"""

from __future__ import annotations

import json
import threading
from typing import Any

from stagecoach.backend import Backend
from stagecoach.core.netem import NetworkSpec
from stagecoach.deploy.resources import BotoClient, Clients, StackResources
from stagecoach.deploy.roles import control_policy, job_boundary_policy, role_path
from stagecoach.deploy.start import create_stage_function
from stagecoach.local.daemon_state import running_stack
from stagecoach.local.fidelity import Fidelity
from stagecoach.local.process import ACCOUNT, REGION, OwnedStack, StackProcess
from stagecoach.planner.emit import asl
from stagecoach.planner.model.platforms import Platform

PREFIX = "stagecoach"
BUCKET = "stagecoach-local"
IMAGE = f"{ACCOUNT}.dkr.ecr.{REGION}.amazonaws.com/stagecoach-worker:local"
JOB_STATE_MACHINE = f"arn:aws:states:{REGION}:{ACCOUNT}:stateMachine:{PREFIX}-job"

ROLE_PATH = role_path(PREFIX)
LOG_GROUP = f"/aws/lambda/{PREFIX}-workers"
LOG_GROUP_ARN = f"arn:aws:logs:{REGION}:{ACCOUNT}:log-group:{LOG_GROUP}:*"
BUCKET_ARN = f"arn:aws:s3:::{BUCKET}"

# `stagecoach console`'s default port (sdk/cli/console.py), named in the links runs print
CONSOLE_PORT = 8765


def _trust(service: str) -> str:
    return json.dumps(
        {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Principal": {"Service": service}, "Action": "sts:AssumeRole"}]}
    )


class LocalBackend(Backend):
    """Runs jobs on the embedded stack; one stack per process, started on first use (or the one this
    project's daemon keeps: `stagecoach local start`, or the CLI's on-demand start)."""

    name = "local"
    _lock = threading.Lock()
    _shared: StackProcess | None = None

    def __init__(
        self,
        faults: dict[str, Any] | None = None,
        network: NetworkSpec | Platform | None = None,
        fidelity: Fidelity | None = None,
        state_dir: str | None = None,
        log_dir: str | None = None,
    ) -> None:
        """``faults``: seeded fault injection (see stagecoach.local.faults) on a stack of its own.
        ``network``: emulate Lambda's network in every worker (core/netem.py), on a stack of its
        own: a NetworkSpec, or a planner Platform whose bandwidth and storage latency to use.
        ``fidelity``: how the stack answers where AWS is stricter than moto (local/fidelity.py);
        the default is AWS's behaviour, and any other setting gets a stack of its own.
        ``state_dir`` (the daemon's): a stack of its own that keeps its objects and records there
        across restarts (local/persist.py), provisioned only the first time; ``log_dir``: its logs."""
        if isinstance(network, Platform):
            network = network_of(network)
        self.fidelity = fidelity or Fidelity()
        provision = True
        if faults or network or state_dir or (fidelity is not None and fidelity != Fidelity()):
            own = OwnedStack(log_dir=log_dir, faults=faults, network=network, fidelity=fidelity, state_dir=state_dir)
            provision = not own.restored  # a restored stack has what provisioning created
            self.stack: StackProcess = own
        else:
            with LocalBackend._lock:
                shared = LocalBackend._shared
                if shared is None or not shared.alive():
                    # this project's daemon's stack (already provisioned), running or started on
                    # demand (daemon_state.wants_daemon): attach to it; else a stack of our own
                    shared = running_stack() or OwnedStack()
                    provision = isinstance(shared, OwnedStack)
                    LocalBackend._shared = shared
                else:
                    provision = False
                self.stack = shared
        self.clients = Clients(
            s3=self.stack.client("s3"),
            lambda_=self.stack.client("lambda"),
            sfn=self.stack.client("stepfunctions"),
            iam=self.stack.client("iam"),
        )
        self.resources = StackResources(
            prefix=PREFIX,
            region=REGION,
            bucket=BUCKET,
            image_uri=IMAGE,
            control_role_arn=f"arn:aws:iam::{ACCOUNT}:role{ROLE_PATH}{PREFIX}-control",
            states_role_arn=f"arn:aws:iam::{ACCOUNT}:role{ROLE_PATH}{PREFIX}-states",
            job_state_machine_arn=JOB_STATE_MACHINE,
            control_function=f"{PREFIX}-worker",
            job_boundary_arn=f"arn:aws:iam::{ACCOUNT}:policy{ROLE_PATH}{PREFIX}-job-boundary",
            log_group_arn=LOG_GROUP_ARN,
            # the local console's page for the job (`stagecoach console`, sdk/console/), not the
            # stack's endpoint (which answers S3's ListAllMyBuckets XML to a browser)
            console=f"`stagecoach console`, then http://127.0.0.1:{CONSOLE_PORT}/#job={{job}}",
        )
        if provision:
            self._provision()

    def _provision(self) -> None:
        """What template.yaml provisions on AWS, created on the embedded stack: the roles carry the
        same policies (deploy/roles.py), which the local stack enforces on the workers' calls."""
        iam = self.clients.iam
        control = control_policy(BUCKET_ARN, LOG_GROUP_ARN, PREFIX, "aws", REGION, ACCOUNT)
        iam.create_role(RoleName=f"{PREFIX}-control", Path=ROLE_PATH, AssumeRolePolicyDocument=_trust("lambda.amazonaws.com"))
        iam.put_role_policy(RoleName=f"{PREFIX}-control", PolicyName="control", PolicyDocument=json.dumps(control))
        # the window and job state machines' roles: the Step Functions interpreter's own calls are
        # not checked locally (docs/local-stack.md), so they carry no policy here
        iam.create_role(RoleName=f"{PREFIX}-states", Path=ROLE_PATH, AssumeRolePolicyDocument=_trust("states.amazonaws.com"))
        iam.create_policy(
            PolicyName=f"{PREFIX}-job-boundary",
            Path=ROLE_PATH,
            PolicyDocument=json.dumps(job_boundary_policy(BUCKET_ARN, LOG_GROUP_ARN, PREFIX)),
        )
        s3 = self.clients.s3
        s3.create_bucket(Bucket=BUCKET)
        s3.put_bucket_encryption(
            Bucket=BUCKET,
            ServerSideEncryptionConfiguration={"Rules": [{"ApplyServerSideEncryptionByDefault": {"SSEAlgorithm": "AES256"}}]},
        )
        # template.yaml's DefaultWorker: the image's function at 2048 MB, where remediation runs
        res = self.resources
        create_stage_function(res, self.clients, res.control_function, "stack", 2048, 900, res.control_role_arn)
        self.clients.sfn.create_state_machine(
            name=f"{PREFIX}-job", definition=json.dumps(asl.job_definition()), roleArn=res.states_role_arn
        )

    def job_commands(self, job_id: str, execution_arn: str) -> list[tuple[str, str]] | None:
        if isinstance(self.stack, OwnedStack):  # inside this process: the job ends with it
            return None
        return [
            ("stop it at the next iteration boundary:", f"stagecoach stop {job_id}"),
            ("inspect it (status, phases, loss, cost):", f"stagecoach inspect {execution_arn}"),
            ("follow it from Python:", f"stagecoach.attach({job_id!r})"),
            ("continue it once stopped or failed:", f"stagecoach resume {job_id}"),
            ("remove it when done:", f"stagecoach cleanup {job_id}"),
        ]

    def available_concurrency(self) -> tuple[int | None, str]:
        """The emulated account's limit (moto implements no GetAccountSettings)."""
        return self.fidelity.account_concurrency, "the local stack's account (Fidelity.account_concurrency)"

    def long_call_client(self, service: str) -> BotoClient:
        return self.stack.client(service, read_timeout=905)


def network_of(platform: Platform) -> NetworkSpec:
    """The emulated network of a planner Platform: its per-worker bandwidth both ways, its latency."""
    return NetworkSpec(up_Bps=platform.bandwidth_Bps, down_Bps=platform.bandwidth_Bps, latency_s=platform.storage_latency_s)
