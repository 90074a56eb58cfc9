"""Values that skip stages go straight to the stage that reads them (issue 11 item 3).

A model whose hidden state from its first block is read again by its last one (a long skip
connection) and whose mask, computed at the start, is read only at the end: cut into four stages,
stage 0 sends the skip and the mask to stage 3 directly, stages 1 and 2 never relay them, and
stage 3 sends the skip's gradient straight back to stage 0, which adds it to the one coming
through the chain. Trained on the real state machines it equals plain PyTorch (float64, within 1e-5).
"""

import pytest
import torch
from test_any_model import plain_pytorch  # the user's own module in a plain PyTorch loop
from torch import nn

from stagecoach import Job
from stagecoach.core import keys
from stagecoach.lambdas.channel import load_tensors
from stagecoach.planner.profile.flows import Flow, Route, Transfer, merged_flows, routes, stage_bytes


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(8, 3)

    def forward(self, z: torch.Tensor, h: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        y = self.out(z + h)
        return torch.where(keep[:, None], y, -y)


class LongSkip(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(6, 8)
        self.body = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(2))
        self.head = Head()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.stem(x))
        keep = x[:, 0] > 0  # a mask made at the start, read only at the end
        z = self.body[1](self.body[0](h))
        return self.head(z, h, keep)


def skip_job(name: str, **kw) -> Job:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(48, 6, generator=g, dtype=torch.float64)
    return Job(
        name=name,
        model=LongSkip,
        blocks=["stem", "body.*", "head"],
        loss=nn.CrossEntropyLoss(),
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
        train=(x, torch.randint(0, 3, (48,), generator=g)),
        global_batch=12,
        iterations=4,
        seed=6,
        dtype=torch.float64,
        **kw,
    )


def test_routes_send_each_value_from_its_producer_to_its_readers():
    """Exact routes for a chain of five blocks cut into three stages."""
    flows = [
        Flow("x", -1, (4,), False),  # the model's input (ids), read again by the last block
        Flow("h", 0, (1,), True),
        Flow("mask", 0, (1, 2, 3, 4), False),
        Flow("skip", 1, (4,), True),
        Flow("z", 3, (4,), True),
    ]
    got = routes(flows, [range(0, 2), range(2, 4), range(4, 5)])
    to1_2 = Transfer(0, (1, 2), ("mask",), ())
    to2 = Transfer(0, (2,), ("x", "skip"), ("skip",))
    z = Transfer(1, (2,), ("z",), ("z",))
    assert got == [Route((), (to1_2, to2)), Route((to1_2,), (z,)), Route((to1_2, to2, z), ())]
    assert got[0].grad_senders() == (2,) and got[1].grad_senders() == (2,)
    assert got[2].grad_receivers(2) == (0, 1) and got[1].grad_receivers(1) == ()
    assert to2.name == "to2" and to1_2.name == "to1-2"


def test_a_stage_counts_only_what_it_reads_and_computes():
    flows = [
        Flow("h", 0, (1, 3), True, 64.0, 64.0),
        Flow("mask", 0, (3,), False, 1.0),
        Flow("z", 1, (2,), True, 64.0, 64.0),
        Flow("w", 2, (3,), True, 64.0, 64.0),
    ]
    middle = stage_bytes(flows, 2, 3)  # reads z, computes w; h and the mask pass it by
    assert (middle.in_ps, middle.out_ps, middle.ingrad_ps, middle.outgrad_ps) == (64.0, 64.0, 64.0, 64.0)
    first = stage_bytes(flows, 0, 1)
    assert (first.out_ps, first.outgrad_ps) == (65.0, 64.0)  # h uploaded once for its two readers, the mask
    last = stage_bytes(flows, 3, 4)
    assert (last.in_ps, last.ingrad_ps) == (129.0, 128.0)  # h and the mask from stage 0, w from stage 2


@pytest.fixture(scope="module")
def skip_run(backend):
    run = skip_job("skip-stages").run(stages=4, replicas=2, micro_batches=3, backend=backend)
    run.wait(progress=False, poll_s=0.2, timeout_s=600)
    return run


def test_a_skip_connection_trains_like_plain_pytorch(skip_run):
    trained, expected = skip_run.trained_model(), plain_pytorch(skip_run.job)
    assert type(trained) is LongSkip
    initial = dict(skip_run.job.user_model(skip_run.job.build_model()).named_parameters())
    got = dict(trained.named_parameters())
    assert max(float((got[k] - initial[k]).detach().abs().max()) for k in got) > 1e-3, "training moved the parameters"
    assert max(float((got[k] - p).detach().abs().max()) for k, p in expected.named_parameters()) < 1e-5


def test_the_skip_and_the_mask_go_from_stage_0_to_stage_3_directly(skip_run, backend):
    """What each stage wrote for the last iteration's first micro-batch: stage 0 uploads its hidden
    state once for both of its readers (stage 1, and stage 3 through the skip) and the mask for
    stage 3 alone; stages 1 and 2 send only the chain's value; stage 3 sends the skip's gradient
    to stage 0 itself, not through 2 and 1."""
    s3, bucket = backend.clients.s3, skip_run.bucket
    t = skip_run.job.iterations - 1
    prefix = f"jobs/{skip_run.job_id}/iter/{t}/"
    listed = [o["Key"][len(prefix) :] for o in s3.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])]
    acts = sorted(k for k in listed if k.startswith("act/") and "/r0/m0/" in k)
    grads = sorted(k for k in listed if k.startswith("grad/") and "/r0/m0/" in k)
    assert acts == ["act/s0/r0/m0/to1-3", "act/s0/r0/m0/to3", "act/s1/r0/m0/to2", "act/s2/r0/m0/to3"]
    assert grads == ["grad/s1/r0/m0/to0", "grad/s2/r0/m0/to1", "grad/s3/r0/m0/to0", "grad/s3/r0/m0/to2"]

    def names(key: str) -> dict[str, torch.Tensor]:
        return load_tensors(s3.get_object(Bucket=bucket, Key=prefix + key)["Body"].read())

    assert [v.dtype for v in names("act/s0/r0/m0/to3").values()] == [torch.bool]  # the mask, no gradient back
    assert [v.dtype for v in names("act/s0/r0/m0/to1-3").values()] == [torch.float64]
    assert len(names("act/s1/r0/m0/to2")) == len(names("act/s2/r0/m0/to3")) == 1  # the chain's value alone
    assert [v.dtype for v in names("grad/s3/r0/m0/to0").values()] == [torch.float64]  # the skip's, not the mask's
    assert keys.act(skip_run.job_id, t, 0, 0, 0, "to3") == prefix + "act/s0/r0/m0/to3"


def test_a_merged_profile_keeps_the_values_that_still_cross_a_cut():
    flows = [Flow("x", -1, (4,), False, 8.0), Flow("h", 0, (1,), True, 64.0, 64.0), Flow("skip", 1, (2, 4), True, 64.0, 64.0)]
    # blocks {0, 1}, {2, 3}, {4}: h stays inside the first group; the skip now leaves group 0
    assert merged_flows(flows, [2, 2, 1]) == (Flow("x", -1, (2,), False, 8.0), Flow("skip", 0, (1, 2), True, 64.0, 64.0))


def test_the_profile_and_the_performance_model_count_the_direct_sends():
    """Stage 2 of LongSkip reads one hidden state (8 float64 = 64 bytes a sample); relayed, it would
    also carry the skip and the mask (129). The model charges the direct bytes."""
    from dataclasses import replace

    from stagecoach.planner.model.perfmodel import SyncChoice, layer_terms
    from stagecoach.planner.model.platforms import aws_platform
    from stagecoach.planner.profile.meta import profile_meta

    job = skip_job("skip-profile")
    profile = profile_meta(job.build_model(), job.train[0][0])
    assert profile.layers[1].out_bytes_per_sample == 129.0  # the cut after block 1 holds z, h and the mask
    io = profile.stage_io(2, 3)
    assert (io.in_ps, io.ingrad_ps, io.out_ps, io.outgrad_ps) == (64.0, 64.0, 64.0, 64.0)
    assert profile.stage_io(0, 1).out_ps == 65.0  # h (for stages 1 and 3) and the mask, once each
    plat, none = aws_platform(), SyncChoice("none", 1)
    args = (False, False, 2048, none, 1, 64, 1, plat)
    direct, relayed = layer_terms(profile, 2, 3, *args), layer_terms(replace(profile, flows=()), 2, 3, *args)
    assert direct.fwd_hop_own_s < relayed.fwd_hop_own_s and direct.bwd_step_s < relayed.bwd_step_s
