"""Any nn.Module, cut at the modules ``blocks`` names (torch.export + PyTorch's pipeline splitter).

The anchor is the user's own module trained by plain PyTorch — not the chain it was cut into: a
BERT-style encoder (integer ids, a boolean attention mask computed in forward, a hidden state that
crosses every cut with the ids and the mask, the output projection tied to the word embeddings)
trains on the real state machines to the parameters plain PyTorch gives, float64 within 1e-5.
"""

import importlib.util
import os
import random

import pytest
import torch
from helpers import selected
from safetensors.torch import load_file
from torch import nn

from stagecoach import Job, JobError
from stagecoach.core.training import batch_indices, ownership
from stagecoach.reference import train_reference

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("bert_example", os.path.join(ROOT, "examples", "bert.py"))
assert _spec is not None and _spec.loader is not None
bert = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bert)

ITERATIONS = 5
BLOCKS = ["embeddings", "encoder.*", "head"]


def tiny_bert() -> nn.Module:
    return bert.Bert(dim=8, heads=2, layers=3)


def make_job(name: str, optimizer, model=tiny_bert, blocks=BLOCKS, **kw) -> Job:
    return Job(
        name=name,
        model=model,
        blocks=blocks,
        loss=nn.CrossEntropyLoss(),
        optimizer=optimizer,
        train=bert.sequences(96, seed=5),
        global_batch=24,
        iterations=ITERATIONS,
        seed=4,
        dtype=torch.float64,
        **kw,
    )


OPTIMIZERS = {
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
    "adam": lambda p: torch.optim.Adam(p, lr=0.01),
}
# (stages, replicas, micro-batches): two points of the grid, both optimizers; the whole grid
# (also (1,1,1) and (3,1,4)) runs in tests/test_transparency_grid.py (slow)
CONFIGS = [("adam", (2, 3, 2)), ("sgd-momentum", (4, 2, 3))]


def plain_pytorch(job: Job) -> nn.Module:
    """The user's module, its optimizer over model.parameters(), full batches: no Stagecoach in it."""
    torch.manual_seed(job.seed)
    model = job.model().to(job.dtype).train()
    optimizer = job.optimizer(list(model.parameters()))
    x, y = job.train
    for t in range(job.iterations):
        idx = batch_indices(job.seed, t, x.shape[0], job.global_batch)
        optimizer.zero_grad()
        job.loss(model(x[idx]), y[idx]).backward()
        optimizer.step()
    return model


def test_the_chain_computes_what_the_model_computes_with_one_tied_tensor():
    job = make_job("split-unit", OPTIMIZERS["adam"])
    chain = job.build_model()
    assert job.layers == len(chain) == 5  # embeddings, three layers, head (the gather joins the last layer)
    torch.manual_seed(job.seed)
    model = tiny_bert().double()
    ids, labels = job.train[0][:7], job.train[1][:7]
    out = ids
    for block in chain:
        out = block(out)
    want = model(ids)
    assert torch.equal(out, want)
    nn.CrossEntropyLoss()(out, labels).backward()
    nn.CrossEntropyLoss()(want, labels).backward()
    chain_params = {n: q for block in chain for piece in block.pieces for n, q in piece.named_parameters(remove_duplicate=False)}
    for name, p in model.named_parameters():
        assert torch.equal(chain_params[name].grad, p.grad), name
    # the word embeddings (block 0) and the decoder (block 4) are one tensor, owned by the first stage
    assert chain[0].pieces[0].get_parameter("embeddings.word.weight") is chain[4].pieces[0].get_parameter("head.decoder.weight")
    own = ownership(list(chain), [range(0, 1), range(1, 4), range(4, 5)])
    assert [t.owner for t in own.tied[2]] == [0]
    # ids (int64) and the mask (bool) cross the cuts forward, without a gradient
    assert {torch.int64, torch.bool} <= set(job.facts.boundary_dtypes[1])


def test_a_model_that_is_not_a_sequential_needs_blocks_and_is_told_which():
    job = make_job("split-none", OPTIMIZERS["adam"], blocks=None)
    with pytest.raises(JobError, match=r"Job\(blocks=\[\.\.\.\]\).*'encoder\.\*'"):
        job.validate()


class Twice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        return self.b(self.a(self.a(x)))


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        h = self.a(x)
        return self.b(h) if h.sum() > 0 else self.b(-h)


class RandomOutsideTorch(nn.Module):
    """A factor drawn by Python's random: export burns the draw it saw into the graph."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        return self.b(self.a(x) * (1 + random.random()))


class Counter(nn.Module):
    """A Python counter kept between calls: the graph holds the value of the call it captured."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.b(self.a(x) * self.calls)


class WithDropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.drop, self.b = nn.Linear(4, 4), nn.Dropout(0.3), nn.Linear(4, 2)

    def forward(self, x):
        return self.b(self.drop(torch.tanh(self.a(x))))


def test_a_chain_that_computes_what_the_model_does_is_accepted_with_dropout():
    """The check that the cut graph equals the model draws the same dropout masks in both."""
    _job(WithDropout, ["a", "b"]).validate()


def _job(model, blocks) -> Job:
    x = torch.randn(16, 4)
    return Job(
        model=model,
        blocks=blocks,
        loss=nn.CrossEntropyLoss(),
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        train=(x, (x[:, 0] > 0).long()),
        global_batch=8,
        iterations=2,
    )


@pytest.mark.parametrize(
    "model, blocks, message",
    [
        (tiny_bert, ["decoder.*"], r"pattern 'decoder\.\*' names no submodule of Bert; e\.g\. blocks="),
        (tiny_bert, ["encoder.*", "encoder.0.qkv"], r"name both 'encoder\.0' and its submodule 'encoder\.0\.qkv'"),
        (tiny_bert, "encoder.*", r"give a list of submodule names"),
        (Twice, ["a", "b"], r"block 'a' runs 2 times in one forward"),
        (DataDependent, ["a", "b"], r"torch\.export could not capture DataDependent as one graph: .*data-dependent"),
        (RandomOutsideTorch, ["a", "b"], r"computes another output than the model itself"),
        (Counter, ["a", "b"], r"computes another output on a second call than the model itself"),
    ],
)
def test_what_cannot_be_cut_is_refused_with_the_reason_and_a_hint(model, blocks, message):
    job = _job(model, blocks) if model is not tiny_bert else make_job("split-bad", OPTIMIZERS["adam"], blocks=blocks)
    with pytest.raises(JobError, match=message):
        job.validate()


class Residual(nn.Module):
    """A ResNet-like nn.Module: BatchNorm inside blocks, a skip connection around two of them."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU())
        self.body = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Tanh()) for _ in range(2))
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        h = self.stem(x)
        return self.head(self.body[1](self.body[0](h)) + h)


def bn_job(name: str, **kw) -> Job:
    g = torch.Generator().manual_seed(9)
    x = torch.randn(48, 6, generator=g, dtype=torch.float64)
    return Job(
        name=name,
        model=Residual,
        blocks=["stem", "body.*", "head"],
        loss=nn.CrossEntropyLoss(),
        optimizer=OPTIMIZERS["adam"],
        train=(x, torch.randint(0, 3, (48,), generator=g)),
        global_batch=12,
        iterations=ITERATIONS,
        seed=2,
        dtype=torch.float64,
        **kw,
    )


@pytest.fixture(scope="module")
def runs(backend, request):
    wanted = {0} | selected(request, "i")  # CONFIGS[0]: the saved model's test reads it too
    started = {}
    started["bn"] = bn_job("any-bn").run(stages=2, backend=backend)
    started["bn-deferred"] = bn_job("any-bn-def", deferred_batch_norm=True).run(stages=2, replicas=2, micro_batches=2, backend=backend)
    for opt_name, (s, d, m) in [c for i, c in enumerate(CONFIGS) if i in wanted]:
        job = make_job(f"any-{opt_name[:4]}-{s}{d}{m}", OPTIMIZERS[opt_name])
        started[(opt_name, (s, d, m))] = job.run(stages=s, replicas=d, micro_batches=m, backend=backend)
    for run in started.values():
        run.wait(progress=False, poll_s=0.2, timeout_s=600)
    return started


@pytest.mark.parametrize(
    "i", [pytest.param(i, id="{}-{}x{}x{}".format(o, *c), marks=() if i == 0 else pytest.mark.slow) for i, (o, c) in enumerate(CONFIGS)]
)
def test_any_model_trains_to_the_parameters_of_plain_pytorch(runs, i):
    run = runs[CONFIGS[i]]
    trained = run.trained_model()
    assert type(trained) is bert.Bert  # the user's own module comes back, not the chain
    expected = plain_pytorch(run.job)
    initial = dict(run.job.user_model(run.job.build_model()).named_parameters())
    got = dict(trained.named_parameters())
    assert set(got) == set(dict(expected.named_parameters()))
    assert max(float((got[k] - initial[k]).detach().abs().max()) for k in got) > 1e-3, "training moved the parameters"
    assert max(float((got[k] - p).detach().abs().max()) for k, p in expected.named_parameters()) < 1e-5
    assert trained.head.decoder.weight is trained.embeddings.word.weight  # still tied


def test_a_saved_model_with_tied_weights_loads_strictly_and_starts_a_job(runs, tmp_path):
    """Once stored the tied tensor under one name: load_state_dict(strict=True) missed the other,
    and Job(init_from=...) refused the file the README offers it."""
    run = runs[CONFIGS[0]]
    path = os.path.join(run.save(str(tmp_path / "saved")), "model.safetensors")
    state = load_file(path)
    trained = run.trained_model()
    assert set(state) == set(trained.state_dict())  # every name, the tied one too
    model = tiny_bert().double()
    model.load_state_dict(state, strict=True)
    assert all(torch.equal(t, trained.state_dict()[k]) for k, t in model.state_dict().items())
    assert model.head.decoder.weight is model.embeddings.word.weight  # loading kept the tie
    job = make_job("any-from-saved", OPTIMIZERS["adam"], init_from=path)
    job.validate()
    start = job.user_model(job.build_model()).state_dict()
    assert all(torch.equal(start[k], t) for k, t in trained.state_dict().items())


def test_init_from_takes_a_file_that_keeps_a_tied_tensor_once():
    """safetensors' save_model (Hugging Face's way) drops a tied tensor's other names: they are
    one tensor in the model, so the name it kept gives the value of both."""
    import tempfile

    from safetensors.torch import save_model

    source = tiny_bert().double()
    with torch.no_grad():
        source.embeddings.word.weight.add_(1.0)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "once.safetensors")
        save_model(source, path)
        assert len(load_file(path)) < len(source.state_dict())
        job = make_job("any-from-once", OPTIMIZERS["adam"], init_from=path)
        job.validate()
        start = job.user_model(job.build_model())
    assert torch.equal(start.head.decoder.weight, source.embeddings.word.weight)
    assert start.head.decoder.weight is start.embeddings.word.weight
    tied_apart = {**source.state_dict(), "head.decoder.weight": torch.zeros_like(source.head.decoder.weight)}
    with pytest.raises(JobError, match="different values, but they are one tensor in the model"):
        make_job("any-from-apart", OPTIMIZERS["adam"], init_from=tied_apart).validate()


def test_batchnorm_inside_any_model_keeps_running_statistics_like_pytorch(runs):
    """BatchNorm modules of a model cut at ``blocks`` are the runtime's own again (its running
    statistics travel per stage): parameters and buffers equal plain PyTorch in train mode on one
    batch, and the deferred rule's reference on a split batch."""
    run = runs["bn"]
    trained, expected = run.trained_model(), plain_pytorch(run.job)
    assert type(trained) is Residual
    want = expected.state_dict()
    got = trained.state_dict()
    assert got.keys() == want.keys() and int(got["body.0.1.num_batches_tracked"]) == ITERATIONS
    assert max(float((got[k].double() - want[k].double()).abs().max()) for k in want) < 1e-5
    run = runs["bn-deferred"]
    want = run.job.user_model(train_reference(run.job, replicas=2, micro_batches=2)).state_dict()
    got = run.trained_model().state_dict()
    assert int(got["stem.1.num_batches_tracked"]) == ITERATIONS  # once per iteration, not per micro-batch
    assert max(float((got[k].double() - want[k].double()).abs().max()) for k in want) < 1e-5


def test_the_profile_counts_only_floating_leaves_for_gradients():
    """ids and the mask cross every cut forward only: the backward traffic the planner prices is
    the hidden state's alone (the measured and the meta-device profiles agree)."""
    from stagecoach.core.profiling import measure_model
    from stagecoach.planner.profile.meta import profile_meta

    job = make_job("split-prof", OPTIMIZERS["adam"])
    sample = job.train[0][0]
    for profile in (measure_model(job.build_model(), sample, micro_batch_sizes=(1, 2)), profile_meta(job.build_model(), sample)):
        layer = profile.layers[1]  # takes (ids, hidden state, mask, ...) from the embeddings' block
        hidden = bert.LENGTH * 8 * 8  # float64 hidden state of one sample: 16 positions x 8 dimensions
        assert layer.ingrad_bytes_per_sample == hidden < layer.in_bytes_per_sample
        assert profile.layers[0].ingrad_bytes_per_sample == 0.0  # integer ids into the model
        assert profile.layers[0].outgrad_bytes_per_sample == hidden < profile.layers[0].out_bytes_per_sample
