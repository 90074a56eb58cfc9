"""The sync model under bfloat16 (docs/performance-model.md §3.2b): the gradients travel at bf16's
size, the parameters and the optimizer state as the fp32 master copies the runtime stores, moves
and cuts into chunks (lambdas/jobctx.py: the layout's itemsize is the master dtype's)."""

import pytest

from stagecoach.core.training import stage_layout
from stagecoach.planner.model.platforms import aws_platform
from stagecoach.planner.model.syncmodel import SYNC_ALGORITHMS

PLAT = aws_platform()  # Adam: optimizer_state_ratio 2
MASTER = 48 * 2**20  # a stage of 12 M fp32 parameters
OPT_S = 0.4


def both(name: str, d: int, k: int, **kw):
    a = SYNC_ALGORITHMS[name]
    fp32 = a.stage(d, k, MASTER, OPT_S, 30.0, PLAT, 1.0, **kw)
    bf16 = a.stage(d, k, MASTER / 2, OPT_S, 30.0, PLAT, 1.0, master_ratio=2.0, **kw)
    return fp32, bf16


@pytest.mark.parametrize(
    "name,d,k",
    [
        ("scatter_reduce", 4, 4),
        ("k_reduce", 3, 2),
        ("all_reduce", 2, 1),
        ("pipelined_scatter_reduce", 4, 4),
        ("lambdaml_scatter_reduce", 3, 3),
    ],
)
def test_the_layout_is_the_master_copys_as_the_runtime_cuts_it(name, d, k):
    fp32, bf16 = both(name, d, k)
    runtime = sum(len(chunks) for chunks in stage_layout(MASTER // 4, 4, k, d))
    assert bf16.shards == fp32.shards == runtime


def test_a_lone_update_moves_only_master_parameters_and_state():
    fp32, bf16 = both("none", 1, 1)
    assert bf16.tail_s == pytest.approx(fp32.tail_s, rel=1e-12)


def test_a_sync_task_reads_bf16_gradients_and_writes_master_parameters_and_state():
    d = k = 4
    fp32, bf16 = both("scatter_reduce", d, k)
    # only the d gradient shards it downloads shrink, by half; the state and the new parameters do not
    assert fp32.task_s - bf16.task_s == pytest.approx(d * (MASTER / 2) / (k * PLAT.bandwidth_Bps), rel=1e-9)
    # the backward task's gradient upload halves (its tail is the upload left after the last pass)
    assert bf16.tail_s < fp32.tail_s


def test_the_exchanges_gather_master_parameters():
    for name in ("pipelined_scatter_reduce", "lambdaml_scatter_reduce"):
        fp32, bf16 = both(name, 4, 4)
        # half the gradient bytes, the same parameter bytes: faster than fp32, slower than if the
        # parameters moved at bf16's size too (the approximation this replaces)
        half = SYNC_ALGORITHMS[name].stage(4, 4, MASTER / 2, OPT_S, 30.0, PLAT, 1.0)
        assert half.tail_s < bf16.tail_s < fp32.tail_s, name
