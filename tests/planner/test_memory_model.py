"""The planner's memory model counts what a container holds (docs/performance-model.md §2): its own
stage only (containers build on the meta device: core/stagebuild.py), its buffers once, the
parameters and gradients a warm container keeps when it runs a sync task, and the whole model for
a job whose factory needs the full build."""

import dataclasses

import pytest
import torch
from torch import nn

from stagecoach import Job
from stagecoach.planner.model.fits import check_fits
from stagecoach.planner.model.perfmodel import stage_terms
from stagecoach.planner.model.platforms import aws_platform
from stagecoach.planner.model.syncmodel import SyncChoice
from stagecoach.planner.profile.layers import LayerProfile, LayerTooLargeError, ModelProfile, merge_layers
from stagecoach.planner.profile.meta import profile_meta

MB = 2**20
PLAT = aws_platform()


def terms(choice: SyncChoice, d: int, p_bytes: float = 100 * MB, **kw: float):
    return stage_terms(p_bytes, 0.1, 0.2, 0.0, 0.0, 0.0, 0.0, 8.0, True, False, 2048, choice, d, 1, 1, PLAT, **kw)


@pytest.mark.parametrize(
    "choice,d", [(SyncChoice("scatter_reduce", 4), 4), (SyncChoice("all_reduce", 1), 4), (SyncChoice("k_reduce", 2), 4)]
)
def test_a_sync_task_counts_the_parameters_and_gradients_its_warm_container_holds(choice, d):
    t = terms(choice, d)
    assert t.sync.tasks > 0
    assert t.memory_bytes == max(t.backward_memory_bytes, 2 * 100 * MB + t.sync.task_bytes)


@pytest.mark.parametrize("choice,d", [(SyncChoice("none", 1), 1), (SyncChoice("pipelined_scatter_reduce", 4), 4)])
def test_without_sync_tasks_the_backward_task_is_the_peak(choice, d):
    t = terms(choice, d)
    assert t.sync.tasks == 0 and t.memory_bytes == t.backward_memory_bytes


def test_buffers_are_held_once_and_a_full_build_holds_the_whole_model():
    choice = SyncChoice("none", 1)
    plain = terms(choice, 1)
    assert terms(choice, 1, buffer_bytes=7 * MB).memory_bytes == plain.memory_bytes + 7 * MB
    assert terms(choice, 1, build_bytes=plain.memory_bytes / 2).memory_bytes == plain.memory_bytes  # the stage is the larger
    assert terms(choice, 1, build_bytes=5000 * MB).memory_bytes == 5000 * MB  # the whole model, while it builds


def test_profiles_record_buffer_bytes_and_merging_sums_them():
    model = lambda: nn.Sequential(nn.Conv2d(1, 8, 3), nn.BatchNorm2d(8), nn.Flatten(), nn.Linear(8 * 4, 2))  # noqa: E731
    prof = profile_meta(model, torch.randn(1, 4, 4))
    assert [l.buffer_bytes for l in prof.layers] == [0.0, 8 * 4 * 2 + 8, 0.0, 0.0]  # running mean and var, the count
    assert merge_layers(prof.layers).buffer_bytes == 72
    again = ModelProfile.from_dict(dataclasses.replace(prof, build_bytes=3.0).to_dict())
    assert again.build_bytes == 3.0 and again.layers[1].buffer_bytes == 72


def test_a_model_built_whole_in_every_container_must_fit_the_largest_tier():
    layer = LayerProfile("small", 1 * MB, 0.0, 1.0, 1.0)
    profile = ModelProfile("big", (layer, layer), 1.0, build_bytes=20_000 * MB)
    with pytest.raises(LayerTooLargeError, match="built whole in every container"):
        check_fits(profile, PLAT)
    check_fits(dataclasses.replace(profile, build_bytes=0.0), PLAT)


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 3)
        self.scale = torch.ones(3)  # a plain tensor attribute: the full build

    def forward(self, x):
        return self.lin(x) * self.scale


def test_the_job_tells_the_planner_what_its_containers_build():
    x, y = torch.randn(16, 6), torch.randint(0, 3, (16,))

    def job(factory):
        return Job(
            model=factory,
            loss=nn.CrossEntropyLoss(),
            optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
            train=(x, y),
            global_batch=8,
            iterations=1,
        )

    profile = ModelProfile("m", (LayerProfile("a", 1.0, 0.0, 1.0, 1.0),), 1.0)
    assert job(lambda: nn.Sequential(nn.Linear(6, 3))).with_job_bytes(profile).build_bytes == 0.0
    full = job(lambda: nn.Sequential(Scaled()))
    assert full.facts.full_build is not None
    assert full.with_job_bytes(profile).build_bytes == (6 * 3 + 3) * 4  # the whole model's parameters and buffers
