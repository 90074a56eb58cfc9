"""Checkpoints kept every N iterations and pretrained weights to start from (issue 15 item 5):
``Job(checkpoint_every=N)`` leaves the model's state_dict (its own names, BatchNorm's running
statistics included) as the workers had it after every N-th iteration, loadable as it is; and
``Job(init_from=...)`` starts a job from such a state_dict, or from a safetensors file, exactly as
plain PyTorch would continue from it (float64)."""

import dataclasses

import pytest
import torch
from test_any_model import Residual, bn_job

from stagecoach import JobError
from stagecoach.core.training import batch_indices
from stagecoach.reference import train_reference


@pytest.fixture(scope="module")
def first(backend):
    run = bn_job("ckpt-first", checkpoint_every=2).run(stages=2, backend=backend)
    run.wait(progress=False, poll_s=0.2, timeout_s=600)
    return run


def test_checkpoints_are_the_models_state_dict_at_those_iterations(first):
    job = first.job
    assert first.checkpoints() == [2, 4] == job.checkpoint_versions()
    for v in (2, 4):
        got = first.checkpoint(v)
        short = dataclasses.replace(bn_job("ckpt-ref"), iterations=v)
        want = short.user_model(train_reference(short)).state_dict()
        assert set(got) == set(want) and "body.0.1.running_mean" in got  # the user's names, buffers too
        assert max(float((got[k].double() - want[k].double()).abs().max()) for k in want) < 1e-8, v
        Residual().double().load_state_dict(got)  # loadable as it is


def test_a_job_starts_from_a_checkpoint_like_plain_pytorch_continues(first, backend):
    start = first.checkpoint(4)
    job = dataclasses.replace(bn_job("ckpt-second", init_from=start), iterations=3)
    run = job.run(stages=2, backend=backend)
    run.wait(progress=False, poll_s=0.2, timeout_s=600)
    initial = job.user_model(job.build_model()).state_dict()
    assert max(float((initial[k].double() - start[k].double()).abs().max()) for k in start) == 0.0
    # plain PyTorch: the user's module loaded with the checkpoint, a fresh optimizer, full batches
    torch.manual_seed(job.seed)
    model = job.model().double().train()
    model.load_state_dict(start)
    opt = job.optimizer(list(model.parameters()))
    x, y = job.train
    for t in range(job.iterations):
        idx = batch_indices(job.seed, t, x.shape[0], job.global_batch)
        opt.zero_grad()
        job.loss(model(x[idx]), y[idx]).backward()
        opt.step()
    want = model.state_dict()
    got = run.trained_model().state_dict()
    assert max(float((got[k].double() - want[k].double()).abs().max()) for k in want) < 1e-5
    assert max(float((got[k].double() - start[k].double()).abs().max()) for k in want) > 1e-4  # it trained on


def test_init_from_a_file_and_what_does_not_fit(first, tmp_path):
    directory = first.save(str(tmp_path / "saved"))
    path = f"{directory}/model.safetensors"
    job = bn_job("ckpt-file", init_from=path)
    got = job.user_model(job.build_model()).state_dict()
    want = first.trained_model().state_dict()
    assert all(torch.equal(got[k].double(), want[k].double()) for k in want)
    partial = {k: v for k, v in first.checkpoint(2).items() if not k.startswith("head")}
    with pytest.raises(JobError, match=r"job.init_from does not fit the model: missing \['head.bias', 'head.weight'\]"):
        bn_job("ckpt-bad", init_from=partial).validate()
    with pytest.raises(JobError, match="is not a readable safetensors file"):
        bn_job("ckpt-nofile", init_from=str(tmp_path / "nothing.safetensors")).validate()
