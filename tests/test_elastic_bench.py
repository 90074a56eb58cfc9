"""benchmarks/elastic.py's pure parts (no stack): epochs and the first checkpoint at a target
accuracy, time per iteration from task records, a schedule cut to a shorter run, loss curves read at a point,
and the tables it prints."""

import os
import sys

import pytest
import torch
from torch import nn

from stagecoach.core.records import TaskMetrics

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import elastic  # noqa: E402

N = 1437  # the digits training split (examples/digits.py)


def task(t: int, start: float, end: float, phase: str = "backward", replica: int = 0) -> TaskMetrics:
    """A task's record as the handler writes it (core/records.py TaskMetrics)."""
    return TaskMetrics(
        phase=phase,
        t=t,
        stage=0,
        index=replica,
        start=start,
        end=end,
        duration_s=end - start,
        upload_s=0.1,
        download_s=0.1,
        transfer_s=0.1,
        wait_s=0.0,
        bytes_up=1024,
        bytes_down=2048,
        puts=1,
        gets=2,
        compute_s=end - start - 0.1,
        container=f"c0-{replica}",
        container_started=90.0,
        invocation=t + 1,
        cold=t == 0,
        memory_mb=1024,
        max_rss_mb=300.0,
    )


def test_epochs_follow_the_data_order_of_a_fixed_and_a_growing_batch():
    assert elastic.epochs_after(0, N, [(0, 16)]) == 0.0
    assert elastic.epochs_after(10, N, [(0, 16)]) == pytest.approx(160 / N)
    # 128 a batch: 11 fit in an epoch (1,408), the 12th starts the next one (29 samples dropped)
    assert elastic.epochs_after(11, N, [(0, 128)]) == pytest.approx(1408 / N)
    assert elastic.epochs_after(12, N, [(0, 128)]) == pytest.approx(1 + 128 / N)
    # AdaBatch 16 -> 32 -> 64 -> 128 at 12, 24, 36: 12 * (16 + 32 + 64) = 1,344 then 128 does not fit
    ada = elastic.configs(48, 16)[2]
    assert ada.batches == [(0, 16), (12, 32), (24, 64), (36, 128)]
    assert elastic.epochs_after(36, N, ada.batches) == pytest.approx(1344 / N)
    assert elastic.epochs_after(37, N, ada.batches) == pytest.approx(1 + 128 / N)


def test_the_configurations_are_hydrozoa_s_three():
    dp1, dp8, ada = elastic.configs(48, 16)
    assert (dp1.name, dp1.global_batch, dp1.run) == ("DP-1", 16, {"replicas": 1})
    assert (dp8.name, dp8.global_batch, dp8.run["replicas"]) == ("DP-8", 128, 8)
    assert ada.run["replicas"] == {0: 1, 12: 2, 24: 4, 36: 8}
    assert ada.run["lr_scale"] == {12: 0.75, 24: 0.75, 36: 0.75}


def test_the_first_checkpoint_at_the_target():
    curve = [(8, 0.62), (4, 0.31), (12, 0.905), (16, 0.88), (20, 0.93)]
    assert elastic.first_reaching(curve, 0.9) == 12
    assert elastic.first_reaching(curve, 0.93) == 20
    assert elastic.first_reaching(curve, 0.95) is None


def test_seconds_to_an_iteration_run_from_the_first_task_to_its_last_task_end():
    ms = [task(0, 100.0, 101.0), task(0, 100.5, 102.5, replica=1), task(1, 103.0, 104.0, "sync"), task(1, 103.0, 103.5)]
    assert elastic.elapsed_by_iteration(ms) == {0: 2.5, 1: 4.0}
    assert elastic.elapsed_by_iteration([]) == {}


def test_seconds_per_iteration_at_each_d():
    # iterations start at 0, 1, 3, 6, 10 (0 and 1 at d = 1, the rest at d = 2): spans 1, 2, 3, 4
    starts = [0.0, 1.0, 3.0, 6.0, 10.0]
    ms = [task(t, s, s + 0.5, replica=r) for t, s in enumerate(starts) for r in range(1 if t < 2 else 2)]
    assert elastic.seconds_by_d(ms, 5, lambda t: 1 if t < 2 else 2) == {1: 2.0, 2: 3.5}  # iteration 0 left out


def test_a_schedule_cut_to_the_target_run_keeps_what_its_iterations_ran():
    ada = elastic.configs(48, 16)[2]
    cut = elastic.truncated(ada.run, 30)
    assert cut == {"replicas": {0: 1, 12: 2, 24: 4}, "global_batch": {0: 16, 12: 32, 24: 64}, "lr_scale": {12: 0.75, 24: 0.75}}
    assert elastic.truncated(ada.run, 12) == {"replicas": {0: 1}, "global_batch": {0: 16}, "lr_scale": {}}
    dp8 = elastic.configs(48, 16)[1]
    assert elastic.truncated(dp8.run, 5) == dp8.run  # no schedule: unchanged


def test_states_compare_bit_for_bit():
    a = {"0.weight": torch.tensor([1.0, 2.0]), "0.bias": torch.tensor([0.5])}
    assert elastic.same_state(a, {k: v.clone() for k, v in a.items()})
    assert not elastic.same_state(
        a, {"0.weight": torch.tensor([1.0, torch.nextafter(torch.tensor(2.0), torch.tensor(3.0)).item()]), "0.bias": torch.tensor([0.5])}
    )
    assert not elastic.same_state(a, {"0.weight": torch.tensor([1.0, 2.0])})


def test_held_out_accuracy_is_exact_at_a_target_s_boundary():
    # 360 samples, the class of each the sign of its one feature; 324 labelled so (90% exactly)
    x = torch.cat([torch.ones(180, 1), -torch.ones(180, 1)])
    y = torch.cat([torch.ones(180, dtype=torch.int64), torch.zeros(180, dtype=torch.int64)])
    y[:36] = 0
    model = nn.Sequential(nn.Linear(1, 2), nn.Dropout(0.9))
    with torch.no_grad():
        model[0].weight.copy_(torch.tensor([[-1.0], [1.0]]))
        model[0].bias.zero_()
    acc = elastic.held_out_accuracy(model, (x, y))
    assert acc == 0.9 and elastic.first_reaching([(8, acc)], 0.9) == 8  # float32 mean: 0.89999998
    with torch.no_grad():
        assert float((model(x).argmax(-1) == y).float().mean()) < 0.9  # why it counts: the float32 mean falls short
    assert not model.training


def test_ratios():
    assert elastic.ratio(3.0, 4.0) == 0.75 and elastic.ratio(None, 4.0) is None and elastic.ratio(1.0, 0.0) is None


def test_a_loss_curve_read_at_a_point_and_at_equal_cost():
    points = [(1.2, 2.3), (2.5, 1.9), (3.9, 1.4)]
    assert elastic.loss_at(points, 3.0) == 1.9 and elastic.loss_at(points, 3.9) == 1.4
    assert elastic.loss_at(points, 1.0) != elastic.loss_at(points, 1.0)  # NaN before the first
    r = elastic.HapResult("k_reduce", losses=[2.3, 1.9, 1.4, 1.1], seconds=[1.0, 2.0, 3.0, 4.0], cost_usd=0.004)
    assert elastic.per_iteration_usd(r) == pytest.approx(0.001)
    assert (
        elastic.equal_cost_loss(r, 0.003) == 1.4 and elastic.equal_cost_loss(r, 0.0025) == 1.9 and elastic.equal_cost_loss(r, 0.01) == 1.1
    )


def test_the_tables_print_measured_and_refused_rows():
    bsp = elastic.HapResult("k_reduce", losses=[2.3, 1.9, 1.4, 1.1], seconds=[1.0, 2.0, 3.0, 4.0], wall_s=9.0, cost_usd=0.004)
    hap = elastic.HapResult("k_reduce_hap", refused="PlanError: sync 'k_reduce_hap' | no runtime yet")
    text = elastic.hap_tables([bsp, hap], points=2)
    lines = text.splitlines()
    assert lines[0] == "| sync | status | iterations | wall s | cost $ | $/iteration | final loss | loss at $0.004 |"
    assert lines[2] == "| k_reduce | measured | 4 | 9.000 | 0.004 | 0.001 | 1.100 | 1.100 |"
    assert lines[3].startswith("| k_reduce_hap | not measured: PlanError: sync 'k_reduce_hap' / no runtime yet |")
    assert "| 2 | 1.900 |" in lines and "| 4.000 | 1.100 |" in lines
    assert elastic.cell(None) == "not reached" and elastic.cell(0.000123) == "0.000123" and elastic.cell(123.45) == "123.5"


def test_the_scaling_tables_and_hydrozoa_s_ratios():
    why = "the run to 8 iterations did not reproduce the full run's checkpoint 8"
    rows = [
        elastic.Measured("DP-1", 8, 50.0, 5.0, 0.002, [(4, 0.5), (8, 0.8)], 0.09, to_target={0.85: None, 0.8: why}),
        elastic.Measured(
            "DP-8", 8, 200.0, 20.0, 0.02, [(4, 0.85), (8, 0.9)], 0.71, to_target={0.85: (4, 0.36, 80.0, 0.01), 0.8: (4, 0.36, 80.0, 0.01)}
        ),
        elastic.Measured(
            "DP-(1-8)",
            8,
            100.0,
            10.0,
            0.008,
            [(4, 0.6), (8, 0.86)],
            0.2,
            to_target={0.85: (8, 0.2, 90.0, 0.008), 0.8: (8, 0.2, 90.0, 0.008)},
        ),
    ]
    rows[2].per_d = {1: 0.3, 8: 1.65}
    text = elastic.scaling_tables(rows, [0.85, 0.8])
    assert "| DP-1 | 8 | 50.0 | 5.000 | 0.002 | 0.090 | 0.800 |" in text
    assert "| DP-1 | not reached |  |  |  |" in text and f"| DP-1 | {why} |  |  |  |" in text
    assert "| DP-(1-8) | 8 | 0.200 | 90.0 | 0.008 |" in text
    assert "| DP-(1-8) cost to 85% / DP-8's | 0.800 |" in text and "| DP-(1-8) epochs to 85% / DP-8's | 0.556 |" in text
    assert "| DP-(1-8) time to 85% / DP-1's | not reached |" in text
    assert "DP-(1-8) d=1: 0.30, d=8: 1.65" in text
    assert "| 4 | 0.500 | 0.850 | 0.600 |" in text
