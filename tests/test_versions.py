"""Which stored versions are whole (core/versions.py): where `resume` and a restarted window start."""

import torch

from stagecoach.core import versions


def test_a_version_with_parameters_alone_is_not_complete_when_the_optimizer_keeps_state():
    """A warm attempt at d > 1 stores every version's parameters but the optimizer state only at
    its checkpoints: before any state is stored (window start 0), only the spec can tell."""
    params = {0: 4, 1: 4, 2: 4, 3: 2}  # version 3 still being written
    assert versions.complete_versions(params, {}, {}, stateful=True) == [0]
    assert versions.complete_versions(params, {}, {}, stateful=False) == [0, 1, 2]
    assert versions.complete_versions(params, {2: 4}, {}, stateful=True) == [0, 2]
    # a spec from before the flag: whether any state is stored
    assert versions.complete_versions(params, {2: 4}, {}) == [0, 2]
    # running statistics are part of a version where the model has them
    assert versions.complete_versions(params, {}, {0: 1, 2: 1}, stateful=False) == [0, 2]


def test_the_resume_point_is_the_latest_complete_version_whose_due_work_is_done():
    complete = [0, 5, 6, 7, 8]
    assert versions.resume_point(complete, 5, 10, set()) == 8
    # version 8's evaluation is missing: its iteration runs again, then the evaluation
    assert versions.resume_point(complete, 5, 10, {8}) == 7
    # nothing past the window's start is complete: the window's start (always kept)
    assert versions.resume_point([0], 5, 10, set()) == 5
    # never outside the window
    assert versions.resume_point([0, 3, 12], 5, 10, set()) == 5
    assert versions.due_versions([4, 10], 3, 10) == {3, 4, 6, 9, 10}


def test_count_versions_reads_the_version_from_each_key():
    prefix = "jobs/j-0123abcd/params/"
    ks = [f"{prefix}v{v}/s{s}/k0/c0" for v in (0, 1, 12) for s in range(2)]
    assert versions.count_versions(ks, prefix) == {0: 2, 1: 2, 12: 2}


def test_an_optimizer_keeps_state_or_not():
    assert versions.optimizer_keeps_state(lambda p: torch.optim.Adam(p, lr=0.1))
    assert versions.optimizer_keeps_state(lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
    assert not versions.optimizer_keeps_state(lambda p: torch.optim.SGD(p, lr=0.1))
