"""State that stays warm (docs/runtime.md): with one replica a stage's parameters and Adam state stay
in its worker's memory, reach S3 only as window checkpoints, and a recycled container mid-window
restarts the window from its checkpoint, bit-identically. The state here is small enough to be
written through (tests/test_write_through.py); the threshold is set to 0 so it is not."""

import re

import pytest
from helpers import recovery_job, same_parameters, task_errors, window_statuses

from stagecoach.local.backend import LocalBackend
from stagecoach.planner import plan as plan_module
from stagecoach.planner.emit import asl
from stagecoach.planner.model.platforms import aws_platform

TIMEOUT_S = 20
WINDOW = 2  # windows [0, 2), [2, 4), [4, 5): checkpoints 0, 2, 4, 5


@pytest.fixture(scope="module", autouse=True)
def short_windows():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(asl, "window_length", lambda plan, limit=asl.HISTORY_LIMIT, **kw: WINDOW)
        mp.setattr(plan_module, "WRITE_THROUGH_BYTES", 0)  # state only at window checkpoints
        yield


def run(backend, name: str, warm: bool):
    r = recovery_job(name, warm).run(stages=2, replicas=1, micro_batches=2, timeout_s=TIMEOUT_S, backend=backend)
    r.wait(progress=False, poll_s=0.2, timeout_s=900)
    return r


def stored_versions(r, kind: str) -> set[int]:
    prefix = f"jobs/{r.job_id}/{kind}/"
    found = set()
    for page in r._c.s3.get_paginator("list_objects_v2").paginate(Bucket=r.bucket, Prefix=prefix):
        for o in page.get("Contents", []):
            found.add(int(re.match(r"v(\d+)/", o["Key"][len(prefix) :]).group(1)))
    return found


@pytest.fixture(scope="module")
def stored(backend):
    return run(backend, "stored", warm=False)


def test_warm_state_trains_bit_identically_and_stores_only_checkpoints(backend, stored):
    warm = run(backend, "warm", warm=True)
    assert same_parameters(warm.trained_model(), stored.trained_model())
    assert stored_versions(warm, "params") == {0, 2, 4, 5}
    assert stored_versions(warm, "optim") == {2, 4, 5}
    # the old path stored every version, and deleted each but the checkpoints once read
    assert stored_versions(stored, "params") == {0, 2, 4, 5}

    # within a window nothing of the state moves: iteration 2 (mid-window [2, 4)) uploads and
    # downloads only activations and input gradients
    def state_bytes(r, t):
        return sum(m.bytes_up + m.bytes_down for m in r.metrics() if m.t == t)

    assert state_bytes(warm, 2) < state_bytes(stored, 2)


def test_a_container_recycled_mid_window_restarts_the_window_from_its_checkpoint(stored):
    faulty = LocalBackend(
        faults={
            "once": [
                {"kind": "kill", "phase": "forward", "t": 1, "stage": 0},
                {"kind": "kill", "phase": "backward", "t": 3, "stage": 1},
            ]
        }
    )
    try:
        r = run(faulty, "recycled", warm=True)
        statuses = window_statuses(r)
        assert statuses.count("FAILED") == 2 and statuses.count("SUCCEEDED") == 3, statuses
        assert "WarmStateLost" in task_errors(r)
        assert same_parameters(r.trained_model(), stored.trained_model())
    finally:
        faulty.stack.close()


@pytest.mark.slow  # the default run meets 25% kills under warm state in test_faults.py (d = 2)
def test_under_many_killed_containers_a_restarted_window_runs_stored_and_completes_bit_identically(stored):
    """25% of tasks killed: a warm window rarely survives, so its restart stores every version
    (an earlier attempt's abort marker says so) and recovers kills by task retries."""
    faulty = LocalBackend(faults={"seed": 4, "kill": 0.25, "throttle": 0.05})
    try:
        r = run(faulty, "many-kills", warm=True)
        assert "WarmStateLost" in task_errors(r)
        assert same_parameters(r.trained_model(), stored.trained_model())
    finally:
        faulty.stack.close()


def test_the_model_charges_a_warm_stage_its_state_once_per_checkpoint():
    import dataclasses

    from stagecoach.planner.model.platforms import funcpipe_platform
    from stagecoach.planner.model.syncmodel import NoSync

    plat = funcpipe_platform()
    p, opt = 1.34e9, 5.0  # BERT-Large's parameters in one stage, fp32
    store = plat.storage_latency_s + (1 + plat.optimizer_state_ratio) * p / plat.bandwidth_Bps
    stored = NoSync().stage(1, 1, p, opt, 30.0, dataclasses.replace(plat, warm_checkpoint_every=0))
    warm = NoSync().stage(1, 1, p, opt, 30.0, plat)
    assert stored.tail_s >= opt + store and (stored.tail_puts, stored.tail_gets) == (2, 1)
    n = plat.warm_checkpoint_every
    assert warm.tail_s == pytest.approx(opt + store / n) and warm.tail_puts == pytest.approx(2 / n)


def test_a_job_without_warm_state_is_planned_and_predicted_with_its_state_through_s3_every_iteration():
    """Job(warm_state=False) stores the parameters and Adam state every iteration: its predictions
    (Job.predict, and the planner through Job.plan) charge that, a warm job's only per checkpoint."""
    warm, cold = recovery_job("pred-warm", warm=True), recovery_job("pred-cold", warm=False)
    plan = warm.manual_plan(stages=2)
    a, b = warm.predict(plan), cold.predict(plan)
    assert b.s3_puts > a.s3_puts + 1 and b.time_s > a.time_s
    # the planner is handed the same platform
    import stagecoach.job as job_module

    seen = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(job_module, "plan_model", lambda profile, batch, platform, **kw: seen.append(platform))
        warm.plan()
        cold.plan()
    assert [p.warm_checkpoint_every for p in seen] == [aws_platform().warm_checkpoint_every, 0]


# -- d > 1: one function per worker, each owner's optimizer state warm in its own container ---------
def run_replicated(backend, name: str, warm: bool, sync: str):
    r = recovery_job(name, warm).run(stages=2, replicas=2, micro_batches=2, sync=sync, timeout_s=TIMEOUT_S, backend=backend)
    r.wait(progress=False, poll_s=0.2, timeout_s=900)
    return r


@pytest.fixture(scope="module")
def stored_replicated(backend):
    return run_replicated(backend, "stored-d2", warm=False, sync="scatter_reduce")


def job_functions(r) -> set[str]:
    names = set()
    for page in r._c.lambda_.get_paginator("list_functions").paginate():
        names |= {f["FunctionName"] for f in page["Functions"] if r.job_id in f["FunctionName"]}
    return names


@pytest.mark.parametrize(
    "sync", ["pipelined_scatter_reduce", *(pytest.param(a, marks=pytest.mark.slow) for a in ("scatter_reduce", "lambdaml_scatter_reduce"))]
)
def test_with_replicas_every_worker_has_a_function_and_keeps_its_shards_state_warm(backend, stored_replicated, sync):
    warm = run_replicated(backend, f"warm-d2-{sync[:4]}", warm=True, sync=sync)
    assert same_parameters(warm.trained_model(), stored_replicated.trained_model())
    # the optimizer state reaches S3 as the windows' checkpoints (the parameters' shards, which
    # the other replicas read, every iteration, each deleted once read: as the stored path)
    assert stored_versions(warm, "optim") == {2, 4, 5}
    names = {n.rsplit("-s", 1)[1] for n in job_functions(warm)}
    sync_fns = {"0-k0", "0-k1", "1-k0", "1-k1"} if sync == "scatter_reduce" else set()
    assert names == {"0", "0-r1", "1", "1-r1", "0-w"} | sync_fns  # and the phase watcher's (plan.watcher_function)
    assert {n.rsplit("-s", 1)[1] for n in job_functions(stored_replicated)} == {"0", "1", "0-w"}  # one per stage without warm state

    # mid-window (iteration 2 of [2, 4)) the state does not move: fewer bytes than the stored path
    def moved(r, t):
        return sum(m.bytes_up + m.bytes_down for m in r.metrics() if m.t == t)

    assert moved(warm, 2) < moved(stored_replicated, 2)


@pytest.mark.parametrize(
    "sync, fault",
    [
        ("pipelined_scatter_reduce", {"kind": "kill", "phase": "backward", "t": 1, "stage": 0}),
        # a sync task's container (slow: the default run recycles a fused exchange's)
        pytest.param("scatter_reduce", {"kind": "kill", "phase": "sync", "t": 3, "stage": 1}, marks=pytest.mark.slow),
    ],
)
def test_with_replicas_a_container_recycled_mid_window_restarts_it_bit_identically(stored_replicated, sync, fault):
    """The killed task's retry runs in a new container, which holds no state: its version check
    fails (WarmStateLost), the window restarts from its checkpoint, the result is the same bits."""
    faulty = LocalBackend(faults={"once": [fault]})
    try:
        r = run_replicated(faulty, f"recycled-d2-{sync[:4]}", warm=True, sync=sync)
        statuses = window_statuses(r)
        assert statuses.count("FAILED") == 1 and statuses.count("SUCCEEDED") == 3, statuses
        assert "WarmStateLost" in task_errors(r)
        assert same_parameters(r.trained_model(), stored_replicated.trained_model())
    finally:
        faulty.stack.close()


@pytest.mark.parametrize("algo", ["scatter_reduce", "pipelined_scatter_reduce", "lambdaml_scatter_reduce"])
def test_the_model_charges_a_shards_owner_its_state_once_per_checkpoint_with_replicas(algo):
    import dataclasses

    from stagecoach.planner.model.platforms import funcpipe_platform
    from stagecoach.planner.model.syncmodel import SYNC_ALGORITHMS, chunks_per_shard

    plat = funcpipe_platform()
    d, p, opt = 4, 1.34e9 / 4, 1.0  # a quarter of BERT-Large per stage, Adam (rho = 2)
    a = SYNC_ALGORITHMS[algo]
    stored = a.stage(d, d, p, opt, 30.0, dataclasses.replace(plat, warm_checkpoint_every=0), 1.0)
    warm = a.stage(d, d, p, opt, 30.0, plat, 1.0)
    n, rho, w = plat.warm_checkpoint_every, plat.optimizer_state_ratio, plat.bandwidth_Bps
    c = chunks_per_shard(d, d, p)
    saved = rho * (1 - 1 / n) * p / (d * w)  # a shard's state, down and up, no longer every iteration
    if algo == "scatter_reduce":  # the sync task downloads its state and uploads it with the parameters
        assert stored.task_s - warm.task_s == pytest.approx(saved + min(2, c) * saved / c)
        assert stored.task_gets - warm.task_gets == pytest.approx(c * (1 - 1 / n))
        assert stored.task_puts - warm.task_puts == pytest.approx(c * (1 - 1 / n))
        assert stored.tail_s == warm.tail_s  # the gradient's upload is not the state's
    else:  # the backward task's own upload of shard r loses the state's bytes (and requests)
        assert stored.tail_puts - warm.tail_puts == pytest.approx(c * (1 - 1 / n))
        if algo == "lambdaml_scatter_reduce":  # phase 3 uploads the shard and its state, alone
            assert stored.tail_s - warm.tail_s == pytest.approx(saved)
        else:  # pipelined: the download link (exchange, then gather: 2E) sets the pace, not the uploads
            assert warm.tail_s == pytest.approx(stored.tail_s)
