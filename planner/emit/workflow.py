"""Which workflow type a job's windows run as, and what each costs (docs/runtime.md "Express windows").

A window runs as a STANDARD state machine (billed per state transition, $0.025 per 1,000) or as an
EXPRESS one (billed per request, $1.00 per million, and per GB-second of its duration, rounded up
to 100 ms, at its memory billed in 64 MB chunks: https://aws.amazon.com/step-functions/pricing/).
An Express execution runs at most five minutes and cannot run a ``.sync`` integration
(https://docs.aws.amazon.com/step-functions/latest/dg/choosing-workflow-type.html), so a window
runs as Express only if

- none of its phases runs in groups (more than GROUP_SIZE tasks: planner/emit/groups.py starts
  each group with startExecution.sync:2), and
- its iterations fit well inside the limit: ``iterations x predicted seconds per iteration x
  EXPRESS_SAFETY <= 300 s``; the window then holds at most that many iterations.

``workflow="auto"`` picks the cheaper of the two by this module's cost of orchestrating the run
(the tasks are the same either way); "express" insists (and is refused where it cannot run);
"standard" is the earlier behaviour. The job's own execution stays STANDARD in every case: it owns
the chain of windows, their restarts, the remediation, stopping and the cost cap.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from stagecoach.planner.emit import asl
from stagecoach.planner.limits import EXPRESS_MAX_DURATION_S, GROUP_SIZE, map_groups
from stagecoach.planner.model.platforms import Platform
from stagecoach.planner.plan import Plan, PlanError

CHOICES = ("auto", "standard", "express")
# A window's predicted time, times this, must fit in the Express limit: room for a slow cold start,
# a retried task and the spread of task times around the model's prediction
EXPRESS_SAFETY = 2.0
# Express memory: "Workflow memory utilized = 50 MB + state machine definition size + execution
# data size x Number of Parallel or Map Steps", billed in 64 MB chunks (pricing page, examples 3-4)
EXPRESS_BASE_MB = 50.0
EXPRESS_MEMORY_STEP_MB = 64
EXPRESS_DURATION_STEP_S = 0.1


@dataclass(frozen=True)
class WorkflowChoice:
    """The windows' type and length, and the orchestration cost of the run each way (USD; the
    Express one None where Express cannot run, with ``why_not``)."""

    workflow: Literal["STANDARD", "EXPRESS"]
    window_length: int
    memory_mb: int  # an Express window's billed memory
    standard_usd: float
    express_usd: float | None
    why_not: str = ""


def needs_groups(plan: Plan) -> bool:
    """Whether a phase Map of the plan runs its tasks in groups of child executions (limits.map_groups)."""
    return any(map_groups(n) for n in (plan.replicas, *(plan.sync_tasks(s) for s in range(plan.stages))))


def express_memory_mb(definition: dict[str, Any], state_bytes: int) -> int:
    """An Express window's billed memory: 50 MB, its definition and its state data once per Map or
    Parallel state, in 64 MB chunks."""
    text = json.dumps(definition)
    steps = text.count('"Type": "Map"') + text.count('"Type": "Parallel"')
    mb = EXPRESS_BASE_MB + (len(text) + state_bytes * max(1, steps)) / 2**20
    return EXPRESS_MEMORY_STEP_MB * math.ceil(mb / EXPRESS_MEMORY_STEP_MB)


def window_memory_mb(plan: Plan, evals: Sequence[int] = (), saves: Sequence[int] = ()) -> int:
    """The billed memory of the plan's window as an Express execution (``express_memory_mb`` of its
    definition, with function names as long as a job's, and its Init state's data)."""
    names = [f"stagecoach-{'x' * 30}-{'0' * 8}-s{s}" for s in range(plan.stages)]
    definition = asl.window_definition(plan, names, evals=evals, saves=saves, abort_key_format="jobs/{}/abort/{}", group_arn=None)
    return express_memory_mb(definition, len(json.dumps(definition["States"]["Init"]["Parameters"])))


def express_fit(iteration_s: float) -> int:
    """Iterations one Express window may hold (0: not even one)."""
    if iteration_s <= 0:
        return 0
    return int(EXPRESS_MAX_DURATION_S // (iteration_s * EXPRESS_SAFETY))


def standard_usd(plan: Plan, iterations: int, length: int, platform: Platform, checks: int = 0) -> float:
    """Step Functions' bill for the windows as STANDARD executions: every state transition of the
    iterations (``checks``: evaluation/checkpoint Due-Choice pairs per iteration), of each window's
    fixed states and of the job's per window."""
    windows = math.ceil(iterations / length)
    per_iteration = asl.transitions_per_iteration(plan) + asl.TRANSITIONS_DUE_CHECK * checks
    transitions = per_iteration * iterations + windows * (asl.TRANSITIONS_WINDOW_FIXED + asl.TRANSITIONS_JOB_PER_WINDOW)
    return transitions * platform.price_transition


def express_usd(iterations: int, length: int, iteration_s: float, memory_mb: int, platform: Platform) -> float:
    """Step Functions' bill for the windows as EXPRESS executions: a request and the duration of
    each (its iterations' predicted time, rounded up to 100 ms, at ``memory_mb``), and the job's
    transitions per window."""
    windows = math.ceil(iterations / length)
    full, last = divmod(iterations, length)
    durations = [length * iteration_s] * full + ([last * iteration_s] if last else [])
    billed_s = sum(math.ceil(round(d / EXPRESS_DURATION_STEP_S, 6)) * EXPRESS_DURATION_STEP_S for d in durations)
    return (
        windows * platform.price_express_request
        + billed_s * memory_mb / 1024.0 * platform.price_express_gb_s
        + windows * asl.TRANSITIONS_JOB_PER_EXPRESS_WINDOW * platform.price_transition
    )


def choose(
    requested: str,
    plan: Plan,
    iterations: int,
    iteration_s: float | None,
    platform: Platform,
    memory_mb: int | None = None,
    evals: Sequence[int] = (),
    saves: Sequence[int] = (),
) -> WorkflowChoice:
    """The windows' workflow for ``requested`` (CHOICES). ``iteration_s``: the predicted seconds of
    one iteration, its evaluation and checkpoint included if the job has them (None: unknown,
    which only "standard" takes); ``memory_mb``: an Express window's billed memory (default
    ``window_memory_mb``). Refuses "express" where Express cannot run, saying why."""
    if requested not in CHOICES:
        raise PlanError(f"workflow={requested!r}: choose one of {', '.join(CHOICES)}")
    length = asl.window_length(plan, evals=evals, saves=saves)
    checks = bool(evals) + bool(saves)
    std = standard_usd(plan, iterations, length, platform, checks)
    if requested == "standard":
        return WorkflowChoice(asl.STANDARD, length, EXPRESS_MEMORY_STEP_MB, std, None, "standard requested")
    why_not, fit = "", 0
    if needs_groups(plan):
        why_not = (
            f"a phase of this plan runs more than {GROUP_SIZE} tasks, in groups started with startExecution.sync:2, "
            "and an Express workflow cannot run a .sync integration: plan fewer replicas or sync tasks, or use workflow='standard'"
        )
    elif iteration_s is None:
        why_not = "no predicted time per iteration for this plan: use workflow='standard', or a plan with a prediction"
    else:
        fit = express_fit(iteration_s)
        if fit < 1:
            why_not = (
                f"one iteration is predicted to take {iteration_s:.1f} s, and an Express window must finish within "
                f"{EXPRESS_MAX_DURATION_S} s with {EXPRESS_SAFETY:g}x to spare: use workflow='standard'"
            )
    if why_not:
        if requested == "express":
            raise PlanError(f"workflow='express' cannot run this plan's windows: {why_not}")
        return WorkflowChoice(asl.STANDARD, length, EXPRESS_MEMORY_STEP_MB, std, None, why_not)
    assert iteration_s is not None  # checked above
    exp_length = min(length, fit)
    memory = memory_mb if memory_mb is not None else window_memory_mb(plan, evals, saves)
    exp = express_usd(iterations, exp_length, iteration_s, memory, platform)
    if requested == "express" or exp < std:
        return WorkflowChoice(asl.EXPRESS, exp_length, memory, std, exp)
    return WorkflowChoice(asl.STANDARD, length, memory, std, exp, "Standard is predicted cheaper")
