"""Mixed precision (issue 15 item 7): ``Job(dtype=torch.bfloat16)`` computes and transfers in
bfloat16 while the stored parameters and the optimizer's state are float32 master copies.

At one stage, one replica and one micro-batch it equals a plain PyTorch mixed-precision loop (a
bf16 copy of fp32 master weights computes the gradient, which updates the master copy in fp32)
exactly; on a split plan the activations, input gradients and gradient shards in S3 are bf16 —
half the bytes — and the parameters float32.
"""

import pytest
import torch
from torch import nn

from stagecoach import Job
from stagecoach.core.training import batch_indices
from stagecoach.lambdas.channel import load_tensors

G = torch.Generator().manual_seed(17)
X = torch.randn(64, 8, generator=G)
Y = (X[:, 0] > 0).long()


def make_job(name: str) -> Job:
    return Job(
        name=name,
        model=lambda: nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 2)),
        loss=nn.CrossEntropyLoss(),
        optimizer=lambda p: torch.optim.Adam(p, lr=0.01),
        train=(X, Y),
        global_batch=16,
        iterations=6,
        seed=3,
        dtype=torch.bfloat16,
    )


def plain_mixed_precision(job: Job) -> nn.Module:
    torch.manual_seed(job.seed)
    master = job.model().float()
    opt = job.optimizer(list(master.parameters()))
    for t in range(job.iterations):
        work = job.model().to(torch.bfloat16)
        work.load_state_dict({k: v.to(torch.bfloat16) for k, v in master.state_dict().items()})
        idx = batch_indices(job.seed, t, X.shape[0], job.global_batch)
        job.loss(work(X[idx].to(torch.bfloat16)), Y[idx]).backward()
        for p, w in zip(master.parameters(), work.parameters()):
            p.grad = w.grad.float()
        opt.step()
    return master


@pytest.fixture(scope="module")
def runs(backend):
    started = {
        "one": make_job("bf16-one").run(backend=backend),
        "split": make_job("bf16-split").run(stages=2, replicas=2, micro_batches=2, backend=backend),
    }
    for run in started.values():
        run.wait(progress=False, poll_s=0.2, timeout_s=600)
    return started


def test_bf16_equals_a_plain_mixed_precision_loop(runs):
    run = runs["one"]
    got = run.trained_model()
    assert all(p.dtype == torch.float32 for p in got.parameters())  # the master weights come back
    want = plain_mixed_precision(run.job)
    initial = run.job.build_model(torch.float32).state_dict()
    assert max(float((got.state_dict()[k] - initial[k]).abs().max()) for k in initial) > 1e-3
    assert max(float((got.state_dict()[k] - v).abs().max()) for k, v in want.state_dict().items()) < 1e-6


def test_bf16_moves_half_the_bytes_and_stores_fp32_weights(runs, backend):
    run = runs["split"]
    losses = run.losses()
    assert losses[-1] < losses[0]
    s3, bucket = backend.clients.s3, run.bucket
    prefix = f"jobs/{run.job_id}/"
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])]

    def dtypes(part: str) -> set:
        found = [k for k in keys if f"/{part}/" in k]
        assert found, part
        return {v.dtype for k in found[:4] for v in load_tensors(s3.get_object(Bucket=bucket, Key=k)["Body"].read()).values()}

    assert dtypes("act") == {torch.bfloat16} and dtypes("grad") == {torch.bfloat16} and dtypes("gshard") == {torch.bfloat16}
    assert dtypes("params") == {torch.float32}
