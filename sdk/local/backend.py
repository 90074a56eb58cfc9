"""The local backend: the embedded stack (moto + the local Lambda runtime) provisioned like SAM would.

Provisioning creates what template.yaml creates on AWS — the bucket (encrypted), the worker and
state-machine roles, the job state machine — so the job deployment code that follows is the same
as on AWS.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import tempfile
import threading
from typing import Any

import boto3
from botocore.config import Config

from stagecoach.deploy import Clients, StackResources
from stagecoach.lambdas.netem import ENV as NETWORK_ENV
from stagecoach.lambdas.netem import NetworkSpec
from stagecoach.planner import asl

REGION = "us-east-1"
ACCOUNT = "123456789012"
PREFIX = "stagecoach"
BUCKET = "stagecoach-local"
IMAGE = f"{ACCOUNT}.dkr.ecr.{REGION}.amazonaws.com/stagecoach-worker:local"

_TRUST = {
    "Version": "2012-10-17",
    "Statement": [{"Effect": "Allow", "Principal": {"Service": "{svc}"}, "Action": "sts:AssumeRole"}],
}


class LocalStack:
    """A moto server process with the Step Functions interpreter and the local Lambda runtime."""

    def __init__(self, log_dir: str | None = None, faults: dict[str, Any] | None = None, network: NetworkSpec | None = None) -> None:
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="stagecoach-local-")
        env = dict(os.environ)
        if faults:
            env["STAGECOACH_FAULTS"] = json.dumps(faults)
        if network:
            env[NETWORK_ENV] = network.to_env()  # the workers inherit it (runtime._env)
        self.log_path = os.path.join(self.log_dir, "workers.log")
        self._server_log = open(os.path.join(self.log_dir, "server.log"), "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "stagecoach.local.stack", "0", self.log_path],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._server_log,
            env=env,
        )
        line = self.proc.stdout.readline().decode()
        if not line.startswith("READY"):
            self.close()
            raise RuntimeError(f"the local stack did not start; see {self.log_dir}/server.log")
        self.port = int(line.split()[1])
        self.endpoint_url = f"http://127.0.0.1:{self.port}"
        atexit.register(self.close)

    def client(self, service: str, read_timeout: int = 60) -> Any:
        return boto3.client(
            service,
            endpoint_url=self.endpoint_url,
            region_name=REGION,
            aws_access_key_id="local",
            aws_secret_access_key="local",
            config=Config(retries={"mode": "standard", "max_attempts": 5}, max_pool_connections=20, read_timeout=read_timeout),
        )

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=20)
            except Exception:
                self.proc.kill()


class LocalBackend:
    """Runs jobs on the embedded stack; one stack per process, started on first use."""

    name = "local"
    _lock = threading.Lock()
    _stack: LocalStack | None = None

    def __init__(self, faults: dict[str, Any] | None = None, network: "NetworkSpec | Any | None" = None) -> None:
        """``faults``: seeded fault injection (see stagecoach.local.faults) on a stack of its own.
        ``network``: emulate Lambda's network in every worker (lambdas/netem.py), on a stack of its
        own: a NetworkSpec, or a planner Platform whose bandwidth and storage latency to use."""
        if network is not None and not isinstance(network, NetworkSpec):
            network = network_of(network)
        if faults or network:
            self.stack = LocalStack(faults=faults, network=network)
            self.clients = self._clients()
            self.resources = self._provision()
            return
        with LocalBackend._lock:
            if LocalBackend._stack is None or LocalBackend._stack.proc.poll() is not None:
                # a stack kept alive by `stagecoach local start` (already provisioned): attach to it
                from stagecoach.cli_local import running_stack

                attached = running_stack()
                if attached is not None:
                    LocalBackend._stack = self.stack = attached  # type: ignore[assignment]
                    self.clients = self._clients()
                    self.resources = self._resources(self._existing_job_sm())
                    return
                LocalBackend._stack = LocalStack()
                self.stack = LocalBackend._stack
                self.clients = self._clients()
                self.resources = self._provision()
            else:
                self.stack = LocalBackend._stack
                self.clients = self._clients()
                self.resources = self._resources(self._existing_job_sm())

    def _clients(self) -> Clients:
        return Clients(s3=self.stack.client("s3"), lambda_=self.stack.client("lambda"), sfn=self.stack.client("stepfunctions"))

    def _resources(self, job_sm: str) -> StackResources:
        return StackResources(
            prefix=PREFIX,
            region=REGION,
            bucket=BUCKET,
            image_uri=IMAGE,
            worker_role_arn=f"arn:aws:iam::{ACCOUNT}:role/{PREFIX}-worker",
            states_role_arn=f"arn:aws:iam::{ACCOUNT}:role/{PREFIX}-states",
            job_state_machine_arn=job_sm,
            console=self.stack.endpoint_url + " (local stack; execution {arn})",
        )

    def _existing_job_sm(self) -> str:
        return f"arn:aws:states:{REGION}:{ACCOUNT}:stateMachine:{PREFIX}-job"

    def _provision(self) -> StackResources:
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
        res = self._resources(self._existing_job_sm())
        self.clients.sfn.create_state_machine(
            name=f"{PREFIX}-job", definition=json.dumps(asl.job_definition()), roleArn=res.states_role_arn
        )
        return res

    def long_call_client(self, service: str) -> Any:
        """A client whose calls may wait up to Lambda's 15 minutes (a synchronous profile invocation)."""
        return self.stack.client(service, read_timeout=905)

    def launch(self, job: Any, plan: Any) -> Any:
        from stagecoach.deploy import deploy_and_start
        from stagecoach.run import Run

        job_id, arn = deploy_and_start(job, plan, self.resources, self.clients)
        return Run(self, job, plan, job_id, arn)


def network_of(platform: Any) -> NetworkSpec:
    """The emulated network of a planner Platform: its per-worker bandwidth both ways, its latency."""
    return NetworkSpec(up_Bps=platform.bandwidth_Bps, down_Bps=platform.bandwidth_Bps, latency_s=platform.storage_latency_s)
