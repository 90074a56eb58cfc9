"""Warm state written through (planner/plan.py ``writes_through``; docs/runtime.md "State that stays
warm"): a stage whose shards are small keeps its state in its containers' memory and also stores
every version, so a container recycled mid-window costs its task's re-run, not a window restart
(which a stage that keeps its state only in memory costs: tests/test_warm_state.py)."""

import dataclasses

import pytest
from helpers import recovery_job, same_parameters, task_errors, window_statuses

from stagecoach.core import keys
from stagecoach.core.records import JobSpec
from stagecoach.local.backend import LocalBackend
from stagecoach.planner.model.platforms import funcpipe_platform
from stagecoach.planner.model.syncmodel import NoSync, ScatterReduce
from stagecoach.planner.plan import WRITE_THROUGH_BYTES

TIMEOUT_S = 20


def run(backend, name: str, warm: bool, replicas: int = 1):
    sync = {"sync": "scatter_reduce"} if replicas > 1 else {}
    r = recovery_job(name, warm).run(stages=2, replicas=replicas, micro_batches=2, timeout_s=TIMEOUT_S, backend=backend, **sync)
    r.wait(progress=False, poll_s=0.2, timeout_s=900)
    return r


def spec_of(r) -> JobSpec:
    return JobSpec.model_validate_json(r._c.s3.get_object(Bucket=r.bucket, Key=keys.job_spec(r.job_id))["Body"].read())


@pytest.fixture(scope="module")
def stored(backend):
    return run(backend, "wt-stored", warm=False)


def test_a_small_warm_stage_stores_every_version_and_its_container_skips_the_download(backend, stored):
    """The same PUTs per iteration as without warm state (parameters and Adam state, every
    version), fewer GETs over the run (the state and parameters its container holds), the same
    parameters. Fewer over the run, not in each iteration: which idle container takes a task is
    the runtime's choice (Lambda promises none), so one iteration may land in a container that
    does not hold the state (CI saw t = 2 do so once)."""
    warm = run(backend, "wt-warm", warm=True)
    assert spec_of(warm).write_through == [True, True]
    assert same_parameters(warm.trained_model(), stored.trained_model())

    def requests(r, t):  # GETs of objects, not a wait's polls (their number is the machine's timing)
        ms = [m for m in r.metrics() if m.t == t and m.phase == "backward"]
        return sum(m.puts for m in ms), sum(m.gets - m.misses for m in ms)

    warm_requests = [requests(warm, t) for t in range(1, 5)]
    stored_requests = [requests(stored, t) for t in range(1, 5)]
    assert [p for p, _ in warm_requests] == [p for p, _ in stored_requests], (warm_requests, stored_requests)
    assert all(wg <= sg for (_, wg), (_, sg) in zip(warm_requests, stored_requests)), (warm_requests, stored_requests)
    assert sum(g for _, g in warm_requests) < sum(g for _, g in stored_requests), (warm_requests, stored_requests)


@pytest.mark.parametrize("replicas", [1, pytest.param(2, marks=pytest.mark.slow)])  # d = 2: `-m slow`
def test_a_container_recycled_mid_window_costs_a_rerun_not_a_window_restart(stored, replicas):
    """Kills at t = 1 (stage 0) and t = 3 (stage 1): the re-runs land in new containers, which
    load the state's version from S3. One window execution, no WarmStateLost, bit-identical
    (d = 2: the scatter-reduce sync task that owns a shard's state is killed)."""
    phase = "backward" if replicas == 1 else "sync"
    faulty = LocalBackend(
        faults={"once": [{"kind": "kill", "phase": "forward", "t": 1, "stage": 0}, {"kind": "kill", "phase": phase, "t": 3, "stage": 1}]}
    )
    try:
        r = run(faulty, f"wt-recycled-{replicas}", warm=True, replicas=replicas)
        assert window_statuses(r) == ["SUCCEEDED"]
        errors = task_errors(r)
        assert errors.count("Runtime.ExitError") == 2 and "WarmStateLost" not in errors, errors
        reference = stored if replicas == 1 else run(faulty, "wt-stored-2", warm=False, replicas=2)
        assert same_parameters(r.trained_model(), reference.trained_model())
    finally:
        faulty.stack.close()


def test_the_model_charges_a_written_through_stage_as_a_stored_one():
    """At most WRITE_THROUGH_BYTES of a shard's parameters: the state crosses S3 every iteration,
    but is not read back (its container holds it: only a reloaded checkpoint's GET, 1/N); above,
    once per window checkpoint."""
    plat = funcpipe_platform()
    stored_plat = dataclasses.replace(plat, warm_checkpoint_every=0)
    small, large = WRITE_THROUGH_BYTES, 2 * WRITE_THROUGH_BYTES
    through, stored = NoSync().stage(1, 1, small, 0.01, 1.0, plat), NoSync().stage(1, 1, small, 0.01, 1.0, stored_plat)
    assert dataclasses.replace(through, tail_gets=stored.tail_gets) == stored
    assert through.tail_gets == pytest.approx(stored.tail_gets / plat.warm_checkpoint_every)
    assert NoSync().stage(1, 1, large, 0.01, 1.0, plat).tail_puts == pytest.approx(2 / plat.warm_checkpoint_every)
    # d = 2, K = 2: a shard is half the stage
    through, stored = (
        ScatterReduce().stage(2, 2, 2 * small, 0.01, 1.0, plat),
        ScatterReduce().stage(2, 2, 2 * small, 0.01, 1.0, stored_plat),
    )
    assert dataclasses.replace(through, task_gets=stored.task_gets) == stored
    assert stored.task_gets - through.task_gets == pytest.approx(1 - 1 / plat.warm_checkpoint_every)  # the state's GET
    assert (
        ScatterReduce().stage(2, 2, 2 * large, 0.01, 1.0, plat).task_puts
        < ScatterReduce().stage(2, 2, 2 * large, 0.01, 1.0, stored_plat).task_puts
    )
