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
    if isinstance(backend, str):
        raise ValueError(f"unknown backend {backend!r}: use 'local' (the AWS backend arrives with the deploy issue)")
    return backend
