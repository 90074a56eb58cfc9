"""Data sets (issue 15 item 1): any map-style Dataset, uploaded once in content-addressed shards,
read by sample, transformed in the worker with randomness seeded per (seed, epoch, sample).

The anchor is a plain PyTorch loop over the user's Dataset (its own __getitem__, its transform
under the documented seed): a Dataset of dict inputs with a random augmentation trains on the real
state machines to the parameters that loop gives, float64 within 1e-5, and a Dataset equals the
tensors it holds.
"""

import hashlib
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset, default_collate

from stagecoach import Job, JobError
from stagecoach.core import keys
from stagecoach.core.samples import SHARD_BYTES, LocalSamples, Manifest, encode
from stagecoach.core.training import batch_indices, derive_seed
from stagecoach.deploy.dataset import encode_samples, upload_samples
from stagecoach.lambdas.channel import Channel
from stagecoach.lambdas.datafetch import DataIntegrityError, RemoteSamples

G = torch.Generator().manual_seed(21)
X = torch.randn(48, 5, generator=G, dtype=torch.float64)
Y = torch.randint(0, 3, (48,), generator=G)


class Pairs(Dataset):
    """A user's Dataset: dict inputs (features and a per-sample weight), a Python int label."""

    def __len__(self) -> int:
        return X.shape[0]

    def __getitem__(self, i: int):
        return {"x": X[i], "w": X[i, :1].abs()}, int(Y[i])


def noise(inp):
    """An augmentation: fresh Gaussian noise on the features, per sample and epoch."""
    return {"x": inp["x"] + 0.1 * torch.randn_like(inp["x"]), "w": inp["w"]}


class Weighted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 8)

    def forward(self, inp):
        return torch.tanh(self.lin(inp["x"])) * inp["w"]


def model() -> nn.Sequential:
    return nn.Sequential(Weighted(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))


def dataset_job(name: str, train, **kw) -> Job:
    return Job(
        name=name,
        model=model,
        loss=nn.CrossEntropyLoss(),
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
        train=train,
        global_batch=12,
        seed=3,
        dtype=torch.float64,
        **kw,
    )


def plain_pytorch(job: Job) -> nn.Module:
    """The user's Dataset and transform in a plain loop: the transform seeded per (seed, epoch,
    sample) as docs/data.md states."""
    torch.manual_seed(job.seed)
    net = job.model().double().train()
    opt = job.optimizer(list(net.parameters()))
    data, steps = job.train, len(job.train) // job.global_batch
    for t in range(job.iterations):
        epoch = t // steps
        items = []
        for i in batch_indices(job.seed, t, len(data), job.global_batch).tolist():
            inp, label = data[i]
            torch.manual_seed(derive_seed(job.seed, "transform", epoch, i))
            items.append((job.transform(inp), label))
        inputs, labels = default_collate(items)
        opt.zero_grad()
        job.loss(net(inputs), labels).backward()
        opt.step()
    return net


def test_epochs_set_the_iterations_and_bad_data_is_refused():
    assert dataset_job("ds-epochs", Pairs(), epochs=3).iterations == 3 * (48 // 12)
    with pytest.raises(JobError, match=r"job.iterations is missing: give iterations= .* or epochs="):
        dataset_job("ds-none", Pairs()).validate()
    with pytest.raises(JobError, match=r"job.train is int: give \(inputs, targets\) tensors or a map-style torch Dataset"):
        dataset_job("ds-bad", 5, iterations=1).validate()

    class Unlabelled(Dataset):
        def __len__(self):
            return 48

        def __getitem__(self, i):
            return X[i]

    with pytest.raises(JobError, match=r"job.train\[0\] is Tensor: a data set's item must be an \(input, target\) pair"):
        dataset_job("ds-unlabelled", Unlabelled(), iterations=1).validate()


def test_shards_are_content_addressed_and_every_record_is_found(backend):
    s3, bucket = backend.clients.s3, backend.resources.bucket
    samples = LocalSamples(Pairs())
    ds = upload_samples(s3, bucket, samples)
    assert upload_samples(s3, bucket, LocalSamples(Pairs())) == ds  # the same data: the same set, nothing re-sent
    manifest = Manifest.parse(s3.get_object(Bucket=bucket, Key=keys.dataset(ds))["Body"].read())
    assert manifest.samples == 48 and manifest.input_bytes == 48 * 6 * 8 and manifest.target_bytes == 48 * 8
    for shard in manifest.shards:
        body = s3.get_object(Bucket=bucket, Key=keys.data_shard(ds, shard))["Body"].read()
        assert hashlib.sha256(body).hexdigest() == shard
    # the set's objects, and only they, lie under its own prefix: what a job's role is granted (deploy/roles.py)
    held = {o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix=keys.dataset_prefix(ds))["Contents"]}
    assert held == {keys.dataset(ds), *(keys.data_shard(ds, h) for h in manifest.shards)}
    # read back as a worker does, by ranged GETs (forced: a 0 MB budget keeps nothing resident)
    remote = RemoteSamples(Channel(s3, bucket), ds, memory_mb=0)
    assert not remote.resident
    idx = torch.tensor([47, 0, 13])
    got = remote.inputs(Channel(s3, bucket), idx, None, 0, 0, torch.float64)
    want = samples.batch(idx)
    assert torch.equal(got["x"], want[0]["x"]) and torch.equal(got["w"], want[0]["w"])
    assert torch.equal(remote.targets(Channel(s3, bucket), idx), want[1])


class Rows(Dataset):
    """The tensors (X, Y) as a Dataset, row by row."""

    def __len__(self):
        return X.shape[0]

    def __getitem__(self, i):
        return X[i], Y[i]


def rows_job(name: str, train) -> Job:
    return Job(
        name=name,
        model=lambda: nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)),
        loss=nn.CrossEntropyLoss(),
        optimizer=lambda p: torch.optim.Adam(p, lr=0.01),
        train=train,
        global_batch=12,
        iterations=6,
        seed=3,
        dtype=torch.float64,
    )


@pytest.fixture(scope="module")
def runs(backend):
    plan = dict(stages=2, replicas=2, micro_batches=2, backend=backend)
    started = {
        "dataset": dataset_job("ds-augment", Pairs(), epochs=2, transform=noise).run(**plan),
        "plain": dataset_job("ds-plain", Pairs(), iterations=8).run(**plan),
        "rows": rows_job("ds-rows", Rows()).run(**plan),
        "tensors": rows_job("ds-tensors", (X, Y)).run(**plan),
    }
    for run in started.values():
        run.wait(progress=False, poll_s=0.2, timeout_s=600)
    return started


def test_a_dataset_with_augmentation_trains_like_a_plain_loop(runs):
    run = runs["dataset"]
    assert run.job.iterations == 8
    got, want = run.trained_model().state_dict(), plain_pytorch(run.job).state_dict()
    initial = run.job.build_model().state_dict()
    assert max(float((got[k] - initial[k]).abs().max()) for k in got) > 1e-3, "training moved it"
    assert max(float((got[k] - want[k]).abs().max()) for k in want) < 1e-5
    # the augmentation changed what was trained (the same job without it ends elsewhere)
    plain = runs["plain"].trained_model().state_dict()
    assert max(float((plain[k] - got[k]).abs().max()) for k in got) > 1e-4


def test_a_dataset_trains_exactly_what_its_tensors_train(runs):
    rows, tensors = runs["rows"].trained_model().state_dict(), runs["tensors"].trained_model().state_dict()
    assert all(torch.equal(rows[k], tensors[k]) for k in rows)
    assert runs["rows"].job.samples.batch(torch.tensor([5, 1]))[0].equal(X[[5, 1]])


def test_a_streamed_read_fetches_only_its_records(backend):
    """A streamed set's records are checked against the manifest's digests, so a worker downloads
    no shard whole: every shard GET is ranged, and the bytes fetched are the records' own."""
    s3, bucket = backend.clients.s3, backend.resources.bucket
    samples = LocalSamples((X * 5 + 1, Y))
    ds = upload_samples(s3, bucket, samples)
    manifest = Manifest.parse(s3.get_object(Bucket=bucket, Key=keys.dataset(ds))["Body"].read())
    gets: list[tuple[str, str | None]] = []

    def seen(params: dict[str, Any], **_: Any) -> None:
        gets.append((params["Key"], params.get("Range")))

    s3.meta.events.register("before-parameter-build.s3.GetObject", seen)
    try:
        remote = RemoteSamples(Channel(s3, bucket), ds, memory_mb=0)
        idx = torch.tensor([3, 40, 7])
        assert torch.equal(remote.inputs(Channel(s3, bucket), idx, None, 0, 0, torch.float64), samples.batch(idx)[0])
    finally:
        s3.meta.events.unregister("before-parameter-build.s3.GetObject", seen)
    shard_gets = [(k, r) for k, r in gets if k.startswith(keys.data_shard(ds, ""))]
    spans = [manifest.locate(i, "input") for i in (3, 40, 7)]
    assert sorted(shard_gets) == sorted((keys.data_shard(ds, manifest.shards[s]), f"bytes={a}-{b - 1}") for s, a, b in spans)


def _shard_of(samples: LocalSamples) -> bytes:
    """The one shard a small set uploads as (deploy/dataset.py: each sample's input and target
    records, concatenated)."""
    return b"".join(encode(part) for i in range(len(samples)) for part in samples[i])


def test_a_shard_that_does_not_hash_to_its_name_is_refused_and_replaced(backend):
    """Shards are named by their SHA-256 and an upload skips a name the bucket holds, so whoever
    may write data/ could place other bytes under a right name, before the upload or after it.
    Workers check the manifest against its name, a whole shard against its name, and a record read
    by range against its digest in the manifest, and refuse one that differs, naming it; an upload
    finding such a shard puts the right bytes back."""
    s3, bucket = backend.clients.s3, backend.resources.bucket
    right = LocalSamples((X * 7 + 3, Y))  # data of this test only: its shard's name is its own
    wrong = LocalSamples((X * 7 - 3, Y))  # same shapes, so every record's offset still fits
    body, poison = _shard_of(right), _shard_of(wrong)
    assert len(body) == len(poison) < SHARD_BYTES
    with tempfile.TemporaryDirectory() as spool:  # the set's id, as the upload computes it, before it is uploaded
        ds = encode_samples(right, Path(spool))[0].dataset_id()
    key = keys.data_shard(ds, hashlib.sha256(body).hexdigest())
    s3.put_object(Bucket=bucket, Key=key, Body=poison)  # placed before the set is ever uploaded

    assert upload_samples(s3, bucket, right) == ds
    assert s3.get_object(Bucket=bucket, Key=key)["Body"].read() == body  # the upload put the right bytes back
    idx = torch.tensor([3, 40])
    for memory_mb in (1024, 0):  # resident (whole shards), streamed (ranged GETs)
        remote = RemoteSamples(Channel(s3, bucket), ds, memory_mb=memory_mb)
        assert torch.equal(remote.inputs(Channel(s3, bucket), idx, None, 0, 0, torch.float64), right.batch(idx)[0])

    s3.put_object(Bucket=bucket, Key=key, Body=poison)  # replaced after the upload
    refused = {
        1024: rf"data shard {key} does not hash to its name .*Nothing was trained on them.*launch the job again",
        0: rf"sample 3's input record in data shard {key} \(bytes \d+-\d+\) does not match its digest in the data set's "
        r"manifest.*Nothing was trained on them.*launch the job again",
    }
    for memory_mb, match in refused.items():  # resident: the shard against its name; streamed: each record
        remote = RemoteSamples(Channel(s3, bucket), ds, memory_mb=memory_mb)
        with pytest.raises(DataIntegrityError, match=match):
            remote.inputs(Channel(s3, bucket), idx, None, 0, 0, torch.float64)
    s3.put_object(Bucket=bucket, Key=key, Body=body)

    # the manifest likewise: another set's manifest under this set's name
    other = upload_samples(s3, bucket, wrong)
    manifest = keys.dataset(ds)
    s3.put_object(Bucket=bucket, Key=manifest, Body=s3.get_object(Bucket=bucket, Key=keys.dataset(other))["Body"].read())
    with pytest.raises(DataIntegrityError, match=rf"data set {manifest} does not hash to its name"):
        RemoteSamples(Channel(s3, bucket), ds, memory_mb=1024)
    assert upload_samples(s3, bucket, right) == ds  # and the next upload puts it back
    RemoteSamples(Channel(s3, bucket), ds, memory_mb=1024)
