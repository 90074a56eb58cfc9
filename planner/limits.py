"""The AWS limits every layer respects, each stated once, with the page that documents it.

Prices and measured speeds live in planner/model/platforms.py; these are hard limits: a plan that
breaks one fails on AWS, so the planner never proposes it, ``Plan`` refuses it, and the local stack
enforces it (sdk/local/fidelity.py imports the Step Functions ones from here).
"""

from __future__ import annotations

from collections.abc import Sequence

# Lambda function memory, MB (https://docs.aws.amazon.com/lambda/latest/dg/configuration-memory.html)
LAMBDA_MIN_MB = 128
LAMBDA_MAX_MB = 10_240
# "a single function can use up to 10,240 MB of memory": Lambda quotas
LAMBDA_QUOTAS_URL = "https://docs.aws.amazon.com/lambda/latest/dg/gettingstarted-limits.html"
# Lambda function timeout, s (https://docs.aws.amazon.com/lambda/latest/dg/gettingstarted-limits.html)
LAMBDA_MAX_TIMEOUT_S = 900
# Lambda's default concurrent executions per Region; new accounts may have less
# (https://docs.aws.amazon.com/lambda/latest/dg/lambda-concurrency.html)
LAMBDA_ACCOUNT_CONCURRENCY = 1_000
# Step Functions: an inline Map runs at most 40 iterations at once
# (https://docs.aws.amazon.com/step-functions/latest/dg/state-map-inline.html)
INLINE_MAP_MAX_CONCURRENCY = 40
# So a Map of a phase with more tasks runs them in groups of at most GROUP_SIZE, each group a child
# execution (states:startExecution.sync:2) of the job's group state machine, started by an inline
# Map of its own: AWS's sample for thousands of parallel tasks does the same
# (aws-samples/app-decompose-for-parallelism). One Map thus runs at most MAP_MAX_TASKS tasks at once.
GROUP_SIZE = INLINE_MAP_MAX_CONCURRENCY
MAP_MAX_TASKS = INLINE_MAP_MAX_CONCURRENCY * GROUP_SIZE
# Step Functions quotas (https://docs.aws.amazon.com/step-functions/latest/dg/service-quotas.html):
# events in one execution's history, and the bytes of an execution's input (StartExecution)
HISTORY_MAX_EVENTS = 25_000
EXECUTION_INPUT_MAX_BYTES = 262_144
# An Express execution runs at most five minutes (same page; Standard vs Express:
# https://docs.aws.amazon.com/step-functions/latest/dg/choosing-workflow-type.html)
EXPRESS_MAX_DURATION_S = 300
# S3 request rates per partitioned prefix, beyond which S3 answers 503 SlowDown
# (https://docs.aws.amazon.com/AmazonS3/latest/userguide/optimizing-performance.html)
S3_GET_PER_PREFIX_PER_S = 5_500
S3_PUT_PER_PREFIX_PER_S = 3_500
# The GETs per second one job's waiting workers may make between them, whatever its size: well under
# the per-prefix rate (a new bucket's keys of one job may share a partition until S3 splits it).
JOB_POLL_BUDGET_PER_S = 1_000
# ...unless the workers' environment names their S3 endpoint's own: the local stack's S3 is one Python
# process serving a few hundred requests a second (its runtime sets it: local/runtime.py)
POLL_BUDGET_ENV = "STAGECOACH_POLL_BUDGET_PER_S"


def map_groups(tasks: int) -> int:
    """The child executions a Map of ``tasks`` runs them in: none (the tasks run in the window's
    own inline Map) up to GROUP_SIZE, else groups of at most GROUP_SIZE."""
    return 0 if tasks <= GROUP_SIZE else -(-tasks // GROUP_SIZE)


def watchable(replicas: int, sync_tasks: Sequence[int]) -> bool:
    """Whether a plan's phases run beside a phase watcher (lambdas/watcher.py, planner/emit/asl.py
    ``_watched``): not when a Map runs in groups (the watcher would have to re-run a task inside a
    group's child execution, which names its functions itself)."""
    return not map_groups(replicas) and not any(map_groups(k) for k in sync_tasks)


# How long a phase watcher waits, once every task of its phase has written its metrics, before it
# ends a phase whose Map is still open (on an invocation killed or hung after its metrics' PUT):
# Step Functions closes a finished Map in tens of milliseconds, so a fault-free phase's own end
# comes first. The watcher is billed for this too: the cost prediction charges it (sdk/cost.py).
WATCH_GRACE_S = 0.5


# A group's child execution enters three states besides its tasks: Items (Pass), Kind? (Choice)
# and its Map (planner/emit/groups.py group_definition).
GROUP_TRANSITIONS = 3


def map_transitions(tasks: int) -> int:
    """State transitions (Standard's billing unit) of a phase Map of ``tasks``, fault-free: the
    Map and a Task per task; in groups also a Task per group (startExecution.sync:2) and each
    child's own states."""
    g = map_groups(tasks)
    return 1 + tasks + g * (1 + GROUP_TRANSITIONS)


def concurrency_needed(peak: int) -> int:
    """The concurrent executions a plan whose phases run ``peak`` invocations at once needs: every
    worker of a phase runs at once (they wait for each other), a restarted window's new tasks start
    while the failed one's wind down (twice the peak), and the remediation step runs beside them."""
    return 2 * peak + 1


def max_peak_invocations(concurrency: int) -> int:
    """The most invocations a plan's phases may run at once on an account of ``concurrency``
    concurrent executions: the largest peak with concurrency_needed(peak) <= concurrency."""
    return max(0, (concurrency - 1) // 2)


def max_stages_at(replicas: int, concurrency: int, inline_only: bool = False) -> int:
    """The most stages a plan of ``replicas`` replicas may have (0: none), the one rule the planner,
    its performance model and the baselines apply. A stage's Map (forward, backward) runs its d
    workers at once and its sync Map K <= d; BackwardSync runs every stage's branch in parallel, so
    a plan of S stages peaks at S d invocations (Plan.peak_invocations), which must leave
    concurrency_needed's restart headroom: S d <= max_peak_invocations(concurrency); and one Map
    runs at most MAP_MAX_TASKS tasks. ``inline_only``: the rule before groups of child executions
    (issue 25), every phase's workers in one inline Map: d <= 40 and (S - 1) d <= 40."""
    if inline_only:
        return 0 if replicas > INLINE_MAP_MAX_CONCURRENCY else 1 + INLINE_MAP_MAX_CONCURRENCY // replicas
    if replicas > MAP_MAX_TASKS:
        return 0
    return max_peak_invocations(concurrency) // replicas


def peak_invocations(stages: int, replicas: int, sync_tasks: Sequence[int] = ()) -> int:
    """The most invocations an iteration runs at once: Forward (S - 1 stages' d workers) or
    BackwardSync, whose stages run in parallel branches, each at most max(d, its sync tasks) at a
    time (a stage's sync Map starts after its backward Map). ``sync_tasks``: per stage (default:
    none wider than d)."""
    backward = sum(max(replicas, k) for k in sync_tasks) if sync_tasks else stages * replicas
    return max((stages - 1) * replicas, backward)


def concurrency_refusal(
    stages: int, replicas: int, concurrency: int, inline_only: bool = False, sync_tasks: Sequence[int] = ()
) -> str | None:
    """Why a plan of ``stages`` x ``replicas`` (and per stage ``sync_tasks``) cannot run on an
    account of ``concurrency`` concurrent executions (None: it can); max_stages_at's rule."""
    if inline_only:
        if stages <= max_stages_at(replicas, concurrency, inline_only) and max(sync_tasks, default=0) <= INLINE_MAP_MAX_CONCURRENCY:
            return None
        return f"{stages} stages x {replicas} replicas exceed the inline Map's {INLINE_MAP_MAX_CONCURRENCY} concurrent tasks"
    widest = max([replicas, *sync_tasks])
    if widest > MAP_MAX_TASKS:
        return (
            f"{widest} tasks in one Map exceed the {MAP_MAX_TASKS} a Map runs at once ({INLINE_MAP_MAX_CONCURRENCY} groups of {GROUP_SIZE})"
        )
    peak = peak_invocations(stages, replicas, sync_tasks)
    if concurrency_needed(peak) <= concurrency:
        return None
    return (
        f"{stages} stages x {replicas} replicas run {peak} Lambda invocations at once, and a restarted window's "
        f"{concurrency_needed(peak)} exceed the account's concurrency of {concurrency}: use fewer stages or "
        "replicas, or raise the account's concurrency (Service Quotas) and plan with it"
    )


# Lambda scales each function by at most 1,000 execution environments every 10 seconds, refilled
# continuously as a best attempt; requests beyond it are throttled (429)
# (https://docs.aws.amazon.com/lambda/latest/dg/scaling-behavior.html, "Concurrency scaling rate").
LAMBDA_SCALING_ENVIRONMENTS = 1_000
LAMBDA_SCALING_WINDOW_S = 10.0


def scaling_ramp_s(environments: int) -> float:
    """Seconds one function needs, beyond its first burst, to reach ``environments`` execution
    environments from none at Lambda's concurrency scaling rate (0 up to 1,000)."""
    extra = max(0, environments - LAMBDA_SCALING_ENVIRONMENTS)
    return extra * LAMBDA_SCALING_WINDOW_S / LAMBDA_SCALING_ENVIRONMENTS


def fits_lambda_timeout(seconds: float, safety: float) -> bool:
    """Whether a task of ``seconds``, given ``safety`` times that as its timeout, fits Lambda's limit."""
    return seconds * safety <= LAMBDA_MAX_TIMEOUT_S


def timeout_refusal(stage: int, phase: str, seconds: float, safety: float, predicted: bool = False) -> str:
    """What to tell a user whose task cannot fit Lambda's 15 minutes, and what to change."""
    verb = "is predicted to take" if predicted else "takes"
    return (
        f"stage {stage}'s {phase} task {verb} {seconds:.0f} s, and with the safety factor {safety} that "
        f"exceeds Lambda's {LAMBDA_MAX_TIMEOUT_S} s limit: use more stages (less work per task), more "
        "replicas (fewer samples per task) or smaller micro-batches"
    )


# The runtime's uploads in flight per worker (lambdas/channel.py): chunks handed to the uploader
# together share the link and land together, so a stream of chunks moves in groups of this many
# (the performance model's pipelining lag, planner/model/syncmodel.py).
UPLOADS_IN_FLIGHT = 4
