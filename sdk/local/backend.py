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
from stagecoach.deploy.resources import Clients, StackResources
from stagecoach.deploy.start import create_stage_function
from stagecoach.lambdas.netem import NetworkSpec
from stagecoach.local.daemon_state import running_stack
from stagecoach.local.fidelity import Fidelity
from stagecoach.local.process import ACCOUNT, REGION, OwnedStack, StackProcess
from stagecoach.planner.emit import asl
from stagecoach.planner.model.platforms import Platform

PREFIX = "stagecoach"
BUCKET = "stagecoach-local"
IMAGE = f"{ACCOUNT}.dkr.ecr.{REGION}.amazonaws.com/stagecoach-worker:local"
JOB_STATE_MACHINE = f"arn:aws:states:{REGION}:{ACCOUNT}:stateMachine:{PREFIX}-job"

_TRUST = {
    "Version": "2012-10-17",
    "Statement": [{"Effect": "Allow", "Principal": {"Service": "{svc}"}, "Action": "sts:AssumeRole"}],
}


class LocalBackend(Backend):
    """Runs jobs on the embedded stack; one stack per process, started on first use (or the one a
    `stagecoach local start` daemon keeps, if it runs)."""

    name = "local"
    _lock = threading.Lock()
    _shared: StackProcess | None = None

    def __init__(
        self, faults: dict[str, Any] | None = None, network: NetworkSpec | Platform | None = None, fidelity: Fidelity | None = None
    ) -> None:
        """``faults``: seeded fault injection (see stagecoach.local.faults) on a stack of its own.
        ``network``: emulate Lambda's network in every worker (lambdas/netem.py), on a stack of its
        own: a NetworkSpec, or a planner Platform whose bandwidth and storage latency to use.
        ``fidelity``: how the stack answers where AWS is stricter than moto (local/fidelity.py);
        the default is AWS's behaviour, and any other setting gets a stack of its own."""
        if isinstance(network, Platform):
            network = network_of(network)
        self.fidelity = fidelity or Fidelity()
        provision = True
        if faults or network or (fidelity is not None and fidelity != Fidelity()):
            self.stack: StackProcess = OwnedStack(faults=faults, network=network, fidelity=fidelity)
        else:
            with LocalBackend._lock:
                shared = LocalBackend._shared
                if shared is None or not shared.alive():
                    # a stack kept alive by `stagecoach local start` (already provisioned): attach to it
                    shared = running_stack() or OwnedStack()
                    provision = isinstance(shared, OwnedStack)
                    LocalBackend._shared = shared
                else:
                    provision = False
                self.stack = shared
        self.clients = Clients(s3=self.stack.client("s3"), lambda_=self.stack.client("lambda"), sfn=self.stack.client("stepfunctions"))
        self.resources = StackResources(
            prefix=PREFIX,
            region=REGION,
            bucket=BUCKET,
            image_uri=IMAGE,
            worker_role_arn=f"arn:aws:iam::{ACCOUNT}:role/{PREFIX}-worker",
            states_role_arn=f"arn:aws:iam::{ACCOUNT}:role/{PREFIX}-states",
            job_state_machine_arn=JOB_STATE_MACHINE,
            control_function=f"{PREFIX}-worker",
            console=self.stack.endpoint_url + " (local stack; execution {arn})",
        )
        if provision:
            self._provision()

    def _provision(self) -> None:
        """What template.yaml provisions on AWS, created on the embedded stack."""
        iam = self.stack.client("iam")
        for role, svc in (("worker", "lambda.amazonaws.com"), ("states", "states.amazonaws.com")):
            trust = json.loads(json.dumps(_TRUST).replace("{svc}", svc))
            iam.create_role(RoleName=f"{PREFIX}-{role}", AssumeRolePolicyDocument=json.dumps(trust))
        s3 = self.clients.s3
        s3.create_bucket(Bucket=BUCKET)
        s3.put_bucket_encryption(
            Bucket=BUCKET,
            ServerSideEncryptionConfiguration={"Rules": [{"ApplyServerSideEncryptionByDefault": {"SSEAlgorithm": "AES256"}}]},
        )
        # template.yaml's DefaultWorker: the image's function at 2048 MB, where remediation runs
        create_stage_function(self.resources, self.clients, self.resources.control_function, "stack", 2048, 900)
        self.clients.sfn.create_state_machine(
            name=f"{PREFIX}-job", definition=json.dumps(asl.job_definition()), roleArn=self.resources.states_role_arn
        )

    def available_concurrency(self) -> tuple[int | None, str]:
        """The emulated account's limit (moto implements no GetAccountSettings)."""
        return self.fidelity.account_concurrency, "the local stack's account (Fidelity.account_concurrency)"

    def long_call_client(self, service: str) -> Any:
        return self.stack.client(service, read_timeout=905)


def network_of(platform: Platform) -> NetworkSpec:
    """The emulated network of a planner Platform: its per-worker bandwidth both ways, its latency."""
    return NetworkSpec(up_Bps=platform.bandwidth_Bps, down_Bps=platform.bandwidth_Bps, latency_s=platform.storage_latency_s)
