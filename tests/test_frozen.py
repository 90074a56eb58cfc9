"""Frozen parameters (``requires_grad=False``, how a pretrained backbone is fine-tuned) train as in
plain PyTorch: no gradient, no sync, no optimizer state, no update — they end bit-identical to
where they started, weight decay included — and the planner charges them no sync
(docs/exactness.md "Frozen parameters").

The stack runs: float64, through the state machines, at (stages, replicas, micro-batches) =
(1,1,1), (3,1,4), (2,3,2) — a fully frozen first stage, a partly frozen stage holding a buffer —
and a frozen stage between two that train, on the fused pipelined exchange with clipping; every
parameter equal to the single-process reference (stagecoach.reference.train_reference, one
torch.optim optimizer over model.parameters(), which skips what has no .grad). Also a bf16 job
(no fp32 master of a frozen parameter) against a plain mixed-precision loop, and (slow) BERT cut
at blocks= with frozen embeddings tied to its decoder against its own module in plain PyTorch.
"""

import dataclasses

import pytest
import torch
from helpers import capped_backend, run_in_waves, selected
from test_any_model import bert as bert_example
from test_any_model import make_job as any_model_job
from test_any_model import plain_pytorch
from torch import nn

from stagecoach import Job, JobError
from stagecoach.core.stagebuild import stage_buffers
from stagecoach.core.training import batch_indices, ownership
from stagecoach.exactness import NotExact, optimizer_groups
from stagecoach.planner.model.perfmodel import SyncChoice, layer_terms
from stagecoach.planner.model.platforms import aws_platform
from stagecoach.planner.plan import Plan
from stagecoach.planner.profile.meta import profile_meta
from stagecoach.reference import train_reference

ITERATIONS = 4
G = torch.Generator().manual_seed(5)
X, Y = torch.randn(48, 10, generator=G, dtype=torch.float64), torch.randint(0, 4, (48,), generator=G)


class Scaled(nn.Module):
    """A linear layer times a fixed per-feature scale (a buffer)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


def backbone_model() -> nn.Sequential:
    """Block 0 frozen whole (a pretrained backbone), block 2 partly (its weight; its bias trains)
    and holding a buffer. Evenly split: 3 stages -> the first holds only frozen parameters."""
    m = nn.Sequential(nn.Linear(10, 16), nn.Tanh(), Scaled(), nn.Tanh(), nn.Dropout(0.1), nn.Linear(16, 4))
    m[0].requires_grad_(False)
    m[2].lin.weight.requires_grad_(False)
    return m


def frozen_middle_model() -> nn.Sequential:
    """A frozen block between two that train: gradients pass through a stage with nothing to sync."""
    m = nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    m[2].requires_grad_(False)
    return m


def adam_decay(params):
    return torch.optim.Adam(params, lr=0.02, weight_decay=0.1)


def adamw_trainable_only(params):
    """PyTorch's idiom: only what trains handed to the optimizer."""
    return torch.optim.AdamW([p for p in params if p.requires_grad], lr=0.02, weight_decay=0.1)


def step_lr(optimizer):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)


def make_job(name: str, model=backbone_model, optimizer=adam_decay, **options) -> Job:
    return Job(
        name=name,
        model=model,
        loss=nn.CrossEntropyLoss(),
        optimizer=optimizer,
        train=(X, Y),
        global_batch=12,
        iterations=ITERATIONS,
        seed=2,
        **{"dtype": torch.float64, **options},
    )


# (name, model, optimizer, (stages, replicas, micro-batches), sync, job options)
CASES = {
    "1x1x1": (backbone_model, adam_decay, (1, 1, 1), None, {}),
    "3x1x4": (backbone_model, adam_decay, (3, 1, 4), None, {}),
    "2x3x2": (backbone_model, adamw_trainable_only, (2, 3, 2), None, {}),
    # a scheduler gives each update its parameter groups' hyperparameters: the frozen first stage's
    # shard is empty, which once failed its update (IndexError in optim_state.apply_update)
    "3x1x2-steplr": (backbone_model, adam_decay, (3, 1, 2), None, {"scheduler": step_lr}),
    "middle-3x2x2-pipelined-clip": (frozen_middle_model, adam_decay, (3, 2, 2), "pipelined_scatter_reduce", {"clip_grad_norm": 0.05}),
}
BF16 = (frozen_middle_model, adam_decay, (1, 1, 1), None, {"dtype": torch.bfloat16})


def bert_frozen_embeddings() -> nn.Module:
    """examples/bert.py with its embeddings frozen — and so the decoder tied to them."""
    m = bert_example.Bert(dim=8, heads=2, layers=3)  # test_any_model.tiny_bert
    m.embeddings.requires_grad_(False)
    return m


def bert_job() -> Job:
    return any_model_job("frozen-bert", adam_decay, model=bert_frozen_embeddings)


# a model cut at blocks=: its values sent straight to their readers; stage 0 the frozen embeddings
BERT_PLAN = dict(balance=[1, 2, 2], replicas=2, micro_batches=2)


@pytest.fixture(scope="module")
def frozen_runs(request):
    wanted = selected(request, "case")
    for name in ("bf16", "bert"):  # the tests of their own, if this session runs them (-m, -k)
        if any(i.name.startswith(f"test_{name}") for i in request.session.items if i.path == request.path):
            wanted.add(name)
    backend = capped_backend()
    starts = {}
    if "bert" in wanted:
        plan = Plan(global_batch=24, **BERT_PLAN)
        starts["bert"] = lambda: bert_job().run(plan=plan, backend=backend)
    for case in [c for c in [*CASES, "bf16"] if c in wanted]:
        model, opt, (s, d, m), sync, options = CASES.get(case, BF16)
        job = make_job(f"frozen-{case[:12]}", model, opt, **options)
        starts[case] = lambda job=job, s=s, d=d, m=m, sync=sync: job.run(stages=s, replicas=d, micro_batches=m, sync=sync, backend=backend)
    yield run_in_waves(starts, 4)
    backend.stack.close()


# 3x1x4 (read by test_no_gradient_is_sent_to_a_frozen_backbone), 2x3x2 and the frozen middle by
# default; one stage and the scheduler's case are `-m slow`
@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow if c in ("1x1x1", "3x1x2-steplr") else ()) for c in CASES])
def test_frozen_parameters_train_exactly_as_plain_pytorch(frozen_runs, case):
    _, _, (_, d, m), _, _ = CASES[case]
    run = frozen_runs[case]
    trained = dict(run.trained_model().named_parameters())
    want = dict(train_reference(run.job, replicas=d, micro_batches=m).named_parameters())
    initial = run.job.build_model()
    before = dict(initial.named_parameters())
    assert trained.keys() == want.keys()
    for name, p in before.items():
        if p.requires_grad:
            assert float((trained[name] - p).detach().abs().max()) > 1e-4, f"{name} trains"
            assert float((trained[name] - want[name]).detach().abs().max()) < 1e-10, name
        else:  # not a bit moved (weight decay on a zero gradient would move it)
            assert torch.equal(trained[name], p) and torch.equal(want[name], p), name
    assert all(torch.equal(b, dict(initial.named_buffers())[k]) for k, b in run.trained_model().named_buffers())


@pytest.mark.slow  # a third wave of runs (~40 s more)
def test_bert_with_frozen_embeddings_cut_at_blocks_trains_as_plain_pytorch(frozen_runs):
    """Frozen word embeddings tied to the decoder (one tensor, frozen on the first and the last
    stage); values sent straight to their readers, none back to the frozen first stage."""
    run = frozen_runs["bert"]
    got = dict(run.trained_model().named_parameters(remove_duplicate=False))
    want = dict(plain_pytorch(run.job).named_parameters(remove_duplicate=False))
    initial = dict(run.job.user_model(run.job.build_model()).named_parameters(remove_duplicate=False))
    assert got.keys() == want.keys() and "head.decoder.weight" in got
    for name, p in initial.items():
        if p.requires_grad:
            assert float((got[name] - p).detach().abs().max()) > 1e-4, f"{name} trains"
            assert float((got[name] - want[name]).detach().abs().max()) < 1e-10, name
        else:
            assert torch.equal(got[name], p) and torch.equal(want[name], p), name


def plain_mixed_precision(job: Job) -> nn.Module:
    """PyTorch's mixed-precision loop: a bf16 working copy of fp32 master weights computes the
    gradient of what trains; the optimizer over every master parameter steps those with one."""
    master = job.build_model(torch.float32)
    opt = job.optimizer(list(master.parameters()))
    for t in range(job.iterations):
        work = job.build_model()
        work.load_state_dict({k: v.to(torch.bfloat16) for k, v in master.state_dict().items()})
        idx = batch_indices(job.seed, t, X.shape[0], job.global_batch)
        job.loss(work(X[idx].to(torch.bfloat16)), Y[idx]).backward()
        for p, w in zip(master.parameters(), work.parameters()):
            p.grad = w.grad.float() if w.grad is not None else None
        opt.step()
    return master


def test_bf16_keeps_no_master_copy_of_frozen_parameters(frozen_runs):
    """Under bf16 the masters are the flat vectors of what trains: a frozen parameter comes back
    as the fp32 value it started with, and the rest equals the plain mixed-precision loop."""
    run = frozen_runs["bf16"]
    got = dict(run.trained_model().named_parameters())
    want = dict(plain_mixed_precision(run.job).named_parameters())
    initial = dict(run.job.build_model(torch.float32).named_parameters())
    assert all(p.dtype == torch.float32 for p in got.values())
    for name, p in initial.items():
        if p.requires_grad:
            assert float((got[name] - p).detach().abs().max()) > 1e-3, f"{name} trains"
            assert float((got[name] - want[name]).detach().abs().max()) < 1e-6, name
        else:
            assert torch.equal(got[name], p) and torch.equal(want[name], p), name


@pytest.mark.parametrize("case", ["3x1x4"])
def test_no_gradient_is_sent_to_a_frozen_backbone(frozen_runs, case):
    """Stage 0 holds only frozen parameters: stage 1 sends it no input gradient (PyTorch computes
    none), while stage 2 sends stage 1 its own (stage 1's bias trains)."""
    run = frozen_runs[case]
    s3 = run.backend.clients.s3
    t = ITERATIONS - 1  # a backward task deletes what it wrote two iterations earlier
    listed = s3.list_objects_v2(Bucket=run.bucket, Prefix=f"jobs/{run.job_id}/iter/{t}/grad/").get("Contents", [])
    stages = {k["Key"].split("/grad/")[1].split("/")[0] for k in listed}
    assert stages == {"s2"}


def test_a_model_with_nothing_to_train_is_refused():
    def everything_frozen():
        return nn.Sequential(nn.Linear(10, 4)).requires_grad_(False)

    with pytest.raises(JobError, match="nothing to train"):
        make_job("frozen-all", everything_frozen).validate()


def test_frozen_parameters_are_in_no_flat_vector_and_travel_with_the_buffers():
    model = backbone_model()
    own = ownership(list(model), [range(0, 2), range(2, 4), range(4, 6)])
    assert own.numels == [0, 16, 16 * 4 + 4]  # stage 0: all frozen; stage 1: the bias only
    assert set(stage_buffers(list(model)[2:4], 2)) == {"2.scale", "2.lin.weight"}
    assert set(stage_buffers(list(model)[0:2], 0)) == {"0.weight", "0.bias"}


def test_a_frozen_weight_two_layers_share_is_stored_once():
    shared = nn.Linear(4, 4).requires_grad_(False)
    assert list(stage_buffers([shared, nn.Tanh(), shared], 0)) == ["0.weight", "0.bias"]


def _stage(profile, plat, choice):
    return layer_terms(profile, 0, len(profile.layers), True, True, 2048, choice, 4, 4, 2, plat)


@pytest.mark.parametrize("algorithm", ["scatter_reduce", "pipelined_scatter_reduce", "all_reduce"])
def test_the_planner_charges_no_sync_and_no_state_for_frozen_parameters(algorithm):
    """The same model with its first layer frozen: the stage syncs, loads and updates only what
    trains (fewer bytes, as many or fewer requests), and still holds the frozen weights."""

    def model(frozen: bool):
        m = nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 4))
        m[0].requires_grad_(not frozen)
        return m

    trainable, frozen = profile_meta(lambda: model(False), torch.zeros(256)), profile_meta(lambda: model(True), torch.zeros(256))
    held = (256 * 256 + 256) * 4
    assert frozen.param_bytes == trainable.param_bytes - held and frozen.frozen_bytes == held
    assert frozen.layers[0].buffer_bytes == held  # still held by the stage
    plat = aws_platform()
    choice = SyncChoice(algorithm, 1 if algorithm == "all_reduce" else 4)
    a, b = _stage(trainable, plat, choice), _stage(frozen, plat, choice)
    assert b.p_bytes == frozen.param_bytes < a.p_bytes
    assert b.sync.tail_s + b.sync.task_s < a.sync.tail_s + a.sync.task_s
    assert b.load_s <= a.load_s and b.gets + b.puts <= a.gets + a.puts
    assert b.memory_bytes < a.memory_bytes  # no gradient, flat copy or optimizer state of the frozen weights...
    unheld = dataclasses.replace(frozen, layers=(dataclasses.replace(frozen.layers[0], buffer_bytes=0.0), *frozen.layers[1:]))
    assert b.memory_bytes - _stage(unheld, plat, choice).memory_bytes == held  # ...but the weights themselves, once


def test_no_gradient_crosses_a_cut_after_a_frozen_backbone():
    """The stage after a frozen backbone sends it no input gradient, and the backbone waits for
    none (lambdas/phases.py): the planner charges none either; a cut after something that trains
    carries its gradient."""
    profile = profile_meta(backbone_model, torch.zeros(10, dtype=torch.float64))
    assert profile.stage_io(0, 2).outgrad_ps == 0.0 and profile.stage_io(2, 4).ingrad_ps == 0.0
    assert profile.stage_io(2, 4).outgrad_ps > 0 and profile.stage_io(4, 6).ingrad_ps > 0


def test_an_optimizer_may_leave_frozen_parameters_out_of_its_groups():
    """PyTorch's idiom (only what trains, in groups) is taken; leaving out one that trains is not."""
    params = list(backbone_model().parameters())
    trains = [p for p in params if p.requires_grad]
    opt = torch.optim.AdamW(
        [{"params": [p for p in trains if p.ndim > 1]}, {"params": [p for p in trains if p.ndim == 1], "weight_decay": 0.0}]
    )
    groups = optimizer_groups(opt, params)
    assert groups is not None and groups.of_param == tuple(-1 if not p.requires_grad else int(p.ndim == 1) for p in params)
    with pytest.raises(NotExact, match="does not optimise exactly"):
        optimizer_groups(torch.optim.AdamW(trains[1:]), params)
