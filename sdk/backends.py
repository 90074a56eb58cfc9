"""Where jobs run: ``local`` (the embedded stack, the default) or ``aws`` (a deployed SAM stack)."""

from __future__ import annotations

from typing import Any, Protocol

from stagecoach.deploy import Clients, StackResources


class Backend(Protocol):
    name: str
    clients: Clients
    resources: StackResources

    def launch(self, job: Any, plan: Any) -> Any: ...


def get_backend(backend: Any = None) -> Any:
    """A backend instance from a name (``"local"``) or an instance (returned as is)."""
    if backend is None or backend == "local":
        from stagecoach.local.backend import LocalBackend

        return LocalBackend()
    if isinstance(backend, str) and backend.startswith("aws:"):
        from stagecoach.aws_backend import AwsBackend

        return AwsBackend(backend.split(":", 1)[1])
    if isinstance(backend, str):
        raise ValueError(
            f"unknown backend {backend!r}: use 'local', 'aws:STACK_NAME', or an instance such as "
            "stagecoach.aws_backend.AwsBackend('STACK_NAME', region)"
        )
    return backend
