"""A replica policy's decisions (planner/segments.py ReplicaPolicy; docs/runtime.md "Dynamic
workers"): the record the gate keeps in the job's prefix (lambdas/policy.py), and the job's spec
with them. The spec in ``jobs/{job}/job.json`` stays as deployed (the job's role may not write
it); every reader that takes iteration t's plan reads it with the decisions applied
(``with_decisions``): the workers, the gate and its phase watcher, and the client (run.read_spec).
"""

from __future__ import annotations

import json
from typing import Any

from stagecoach.core.keys import job_prefix
from stagecoach.core.records import JobSpec
from stagecoach.planner.plan import Plan
from stagecoach.planner.segments import decided_plan


def decisions_key(job: str) -> str:
    """The job's record of its policy's decisions: ``{"decisions": [[first, end, d], ...] (one per
    window, in order), "losses": [the loss of each iteration the policy has seen]}``."""
    return f"{job_prefix(job)}policy/decisions.json"


def parse_record(body: bytes | None) -> dict[str, Any]:
    """The record as stored, or an empty one before the first decision."""
    return json.loads(body) if body is not None else {"decisions": [], "losses": []}


def top_plan(plan: Plan) -> Plan:
    """A policy plan as deployed: without decisions."""
    return Plan.from_dict({k: v for k, v in plan.to_dict().items() if k not in ("segments", "decided")})


def with_decisions(spec: JobSpec, body: bytes | None) -> JobSpec:
    """``spec`` with its policy's recorded decisions (``body``: the record, None if none yet) as
    the plan's segments (planner/segments.py decided_plan); a spec without a policy unchanged."""
    if not spec.plan.get("choices"):
        return spec
    decisions = [(int(a), int(b), int(d)) for a, b, d in parse_record(body)["decisions"]]
    plan = decided_plan(top_plan(spec.to_plan()), decisions)
    return spec.model_copy(update={"plan": plan.to_dict()})
