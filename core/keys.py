"""The S3 key layout (docs/runtime.md "Checkpoints, cleanup, idempotence"), in one place: every key carries its job and iteration."""

from __future__ import annotations


def job_prefix(job: str) -> str:
    return f"jobs/{job}/"


def job_spec(job: str) -> str:
    return f"jobs/{job}/job.json"


def job_code(job: str) -> str:
    return f"jobs/{job}/model/job.pkl"


def initial_buffers(job: str, stage: int) -> str:
    """A stage's buffers as the factory initialises them, for a container that builds only its
    stage on the meta device (core/stagebuild.py): written once by the client at job start."""
    return f"jobs/{job}/model/buffers/s{stage}"


def plan(job: str) -> str:
    return f"jobs/{job}/plan.json"


def params(job: str, version: int, stage: int, shard: int, chunk: int) -> str:
    """A shard is stored as chunk objects (training.stage_layout) so a reader can start on the first
    chunk while the writer still updates the next."""
    return f"jobs/{job}/params/v{version}/s{stage}/k{shard}/c{chunk}"


def optim(job: str, version: int, stage: int, shard: int, chunk: int) -> str:
    return f"jobs/{job}/optim/v{version}/s{stage}/k{shard}/c{chunk}"


def state_prefix(job: str, kind: str) -> str:
    """Every version of one kind of stored state: ``kind`` is "params", "optim" or "buffers"."""
    return f"jobs/{job}/{kind}/"


def state_version(job: str, kind: str, key: str) -> int:
    """The version a ``params``/``optim``/``buffers`` key (under ``state_prefix``) belongs to."""
    return int(key[len(state_prefix(job, kind)) :].split("/")[0][1:])


def buffers(job: str, version: int, stage: int) -> str:
    """A stage's running statistics (BatchNorm) after ``version`` iterations (training.running_stats)."""
    return f"jobs/{job}/buffers/v{version}/s{stage}"


def bn_stats(job: str, t: int, stage: int, replica: int) -> str:
    """What a replica's BatchNorms of ``stage`` saw in iteration t (deferred batch norm:
    lambdas/deferred_bn.py), which replica 0's backward task combines into one update."""
    return f"jobs/{job}/iter/{t}/bnstats/s{stage}/r{replica}"


def act(job: str, t: int, stage: int, replica: int, mb: int, part: str = "", space: str = "") -> str:
    """A stage's output for one micro-batch; ``part``: one object per set of reading stages when
    values go straight to the stages that read them (planner/profile/flows.py Transfer.name);
    ``space``: "eval/" for the evaluation of version t (lambdas/evaluation.py), apart from
    iteration t's training objects."""
    key = f"jobs/{job}/iter/{t}/{space}act/s{stage}/r{replica}/m{mb}"
    return f"{key}/{part}" if part else key


def grad(job: str, t: int, stage: int, replica: int, mb: int, to: int | None = None) -> str:
    """A stage's input gradient for one micro-batch; ``to``: the part for the stage that computed
    those inputs, when values go straight to their readers."""
    key = f"jobs/{job}/iter/{t}/grad/s{stage}/r{replica}/m{mb}"
    return key if to is None else f"{key}/to{to}"


def grad_norm(job: str, t: int, stage: int, shard: int) -> str:
    """The squared norm of shard ``shard`` of stage ``stage``'s reduced gradient in iteration t
    (lambdas/clipping.py): every updating task reads everyone's before it updates."""
    return f"jobs/{job}/iter/{t}/norm/s{stage}/k{shard}"


def checkpoint(job: str, version: int, stage: int) -> str:
    """Stage ``stage``'s part of the model's state_dict after ``version`` iterations (Job.checkpoint_every)."""
    return f"jobs/{job}/checkpoints/v{version}/s{stage}.safetensors"


def checkpoints_prefix(job: str) -> str:
    return f"jobs/{job}/checkpoints/"


def checkpoint_of(job: str, key: str) -> tuple[int, int]:
    """The (version, stage) a ``checkpoint`` key names: the inverse of ``checkpoint``."""
    v, s = key[len(checkpoints_prefix(job)) :].split("/")
    return int(v[1:]), int(s[1:].split(".")[0])


def eval_result(job: str, version: int, replica: int) -> str:
    """What replica ``replica``'s last stage measured evaluating the parameters after ``version``
    iterations on its slice of the validation set (core/records.py EvalResult)."""
    return f"jobs/{job}/eval/v{version}/r{replica}.json"


def tied_grad(job: str, t: int, owner: int, user: int, replica: int) -> str:
    """Stage ``user``'s gradient of the parameters it shares with stage ``owner`` (tied weights),
    which the owner adds to its own before the update."""
    return f"jobs/{job}/iter/{t}/tied/s{owner}/from{user}/r{replica}"


# The sync's per-replica objects are spread over SPREAD stable prefixes, ``jobs/{job}/sync{nn}/``,
# ahead of the iteration (docs/runtime.md "Request rates"): S3 serves 3,500 PUT and 5,500 GET per
# second per partitioned prefix and partitions a busy prefix over time
# (https://docs.aws.amazon.com/AmazonS3/latest/userguide/optimizing-performance.html), so a
# partition that helps must outlive an iteration; under ``iter/{t}/`` every iteration is a new range.
SPREAD = 64


def _spread(job: str, n: int) -> str:
    return f"jobs/{job}/sync{n % SPREAD:02d}/"


def gshard(job: str, t: int, stage: int, replica: int, shard: int, chunk: int) -> str:
    """Chunk ``chunk`` of shard ``shard`` of replica ``replica``'s gradient, for the shard's reducer."""
    return f"{_spread(job, replica)}iter/{t}/gshard/s{stage}/r{replica}/k{shard}/c{chunk}"


def gradient(job: str, t: int, stage: int, replica: int) -> str:
    """Replica ``replica``'s whole gradient of a small stage as one object (one flat tensor, its
    shards one after the other), each shard read by its owner with a ranged GET
    (planner/model/syncmodel.py ``one_gradient_object``): in place of the K ``gshard`` objects."""
    return f"{_spread(job, replica)}iter/{t}/gshard/s{stage}/r{replica}/all"


def gsend(job: str, t: int, stage: int, replica: int, group: int) -> str:
    """Group ``group`` of the chunks replica ``replica`` sends its peers in a fused exchange (one
    flat tensor of consecutive chunks, each read by its owner with a ranged GET:
    lambdas/collectives.py ``send_groups``): in place of one ``gshard`` object per chunk."""
    return f"{_spread(job, replica)}iter/{t}/gshard/s{stage}/r{replica}/g{group}"


def partial(job: str, t: int, stage: int, block: int, shard: int, chunk: int) -> str:
    """A level-1 aggregator's running prefix: chunk ``chunk`` of shard ``shard`` summed over every
    replica through block ``block`` (the hierarchical chain, lambdas/collectives.py ``reduce_block``),
    for the next aggregator, or, the last, the shard's root."""
    return f"{_spread(job, block)}iter/{t}/partial/s{stage}/b{block}/k{shard}/c{chunk}"


# A stage's updated parameters are read by every replica's next task (d GETs per object): from
# this many replicas on, whoever updates a shard in a sync Map also stores each chunk as a read copy
# under a spread prefix, and replicas read the copy (collectives.gather), so the d x K x C GETs per
# stage spread over SPREAD prefixes instead of landing on ``jobs/{job}/params/`` together.
READ_COPIES_MIN_REPLICAS = 64


def params_copy(job: str, version: int, stage: int, shard: int, chunk: int) -> str:
    """The read copy of ``params(job, version, stage, shard, chunk)`` (READ_COPIES_MIN_REPLICAS):
    transient, like an iteration's objects; the stored version stays ``params``."""
    return f"{_spread(job, stage * 49 + shard * 31 + chunk)}iter/{version}/params/s{stage}/k{shard}/c{chunk}"


def rate_prefix(key: str) -> str:
    """The prefix S3's request rates apply to, as docs/runtime.md "Request rates" defines it: the
    key up to its first component that names an iteration or a version (``iter``, ``v{n}``,
    ``it{n}``), the part that stays the same from one iteration to the next."""
    parts = key.split("/")
    for i, part in enumerate(parts[:-1]):
        if part == "iter" or (part[:1] == "v" and part[1:].isdigit()) or (part[:2] == "it" and part[2:].isdigit()):
            return "/".join(parts[:i]) + "/"
    return key.rsplit("/", 1)[0] + "/"


def metrics_prefix(job: str) -> str:
    return f"jobs/{job}/metrics/"


def metrics(job: str, t: int, phase: str, stage: int, index: int) -> str:
    """One object per task; zero-padded so a listing comes back in iteration order."""
    return f"jobs/{job}/metrics/it{t:08d}/{phase}-s{stage}-{index}.json"


def dataset_prefix(dataset_id: str) -> str:
    """Everything of one data set: its manifest and its shards. A job's role is granted reading
    exactly the prefixes of the data sets it uses (deploy/roles.py job_dataset_policy), one
    statement entry per set whatever its shard count."""
    return f"data/{dataset_id}/"


def dataset(dataset_id: str) -> str:
    """A data set's manifest (core/samples.py Manifest); ``dataset_id`` is its own content's hash."""
    return f"{dataset_prefix(dataset_id)}manifest"


def data_shard(dataset_id: str, digest: str) -> str:
    """A shard of the data set's samples, named by its content's hash, under its data set's prefix
    (the same data uploaded again is the same set and the same keys)."""
    return f"{dataset_prefix(dataset_id)}shards/{digest}"


def memory_pressure(job: str, stage: int) -> str:
    """Written once by a stage's container whose memory came near its limit: the remediation's
    evidence that a kill AWS reports without a cause was for memory (lambdas/remediate.py)."""
    return f"jobs/{job}/evidence/memory-s{stage}.json"


def remediations_prefix(job: str) -> str:
    return f"jobs/{job}/remediations/"


def remediation(job: str, time_ms: int, stage: int) -> str:
    return f"{remediations_prefix(job)}{time_ms}-s{stage}.json"


def learnt_memory(name: str) -> str:
    """Per job name: the memory the remediation found each stage needs, for the job's next run."""
    return f"history/{name}/memory.json"


def learnt_task_seconds(name: str) -> str:
    """Per job name: the task seconds a run observed, for the next run's timeouts (sdk/history.py)."""
    return f"history/{name}/task_seconds.json"


# The abort marker's key as a States.Format template (job, window attempt): the emitted window
# writes it from its own input (planner/emit/asl.py window_definition's ``abort_key_format``).
WINDOW_ABORT = "jobs/{}/abort/{}"


def window_abort(job: str, attempt: str) -> str:
    """Written by a window execution whose phase failed (``WINDOW_ABORT``): that attempt's tasks
    still waiting for objects stop (lambdas/channel.py)."""
    return WINDOW_ABORT.format(job, attempt)


def window_aborts(job: str, window_start: int) -> str:
    """The prefix of the abort markers of every attempt at the window starting at ``window_start``
    (the job state machine names attempts ``w{start}-{uuid}``)."""
    return f"jobs/{job}/abort/w{window_start}-"


def stop_request(job: str) -> str:
    """Asks the job to stop at its next iteration boundary (records.StopRequest; lambdas/gate.py)."""
    return f"jobs/{job}/stop/request.json"


def stopped(job: str) -> str:
    """Where and why the job stopped (records.StopRecord): the version its checkpoint holds."""
    return f"jobs/{job}/stop/stopped.json"


def learnt_timeouts(job: str) -> str:
    """The iteration gate's record of how long the job's tasks take (records.LearntTimeouts)."""
    return f"jobs/{job}/timeouts.json"


def predicted_cost(job: str) -> str:
    """The performance model's cost of the whole run, as the client predicted it before the start
    (sdk/cost.py CostReport.to_dict): for readers without the Job, such as the local console."""
    return f"jobs/{job}/cost/predicted.json"


def watcher_usage_prefix(job: str) -> str:
    return f"jobs/{job}/cost/phase-watcher/"


def watcher_usage(job: str, t: int, watch: str, attempt: str) -> str:
    """What the phase watcher of iteration t's ``watch`` phase used in a window attempt (records.WatcherUsage)."""
    return f"{watcher_usage_prefix(job)}{t}-{watch}-{attempt or 'none'}.json"


def cost_tally(job: str) -> str:
    """The engine's running cost count of a job with a cost cap (records.CostTally)."""
    return f"jobs/{job}/cost/tally.json"
