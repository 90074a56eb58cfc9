"""The issue's full transparency grid (slow: `pytest -m slow tests/test_transparency_grid.py`).

Every capability that once was refused or silently wrong — parameter groups, weights tied across
stages, a module used twice, integer ids across a cut, (state, skip) pairs, dicts with a boolean
mask, any nn.Module cut at ``blocks``, a skip connection sent straight from stage 0 to the last
stage — at (stages, replicas, micro-batches) = (1,1,1), (3,1,4),
(2,3,2) and (4,2,3), each with an Adam-family and an SGD-momentum optimizer, through the real state
machines in float64: parameters (and buffers) equal single-process PyTorch within 1e-5. The
default run holds a representative subset (tests/test_transparency.py, tests/test_exactness.py,
tests/test_any_model.py, tests/test_skip_stages.py); this is the whole grid, 64 runs.
"""

import pytest
import torch
from helpers import capped_backend, run_in_waves, selected
from test_any_model import BLOCKS, plain_pytorch, tiny_bert
from test_any_model import bert as bert_example
from test_exactness import X, Y, cells_with_pairs, ids_then_embedding, masked_dicts
from test_skip_stages import LongSkip
from test_transparency import (
    adamw_no_decay_on_biases,
    model_with_a_module_used_twice,
    model_with_dropout,
    model_with_tied_weights,
    sgd_frozen_biases,
)
from torch import nn

from stagecoach import Job
from stagecoach.reference import train_reference

pytestmark = pytest.mark.slow

GRID = [(1, 1, 1), (3, 1, 4), (2, 3, 2), (4, 2, 3)]
ADAM = lambda p: torch.optim.Adam(p, lr=0.01)  # noqa: E731
SGD = lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)  # noqa: E731
G = torch.Generator().manual_seed(11)
X10, Y4 = torch.randn(48, 10, generator=G, dtype=torch.float64), torch.randint(0, 4, (48,), generator=G)
X6, Y3 = torch.randn(48, 6, generator=G, dtype=torch.float64), torch.randint(0, 3, (48,), generator=G)

# item: (model, data, blocks, {optimizer name: factory})
ITEMS = {
    "groups": (model_with_dropout, (X10, Y4), None, {"adamw": adamw_no_decay_on_biases, "sgd": sgd_frozen_biases}),
    "tied": (model_with_tied_weights, (X10, Y4), None, {"adam": ADAM, "sgd": SGD}),
    "twice": (model_with_a_module_used_twice, (X10, Y4), None, {"adam": ADAM, "sgd": SGD}),
    "ids": (ids_then_embedding, (X, Y), None, {"adam": ADAM, "sgd": SGD}),
    "pairs": (cells_with_pairs, (X, Y), None, {"adam": ADAM, "sgd": SGD}),
    "dicts": (masked_dicts, (X, Y), None, {"adam": ADAM, "sgd": SGD}),
    "any-model": (tiny_bert, bert_example.sequences(48, seed=5), BLOCKS, {"adam": ADAM, "sgd": SGD}),
    "skip": (LongSkip, (X6, Y3), ["stem", "body.*", "head"], {"adam": ADAM, "sgd": SGD}),
}
CASES = [(item, opt, cfg) for item, (_, _, _, opts) in ITEMS.items() for opt in opts for cfg in GRID]
# Runs at once: 2 cores, and each run's workers are processes (~240 MB each; with warm state and
# d > 1 a function, so a process, per worker): 8 at once and the previous waves' idle workers
# OOM-killed this 24 GiB machine. A stack of its own caps the processes (Fidelity.max_environments),
# shutting down the longest-idle ones (finished runs') first.
WAVE = 4


@pytest.fixture(scope="module")
def grid_backend():
    b = capped_backend()
    yield b
    b.stack.close()


def make_job(item: str, opt: str) -> Job:
    model, data, blocks, opts = ITEMS[item]
    return Job(
        name=f"grid-{item}-{opt}",
        model=model,
        blocks=blocks,
        loss=nn.CrossEntropyLoss(),
        optimizer=opts[opt],
        train=data,
        global_batch=12,
        iterations=4,
        seed=1,
        dtype=torch.float64,
    )


@pytest.fixture(scope="module")
def grid_runs(grid_backend, request):
    # only the cases this session runs (e.g. `-k skip`), in waves
    wanted = selected(request, "case")
    cases = [c for c in CASES if c in wanted]
    starts = {
        c: (lambda c=c: make_job(c[0], c[1]).run(stages=c[2][0], replicas=c[2][1], micro_batches=c[2][2], backend=grid_backend))
        for c in cases
    }
    return run_in_waves(starts, WAVE)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "{}-{}-{}x{}x{}".format(c[0], c[1], *c[2]))
def test_every_capability_equals_plain_pytorch_on_the_whole_grid(grid_runs, case):
    item, opt, (s, d, m) = case
    run = grid_runs[case]
    got = run.trained_model().state_dict()
    if item in ("any-model", "skip"):
        want = plain_pytorch(run.job).state_dict()  # the user's module, its own forward
    else:
        want = train_reference(run.job, replicas=d, micro_batches=m).state_dict()
    initial = run.job.user_model(run.job.build_model()).state_dict()
    assert got.keys() == want.keys()
    assert max(float((got[k].double() - initial[k].double()).abs().max()) for k in got) > 1e-4, "training moved it"
    for k in want:
        assert float((got[k].double() - want[k].double()).abs().max()) < 1e-5, k
