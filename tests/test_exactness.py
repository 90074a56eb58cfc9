"""Never train a wrong model: every input the runtime cannot train exactly is refused before deployment.

Each refusal is a case that, accepted, trained something other than plain PyTorch without an error
(tied weights drift apart, a module used twice trained as one, parameter groups collapse, a
non-elementwise optimizer on flat shards, buffers never carried, ...) or failed only after
deployment. The runtime fixes made for the cases that can be trained exactly are checked end to
end, in float64, through the real state machines.
"""

import numpy as np
import pytest
import torch
from helpers import selected
from torch import nn

from stagecoach import Job, JobError, Plan
from stagecoach.reference import train_reference

G = torch.Generator().manual_seed(11)
X = torch.randn(48, 6, generator=G, dtype=torch.float64)
Y = torch.randint(0, 3, (48,), generator=G)
IDS = torch.randint(0, 10, (48, 5), generator=G)


def plain() -> nn.Sequential:
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Linear(8, 3))


def job(model=plain, optimizer=lambda p: torch.optim.Adam(p, lr=0.01), loss=None, train=None, name="exact", **kw) -> Job:
    return Job(
        model=model,
        loss=loss or nn.CrossEntropyLoss(),
        optimizer=optimizer,
        train=train or (X, Y),
        global_batch=12,
        iterations=3,
        seed=2,
        dtype=torch.float64,
        name=name,
        **kw,
    )


# -- models, optimizers and losses that no plan trains exactly ---------------------------------------
def tied_across_blocks():
    a, b = nn.Linear(6, 6), nn.Linear(6, 6)
    b.weight = a.weight
    return nn.Sequential(a, nn.Tanh(), b, nn.Linear(6, 3))


def module_used_twice():
    a = nn.Linear(6, 6)
    return nn.Sequential(a, nn.Tanh(), a, nn.Linear(6, 3))


def two_groups(p):
    return torch.optim.AdamW([{"params": p[:2], "weight_decay": 0.0}, {"params": p[2:]}], lr=0.01)


class Counter(nn.Module):
    """A buffer updated in forward (like BatchNorm's num_batches_tracked)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.seen += x.shape[0]
        return self.lin(x)


class WithUnused(nn.Module):
    def __init__(self):
        super().__init__()
        self.used, self.spare = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x):
        return self.used(x)


def all_frozen():
    return plain().requires_grad_(False)


SHARED_NET = plain()


def numpy_init():
    m = plain()
    with torch.no_grad():
        m[0].weight.copy_(torch.from_numpy(np.random.randn(8, 6)))
    return m


class LearnedLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.temperature = nn.Parameter(torch.ones(()))

    def forward(self, out, y):
        return nn.functional.cross_entropy(out / self.temperature, y)


def norm_used_twice():
    bn = nn.BatchNorm1d(6)
    return nn.Sequential(nn.Linear(6, 6), bn, nn.Tanh(), bn, nn.Linear(6, 3))


REFUSED = [
    (
        "a module with buffers used twice",
        dict(model=norm_used_twice),
        "blocks 1 and 3 are the same module \\(BatchNorm1d\\), which has buffers",
    ),
    ("Adafactor", dict(optimizer=lambda p: torch.optim.Adafactor(p, lr=0.01)), "does not update each element on its own"),
    ("LBFGS", dict(optimizer=lambda p: torch.optim.LBFGS(p)), "closure"),
    ("SparseAdam", dict(optimizer=lambda p: torch.optim.SparseAdam(p)), "cannot take a plain step"),
    ("Muon", dict(optimizer=lambda p: torch.optim.Muon(p)), "fails"),
    (
        "a group hyperparameter that cannot travel",
        dict(optimizer=lambda p: torch.optim.SGD([{"params": p[:1], "lr": torch.tensor(0.1)}, {"params": p[1:]}], lr=0.01)),
        "parameter group 0's 'lr' is a Tensor",
    ),
    (
        "an optimizer over other tensors",
        dict(optimizer=lambda p: torch.optim.SGD(p[:1], lr=0.1)),
        "does not optimise exactly the parameters it is given",
    ),
    ("a buffer updated in forward", dict(model=lambda: nn.Sequential(Counter(), nn.Linear(6, 3))), "buffer 'seen'"),
    ("nothing that trains", dict(model=all_frozen), "nothing to train"),
    ("an unused parameter", dict(model=lambda: nn.Sequential(WithUnused(), nn.Linear(6, 3))), "'spare.weight' gets no gradient"),
    (
        "a sparse gradient",
        dict(
            model=lambda: nn.Sequential(nn.Embedding(10, 6, sparse=True), nn.Flatten(), nn.Linear(30, 3)),
            train=(IDS, Y),
            optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        ),
        "sparse gradient",
    ),
    ("one model object for every build", dict(model=lambda: SHARED_NET), "returned the same module object twice"),
    ("a factory not seeded by torch", dict(model=numpy_init), "builds different values of '0.weight'"),
    ("a loss with parameters", dict(loss=LearnedLoss()), "has parameters, which Stagecoach never trains"),
]


@pytest.mark.parametrize("change, message", [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED])
def test_what_no_plan_trains_exactly_is_refused_with_the_fix(change, message):
    with pytest.raises(JobError, match=message):
        job(**change).validate()


class NoBackend:
    """Any use of the backend fails the test: a refused job must not reach it."""

    def __getattr__(self, name):
        raise AssertionError(f"the backend was used ({name}) for a job that should have been refused")


@pytest.mark.parametrize("change", [c[1] for c in REFUSED[:3]], ids=[c[0] for c in REFUSED[:3]])
def test_the_silently_wrong_inputs_are_refused_before_the_backend_is_touched(change):
    with pytest.raises(JobError):
        job(**change).run(stages=2, replicas=2, micro_batches=2, backend=NoBackend())


@pytest.mark.parametrize("model", [tied_across_blocks, module_used_twice], ids=["tied weights across blocks", "a module used twice"])
def test_shared_parameters_are_accepted_and_owned_by_their_first_stage(model):
    """Once refused (the copies drifted apart, or a 4-block model trained as 3): the first stage
    that uses a shared parameter owns it; tests/test_transparency.py trains them through the
    state machines."""
    from stagecoach.core.training import ownership

    j = job(model=model)
    j.validate()
    layers = list(j.build_model())
    own = ownership(layers, [range(0, 2), range(2, 4)])
    shared = layers[0].weight
    assert any(p is shared for p in own.owned[0]) and not any(p is shared for p in own.owned[1])
    (tied,) = [t for t in own.tied[1] if t.param is shared]
    assert (tied.owner, tied.offset) == (0, 0) and own.users(0) == [1]
    everything = {id(p) for p in j.build_model().parameters()}
    assert sum(len(o) for o in own.owned) == len(everything)  # each parameter in exactly one flat vector


def test_parameter_groups_are_accepted_and_recorded_per_parameter():
    """Once refused (the groups collapsed on a flat shard): each group now keeps its own
    hyperparameters on the workers (tests/test_transparency.py trains with them)."""
    j = job(optimizer=two_groups)
    j.validate()
    groups = j.facts.optimizer_groups
    assert groups is not None and groups.of_param == (0, 0) + (1,) * (len(list(j.build_model().parameters())) - 2)
    assert groups.hparams[0]["weight_decay"] == 0.0 and groups.hparams[1]["weight_decay"] == 0.01  # AdamW's default
    assert groups.hparams[0]["betas"] == [0.9, 0.999]  # as JSON carries them
    assert job().facts.optimizer_groups is None  # one group: the workers use the factory as it is


ELEMENTWISE = {
    "SGD momentum wd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=True),
    "Adam": lambda p: torch.optim.Adam(p, lr=0.01),
    "AdamW amsgrad": lambda p: torch.optim.AdamW(p, lr=0.01, amsgrad=True),
    "NAdam": lambda p: torch.optim.NAdam(p, lr=0.01),
    "RAdam": lambda p: torch.optim.RAdam(p, lr=0.01),
    "RMSprop": lambda p: torch.optim.RMSprop(p, lr=0.01, momentum=0.5),
    "Adagrad": lambda p: torch.optim.Adagrad(p, lr=0.01),
    "Adamax": lambda p: torch.optim.Adamax(p, lr=0.01),
    "Adadelta": lambda p: torch.optim.Adadelta(p),
    "ASGD": lambda p: torch.optim.ASGD(p, lr=0.01),
    "Rprop": lambda p: torch.optim.Rprop(p, lr=0.01),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", list(ELEMENTWISE))
def test_elementwise_optimizers_are_accepted(name, dtype):
    j = job(optimizer=ELEMENTWISE[name])
    j.dtype = dtype
    j.validate()


# -- what depends on the plan -------------------------------------------------------------------------
def bn_batch_stats():
    return nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6, track_running_stats=False), nn.Linear(6, 3))


class Ids(nn.Module):
    """Emits integer ids (the next block embeds them): an integer tensor at the boundary after it."""

    def forward(self, x):
        return (x.abs() * 3).long().clamp(max=9)


def ids_then_embedding():
    return nn.Sequential(Ids(), nn.Embedding(10, 4), nn.Flatten(), nn.Linear(24, 3))


PLAN_DEPENDENT = [
    ("batch statistics", dict(model=bn_batch_stats), "its BatchNorm1d normalise over the batch"),
    # running statistics are kept by the runtime (updated in the forward pass only): exact wherever the batch stays whole
    (
        "running statistics",
        dict(model=lambda: nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6), nn.Linear(6, 3))),
        "its BatchNorm1d normalise over the batch",
    ),
    ("a sum loss", dict(loss=nn.CrossEntropyLoss(reduction="sum")), "the mean of their own losses"),
    (
        "class weights",
        dict(loss=nn.CrossEntropyLoss(weight=torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64))),
        "the mean of their own losses",
    ),
]


@pytest.mark.parametrize("change, message", [c[1:] for c in PLAN_DEPENDENT], ids=[c[0] for c in PLAN_DEPENDENT])
def test_a_split_batch_is_refused_where_the_parts_do_not_add_up_and_one_batch_is_accepted(change, message):
    j = job(**change)
    j.validate()
    j.check_plan(j.manual_plan(stages=2))  # the global batch stays together: exact
    with pytest.raises(JobError, match=message):
        j.check_plan(j.manual_plan(stages=2, replicas=2))
    with pytest.raises(JobError, match=message):
        j.check_plan(j.manual_plan(stages=1, micro_batches=2))


def test_the_planner_keeps_the_batch_together_for_a_job_that_needs_it():
    """Job.plan plans only one replica and one micro-batch for a model that normalises over the
    batch, so its recommendation is one check_plan accepts."""
    j = job(model=lambda: nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6), nn.Linear(6, 3)))
    result = j.plan(time_limit=5)
    plans = [p.to_plan() for p in result.pareto]
    assert plans and all((p.replicas, p.micro_batches) == (1, 1) for p in plans)
    j.check_plan(result.recommended.to_plan())


def with_batchnorm():
    return nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 3))


class MixesSamples(nn.Module):
    """Couples the samples of a batch without being a BatchNorm."""

    def forward(self, x):
        return x - x.mean(0, keepdim=True)


class NormTwice(nn.Module):
    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(6)

    def forward(self, x):
        return self.bn(torch.tanh(self.bn(x)))


def test_a_split_batch_refusal_for_batchnorm_names_the_deferred_batch_norm_option():
    j = job(model=with_batchnorm)
    j.validate()
    with pytest.raises(JobError, match=r"deferred_batch_norm=True\): each micro-batch is then normalised with its own statistics"):
        j.check_plan(j.manual_plan(stages=2, replicas=2))
    with pytest.raises(JobError, match=r"running statistics are updated once per iteration"):
        j.check_plan(j.manual_plan(stages=1, micro_batches=2))


def test_deferred_batch_norm_accepts_a_split_batch_for_batchnorm_only():
    j = job(model=with_batchnorm, deferred_batch_norm=True)
    j.validate()
    assert j.facts.batch_coupling and j.facts.coupling_beyond_batch_norm is None
    for stages, d, m in [(1, 1, 1), (2, 2, 1), (2, 1, 3), (3, 2, 3)]:
        j.check_plan(j.manual_plan(stages=stages, replicas=d, micro_batches=m))
    with pytest.raises(JobError, match="micro-batches of one sample"):  # 12 samples, 12 parts
        j.check_plan(j.manual_plan(stages=2, replicas=2, micro_batches=6))
    # what the option cannot reproduce stays refused
    cases = [
        (dict(loss=nn.CrossEntropyLoss(reduction="sum")), "the mean of their own losses"),
        (
            dict(model=lambda: nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6), MixesSamples(), nn.Linear(6, 3))),
            "even without its BatchNorms",
        ),
        (dict(model=lambda: nn.Sequential(nn.Linear(6, 6), MixesSamples(), nn.Linear(6, 3))), "depends on the other samples"),
        (dict(model=lambda: nn.Sequential(nn.Linear(6, 6), NormTwice(), nn.Linear(6, 3))), "runs 2 times in one forward pass"),
    ]
    for change, message in cases:
        other = job(deferred_batch_norm=True, **({"model": with_batchnorm} | change))
        other.validate()
        other.check_plan(other.manual_plan(stages=2))  # the global batch kept together: exact, as before
        with pytest.raises(JobError, match=message):
            other.check_plan(other.manual_plan(stages=2, replicas=2))


def test_deferred_batch_norm_must_be_a_bool():
    with pytest.raises(JobError, match="deferred_batch_norm"):
        job(model=with_batchnorm, deferred_batch_norm="yes").validate()


def test_the_planner_splits_the_batch_of_a_batchnorm_model_under_deferred_batch_norm():
    """With the option, Job.plan considers replicas and micro-batches (of at least two samples)
    for a model with BatchNorm, and check_plan accepts what it recommends."""
    j = job(model=with_batchnorm, deferred_batch_norm=True)
    result = j.plan(time_limit=5)
    plans = [p.to_plan() for p in result.pareto]
    assert plans and all(p.replicas * p.micro_batches > 1 and p.micro_batch_size >= 2 for p in plans)
    for p in plans:
        j.check_plan(p)


def test_a_cut_that_an_integer_tensor_crosses_is_accepted():
    """Once refused: integer tensors (ids) now travel forward and get no gradient (EXACT below runs it)."""
    j = job(model=ids_then_embedding)
    j.validate()
    assert j.facts.boundary_dtypes[0] == (torch.int64,)
    j.check_plan(Plan(balance=[1, 3], global_batch=12))
    j.check_plan(Plan(balance=[1, 1, 1, 1], replicas=2, micro_batches=2, global_batch=12))


class Lin(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x):
        return self.lin(x)


class Borrows(nn.Module):
    """Registers another block's parameter as its own buffer: one tensor, trained through both uses."""

    def __init__(self, other: Lin):
        super().__init__()
        self.register_buffer("w", other.lin.weight)

    def forward(self, x):
        return torch.tanh(x @ self.w.T)


def borrowed_weight():
    a = Lin()
    return nn.Sequential(a, nn.Tanh(), Borrows(a), nn.Linear(6, 3))


def test_a_parameter_another_block_holds_as_a_buffer_is_refused_where_a_cut_separates_them():
    """Once trained with max |diff| 0.017 on every parameter when a cut fell between the two
    blocks: the later stage kept the buffer as a copy of version 0, and its gradient never reached
    the parameter. Plans that keep both blocks on one stage train it exactly (EXACT below)."""
    j = job(model=borrowed_weight)
    j.validate()
    for plan in (j.manual_plan(stages=1, replicas=2, micro_batches=2), Plan(balance=[3, 1], replicas=2, global_batch=12)):
        j.check_plan(plan)
    for balance in ([1, 3], [2, 2], [1, 1, 1, 1]):
        with pytest.raises(JobError, match=r"block 2's buffer 'w' is block 0's parameter 'lin.weight'.*blocks 0 to 2 on one stage"):
            j.check_plan(Plan(balance=balance, global_batch=12))
    with pytest.raises(JobError, match="block 2's buffer 'w'"):
        job(model=borrowed_weight).run(plan=Plan(balance=[2, 2], global_batch=12), backend=NoBackend())


# -- the cases made exact, end to end ----------------------------------------------------------------------
def activation_used_twice():
    act = nn.Tanh()  # stateless: its two uses may sit on different stages
    return nn.Sequential(nn.Linear(6, 6), act, nn.Linear(6, 6), act, nn.Linear(6, 3))


def in_place_first_layer():
    return nn.Sequential(nn.Linear(6, 6), nn.ReLU(inplace=True), nn.Linear(6, 3))


def parameter_free_first_stage():
    return nn.Sequential(nn.Flatten(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3))


class RandomProjection(nn.Module):
    """A fixed random buffer drawn by the factory: every container must draw the same one."""

    def __init__(self):
        super().__init__()
        self.register_buffer("proj", torch.randn(6, 6))
        self.lin = nn.Linear(6, 6)

    def forward(self, x):
        return self.lin(x @ self.proj)


class PlainScale(nn.Module):
    """A tensor in a plain attribute, drawn by the factory: a build on the meta device would leave
    it without values, so every container builds the whole model (JobSpec.build = "full")."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.scale = torch.rand(6, dtype=torch.float64) + 0.5

    def forward(self, x):
        return self.lin(x) * self.scale


class TiedInside(nn.Module):
    """Weights tied inside one block: autograd sums both uses' gradients, as in plain PyTorch."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)
        self.b.weight = self.a.weight

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


class Stem(nn.Module):
    """Starts AmoebaNet-D's (state, skip) pairs."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x):
        h = torch.tanh(self.lin(x))
        return h, h


class Cell(nn.Module):
    """An AmoebaNet-D-like cell: takes (state, skip), returns (new state, state)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, pair):
        state, skip = pair
        return torch.tanh(self.a(state) + self.b(skip)), state


class PairHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 3)

    def forward(self, pair):
        return self.lin(pair[0])  # the skip is not used: its gradient is zero


def cells_with_pairs():
    return nn.Sequential(Stem(), Cell(), Cell(), Cell(), PairHead())


class Encode(nn.Module):
    """Hidden states and a boolean mask, in a dict (as an encoder passes attention masks)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x):
        return {"h": torch.tanh(self.lin(x)), "mask": x > 0}


class MaskedLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, d):
        return {"h": torch.tanh(self.lin(d["h"])) * d["mask"], "mask": d["mask"]}


class Pool(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 3)

    def forward(self, d):
        return self.lin(d["h"])


def masked_dicts():
    return nn.Sequential(Encode(), MaskedLayer(), MaskedLayer(), Pool())


EXACT = [
    ("stateless module used twice across stages", activation_used_twice, (3, 2), (2, 2)),
    ("in-place first layer of a stage", in_place_first_layer, (1, 2), (2, 2)),
    ("parameter-free first stage", parameter_free_first_stage, (1, 3), (2, 2)),
    ("random buffer from the factory", lambda: nn.Sequential(RandomProjection(), nn.Tanh(), nn.Linear(6, 3)), (1, 2), (2, 2)),
    ("a plain tensor attribute (full build)", lambda: nn.Sequential(PlainScale(), nn.Tanh(), nn.Linear(6, 3)), (1, 2), (2, 2)),
    ("weights tied inside one block", lambda: nn.Sequential(TiedInside(), nn.Linear(6, 3)), (1, 1), (2, 2)),
    ("a parameter another block holds as a buffer, on one stage", borrowed_weight, (3, 1), (2, 2)),
    ("batch statistics on one batch", bn_batch_stats, (1, 2), (1, 1)),
    # integer ids cross the cut after block 0 (no gradient back), then every later cut carries floats
    ("integer ids across a cut", ids_then_embedding, (1, 1, 1, 1), (2, 2)),
    ("integer ids into the last stage", ids_then_embedding, (1, 3), (1, 1)),
    # tuples across every cut (AmoebaNet-D's cells), and dicts holding a boolean mask
    ("(state, skip) pairs across cuts", cells_with_pairs, (1, 1, 1, 1, 1), (2, 2)),
    ("(state, skip) pairs, two stages", cells_with_pairs, (2, 3), (1, 1)),
    ("a dict with a mask across cuts", masked_dicts, (1, 1, 1, 1), (2, 2)),
]


# the default run trains the edge models that cross a cut in a new way; the rest are `-m slow`
DEFAULT_EXACT = {
    "stateless module used twice across stages",
    "in-place first layer of a stage",
    "integer ids across a cut",
    "(state, skip) pairs across cuts",
    "a dict with a mask across cuts",
}
EXACT_LABELS = [pytest.param(c[0], id=c[0], marks=() if c[0] in DEFAULT_EXACT else pytest.mark.slow) for c in EXACT]


@pytest.fixture(scope="module")
def exact_runs(backend, request):
    wanted = selected(request, "label")
    started = {}
    for label, model, balance, (d, m) in [c for c in EXACT if c[0] in wanted]:
        j = job(model=model, optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.01), name="exact")
        plan = Plan(balance=balance, replicas=d, micro_batches=m, global_batch=12)
        started[label] = (j, d, m, j.run(plan=plan, backend=backend))
    return started


@pytest.mark.parametrize("label", EXACT_LABELS)
def test_accepted_edge_models_train_exactly_like_plain_pytorch(exact_runs, label):
    j, d, m, run = exact_runs[label]
    run.wait(progress=False, poll_s=0.2, timeout_s=600)
    got = run.trained_model().state_dict()
    want = train_reference(j, replicas=d, micro_batches=m).state_dict()
    assert got.keys() == want.keys()
    for k in want:
        assert torch.allclose(got[k], want[k], rtol=0, atol=1e-10), k


@pytest.mark.parametrize("label", EXACT_LABELS)
def test_the_spec_records_whether_containers_build_only_their_stage(exact_runs, label):
    j, _, _, run = exact_runs[label]
    run.wait(progress=False, poll_s=0.2, timeout_s=600)
    spec = run.spec()
    if label.endswith("(full build)"):
        assert spec.build == "full" and "attribute 'scale'" in spec.full_build_reason
    else:
        assert (spec.build, spec.full_build_reason) == ("meta", None)
