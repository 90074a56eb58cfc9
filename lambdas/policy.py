"""A replica policy's decisions, made by the iteration gate (lambdas/gate.py; docs/runtime.md
"Dynamic workers"): ``Job.run(replicas=ReplicaPolicy(choose, choices))`` ships the policy with the
job's code, and at a window's first iteration the gate, on the job's stage-0 function and with the
job's role (never the control role: this is user code), calls ``choose`` with the run's metrics so
far and answers the chosen d's segment, which the joined window routes on
(planner/emit/segments.py ``policy_windows``).

A decision is recorded before anything runs with it, in ``jobs/{job}/policy/decisions.json``
(``[first, end, d]`` per window, with every iteration's loss read so far; core/decisions.py), and
every reader that takes iteration t's plan (workers, the phase watcher, the client's cost,
inspect) reads the job's spec with the decisions applied (``plan.segments`` and ``plan.decided``:
core/decisions.py ``with_decisions``), so it reads the d the policy chose. A window that restarts, or a job resumed inside a decided window,
reuses the recorded decision (the policy is not called again for iterations it decided); a window
past the decided ones calls it.
"""

from __future__ import annotations

import json
import math
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import cloudpickle

from stagecoach.core import keys
from stagecoach.core.decisions import decisions_key, parse_record, top_plan, with_decisions
from stagecoach.core.events import GateEvent
from stagecoach.core.records import JobSpec, TaskMetrics
from stagecoach.core.training import epoch_of
from stagecoach.lambdas.channel import Channel
from stagecoach.planner.plan import Plan
from stagecoach.planner.segments import PolicyMetrics, ReplicaPolicy, decided_plan

_POLICY: dict[tuple[str, str], ReplicaPolicy] = {}


def load_policy(ch: Channel, job: str) -> ReplicaPolicy:
    """The job's policy, from its code in its own bucket (deploy/upload.py), once per container."""
    key = (ch.bucket, job)
    if key not in _POLICY:
        body = ch.get_bytes(keys.job_code(job))
        policy = cloudpickle.loads(body).get("replica_policy") if body is not None else None  # the user's own code
        if not isinstance(policy, ReplicaPolicy):
            raise RuntimeError(f"job {job!r}: its plan has choices but its code carries no replica policy (Job.run(replicas=policy))")
        _POLICY.clear()
        _POLICY[key] = policy
    return _POLICY[key]


def covered(plan: Plan, t: int) -> bool:
    """Whether ``plan`` (a policy's, as some spec holds it) has decided iteration t's d."""
    return bool(plan.segments) and t < plan.decided


def segment_of(plan: Plan, t: int) -> int:
    """The index (into ``plan.choices``) of iteration t's d, as the joined window numbers segments."""
    return plan.choices.index(plan.plan_at(t).replicas)


def losses(ch: Channel, job: str, plan: Plan, ts: range) -> list[float]:
    """Iterations ``ts``' losses: each the mean of its replicas' (the last stage's backward tasks'
    metrics, as Run.losses() reads them), NaN where none is known."""
    last = plan.stages - 1
    wanted = [(t, r) for t in ts for r in range(plan.plan_at(t).replicas)]
    with ThreadPoolExecutor(max_workers=16) as pool:
        bodies = list(pool.map(ch.get_bytes, [keys.metrics(job, t, "backward", last, r) for t, r in wanted]))
    per: dict[int, list[float]] = {t: [] for t in ts}
    for (t, _), body in zip(wanted, bodies):
        loss = TaskMetrics.model_validate_json(body).loss if body is not None else None
        if loss is not None:
            per[t].append(loss)
    return [sum(ls) / len(ls) if ls else math.nan for ls in per.values()]


def _choose(ch: Channel, spec: JobSpec, plan: Plan, record: dict[str, Any], t: int) -> int:
    """Call the policy for the window starting at t with the run's metrics so far; its d, checked."""
    seen = record.setdefault("losses", [])
    seen.extend(losses(ch, spec.job, plan, range(len(seen), t)))
    previous = plan.plan_at(t - 1).replicas if t > 0 and plan.segments else None
    epoch = epoch_of(t, spec.dataset.n_train, plan.global_batch)
    policy = load_policy(ch, spec.job)
    d = policy.choose(PolicyMetrics(iteration=t, epoch=epoch, replicas=previous, losses=tuple(seen[:t])))
    if d not in plan.choices:
        raise ValueError(f"replica policy chose d={d!r} at iteration {t}: not one of its choices {list(plan.choices)}")
    return int(d)


def decide(ch: Channel, spec: JobSpec, ev: GateEvent) -> tuple[int, JobSpec]:
    """The segment iteration ``ev.t`` runs, deciding it if no recorded decision covers it (the
    window's first iteration: [t, end) gets the policy's d); the spec with the decisions applied."""
    record = parse_record(ch.get_bytes(decisions_key(ev.job)))
    decisions: list[list[int]] = record["decisions"]
    top = top_plan(spec.to_plan())
    covering = [x for x in decisions if x[0] <= ev.t < x[1]]
    if covering:  # recorded by an earlier attempt at this window (or one a resumed job restarts inside)
        covering[-1][1] = max(covering[-1][1], ev.end)
    else:
        decisions.append([ev.t, ev.end, _choose(ch, spec, decided_plan(top, [(a, b, d) for a, b, d in decisions]), record, ev.t)])
    body = json.dumps(record).encode()
    ch.put_bytes(decisions_key(ev.job), body)
    spec = with_decisions(spec, body)
    return segment_of(spec.to_plan(), ev.t), spec


def current_spec(ch: Channel, job: str) -> JobSpec:
    """The job's spec as deployed, with its policy's decisions so far applied (two GETs)."""
    body = ch.get_bytes(keys.job_spec(job))
    if body is None:
        raise FileNotFoundError(f"job {job!r} has no spec in s3://{ch.bucket}/{keys.job_spec(job)}")
    return with_decisions(JobSpec.model_validate_json(body), ch.get_bytes(decisions_key(job)))


def last_segment(plan: Plan) -> int:
    """The segment a gate answers where no decision is needed (a window's end, or a stop): the
    last decision's, or the largest choice's before any."""
    return plan.choices.index(plan.segments[-1][1].replicas) if plan.segments else len(plan.choices) - 1
