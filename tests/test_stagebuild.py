"""A container builds and holds only its own stage (core/stagebuild.py, docs/runtime.md
"Building a stage"): the factory runs on the meta device, the stage's blocks get storage, and their
values come from S3; a factory that a meta build would not reproduce falls back to the full build,
which the client decides (sdk/exactness.py meta_build_refusal) and the job's spec records."""

import math

import pytest
import torch
from safetensors.torch import load as st_load
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from stagecoach import Job
from stagecoach.core import keys
from stagecoach.core.stagebuild import build_meta, build_stage, held_bytes, load_buffers, materialize, stage_buffers
from stagecoach.core.training import build_model, ownership
from stagecoach.exactness import meta_build_refusal
from stagecoach.reference import train_reference

SEED = 5


class Allocations(TorchDispatchMode):
    """Bytes of the CPU storages created while it is active (each storage once)."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                self.storages.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        return out

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())


class Head(nn.Module):
    """Ties the first block's weight (BERT's decoder and word embeddings): one tensor on two stages."""

    def __init__(self, first: nn.Linear) -> None:
        super().__init__()
        self.first = first
        self.bias = nn.Parameter(torch.zeros(first.in_features))

    def forward(self, h):
        return h @ self.first.weight + self.bias


class Positional(nn.Module):
    """A non-persistent buffer computed by the factory (not in the state dict, still needed)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.register_buffer("table", torch.sin(torch.arange(n, dtype=torch.float32) / 3.0), persistent=False)
        self.lin = nn.Linear(n, n)

    def forward(self, x):
        return self.lin(x + self.table)


def model(width: int = 16) -> nn.Sequential:
    first = nn.Linear(6, width)
    return nn.Sequential(
        first,
        nn.BatchNorm1d(width),
        nn.Tanh(),
        Positional(width),
        nn.Linear(width, width),
        nn.Tanh(),
        nn.Linear(width, width),
        Head(first),
    )


STAGES = [range(0, 3), range(3, 5), range(5, 8)]


def stage_bytes(layers, stage: int) -> int:
    own = ownership(layers, STAGES)
    tied = [t.param for t in own.tied[stage]]
    tensors = {id(t): t for t in [*own.owned[stage], *tied, *stage_buffers([layers[i] for i in STAGES[stage]], 0).values()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())


@pytest.mark.parametrize("stage", range(3))
def test_the_meta_build_allocates_its_stage_and_the_full_build_the_whole_model(stage):
    whole = build_model(model, SEED, torch.float32)
    layers = list(whole)
    whole_bytes = sum(t.numel() * t.element_size() for t in [*whole.parameters(), *whole.buffers()])
    with Allocations() as meta:
        built = build_stage(model, SEED, torch.float32, STAGES, stage, "meta")
    with Allocations() as full:
        build_stage(model, SEED, torch.float32, STAGES, stage, "full")
    assert meta.bytes == stage_bytes(layers, stage) == held_bytes(built.layers) < whole_bytes
    assert full.bytes >= whole_bytes
    assert all(t.device.type == "cpu" for blk in built.layers for t in [*blk.parameters(), *blk.buffers()])


def test_a_parameter_shared_with_an_earlier_stage_is_one_tensor_in_the_stage_and_in_its_records():
    built = build_stage(model, SEED, torch.float32, STAGES, 2, "meta")
    head = built.layers[-1]
    tied = built.own.tied[2]  # the first block's weight and bias (the head holds that block)
    assert [t.param for t in tied] == [head.first.weight, head.first.bias]
    assert [(t.owner, t.index, t.offset) for t in tied] == [(0, 0, 0), (0, 1, 6 * 16)]
    owned = built.own.owned[2]
    assert [id(p) for p in owned] == [id(p) for blk in built.layers for p in blk.parameters() if all(p is not t.param for t in tied)]
    # positions in model.parameters() of the whole model, as the spec's parameter groups count them
    whole = list(build_model(model, SEED, torch.float32).parameters())
    assert sorted(built.param_index.values()) == [i for i, p in enumerate(whole)][-len(owned) :]
    # the other stages' sizes are known without their tensors (the sync layout of an owner)
    assert built.own.numels == ownership(list(build_model(model, SEED, torch.float32)), STAGES).numels


def test_a_meta_built_stage_loaded_with_the_factorys_values_computes_what_the_factorys_model_does():
    whole = build_model(model, SEED, torch.float64).train()
    built = build_stage(model, SEED, torch.float64, STAGES, 1, "meta")
    real = [whole[i] for i in STAGES[1]]
    with torch.no_grad():
        for a, b in zip([p for blk in built.layers for p in blk.parameters()], [p for blk in real for p in blk.parameters()]):
            a.copy_(b)
    load_buffers(built.layers, 3, stage_buffers(real, 3))
    assert set(stage_buffers(built.layers, 3)) == {"3.table"}  # non-persistent, yet travels
    x = torch.randn(4, 16, dtype=torch.float64)
    y_meta, y_real = x, x
    for a, b in zip(built.layers, real):
        y_meta, y_real = a(y_meta), b(y_real)
    assert torch.equal(y_meta, y_real)


def test_materialize_keeps_a_tensor_used_twice_as_one():
    with torch.device("meta"):
        m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    m[1].weight = m[0].weight
    materialize([m[0], m[1]])
    assert m[0].weight is m[1].weight and m[0].weight.device.type == "cpu"
    assert isinstance(m[1].weight, nn.Parameter) and m[1].bias.device.type == "cpu"


# -- which factories the meta build reproduces, decided on the client -------------------------------------
class PlainTensor(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 3)
        self.scale = torch.full((3,), 2.0)  # neither a parameter nor a buffer

    def forward(self, x):
        return self.lin(x) * self.scale


class HiddenModule(nn.Module):
    def __init__(self):
        super().__init__()
        self.helpers = [nn.Linear(6, 3)]  # a module in a plain list: never registered

    def forward(self, x):
        return self.helpers[0](x)


class ScalarFromWeights(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 3)
        self.k = float(self.lin.weight.detach().abs().max())  # needs values at build time

    def forward(self, x):
        return self.lin(x) * self.k


class ViewOfParameter(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 3)
        self.register_buffer("row", self.lin.weight.detach()[0])  # shares the weight's storage

    def forward(self, x):
        return self.lin(x) + self.row[:1]


class NumpyInit(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("mix", torch.from_numpy(__import__("numpy").eye(6, dtype="float32")))  # on the CPU under meta too
        self.lin = nn.Linear(6, 3)

    def forward(self, x):
        return self.lin(x @ self.mix)


FULL = [
    ("a tensor in a plain attribute", PlainTensor, "attribute 'scale'"),
    ("a module in a plain list", HiddenModule, "keeps a module with tensors of its own in its attribute 'helpers'"),
    ("values read while building", ScalarFromWeights, "fails on the meta device"),
    ("a buffer viewing a parameter", ViewOfParameter, "shares storage"),
    ("spectral norm's computed weight", lambda: nn.utils.spectral_norm(nn.Linear(6, 3)), "attribute 'weight'"),
]
META = [
    ("plain blocks", lambda: nn.Sequential(nn.Linear(6, 6), nn.Tanh())),
    ("BatchNorm", lambda: nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6))),
    ("tied weights and a non-persistent buffer", lambda: model(6)),
    ("a buffer the factory builds on the CPU", NumpyInit),
    ("weight norm as a parametrization", lambda: nn.utils.parametrizations.weight_norm(nn.Linear(6, 3))),
]


def _sequential(block):
    return lambda: block() if isinstance(block(), nn.Sequential) else nn.Sequential(block())


@pytest.mark.parametrize("label,block,message", FULL, ids=[c[0] for c in FULL])
def test_a_factory_the_meta_build_would_not_reproduce_gets_the_full_build(label, block, message):
    factory = _sequential(block)
    why = meta_build_refusal(factory, lambda: build_model(factory, SEED, torch.float32), torch.randn(4, 6), SEED, torch.float32)
    assert why is not None and message in why


@pytest.mark.parametrize("label,block", META, ids=[c[0] for c in META])
def test_a_factory_whose_state_is_its_parameters_and_buffers_gets_the_meta_build(label, block):
    factory = _sequential(block)
    assert meta_build_refusal(factory, lambda: build_model(factory, SEED, torch.float32), torch.randn(4, 6), SEED, torch.float32) is None


def test_job_validate_records_the_build_and_why():
    x, y = torch.randn(32, 6), torch.randint(0, 3, (32,))

    def job(factory):
        return Job(
            model=factory,
            loss=nn.CrossEntropyLoss(),
            optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
            train=(x, y),
            global_batch=8,
            iterations=1,
        )

    assert job(lambda: nn.Sequential(nn.Linear(6, 3))).facts.full_build is None
    why = job(lambda: nn.Sequential(PlainTensor())).facts.full_build
    assert why and "scale" in why


def test_a_model_captured_as_a_graph_gets_the_meta_build_and_its_stages_allocate_only_themselves():
    """Job(blocks=...) cuts an exported graph (core/graph_split.py): built on the meta device,
    the graph names that device in its ops, which the build points back at the CPU."""
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "bert.py")
    spec = importlib.util.spec_from_file_location("bert_example_meta", path)
    bert = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bert)
    job = Job(
        model=lambda: bert.Bert(dim=8, heads=2, layers=3),
        blocks=["embeddings", "encoder.*", "head"],
        loss=nn.CrossEntropyLoss(),
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        train=bert.sequences(32, seed=1),
        global_batch=8,
        iterations=1,
        dtype=torch.float64,
    )
    assert job.facts.full_build is None
    whole = job.build_model()
    stages = [range(0, 2), range(2, 5)]
    own = ownership(list(whole), stages)
    factory = job.factory  # what a container unpickles: the cut's recipe, sample shape included
    for s in range(2):
        with Allocations() as alloc:
            built = build_stage(factory, job.seed, job.dtype, stages, s, "meta")
        tensors = {id(t): t for t in [*own.owned[s], *(t.param for t in own.tied[s])]}
        tensors |= {id(b): b for i in stages[s] for b in whole[i].buffers()}
        assert alloc.bytes == held_bytes(built.layers) == sum(t.numel() * t.element_size() for t in tensors.values())


def test_build_meta_builds_nothing():
    m = build_meta(lambda: nn.Sequential(nn.Linear(1000, 1000)), SEED, torch.float64)
    assert all(p.device.type == "meta" and p.dtype == torch.float64 for p in m.parameters())


# -- on the local stack ----------------------------------------------------------------------------------
def test_each_container_holds_its_stage_and_the_job_trains_like_plain_pytorch(backend):
    """Three stages, a weight tied across the first and the last, BatchNorm, a non-persistent
    buffer: the spec records the meta build, each stage's initial buffers travel, every task's
    container holds exactly its stage's bytes, and the parameters and running statistics end
    where single-process PyTorch's do."""
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(64, 6, generator=g, dtype=torch.float64), torch.randint(0, 6, (64,), generator=g)
    job = Job(
        model=model,
        loss=nn.CrossEntropyLoss(),
        optimizer=lambda p: torch.optim.Adam(p, lr=0.01),
        train=(x, y),
        global_batch=16,
        iterations=3,
        seed=SEED,
        dtype=torch.float64,
        name="meta-build",
    )
    from stagecoach import Plan

    run = job.run(plan=Plan(balance=[3, 2, 3], global_batch=16), backend=backend)
    assert run.wait(progress=False, poll_s=0.2, timeout_s=600) == "SUCCEEDED", run.failure()
    spec = run.spec()
    assert (spec.build, spec.full_build_reason) == ("meta", None)
    listed = backend.clients.s3.list_objects_v2(Bucket=run.bucket, Prefix=keys.initial_buffers(run.job_id, 0)[:-1])["Contents"]
    # stage 2 has no buffers: nothing uploaded, nothing read
    assert sorted(o["Key"] for o in listed) == [keys.initial_buffers(run.job_id, s) for s in (0, 1)]
    # the running statistics' version 0 (a retried task of iteration 0 reloads it), BatchNorm's only
    body = backend.clients.s3.get_object(Bucket=run.bucket, Key=keys.buffers(run.job_id, 0, 0))["Body"].read()
    assert set(st_load(body)) == {"1.running_mean", "1.running_var", "1.num_batches_tracked"}
    layers = list(job.build_model())
    for m in run.metrics():
        assert m.model_bytes == stage_bytes(layers, m.stage), (m.phase, m.stage)
    want = train_reference(job)
    got = run.trained_model()
    for (k, a), b in zip(got.state_dict().items(), want.state_dict().values()):
        assert torch.allclose(a, b, rtol=0, atol=1e-10), k
    assert math.isfinite(run.losses()[-1])


def _linear_job(name: str, width: int, blocks: int) -> Job:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, width, generator=g), torch.randint(0, 4, (64,), generator=g)

    def model() -> nn.Sequential:
        return nn.Sequential(
            *[nn.Linear(width, width) for _ in range(blocks - 1)], nn.Sequential(nn.Linear(width, width), nn.Linear(width, 4))
        )

    return Job(
        model=model,
        loss=nn.CrossEntropyLoss(),
        optimizer=lambda p: torch.optim.SGD(p, lr=0.01),
        train=(x, y),
        global_batch=16,
        iterations=1,
        name=name,
    )


@pytest.mark.slow
def test_a_model_whose_whole_exceeds_what_a_function_may_hold_trains_stage_by_stage(backend):
    """32 stages of 8 MiB, 256 MiB in all; every stage's function gets its runtime's own peak
    (a worker that trained a 1 KiB model) plus half the model: the whole model would not fit
    beside the runtime, but each stage does, and the stack kills any process whose resident set
    passes its function's memory (sdk/local/runtime.py)."""
    from stagecoach import Plan

    tiny = _linear_job("meta-base", 8, 2)
    run = tiny.run(plan=Plan(balance=[2], global_batch=16, memory_mb=1024), backend=backend)
    assert run.wait(progress=False, poll_s=0.2, timeout_s=600) == "SUCCEEDED", run.failure()
    base_mb = max(m.max_rss_mb for m in run.metrics())

    stages, width = 32, 1448
    job = _linear_job("meta-big", width, stages)
    whole = job.build_model()
    whole_mb = sum(p.numel() * p.element_size() for p in whole.parameters()) / 2**20
    memory_mb = math.ceil(base_mb + whole_mb / 2)
    assert whole_mb > memory_mb - base_mb  # the whole model does not fit beside the runtime
    run = job.run(plan=Plan(balance=[1] * stages, global_batch=16, memory_mb=memory_mb), backend=backend)
    assert run.wait(progress=False, poll_s=0.2, timeout_s=900) == "SUCCEEDED", run.failure()
    assert run.spec().build == "meta"
    c = backend.clients
    assert not c.s3.list_objects_v2(Bucket=run.bucket, Prefix=f"jobs/{run.job_id}/remediations/").get("Contents")
    fn = run.spec().window_state_machine.split(":")[-1].replace("-window", "-s0")
    assert c.lambda_.get_function_configuration(FunctionName=fn)["MemorySize"] == memory_mb  # never raised
    layers = list(whole)
    metrics = run.metrics()
    assert len(metrics) == 2 * stages - 1
    for m in metrics:
        stage_mb = sum(p.numel() * p.element_size() for p in layers[m.stage].parameters()) / 2**20
        assert m.model_bytes == stage_mb * 2**20  # the stage's parameters, not the whole model's
        assert m.max_rss_mb <= memory_mb
        assert m.max_rss_mb - base_mb < whole_mb / 2
    assert math.isfinite(run.losses()[0])
