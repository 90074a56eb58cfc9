"""S3 requests per iteration, counted where AWS would bill them: every request the local stack serves
(sdk/local/access.py ``REQUEST_LOG_ENV``), by kind of object, for a job of the README demo's shape
(3 stages x 2 replicas x 2 micro-batches, scatter-reduce, Adam), and of a float64 one whose backward
tasks exchange the gradient (pipelined scatter-reduce). Issue 26's cuts stay cut (a small stage's
gradient is one object per replica; a fused exchange's chunks travel merged; both read by ranged
GETs), the performance model counts
exactly the PUTs and GETs the tasks make, and the parameters are still plain PyTorch's, bit for bit.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections import Counter
from urllib.parse import parse_qs

import pytest
import torch
from helpers import max_diff
from memory_s3 import MemoryS3
from torch import nn

from stagecoach import Job, Run
from stagecoach.lambdas.channel import Channel
from stagecoach.local.access import REQUEST_LOG_ENV
from stagecoach.local.backend import BUCKET, LocalBackend
from stagecoach.planner.model import syncmodel
from stagecoach.planner.model.platforms import Platform, aws_platform
from stagecoach.reference import train_reference
from stagecoach.run import phase_watchers

ITERATIONS = 5
STEADY = range(1, ITERATIONS - 1)
SHAPE = {"stages": 3, "replicas": 2, "micro_batches": 2}
TASK_KINDS = ("act", "grad", "gradient", "gshard", "params", "optim")  # what the model counts


def demo_like(name: str) -> Job:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(96, 12, generator=g), torch.randint(0, 5, (96,), generator=g)
    return Job(
        name=name,
        model=lambda: nn.Sequential(
            nn.Sequential(nn.Linear(12, 16), nn.ReLU()),
            nn.Dropout(0.1),
            nn.Sequential(nn.Linear(16, 16), nn.ReLU()),
            nn.Dropout(0.1),
            nn.Sequential(nn.Linear(16, 8), nn.ReLU()),
            nn.Linear(8, 5),
        ),
        loss=nn.CrossEntropyLoss(),
        optimizer=lambda p: torch.optim.Adam(p, lr=3e-3),
        train=(x, y),
        global_batch=16,
        iterations=ITERATIONS,
        seed=0,
    )


def kind(key: str) -> str:
    """The kind of a job's object (its key below jobs/{job}/), as this test counts them."""
    for name, pattern in (
        ("metrics", r"^metrics/"),
        ("act", r"^iter/\d+/act/"),
        ("grad", r"^iter/\d+/grad/"),
        ("gradient", r"/gshard/.*/all$"),
        ("gshard", r"/gshard/"),
        ("params", r"^params/"),
        ("optim", r"^optim/"),
    ):
        if re.search(pattern, key):
            return name
    return "other"


def per_iteration(log: str, job: str, skip: frozenset[int] = frozenset()) -> Counter[tuple[str, str]]:
    """(kind, class) -> requests per iteration of the steady state, from the stack's request log,
    leaving out the iterations in ``skip``. Classes: PUT, LIST, GET (and HEAD), RANGE (a ranged
    GET: 206), POLL (a GET answered 404)."""
    steady = [t for t in STEADY if t not in skip]
    assert steady, f"every steady iteration ran a task twice: {sorted(skip)}"
    out: Counter[tuple[str, str]] = Counter()
    prefix = f"{BUCKET}/jobs/{job}/"
    with open(log) as f:
        for line in f:
            method, path, query, status = line.rstrip("\n").split("\t")
            q = parse_qs(query)
            if not path.lstrip("/").startswith(prefix) or method not in ("GET", "HEAD", "PUT"):
                continue
            rest = path.lstrip("/")[len(prefix) :]
            found = re.search(r"(?:^|/)(?:it|iter/|v)(\d+)(?:/|$)", rest)
            if found is None or int(found.group(1)) not in steady or "list-type" in q:
                continue
            cls = "PUT" if method == "PUT" else {"404": "POLL", "206": "RANGE"}.get(status, "GET")
            out[kind(rest), cls] += 1
    return Counter({k: v / len(steady) for k, v in out.items()})


def run_twice(backend: LocalBackend, job: str) -> frozenset[int]:
    """The iterations in which a phase watcher ran a task again (lambdas/watcher.py: a task late
    past twice its usual time, which a loaded machine makes of a fault-free one): its requests twice."""
    return frozenset(w.t for w in phase_watchers(backend.clients.s3, backend.resources.bucket, job) if w.again)


def float64_job(name: str) -> Job:
    """A float64 job for 2 stages x 4 replicas: its runs equal plain PyTorch's to float64 noise."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 10, generator=g, dtype=torch.float64), torch.randint(0, 3, (64,), generator=g)
    return Job(
        name=name,
        model=lambda: nn.Sequential(nn.Linear(10, 24), nn.Tanh(), nn.Linear(24, 3)),
        loss=nn.CrossEntropyLoss(),
        optimizer=lambda p: torch.optim.Adam(p, lr=1e-2),
        train=(x, y),
        global_batch=16,
        iterations=ITERATIONS,
        seed=0,
        dtype=torch.float64,
    )


MERGED = {"stages": 2, "replicas": 4, "micro_batches": 1}
MERGED_CHUNKS = 2  # C per shard: each backward task sends (d-1) C = 6 chunks, in 2 objects


def start_merged(backend: LocalBackend) -> dict[str, Run]:
    """The float64 job with its gradients exchanged in the backward tasks (merged objects, ranged
    GETs) and, for its bits, the same job reduced by a sync Map (scatter-reduce: the same left fold)."""
    job = float64_job("requests-merged")
    plan = dataclasses.replace(job.manual_plan(sync="pipelined_scatter_reduce", **MERGED), chunks=(MERGED_CHUNKS,) * 2)
    twin = dataclasses.replace(job.manual_plan(sync="scatter_reduce", aggregators=4, **MERGED), chunks=(MERGED_CHUNKS,) * 2)
    return {"exchange": job.run(plan=plan, backend=backend), "map": float64_job("requests-map").run(plan=twin, backend=backend)}


@pytest.fixture(scope="module")
def logged(tmp_path_factory):
    """The jobs of this module, run on a stack of its own that logs every S3 request it serves."""
    log = str(tmp_path_factory.mktemp("requests") / "s3.log")
    saved = {k: os.environ.get(k) for k in (REQUEST_LOG_ENV, "STAGECOACH_LOCAL_ATTACH")}
    # set while the stack starts (its server inherits it) and the module's runs go
    os.environ.update({REQUEST_LOG_ENV: log, "STAGECOACH_LOCAL_ATTACH": "0"})
    shared, LocalBackend._shared = LocalBackend._shared, None  # the session's, started without the log
    backend = None
    try:
        backend = LocalBackend()  # a stack of its own: its process starts now, with the variable
        job = demo_like("requests-demo")
        run = job.run(backend=backend, **SHAPE)
        # the same job whose gradients travel as chunk objects: the pipelined sync exchanges them itself
        chunked = demo_like("requests-chunked").run(backend=backend, sync="pipelined_scatter_reduce", **SHAPE)
        for r in (run, chunked):
            assert r.wait(progress=False, poll_s=0.2, timeout_s=900) == "SUCCEEDED"
        merged = start_merged(backend)  # after the demo's: a loaded machine's late tasks run twice
        for r in merged.values():
            assert r.wait(progress=False, poll_s=0.2, timeout_s=900) == "SUCCEEDED"
        counts = per_iteration(log, run.job_id, run_twice(backend, run.job_id))
        ex = merged["exchange"]
        merged_counts = per_iteration(log, ex.job_id, run_twice(backend, ex.job_id))
    except BaseException:
        if backend is not None:
            backend.stack.close()  # the stack it started, also when its runs fail
        raise
    finally:
        LocalBackend._shared = shared
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    yield (job, run, counts, chunked), (merged, merged_counts)
    backend.stack.close()


@pytest.fixture(scope="module")
def counted(logged):
    """The demo-shaped job's run, its requests per iteration, and its pipelined twin's run."""
    return logged[0]


@pytest.fixture(scope="module")
def merged(logged):
    """The float64 exchange run and its sync-Map twin, and the exchange run's requests per iteration."""
    return logged[1]


def test_each_replica_sends_a_small_stages_gradient_as_one_object(counted):
    """One PUT per backward task (6), not one per shard (12); each sync task reads its shard of
    each replica's with one ranged GET (3 stages x K = 2 sync tasks x d = 2)."""
    _, run, each, _ = counted
    assert each["gradient", "PUT"] == 6 and each["gshard", "PUT"] == 0
    assert each["gradient", "RANGE"] == 12 and each["gradient", "GET"] == 0
    plan = run.plan
    assert sum(plan.sync_tasks(s) for s in range(plan.stages)) * plan.replicas == 12


def test_the_model_counts_the_requests_the_tasks_make(counted):
    """The performance model's PUTs per iteration are the tasks' own, exactly (each task's metrics
    object besides: one per task, which sdk/cost.py adds); its GETs, polls aside (its polls are
    AWS's, at 30 ms a request), too but for the optimizer state's reload, 1/N an iteration."""
    job, run, each, _ = counted
    est = job.predict(run.plan)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Platform, "polls_while_waiting", lambda self, wait_s, *_, **__: 0.0)
        quiet = job.predict(run.plan)
    puts = sum(v for (k, cls), v in each.items() if k in TASK_KINDS and cls == "PUT")
    gets = sum(v for (k, cls), v in each.items() if k in TASK_KINDS and cls in ("GET", "RANGE"))
    assert puts == est.s3_puts == 34
    assert each["metrics", "PUT"] == est.invocations == 16
    assert gets == pytest.approx(quiet.s3_gets, abs=0.1) and gets == 44


def test_one_object_gradients_train_the_same_bits(counted):
    """Against the same job whose gradients travel as one object per chunk (the pipelined sync's
    exchange): every stage's parameters equal to the bit, and plain PyTorch's within float noise
    (tests/test_transparency.py: the micro-batched sum's order differs from one batch's)."""
    job, run, _, chunked = counted
    for s in range(SHAPE["stages"]):
        assert torch.equal(run.stage_vector(s), chunked.stage_vector(s))
    expected = train_reference(job, replicas=SHAPE["replicas"], micro_batches=SHAPE["micro_batches"])
    assert max_diff(run.trained_model(), job.build_model()) > 1e-3
    assert max_diff(run.trained_model(), expected) < 1e-5


@pytest.mark.parametrize(
    "algo, k, chunks, grad_bytes, blocks, one",
    [
        ("scatter_reduce", 2, 1, 100_000, 1, True),
        ("k_reduce", 4, 1, syncmodel.ONE_OBJECT_GRADIENT_BYTES, 1, True),
        ("scatter_reduce", 2, 1, syncmodel.ONE_OBJECT_GRADIENT_BYTES + 1, 1, False),  # large: chunks leave as they are final
        ("scatter_reduce", 8, 2, 100_000, 1, False),  # two chunks a shard
        ("all_reduce", 1, 1, 100_000, 1, False),  # one shard is one object already
        ("hierarchical", 40, 1, 100_000, 1, True),
        ("hierarchical", 40, 1, 100_000, 3, False),  # level-1 aggregators read the shards
        ("pipelined_scatter_reduce", 2, 1, 100_000, 1, False),  # exchanged among the replicas
    ],
)
def test_which_stages_send_one_gradient_object(algo, k, chunks, grad_bytes, blocks, one):
    assert syncmodel.one_gradient_object(algo, k, chunks, grad_bytes, blocks) is one


def test_the_model_charges_one_put_per_replica_for_a_one_object_gradient():
    plat = aws_platform()
    small = syncmodel.SyncChoice("scatter_reduce", 4).algorithm.stage(4, 4, 200_000, 0.0, 0.0, plat)
    large = syncmodel.SyncChoice("scatter_reduce", 4).algorithm.stage(4, 4, 40e6, 0.0, 0.0, plat)
    assert small.shards == 4 and small.tail_puts == 1
    assert large.tail_puts == large.shards > 4


def test_a_workers_list_counts_as_what_s3_bills_it_a_put():
    """S3 prices a LIST as a PUT (https://aws.amazon.com/s3/pricing/): the channel counts it so,
    and the measured cost (a task's ``puts``) prices it so."""
    s3 = MemoryS3()
    ch = Channel(s3, "bucket")
    s3.put_object(Bucket="bucket", Key="jobs/j/abort/w0-a", Body=b"{}")
    assert ch.any_under("jobs/j/abort/w0-") and not ch.any_under("jobs/j/abort/w5-")
    assert (ch.stats.puts, ch.stats.gets) == (2, 0)


def test_the_exchange_sends_its_peers_chunks_in_merged_objects(merged):
    """Each backward task PUTs its (d-1) C = 6 peer chunks as 2 objects (UPLOADS_IN_FLIGHT chunks
    each), not 6; each owner still reads every chunk of its shard, now by a ranged GET: 2 stages x
    d = 4 tasks x 2 objects = 16 PUTs an iteration where one object per chunk was 48."""
    runs, each = merged
    d, c, stages = MERGED["replicas"], MERGED_CHUNKS, MERGED["stages"]
    per_task = syncmodel.exchange_objects("pipelined_scatter_reduce", d, c)
    assert per_task == 2 and each["gshard", "PUT"] == stages * d * per_task == 16
    assert stages * d * (d - 1) * c - each["gshard", "PUT"] == 32  # the PUTs the merge saves
    assert each["gshard", "RANGE"] == stages * d * (d - 1) * c and each["gshard", "GET"] == 0


def test_merged_exchange_objects_train_the_same_bits(merged):
    """The transport changed, not the reduction: every stage equals, to the bit, the same job
    reduced by a sync Map (the same left fold), and plain PyTorch's within float64 noise."""
    runs, _ = merged
    ex, twin = runs["exchange"], runs["map"]
    for s in range(MERGED["stages"]):
        assert torch.equal(ex.stage_vector(s), twin.stage_vector(s))
    job = ex.job
    assert max_diff(ex.trained_model(), job.build_model()) > 1e-3
    assert max_diff(ex.trained_model(), train_reference(job, replicas=MERGED["replicas"], micro_batches=1)) < 1e-12


def test_the_model_counts_the_merged_exchanges_requests(merged):
    """The model's PUTs per iteration are the exchange tasks' own, exactly; its GETs, polls
    aside, too but for the optimizer state's reload (as for the demo)."""
    runs, each = merged
    run = runs["exchange"]
    est = run.job.predict(run.plan)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Platform, "polls_while_waiting", lambda self, wait_s, *_, **__: 0.0)
        quiet = run.job.predict(run.plan)
    puts = sum(v for (k, cls), v in each.items() if k in TASK_KINDS and cls == "PUT")
    gets = sum(v for (k, cls), v in each.items() if k in TASK_KINDS and cls in ("GET", "RANGE"))
    assert puts == est.s3_puts
    assert gets == pytest.approx(quiet.s3_gets, abs=0.5)


def test_the_in_memory_s3_serves_a_range_as_s3_does():
    """``bytes=a-b`` is [a, b] with both ends included, b clipped to the object (the GetObject
    page's Range, RFC 9110); the exchange's ranged reads rely on it in the in-memory S3 too."""
    s3 = MemoryS3()
    s3.put_object(Bucket="bucket", Key="k", Body=bytes(range(10)))
    got = [s3.get_object(Bucket="bucket", Key="k", Range=r)["Body"].read() for r in ("bytes=2-4", "bytes=8-20", "bytes=3-")]
    assert got == [bytes([2, 3, 4]), bytes([8, 9]), bytes(range(3, 10))]
    with pytest.raises(ValueError, match="not satisfiable"):
        s3.get_object(Bucket="bucket", Key="k", Range="bytes=10-12")
