"""Inputs that used to be deployed and then fail inside a task, or to be refused with the wrong
words (issue 24 item 12): each is refused by ``Job.validate`` — before anything is deployed or
uploaded — with a message that names the cause and the fix; or, where plain PyTorch trains it,
accepted and trained as plain PyTorch does.

No test here starts a stack: a refusal comes from ``validate``, and ``run`` on a backend that fails
any use shows the job never reached it (nothing deployed, nothing uploaded).
"""

import threading

import numpy as np
import pytest
import torch
from torch import nn

from stagecoach import Job, JobError
from stagecoach.backend import Backend
from stagecoach.deploy.dataset import upload_samples
from stagecoach.reference import train_reference

X = torch.randn(32, 4, generator=torch.Generator().manual_seed(3))
Y = torch.randint(0, 2, (32,), generator=torch.Generator().manual_seed(4))


def model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def good(**change) -> Job:
    kw = dict(
        model=model,
        loss=nn.CrossEntropyLoss(),
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        train=(X, Y),
        global_batch=8,
        iterations=3,
        name="refused",
    )
    kw.update(change)
    return Job(**kw)


class NoBackend(Backend):
    """A backend whose every use fails the test: a refused job must not reach it (its clients
    would upload the data set and the code, then create the functions)."""

    name = "none"

    def __getattribute__(self, name):
        if name.startswith("__"):
            return object.__getattribute__(self, name)
        raise AssertionError(f"the backend was used ({name}) for a job that should have been refused")

    def long_call_client(self, service):
        raise AssertionError("the backend was used")


class Argmax(nn.Module):
    """Ends the model in an integer tensor: no gradient reaches any parameter."""

    def forward(self, x):
        return x.argmax(-1)


class ShapeChanges(torch.utils.data.Dataset):
    """Samples 0-7 have 4 features, the later ones 5: a batch of both cannot be stacked."""

    def __len__(self):
        return 32

    def __getitem__(self, i):
        return torch.zeros(4 if i < 8 else 5), i % 2


class LongerThanItems(torch.utils.data.Dataset):
    """Says 40 samples, holds 32."""

    def __len__(self):
        return 40

    def __getitem__(self, i):
        return X[i], Y[i]  # IndexError past 31


LOCK = threading.Lock()
NAN_AT_1 = X.clone()
NAN_AT_1[1, 2] = float("nan")


def lazy_model() -> nn.Sequential:
    return nn.Sequential(nn.LazyLinear(8), nn.Tanh(), nn.Linear(8, 2))


class LazyNet(nn.Module):
    """A lazy module in a model cut at ``blocks``: torch.export cannot capture it uninitialised."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.LazyLinear(8), nn.Linear(8, 2)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


CASES = [
    (
        "an integer output",
        dict(model=lambda: nn.Sequential(nn.Linear(4, 8), Argmax()), loss=lambda out, y: (out.double() - y).pow(2).mean()),
        r"the model's output is an integer tensor \(torch.int64\).*no gradient.*return floating values",
    ),
    (
        "a scheduler shorter than the job",
        dict(scheduler=lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=2)),
        r"job.scheduler fails at step 3 of the job's 3 iterations.*total steps is 2.*covers all 3 iterations",
    ),
    (
        "a data set whose samples change shape",
        dict(train=ShapeChanges()),
        r"job.train\[8\]'s input has shape \(5,\) but job.train\[0\]'s \(4,\).*same shapes",
    ),
    (
        "an unpicklable transform",
        dict(transform=lambda x: x if LOCK else x),
        r"job.transform cannot be pickled.*lock.*module-level function",
    ),
    (
        "a data set longer than its items",
        dict(train=LongerThanItems()),
        r"job.train\[32\] raises IndexError.*len\(job.train\) is 40.*__len__",
    ),
    (
        "a lazy module",
        dict(model=lazy_model),
        r"LazyLinear.*uninitialized.*dry run.*model\(torch.zeros\(1, 4\)\)",
    ),
    (
        "a lazy module in a model cut at blocks",
        dict(model=LazyNet, blocks=["a", "b"]),
        r"LazyLinear.*uninitialized.*dry run.*model\(torch.zeros\(1, 4\)\)",
    ),
    ("a NaN input", dict(train=(NAN_AT_1, Y)), r"job.train\[1\]'s input holds NaN"),
    ("a seed beyond torch's", dict(seed=2**64), r"job.seed=18446744073709551616.*below 2\*\*64"),
]


@pytest.mark.parametrize("change, message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_refused_by_validate_with_the_cause_and_the_fix(change, message):
    with pytest.raises(JobError, match=message):
        good(**change).validate()


@pytest.mark.parametrize("change", [c[1] for c in CASES], ids=[c[0] for c in CASES])
def test_refused_before_the_backend_is_touched(change):
    with pytest.raises(JobError):
        good(**change).run(stages=2, backend=NoBackend())


def test_a_nan_input_is_named_rather_than_blamed_on_the_loss():
    """Once refused only on a split batch, as a loss that is not a mean (reduction='sum')."""
    with pytest.raises(JobError) as e:
        good(train=(NAN_AT_1, Y)).validate()
    assert "reduction" not in str(e.value)


def test_what_the_refusals_advise_is_accepted():
    good(scheduler=lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=3)).validate()
    good(seed=2**64 - 1).validate()

    def materialised() -> nn.Sequential:  # torch's advice for lazy modules: a dry run in the factory
        m = lazy_model()
        with torch.no_grad():
            m(torch.zeros(1, 4))
        return m

    j = good(model=materialised)
    j.validate()
    assert j.build_model()[0].weight.shape == (8, 4)


class Uploads:
    """What upload_samples writes, by key (the slice of an S3 client it uses)."""

    class exceptions:
        ClientError = KeyError

    def __init__(self):
        self.objects = {}

    def head_object(self, Bucket, Key, **_):
        return {"ContentLength": len(self.objects[Key])}

    def upload_fileobj(self, body, Bucket, Key, **_):
        self.objects[Key] = body.read()

    def put_object(self, Bucket, Key, Body, **_):
        self.objects[Key] = bytes(Body)


def test_numpy_arrays_train_as_the_same_tensors_do():
    """numpy arrays as ``train=`` were read as a data set of 2 samples (the arrays)."""
    as_numpy, as_tensors = good(train=(X.numpy(), Y.numpy())), good()
    as_numpy.validate()
    assert len(as_numpy.samples) == 32
    a, b = as_numpy.head(8), as_tensors.head(8)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    # the workers read the same bytes: the uploaded data set is the tensors' one
    uploads = [Uploads(), Uploads()]
    assert upload_samples(uploads[0], "b", as_numpy.samples) == upload_samples(uploads[1], "b", as_tensors.samples)
    assert uploads[0].objects == uploads[1].objects
    got, want = train_reference(as_numpy).state_dict(), train_reference(as_tensors).state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert as_numpy.predict(as_numpy.manual_plan()).time_s > 0  # the profile reads its samples too


def test_numpy_items_of_a_dataset_become_tensors_as_default_collate_makes_them():
    class Arrays(torch.utils.data.Dataset):
        def __len__(self):
            return 32

        def __getitem__(self, i):
            return X[i].numpy(), np.int64(Y[i])

    j = good(train=Arrays())
    j.validate()
    x, y = j.head(8)
    assert torch.equal(x, X[:8]) and torch.equal(y, Y[:8])
