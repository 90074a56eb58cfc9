"""Deferred batch norm's arithmetic (lambdas/deferred_bn.py) against PyTorch's own BatchNorm.

The end-to-end runs through the state machines are in tests/test_transparency.py; here the record,
the combination and the update are compared with a BatchNorm that sees the whole global batch at
once, which is what the documented semantics say the one update per iteration equals.
"""

import pytest
import torch
from torch import nn

from stagecoach.core.training import tracked_norms
from stagecoach.lambdas import deferred_bn


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("kind", ["1d", "1d-seq", "2d"])
def test_one_update_from_every_replica_and_micro_batch_equals_pytorch_on_the_global_batch(kind, momentum, dtype):
    g = torch.Generator().manual_seed(0)
    make = {"1d": nn.BatchNorm1d, "1d-seq": nn.BatchNorm1d, "2d": nn.BatchNorm2d}[kind]
    shape = {"1d": (5, 4), "1d-seq": (5, 4, 3), "2d": (3, 4, 2, 3)}[kind]
    # the truth in float64, on the same (rounded) inputs
    runtime, whole = make(4, momentum=momentum).to(dtype), make(4, momentum=momentum).double()
    replicas, micro_batches = 3, 2
    for _ in range(3):
        # a large offset: sum of squares minus squared sum would cancel in float32
        parts = [(torch.randn(shape, generator=g, dtype=torch.float64) * 2 + 1000).to(dtype) for _ in range(replicas * micro_batches)]
        records = []
        for r in range(replicas):
            record = deferred_bn.BatchStats({"0": runtime})
            for j in reversed(range(micro_batches)):  # the last stage's order
                x = parts[r * micro_batches + j]
                with record.recording(j):
                    y = runtime(x)
                # normalised with the micro-batch's own statistics, as in train mode
                torch.testing.assert_close(y, nn.functional.batch_norm(x, None, None, runtime.weight, runtime.bias, True, 0.0, runtime.eps))
            records.append(record.tensors())
        deferred_bn.commit({"0": runtime}, deferred_bn.combine(records))
        with torch.no_grad():
            whole(torch.cat(parts).double())
        assert int(runtime.num_batches_tracked) == int(whole.num_batches_tracked)
        tol = 1e-12 if dtype == torch.float64 else 1e-6  # float32: the buffers' own rounding
        for name in ("running_mean", "running_var"):
            a, b = getattr(runtime, name).double(), getattr(whole, name).double()
            assert float((a - b).abs().max()) <= tol * float(b.abs().max()), name


def test_suspended_leaves_running_statistics_alone_and_restores_tracking():
    bn = nn.BatchNorm1d(3)
    before = {k: v.clone() for k, v in bn.named_buffers()}
    with deferred_bn.suspended([bn]):
        bn(torch.randn(4, 3))
    assert all(torch.equal(before[k], v) for k, v in bn.named_buffers())
    assert bn.track_running_stats
    bn(torch.randn(4, 3))
    assert int(bn.num_batches_tracked) == 1


def test_tracked_norms_are_keyed_like_the_running_statistics():
    from stagecoach.core.training import running_stats

    layers = [nn.Linear(2, 3), nn.Sequential(nn.BatchNorm1d(3), nn.BatchNorm1d(3, track_running_stats=False)), nn.BatchNorm1d(3)]
    norms = tracked_norms(layers, 4)
    assert list(norms) == ["5.0", "6"]
    assert {k.rsplit(".", 1)[0] for k in running_stats(layers, 4)} == set(norms)
