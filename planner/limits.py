"""The AWS limits every layer respects, each stated once, with the page that documents it.

Prices and measured speeds live in planner/model/platforms.py; these are hard limits: a plan that
breaks one fails on AWS, so the planner never proposes it, ``Plan`` refuses it, and the local stack
enforces it (sdk/local/fidelity.py imports the Step Functions ones from here).
"""

from __future__ import annotations

# Lambda function memory, MB (https://docs.aws.amazon.com/lambda/latest/dg/configuration-memory.html)
LAMBDA_MIN_MB = 128
LAMBDA_MAX_MB = 10_240
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
# S3 request rates per partitioned prefix, beyond which S3 answers 503 SlowDown
# (https://docs.aws.amazon.com/AmazonS3/latest/userguide/optimizing-performance.html)
S3_GET_PER_PREFIX_PER_S = 5_500
S3_PUT_PER_PREFIX_PER_S = 3_500
# The GETs per second one job's waiting workers may make between them, whatever its size: well under
# the per-prefix rate (a new bucket's keys of one job may share a partition until S3 splits it).
JOB_POLL_BUDGET_PER_S = 1_000


def map_groups(tasks: int) -> int:
    """The child executions a Map of ``tasks`` runs them in: none (the tasks run in the window's
    own inline Map) up to GROUP_SIZE, else groups of at most GROUP_SIZE."""
    return 0 if tasks <= GROUP_SIZE else -(-tasks // GROUP_SIZE)


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
