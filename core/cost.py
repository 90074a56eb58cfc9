"""What AWS bills for a job's work, by its list prices: the one place the billing arithmetic lives.

Both the engine (the iteration gate's cost cap, lambdas/gate.py) and the SDK (``Run.cost()``,
sdk/cost.py) price a task's metrics with these functions, so the cap and the report cannot
disagree about what a task cost. The prices are the planner's (planner/model/platforms.py
``Platform``: us-east-1 list prices as of ``PRICES_AS_OF``), so predicted and measured costs use
the same numbers. Billing rules, as AWS publishes them:

- Lambda (https://aws.amazon.com/lambda/pricing/): each invocation is one request ($0.20 per
  million) plus its duration, rounded up to the nearest millisecond with no minimum (since
  December 2020: https://aws.amazon.com/blogs/aws/new-for-aws-lambda-1ms-billing-granularity-adds-cost-savings/),
  times the configured memory in GB, where GB = MB / 1024 (Lambda's "MB" are MiB: a 1,024 MB
  function is billed as 1 GB), at $0.0000166667 per GB-second on x86_64 ($0.0000133334 on arm64).
  A task's ``duration_s`` is measured inside the handler, so it misses the runtime's own few
  milliseconds around it: the measured figure is a slight underestimate of the billed one.
- Step Functions Standard (https://aws.amazon.com/step-functions/pricing/): $0.025 per 1,000 state
  transitions; every state entered is one, and so is every retry of a state.
- S3 (https://aws.amazon.com/s3/pricing/, S3 Standard): $0.005 per 1,000 PUT, COPY, POST and LIST
  requests, $0.0004 per 1,000 GET (and HEAD); DELETE requests are free. Storage and transfer
  within the region are not charged per request and are left out (a job's objects are transient;
  see docs/cost.md).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import Any

from stagecoach.core.records import TaskMetrics, WatcherUsage

# The phases a cost is broken down into: the three of an iteration, the iteration gate (which
# checks for a stop request and the cost cap before each iteration, lambdas/gate.py) and the
# launch (the client's uploads before the job starts).
COST_PHASES = ("forward", "backward", "sync", "gate", "launch")


@dataclass(frozen=True)
class Prices:
    """USD per unit, from the planner's platform (``Prices.of(platform)``)."""

    gb_s: float
    request: float
    transition: float
    put: float
    get: float
    as_of: str = ""
    # Step Functions Express (windows run as EXPRESS: planner/emit/workflow.py): per request, per GB-s
    express_request: float = 1.00 / 1e6
    express_gb_s: float = 0.00001667

    @classmethod
    def of(cls, platform: Any) -> Prices:
        """The prices of a planner ``Platform`` (duck-typed: lambdas never needs the planner's model)."""
        return cls(
            gb_s=platform.price_gb_s,
            request=platform.price_request,
            transition=platform.price_transition,
            put=platform.price_put,
            get=platform.price_get,
            as_of=platform.prices_as_of,
            express_request=getattr(platform, "price_express_request", cls.express_request),
            express_gb_s=getattr(platform, "price_express_gb_s", cls.express_gb_s),
        )


def billed_ms(duration_s: float) -> int:
    """Lambda's billed duration: rounded up to the millisecond (a float's noise below 1 ns is not
    a millisecond more)."""
    return max(0, math.ceil(round(duration_s * 1000.0, 6)))


def gb_seconds(duration_s: float, memory_mb: int) -> float:
    """GB-seconds of one invocation: billed milliseconds x memory in GB (MB / 1024)."""
    return billed_ms(duration_s) / 1000.0 * (memory_mb / 1024.0)


@dataclass(frozen=True)
class Usage:
    """Billable quantities of some part of a job, and nothing else: priced by ``usd``."""

    gb_s: float = 0.0
    invocations: int = 0
    transitions: int = 0
    puts: int = 0  # PUT, COPY, POST and LIST requests (S3's first price class)
    gets: int = 0  # GET and HEAD
    express_requests: int = 0  # Express executions started (windows run as EXPRESS)
    express_gb_s: float = 0.0  # their billed duration x billed memory (GB = 1,024 MB)

    def __add__(self, other: Usage) -> Usage:
        return Usage(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    def usd(self, prices: Prices) -> float:
        return (
            self.gb_s * prices.gb_s
            + self.invocations * prices.request
            + self.transitions * prices.transition
            + self.puts * prices.put
            + self.gets * prices.get
            + self.express_requests * prices.express_request
            + self.express_gb_s * prices.express_gb_s
        )


def task_usage(m: TaskMetrics) -> Usage:
    """One task: its invocation, its billed GB-seconds and its S3 requests, plus the PUT of its own
    metrics object (written after the channel's counters are read)."""
    return Usage(gb_s=gb_seconds(m.duration_s, m.memory_mb), invocations=1, puts=m.puts + 1, gets=m.gets)


def watcher_usage(w: WatcherUsage) -> Usage:
    """One phase watcher's invocation (lambdas/watcher.py) as it recorded itself. Its re-runs are
    task invocations, counted by their own metrics: a task that ran twice and wrote its metrics
    twice counts once, as a killed or timed-out invocation is not counted (docs/cost.md)."""
    return Usage(gb_s=gb_seconds(w.duration_s, w.memory_mb), invocations=1, puts=w.puts, gets=w.gets)


# Step Functions Express (https://aws.amazon.com/step-functions/pricing/): each execution is one
# request, and its duration is billed rounded up to the next 100 ms, at its memory rounded up to
# the next 64 MB (docs/cost.md "Express windows")
EXPRESS_STEP_S = 0.1
EXPRESS_MEMORY_STEP_MB = 64


def express_billed_s(duration_s: float) -> float:
    """An Express execution's billed duration: rounded up to 100 ms (noise below 1 us is not 100 ms more)."""
    return math.ceil(round(duration_s * 10, 6)) / 10  # in steps of EXPRESS_STEP_S


def express_gb_s(duration_s: float, memory_mb: int) -> float:
    """GB-seconds of an Express execution of ``duration_s`` at ``memory_mb``, both in billed steps.
    The gate's cost cap and the predicted cost (sdk/cost.py) price Express windows with it."""
    mb = EXPRESS_MEMORY_STEP_MB * math.ceil(memory_mb / EXPRESS_MEMORY_STEP_MB)
    return express_billed_s(duration_s) * mb / 1024.0


def usage_by_phase(metrics: Iterable[TaskMetrics]) -> dict[str, Usage]:
    """Per phase ("forward", "backward", "sync"), the tasks' summed usage (no transitions: those
    come from the state machines, sdk/cost.py)."""
    out: dict[str, Usage] = {}
    for m in metrics:
        out[m.phase] = out.get(m.phase, Usage()) + task_usage(m)
    return out
