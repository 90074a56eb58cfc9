"""The one place a backend is chosen: ``local`` (the embedded stack, the default) or ``aws`` (a SAM stack)."""

from __future__ import annotations

import os
from typing import Any, TypedDict

from stagecoach.aws.backend import AwsBackend
from stagecoach.aws.stack import StackError
from stagecoach.backend import Backend
from stagecoach.core.netem import NetworkSpec
from stagecoach.local.backend import LocalBackend
from stagecoach.planner.model.platforms import Platform


class LocalStackOptions(TypedDict, total=False):
    """What starts a local stack of its own (``get_backend``'s ``network`` and ``faults``)."""

    network: NetworkSpec | Platform | None
    faults: dict[str, Any] | None


class Where(LocalStackOptions, total=False):
    """``get_backend``'s keywords, as the functions that choose the backend themselves take them
    (stagecoach.attach, resume, list_jobs)."""

    stack: str | None
    region: str | None


def get_backend(
    backend: Backend | str | None = None,
    *,
    stack: str | None = None,
    region: str | None = None,
    network: NetworkSpec | Platform | None = None,
    faults: dict[str, Any] | None = None,
) -> Backend:
    """A backend from an instance (returned as is) or a name.

    ``None``: ``aws`` if ``stack`` (or STAGECOACH_STACK) is given, else ``local``. ``"aws"`` needs
    the stack's name; ``"aws:NAME"`` carries it. ``network`` and ``faults`` start a local stack of
    its own that emulates Lambda's network (a NetworkSpec or a planner Platform) or injects faults.
    """
    if isinstance(backend, Backend):
        return backend
    if backend is not None and not isinstance(backend, str):
        raise TypeError(f"backend={backend!r}: give 'local', 'aws', 'aws:STACK' or a stagecoach.backend.Backend")
    stack = stack or (backend.split(":", 1)[1] if backend and backend.startswith("aws:") else None)
    name = backend.split(":", 1)[0] if backend else ("aws" if stack or os.environ.get("STAGECOACH_STACK") else "local")
    if name == "local":
        return LocalBackend(faults=faults, network=network)
    if name == "aws":
        if network is not None or faults:
            raise StackError("network emulation and fault injection exist only on the local backend; on AWS both are real")
        stack = stack or os.environ.get("STAGECOACH_STACK")
        if not stack:
            raise StackError("the aws backend needs the stack's name: --stack NAME (or STAGECOACH_STACK), or backend='aws:NAME'")
        return AwsBackend(stack, region)
    raise StackError(f"unknown backend {backend!r}: use 'local', 'aws:STACK_NAME', or an instance such as AwsBackend('STACK_NAME', region)")
