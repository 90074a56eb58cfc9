"""Transparency: a pipelined, data-parallel run ends with the parameters of plain single-process PyTorch.

Every configuration of the issue runs on the embedded local stack — Step Functions states, Lambda
tasks, S3 transport, sharded optimizer — in float64, and is compared element by element with
stagecoach.reference.train_reference (same init, data order, global batch; the same micro-batches,
so dropout draws the same masks). A model without dropout is also compared with ordinary
full-batch training, which knows nothing of replicas or micro-batches.
"""

import dataclasses

import pytest
import torch
from helpers import capped_backend, max_diff, run_in_waves, watcher_events
from torch import nn

from stagecoach import Job
from stagecoach.planner.emit import asl
from stagecoach.reference import train_reference

ITERATIONS = 6
GLOBAL_BATCH = 24
CONFIGS = [(1, 1, 1), (2, 1, 4), (1, 3, 2), (3, 2, 4)]  # (stages, replicas, micro-batches)
# every sync algorithm, alone and mixed per stage (stages, replicas, micro-batches, sync, K)
SYNC_CONFIGS = [
    (2, 3, 2, "pipelined_scatter_reduce", None),
    (2, 3, 2, "lambdaml_scatter_reduce", None),
    (2, 3, 2, "k_reduce", 2),
    (2, 3, 2, "all_reduce", None),
    (3, 2, 4, ("pipelined_scatter_reduce", "all_reduce", "k_reduce"), (2, 1, 2)),
]
OPTIMIZERS = {
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
    "adam": lambda p: torch.optim.Adam(p, lr=0.01),
}


def adamw_no_decay_on_biases(p):
    """The usual recipe: weight decay on matrices only."""
    return torch.optim.AdamW(
        [{"params": [q for q in p if q.ndim > 1], "weight_decay": 0.5}, {"params": [q for q in p if q.ndim <= 1], "weight_decay": 0.0}],
        lr=0.01,
    )


def sgd_frozen_biases(p):
    """A group with its own learning rate (0: the biases must end exactly where they started)."""
    return torch.optim.SGD(
        [{"params": [q for q in p if q.ndim > 1]}, {"params": [q for q in p if q.ndim <= 1], "lr": 0.0}], lr=0.05, momentum=0.9
    )


# parameter groups (once refused: they collapsed into one on a flat shard); shards cut across groups
GROUP_CONFIGS = [("adamw-groups", adamw_no_decay_on_biases, (2, 3, 2)), ("sgd-groups", sgd_frozen_biases, (4, 2, 3))]


def model_with_batchnorm() -> nn.Sequential:
    """BatchNorm with exponential (default) and cumulative (momentum=None) running statistics."""
    return nn.Sequential(
        nn.Linear(10, 32),
        nn.BatchNorm1d(32),
        nn.Tanh(),
        nn.Dropout(0.1),
        nn.Linear(32, 32),
        nn.BatchNorm1d(32, momentum=None),
        nn.Tanh(),
        nn.Linear(32, 4),
    )


# BatchNorm keeps the global batch together (batch statistics couple its samples): stages only
BN_CONFIGS = [("sgd-momentum", (1, 1, 1)), ("adam", (3, 1, 1)), ("adam", (4, 1, 1))]
# ... unless the job opts in to deferred batch norm (docs/exactness.md): per micro-batch
# statistics, running statistics updated once per iteration from the whole global batch.
# (2, 1, 1): with the option on a plan that keeps the batch together, plain PyTorch exactly.
# (optimizer, (stages, replicas, micro-batches), sync: None for the default)
DEFERRED_BN_CONFIGS = [("adam", (2, 3, 2), None), ("sgd-momentum", (2, 1, 1), None)]
DEFERRED_BN_SLOW_CONFIGS = [
    ("sgd-momentum", (2, 3, 2), None),
    ("adam", (3, 1, 4), None),
    ("sgd-momentum", (3, 1, 4), None),
    ("adam", (4, 2, 3), None),
    # replica 0 merges the records after the backward tasks' own exchange
    ("sgd-momentum", (4, 2, 3), "pipelined_scatter_reduce"),
]


class TiedHead(nn.Module):
    """An output layer that reuses the input projection's weight, transposed (BERT's decoder and
    word embeddings): one tensor on the first and the last stage."""

    def __init__(self, projection: nn.Linear) -> None:
        super().__init__()
        self.projection = projection
        self.bias = nn.Parameter(torch.zeros(projection.in_features))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h @ self.projection.weight + self.bias


def model_with_tied_weights() -> nn.Sequential:
    projection = nn.Linear(10, 32)
    return nn.Sequential(
        projection, nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Dropout(0.1), nn.Linear(32, 32), nn.Tanh(), TiedHead(projection)
    )


def model_with_a_module_used_twice() -> nn.Sequential:
    shared = nn.Linear(32, 32)
    return nn.Sequential(nn.Linear(10, 32), nn.Tanh(), shared, nn.Tanh(), shared, nn.Tanh(), nn.Linear(32, 4))


# shared parameters (once refused: the copies drifted apart); the first stage that uses one owns it.
# Each at every (stages, replicas, micro-batches) of the issue with both optimizers: the slow grid
# (tests/test_transparency_grid.py).
SHARED_CONFIGS = [
    ("tied", model_with_tied_weights, "adam", (2, 3, 2)),
    ("tied", model_with_tied_weights, "sgd-momentum", (4, 2, 3)),
    ("twice", model_with_a_module_used_twice, "sgd-momentum", (4, 2, 3)),
]


def model_with_dropout() -> nn.Sequential:
    return nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Dropout(0.2), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))


def model_without_dropout() -> nn.Sequential:
    return nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 16), nn.Linear(16, 4))


def make_job(name: str, model, optimizer, **options) -> Job:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(96, 10, generator=g, dtype=torch.float64)
    y = torch.randint(0, 4, (96,), generator=g)
    return Job(
        model=model,
        loss=nn.CrossEntropyLoss(),
        optimizer=optimizer,
        train=(x, y),
        global_batch=GLOBAL_BATCH,
        iterations=ITERATIONS,
        seed=3,
        dtype=torch.float64,
        name=name,
        **options,
    )


# The default run (`make test`) trains one configuration per capability; the rest of the grid is
# `-m slow` (`make test-all`). A key names one run of the `runs` fixture.
DEFAULT_KEYS = {
    ("sgd-momentum", (2, 1, 4)),
    ("adam", (3, 2, 4)),
    ("sync", len(SYNC_CONFIGS) - 1),  # three algorithms mixed per stage
    ("sgd-groups", (4, 2, 3)),
    ("bn-adam", (3, 1, 1)),
    ("tied-adam", (2, 3, 2)),
    ("nodrop", (3, 2, 4)),
}


def tier(key, *values, id: str):
    """A test parameter marked slow unless its run is one of DEFAULT_KEYS."""
    return pytest.param(*values, id=id, marks=() if key in DEFAULT_KEYS else pytest.mark.slow)


def _keys_of(item) -> set:
    """The runs a selected test of this module reads (every run, for the history count)."""
    params = getattr(item, "callspec", None)
    params = params.params if params else {}
    if "opt_name" in params:
        return {(params["opt_name"], params["cfg"])}
    if "i" in params and "sync_algorithm" in item.name:
        return {("sync", params["i"])}
    if "i" in params and "groups" in item.name:
        name, _, cfg = GROUP_CONFIGS[params["i"]]
        return {(name, cfg)}
    if "i" in params and "batchnorm_parameters" in item.name:
        opt_name, cfg = BN_CONFIGS[params["i"]]
        return {(f"bn-{opt_name}", cfg)}
    if "i" in params and "shared" in item.name:
        kind, _, opt_name, cfg = SHARED_CONFIGS[params["i"]]
        return {(f"{kind}-{opt_name}", cfg)}
    named = {
        "test_sync_algorithms_agree_bit_for_bit": {("sync", i) for i in range(3)},
        "test_micro_batched_data_parallel_pipeline_equals_full_batch_training": {("nodrop", (3, 2, 4))},
        "test_losses_are_reported_per_iteration": {("adam", (3, 2, 4))},
        "test_warm_containers_are_reused_and_cold_starts_counted": {("adam", (3, 2, 4))},
    }
    return named.get(item.name, set())


def _planned() -> dict:
    """Every configuration: key -> (job, run options)."""
    planned = {}
    for opt_name, opt in OPTIMIZERS.items():
        for s, d, m in CONFIGS:
            planned[(opt_name, (s, d, m))] = (
                make_job(f"tr-{opt_name[:4]}-{s}{d}{m}", model_with_dropout, opt),
                dict(stages=s, replicas=d, micro_batches=m),
            )
    for i, (s, d, m, sync, k) in enumerate(SYNC_CONFIGS):
        job = make_job(f"tr-sync-{i}", model_with_dropout, OPTIMIZERS["adam"])
        planned[("sync", i)] = (job, dict(stages=s, replicas=d, micro_batches=m, sync=sync, aggregators=k))
    for name, opt, (s, d, m) in GROUP_CONFIGS:
        planned[(name, (s, d, m))] = (make_job(f"tr-{name}", model_with_dropout, opt), dict(stages=s, replicas=d, micro_batches=m))
    for opt_name, (s, d, m) in BN_CONFIGS:
        job = make_job(f"tr-bn-{opt_name[:4]}-{s}{d}{m}", model_with_batchnorm, OPTIMIZERS[opt_name])
        planned[(f"bn-{opt_name}", (s, d, m))] = (job, dict(stages=s, replicas=d, micro_batches=m))
    for kind, model, opt_name, (s, d, m) in SHARED_CONFIGS:
        job = make_job(f"tr-{kind}-{opt_name[:4]}-{s}{d}{m}", model, OPTIMIZERS[opt_name])
        planned[(f"{kind}-{opt_name}", (s, d, m))] = (job, dict(stages=s, replicas=d, micro_batches=m))
    planned[("nodrop", (3, 2, 4))] = (
        make_job("tr-nodrop", model_without_dropout, OPTIMIZERS["adam"]),
        dict(stages=3, replicas=2, micro_batches=4),
    )
    return planned


@pytest.fixture(scope="module")
def runs(request):
    """The configurations the selected tests read, 4 runs at a time on a capped stack of its own
    (all 22 at once, with a process per warm worker, exhausted this 24 GiB machine's memory)."""
    items = [i for i in request.session.items if i.path == request.path]
    wanted = set().union(*(_keys_of(i) for i in items))
    planned = {key: value for key, value in _planned().items() if key in wanted}
    backend = capped_backend()
    starts = {key: (lambda job=job, opts=opts: job.run(backend=backend, **opts)) for key, (job, opts) in planned.items()}
    yield run_in_waves(starts, 4)
    backend.stack.close()


@pytest.mark.parametrize(("opt_name", "cfg"), [tier((o, c), o, c, id="{}x{}x{}-{}".format(*c, o)) for c in CONFIGS for o in OPTIMIZERS])
def test_parameters_equal_single_process_pytorch(runs, opt_name, cfg):
    run = runs[(opt_name, cfg)]
    _, d, m = cfg
    expected = train_reference(run.job, replicas=d, micro_batches=m)
    trained = run.trained_model()
    initial = run.job.build_model()
    assert max_diff(trained, initial) > 1e-3, "training must have moved the parameters"
    assert max_diff(trained, expected) < 1e-5


@pytest.mark.parametrize("i", [tier(("sync", i), i, id="{}x{}x{}-{}".format(*c[:4])) for i, c in enumerate(SYNC_CONFIGS)])
def test_every_sync_algorithm_gives_the_parameters_of_single_process_pytorch(runs, i):
    run = runs[("sync", i)]
    _, d, m, _, _ = SYNC_CONFIGS[i]
    expected = train_reference(run.job, replicas=d, micro_batches=m)
    assert max_diff(run.trained_model(), run.job.build_model()) > 1e-3
    assert max_diff(run.trained_model(), expected) < 1e-5


@pytest.mark.parametrize("i", [tier((c[0], c[2]), i, id=c[0]) for i, c in enumerate(GROUP_CONFIGS)])
def test_parameter_groups_keep_their_own_hyperparameters(runs, i):
    name, _, cfg = GROUP_CONFIGS[i]
    run = runs[(name, cfg)]
    expected = train_reference(run.job, replicas=cfg[1], micro_batches=cfg[2])
    trained, initial = run.trained_model(), run.job.build_model()
    assert max_diff(trained, initial) > 1e-3
    assert max_diff(trained, expected) < 1e-5
    if name == "sgd-groups":  # lr 0 on the biases: untouched, to the bit
        assert all(torch.equal(p, q) for p, q in zip(trained.parameters(), initial.parameters()) if p.ndim == 1)
    else:  # one group collapsed into the other would give other parameters
        collapsed = dataclasses.replace(run.job, optimizer=lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.5))
        assert max_diff(trained, train_reference(collapsed, replicas=cfg[1], micro_batches=cfg[2])) > 1e-4


@pytest.mark.parametrize("i", [tier((f"bn-{o}", c), i, id="{}-{}x{}x{}".format(o, *c)) for i, (o, c) in enumerate(BN_CONFIGS)])
def test_batchnorm_parameters_and_running_statistics_equal_pytorch_in_train_mode(runs, i):
    """Running statistics are updated in the forward pass only — never again by the backward
    phase's recompute — and kept per stage across iterations and containers."""
    opt_name, cfg = BN_CONFIGS[i]
    _check_batchnorm(runs[(f"bn-{opt_name}", cfg)], 1, 1)


def _check_batchnorm(run, d: int, m: int) -> dict[str, torch.Tensor]:
    """Parameters and every BatchNorm buffer equal the single-process reference; the statistics
    were updated once per iteration and moved. Returns the trained buffers."""
    expected = train_reference(run.job, replicas=d, micro_batches=m)
    trained = run.trained_model()
    assert max_diff(trained, run.job.build_model()) > 1e-3
    assert max_diff(trained, expected) < 1e-5
    got, want = dict(trained.named_buffers()), dict(expected.named_buffers())
    assert set(got) == set(want) and len(got) == 6
    assert all(int(got[k]) == ITERATIONS for k in got if k.endswith("num_batches_tracked"))  # once per iteration
    assert max(float((got[k].double() - want[k].double()).abs().max()) for k in got) < 1e-5
    initial = dict(run.job.build_model().named_buffers())
    assert all(float((got[k] - initial[k]).abs().max()) > 1e-3 for k in ("1.running_var", "5.running_var"))  # they did move
    return got


def _start_deferred_bn(backend, configs):
    started = {}
    for opt_name, (s, d, m), sync in configs:
        job = make_job(f"tr-dbn-{opt_name[:4]}-{s}{d}{m}", model_with_batchnorm, OPTIMIZERS[opt_name], deferred_batch_norm=True)
        started[(opt_name, (s, d, m))] = job.run(stages=s, replicas=d, micro_batches=m, sync=sync, backend=backend)
    for run in started.values():
        run.wait(progress=False, poll_s=0.2, timeout_s=600)
    return started


@pytest.fixture(scope="module")
def deferred_bn_runs(backend):
    return _start_deferred_bn(backend, DEFERRED_BN_CONFIGS)


@pytest.fixture(scope="module")
def deferred_bn_slow_runs(backend):
    return _start_deferred_bn(backend, DEFERRED_BN_SLOW_CONFIGS)


def _check_deferred_bn(run, cfg):
    """Parameters and every BatchNorm buffer equal the single-process reference, which follows the
    documented semantics in plain PyTorch (per micro-batch normalisation; one running-statistics
    update per iteration from the concatenated global batch)."""
    _, d, m = cfg
    got = _check_batchnorm(run, d, m)
    if d * m > 1:
        # the semantics differ from updating per micro-batch, by more than the tolerance
        per_micro_batch = dataclasses.replace(run.job, deferred_batch_norm=False)
        stale = dict(train_reference(per_micro_batch, replicas=d, micro_batches=m).named_buffers())
        assert max(float((got[k].double() - stale[k].double()).abs().max()) for k in got) > 1e-3


@pytest.mark.parametrize(
    "i", range(len(DEFERRED_BN_CONFIGS)), ids=lambda i: "{}-{}x{}x{}".format(DEFERRED_BN_CONFIGS[i][0], *DEFERRED_BN_CONFIGS[i][1])
)
def test_deferred_batch_norm_splits_the_batch_and_updates_running_statistics_once_per_iteration(deferred_bn_runs, i):
    opt_name, cfg, _ = DEFERRED_BN_CONFIGS[i]
    _check_deferred_bn(deferred_bn_runs[(opt_name, cfg)], cfg)


@pytest.mark.slow
@pytest.mark.parametrize(
    "i",
    range(len(DEFERRED_BN_SLOW_CONFIGS)),
    ids=lambda i: "{}-{}x{}x{}{}".format(
        DEFERRED_BN_SLOW_CONFIGS[i][0],
        *DEFERRED_BN_SLOW_CONFIGS[i][1],
        f"-{DEFERRED_BN_SLOW_CONFIGS[i][2]}" if DEFERRED_BN_SLOW_CONFIGS[i][2] else "",
    ),
)
def test_deferred_batch_norm_on_every_split(deferred_bn_slow_runs, i):
    opt_name, cfg, _ = DEFERRED_BN_SLOW_CONFIGS[i]
    _check_deferred_bn(deferred_bn_slow_runs[(opt_name, cfg)], cfg)


@pytest.mark.parametrize(
    "i", [tier((f"{k}-{o}", c), i, id="{}-{}-{}x{}x{}".format(k, o, *c)) for i, (k, _, o, c) in enumerate(SHARED_CONFIGS)]
)
def test_shared_parameters_train_as_one_tensor_like_pytorch(runs, i):
    kind, _, opt_name, cfg = SHARED_CONFIGS[i]
    run = runs[(f"{kind}-{opt_name}", cfg)]
    expected = train_reference(run.job, replicas=cfg[1], micro_batches=cfg[2])
    trained = run.trained_model()
    assert max_diff(trained, run.job.build_model()) > 1e-3
    assert max_diff(trained, expected) < 1e-5
    # still one tensor in the trained model, used at both places
    layers = list(trained)
    assert (layers[-1].projection is layers[0]) if kind == "tied" else (layers[2] is layers[4])


@pytest.mark.slow  # tests/test_collectives.py checks the same on the algorithms themselves, fast
def test_sync_algorithms_agree_bit_for_bit(runs):
    """Same reduction order, elementwise optimizer: the algorithms differ in traffic, not in bits."""
    vectors = [torch.cat([runs[("sync", i)].stage_vector(s) for s in range(2)]) for i in range(3)]
    assert torch.equal(vectors[0], vectors[1]) and torch.equal(vectors[0], vectors[2])


def test_micro_batched_data_parallel_pipeline_equals_full_batch_training(runs):
    run = runs[("nodrop", (3, 2, 4))]
    expected = train_reference(run.job)  # one batch of 24, no replicas, no micro-batches
    assert max_diff(run.trained_model(), expected) < 1e-5


def test_losses_are_reported_per_iteration(runs):
    run = runs[("adam", (3, 2, 4))]
    losses = run.losses()
    assert len(losses) == ITERATIONS and all(0 < v < 10 for v in losses)


def test_window_history_matches_the_emitters_count(runs):
    """Every fault-free run's window has exactly the emitter's count of events. A task that ran past
    its learnt timeout (at least 2 s, lambdas/timeouts.py) on this loaded 2-core machine is run again,
    correctly, with events the formula leaves out: such a run is checked for that cause alone, and
    most runs must have none."""
    exact = 0
    for (_, cfg), run in runs.items():
        windows = run.window_executions()
        assert len(windows) == 1
        # the phase watchers' Tasks left out (their end is moto's timing: docs/local-stack.md)
        history = run.history(execution_arn=windows[0])
        watchers = watcher_events(history)
        events = [e for e in history if e not in watchers]
        watched = ITERATIONS * asl.watched_phases(run.plan)
        assert len([e for e in watchers if e["type"] == "TaskStateEntered"]) == watched, cfg
        expected = asl.EV_WINDOW_FIXED + ITERATIONS * asl.events_per_iteration(run.plan) - watched * asl.EV_TASK
        again = [e["type"] for e in events if e["type"] in ("TaskTimedOut", "TaskFailed")]
        if not again:
            assert len(events) == expected, cfg
            exact += 1
        else:
            assert len(events) > expected and "TaskTimedOut" in again, (cfg, again)
    assert exact > len(runs) / 2, f"only {exact} of {len(runs)} runs had no task timed out"


def test_warm_containers_are_reused_and_cold_starts_counted(runs):
    ms = runs[("adam", (3, 2, 4))].metrics()
    containers = {m.container for m in ms}
    cold = [m for m in ms if m.cold]
    assert len(cold) == len(containers), "exactly one cold start per container"
    assert len(containers) < len(ms) / 4, "most tasks run in warm containers"
    assert max(m.invocation for m in ms) >= ITERATIONS
