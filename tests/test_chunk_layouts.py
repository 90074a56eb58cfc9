"""The chunks per shard a plan names (Plan.chunks, chosen by the planner's predicted cost) change no
bits: a chunk is a range of a shard, and every element is reduced in the same order whatever the
cut. End to end on the local stack, float64, 3 replicas: C = 1 and C = 4 train the same model as
single-process PyTorch, through the sync Map (scatter-reduce) and the fused exchange (pipelined)."""

from __future__ import annotations

import dataclasses

import torch
from helpers import max_diff
from torch import nn

from stagecoach import Job
from stagecoach.reference import train_reference

D = 3
M = 1


def small_job(name: str) -> Job:
    g = torch.Generator().manual_seed(11)
    x = torch.randn(72, 10, generator=g, dtype=torch.float64)
    y = torch.randint(0, 4, (72,), generator=g)
    return Job(
        name=name,
        model=lambda: nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Dropout(0.2), nn.Linear(32, 24), nn.Tanh(), nn.Linear(24, 4)),
        loss=nn.CrossEntropyLoss(),
        optimizer=lambda p: torch.optim.Adam(p, lr=1e-2),
        train=(x, y),
        global_batch=4 * D,
        iterations=3,
        seed=5,
        dtype=torch.float64,
    )


def test_the_chunk_count_changes_no_bits(backend):
    plans, runs = {}, {}
    for c in (1, 4):
        job = small_job(f"chunks-{c}")
        plan = job.manual_plan(stages=2, replicas=D, micro_batches=M, sync=("scatter_reduce", "pipelined_scatter_reduce"))
        plans[c] = dataclasses.replace(plan, chunks=(c, c))
        runs[c] = job.run(plan=plans[c], backend=backend)
    assert plans[1].chunks == (1, 1) and plans[4].chunks == (4, 4)
    for c, run in runs.items():
        status = run.wait(progress=False, poll_s=0.2, timeout_s=900)
        assert status == "SUCCEEDED", (c, status)
    for c, run in runs.items():  # the runtime cut each shard as the plan says: objects c0..c{C-1}
        pages = backend.clients.s3.get_paginator("list_objects_v2").paginate(
            Bucket=backend.resources.bucket, Prefix=f"jobs/{run.job_id}/params/"
        )
        keys = [o["Key"] for page in pages for o in page.get("Contents", [])]
        assert {int(k.rsplit("/c", 1)[1]) for k in keys if "/k" in k} == set(range(c)), (c, keys[:8])
    trained = {c: run.trained_model() for c, run in runs.items()}
    assert max_diff(trained[1], runs[1].job.build_model()) > 1e-3, "training must have moved the parameters"
    for (name, p), q in zip(trained[4].named_parameters(), trained[1].parameters()):
        assert torch.equal(p, q), f"C=4 against C=1, {name}: max diff {(p - q).abs().max()}"
    expected = train_reference(runs[1].job, replicas=D, micro_batches=M)
    for c, model in trained.items():
        for (name, p), q in zip(model.named_parameters(), expected.parameters()):
            assert p.dtype == q.dtype == torch.float64
            assert torch.equal(p, q), f"C={c} {name}: max diff {(p - q).abs().max()}"
