"""How faithfully the embedded stack answers as AWS does, where moto (or a local process) is kinder.

Every behaviour here is on by default: a job that completes locally must also complete on AWS. A
test may switch one off only to isolate what it tests, and says why. Each default cites what it
emulates (docs/local-stack.md has the table with sources):

- ``sync_casing``: the result and the failure Cause of a ``states:startExecution.sync``/``.sync:2``
  task carry DescribeExecution's fields in Step Functions' PascalCase (``ExecutionArn``,
  ``Status``, ``Error``, ``Cause``, ...); moto 5.2.1 leaves boto3's camelCase.
- ``error_shapes``: how an out-of-memory kill and a function timeout reach Step Functions. AWS has
  been seen reporting an out-of-memory kill as ``Runtime.OutOfMemory``, as ``Runtime.ExitError``
  (both with "signal: killed" in the Cause) and, per the Step Functions guide "Handle Lambda
  service exceptions", as ``Lambda.Unknown`` (no error type at all), which also covers timeouts
  (whose payload carries only "Task timed out after N seconds"). ``"seeded"`` draws one shape per
  invocation from ``error_seed``, so a run meets all of them; a shape's name forces that one.
- ``history_limit``: an execution that would record its 25,000th history event fails with
  ``States.Runtime`` instead (the Step Functions quota; moto records without bound).
- ``input_limit``: StartExecution refuses an input over 262,144 bytes with a ValidationException
  (the API's length constraint; moto accepts any size).
- ``enforce_iam``: the calls a local function makes are decided by its role's policies and
  permissions boundary (local/access.py); moto checks neither Resource nor Condition.
- ``role_propagation_s``: for this long after CreateRole, Lambda's CreateFunction refuses the role
  ("The role defined for the function cannot be assumed by Lambda."), as while IAM propagates it.
- ``idle_reclaim_s``: an execution environment idle this long is shut down (Lambda reclaims idle
  ones after minutes, and promises no time; the next invocation is a cold start).
- ``max_environments``: if set, at most this many execution environments (worker processes) exist
  at once on this machine; starting one more first shuts down the longest-idle ones (Lambda may
  reclaim an idle environment at any time). Off by default: an evicted warm worker restarts its
  window (correct, slower); ``default_max_environments()`` is what 60% of the machine's memory
  holds at ~300 MB each, for sessions that run several stacks at once.
- ``account_concurrency``: at most this many invocations run at once in the "account"; one more is
  throttled as Lambda throttles it (HTTP 429 TooManyRequestsException, Reason
  ConcurrentInvocationLimitExceeded). AWS's default quota is 1,000; new accounts may have 10.
- ``express_max_s``: an Express execution runs at most this long, then ends TIMED_OUT (Step
  Functions' Express limit, five minutes; local/express.py). A test may shorten it to reach it.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import asdict, dataclass, replace
from typing import Any

from stagecoach.planner.limits import EXECUTION_INPUT_MAX_BYTES, EXPRESS_MAX_DURATION_S, HISTORY_MAX_EVENTS, LAMBDA_ACCOUNT_CONCURRENCY

ENV = "STAGECOACH_FIDELITY"

OOM_SHAPES = ("Runtime.OutOfMemory", "Runtime.ExitError", "Lambda.Unknown")
TIMEOUT_SHAPES = ("Sandbox.Timedout", "Lambda.Unknown")
HISTORY_LIMIT = HISTORY_MAX_EVENTS
INPUT_LIMIT = EXECUTION_INPUT_MAX_BYTES
ACCOUNT_CONCURRENCY = LAMBDA_ACCOUNT_CONCURRENCY
EXPRESS_MAX_S = float(EXPRESS_MAX_DURATION_S)


ENVIRONMENT_BYTES = 300 * 2**20  # a worker process's resident set, torch imported (measured: 270-290 MB)


def default_max_environments() -> int:
    """Worker processes that fit in 60% of this machine's memory (at least 16)."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 64
    return max(16, int(0.6 * total // ENVIRONMENT_BYTES))


@dataclass(frozen=True)
class Fidelity:
    sync_casing: bool = True
    error_shapes: str = "seeded"
    error_seed: int = 0
    history_limit: int = HISTORY_LIMIT
    input_limit: int = INPUT_LIMIT
    account_concurrency: int = ACCOUNT_CONCURRENCY
    enforce_iam: bool = True
    role_propagation_s: float = 1.0
    idle_reclaim_s: float = 120.0
    max_environments: int = 0  # 0: no cap; default_max_environments() gives what this machine's memory holds
    express_max_s: float = EXPRESS_MAX_S

    def __post_init__(self) -> None:
        allowed = ("seeded", *OOM_SHAPES, *TIMEOUT_SHAPES)
        if self.error_shapes not in allowed:
            raise ValueError(f"error_shapes must be one of {sorted(set(allowed))}, got {self.error_shapes!r}")
        for name in ("history_limit", "input_limit", "account_concurrency", "idle_reclaim_s", "express_max_s"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    def environments_cap(self) -> int:
        return self.max_environments or 1 << 30

    def to_env(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> Fidelity:
        raw = (environ if environ is not None else os.environ).get(ENV)
        return cls(**json.loads(raw)) if raw else cls()

    def with_(self, **changes: Any) -> Fidelity:
        return replace(self, **changes)


class ErrorShapes:
    """Draws, per failed invocation, the shape AWS reports it in (thread-safe enough: one draw each)."""

    def __init__(self, fidelity: Fidelity) -> None:
        self.setting = fidelity.error_shapes
        self._rng = random.Random(fidelity.error_seed)

    def _draw(self, shapes: tuple[str, ...]) -> str:
        if self.setting == "seeded":
            return self._rng.choice(shapes)
        return self.setting if self.setting in shapes else shapes[0]

    def out_of_memory(self) -> str:
        return self._draw(OOM_SHAPES)

    def timeout(self) -> str:
        return self._draw(TIMEOUT_SHAPES)
