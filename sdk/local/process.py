"""The embedded stack's server process, owned by this process or by a `stagecoach local` daemon.

Either way a backend needs the same few things of it: its endpoint, clients for it, whether it is
still alive, and where its logs are. :class:`OwnedStack` starts the server (``stagecoach.local.stack``)
and stops it when this process exits; :class:`AttachedStack` is one a daemon owns and this process
only uses.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import tempfile
from abc import ABC, abstractmethod
from typing import IO, Any

import boto3
from botocore.config import Config

from stagecoach.core.netem import ENV as NETWORK_ENV
from stagecoach.core.netem import NetworkSpec
from stagecoach.deploy.resources import BotoClient
from stagecoach.local.fidelity import ENV as FIDELITY_ENV
from stagecoach.local.fidelity import Fidelity
from stagecoach.local.persist import ENV as STATE_ENV

REGION = "us-east-1"
ACCOUNT = "123456789012"  # moto's account: AWS's documentation example, never a real one


class StackProcess(ABC):
    endpoint_url: str
    log_dir: str

    @property
    def log_path(self) -> str:
        """The workers' log (every local Lambda invocation's output)."""
        return os.path.join(self.log_dir, "workers.log")

    def client(self, service: str, read_timeout: int = 60) -> BotoClient:
        return boto3.client(
            service,
            endpoint_url=self.endpoint_url,
            region_name=REGION,
            aws_access_key_id="local",
            aws_secret_access_key="local",
            config=Config(retries={"mode": "standard", "max_attempts": 5}, max_pool_connections=20, read_timeout=read_timeout),
        )

    @abstractmethod
    def alive(self) -> bool: ...

    @abstractmethod
    def close(self) -> None: ...


class OwnedStack(StackProcess):
    """A moto server process with the Step Functions interpreter and the local Lambda runtime."""

    def __init__(
        self,
        log_dir: str | None = None,
        faults: dict[str, Any] | None = None,
        network: NetworkSpec | None = None,
        fidelity: Fidelity | None = None,
        state_dir: str | None = None,
    ) -> None:
        """``state_dir``: the stack saves its objects and records there and restores them when it
        starts (stagecoach.local.persist; the daemon's stack); ``restored`` says whether it did."""
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="stagecoach-local-")
        env = dict(os.environ)
        env.pop(STATE_ENV, None)
        # saving on shutdown takes longer than stopping: give it that long before killing the stack
        self.close_timeout = 20.0 if state_dir is None else 100.0
        if state_dir is not None:
            env[STATE_ENV] = state_dir
        if fidelity is not None:
            env[FIDELITY_ENV] = fidelity.to_env()
        if faults:
            env["STAGECOACH_FAULTS"] = json.dumps(faults)
        if network:
            env[NETWORK_ENV] = network.to_env()  # the workers inherit it (runtime._env)
        self._server_log = open(os.path.join(self.log_dir, "server.log"), "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "stagecoach.local.stack", "0", self.log_path],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._server_log,
            env=env,
        )
        out: IO[bytes] | None = self.proc.stdout
        line = out.readline().decode() if out else ""
        if not line.startswith("READY"):
            self.close()
            raise RuntimeError(f"the local stack did not start; see {self.log_dir}/server.log")
        self.port = int(line.split()[1])
        self.restored = "restored" in line.split()[2:]
        self.endpoint_url = f"http://127.0.0.1:{self.port}"
        atexit.register(self.close)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                if self.proc.stdin:
                    self.proc.stdin.close()  # the server exits when its stdin closes
                self.proc.wait(timeout=self.close_timeout)
            except Exception:
                self.proc.kill()
