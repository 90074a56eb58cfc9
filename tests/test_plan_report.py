"""The planner's Pareto plot is readable (issue 28): no offset or exponent on an axis, a cost axis
that does not blow a $2e-8 difference up to its whole height, tick labels that do not overlap, and
each Pareto plan labelled with its stages, replicas and memory tiers."""

from dataclasses import replace

import matplotlib
import pytest

from stagecoach.cli.plan_report import axis_limits, pareto_figure, pareto_png, point_label
from stagecoach.planner.model.perfmodel import Config, evaluate
from stagecoach.planner.model.platforms import aws_platform
from stagecoach.planner.model.syncmodel import SyncChoice
from stagecoach.planner.profile.layers import LayerProfile, ModelProfile
from stagecoach.planner.solve.sweep import PlannedConfig, PlanningResult

matplotlib.use("Agg")
MB = 2**20
PROFILE = ModelProfile(
    "tiny",
    tuple(LayerProfile(f"l{j}", 2 * MB, MB, 0.1 * MB, 0.1 * MB, 1e7, 2e7) for j in range(4)),
    0.1 * MB,
)


def planned(stages: int, tier: int, replicas: int, time_s: float, cost: float, weights: tuple[float, float]) -> PlannedConfig:
    """A plan with the shape given and the predictions given (as the shipped examples' plans)."""
    sync = SyncChoice("none", 1) if replicas == 1 else SyncChoice("scatter_reduce", replicas)
    cfg = Config((4 // stages,) * stages, (tier,) * stages, replicas, 8, 8, (sync,) * stages)
    est = replace(evaluate(PROFILE, cfg, aws_platform()), time_s=time_s, cost=cost)
    return PlannedConfig(est, weights, "milp", 0.1, PROFILE, aws_platform())


def result(plans: list[PlannedConfig], recommended: int) -> PlanningResult:
    return PlanningResult(PROFILE, 64, aws_platform(), plans, plans, plans[recommended], 1.0)


# The case: two one-stage plans that differ only in the memory tier, $2e-8 and 1 ms apart
# (matplotlib's own axes: an offset cost axis, overlapping 1.942x10^-1 labels on the time axis).
CLOSE = result([planned(1, 512, 1, 0.1952, 1.568e-4, (1, 0)), planned(1, 1024, 1, 0.1942, 1.568e-4 + 2e-8, (1, 2**19))], 1)
# A wide front: times and costs spanning more than a factor 4 (logarithmic axes).
WIDE = result(
    [
        planned(1, 8192, 1, 15.5, 0.0022, (1, 0)),
        planned(1, 10240, 2, 8.97, 0.0038, (1, 2**16)),
        planned(2, 10240, 4, 4.24, 0.0115, (1, 2**19)),
        planned(4, 10240, 4, 1.9, 0.031, (0, 1)),
    ],
    1,
)


def shown(axis):
    """The tick labels drawn on ``axis``, minor ones included (a log axis labels some)."""
    return [t for t in axis.get_ticklabels() + axis.get_ticklabels(minor=True) if t.get_visible() and t.get_text()]


def drawn(res: PlanningResult):
    fig = pareto_figure(res)
    fig.canvas.draw()
    return fig, fig.axes[0]


@pytest.mark.parametrize("res", [CLOSE, WIDE], ids=["close", "wide"])
def test_no_axis_has_an_offset_or_an_exponent(res):
    fig, ax = drawn(res)
    for axis in (ax.xaxis, ax.yaxis):
        assert axis.get_offset_text().get_text() == ""
        labels = [t.get_text() for t in shown(axis)]
        assert len(labels) >= 2
        assert not any("e" in s or "\\times" in s or "10^" in s for s in labels), labels
    matplotlib.pyplot.close(fig)


def test_a_tiny_cost_difference_is_drawn_tiny():
    fig, ax = drawn(CLOSE)
    lo, hi = ax.get_ylim()
    assert hi - lo >= 0.1 * 1.568e-4  # the axis spans at least +-5% of the cost...
    assert 2e-8 / (hi - lo) < 0.01  # ...so $2e-8 is under 1% of its height, not all of it
    assert lo <= 1.568e-4 <= hi and lo <= 1.568e-4 + 2e-8 <= hi
    matplotlib.pyplot.close(fig)


@pytest.mark.parametrize("res", [CLOSE, WIDE], ids=["close", "wide"])
def test_tick_labels_do_not_overlap(res):
    fig, ax = drawn(res)
    renderer = fig.canvas.get_renderer()
    for axis in (ax.xaxis, ax.yaxis):
        boxes = [t.get_window_extent(renderer) for t in shown(axis)]
        for i, a in enumerate(boxes):
            for b in boxes[i + 1 :]:
                assert not a.overlaps(b), (axis.axis_name, [t.get_text() for t in shown(axis)])
    matplotlib.pyplot.close(fig)


def test_each_pareto_plan_is_labelled_with_its_stages_replicas_and_tiers():
    fig, ax = drawn(CLOSE)
    texts = [t.get_text() for t in ax.get_legend().get_texts()]
    assert len(texts) == 2 and texts[0] != texts[1]
    assert texts[0].startswith("1 stage x 1 replica, 512 MB, 8 micro-batches of 8: 0.195 s")
    assert texts[1].startswith("1 stage x 1 replica, 1024 MB, 8 micro-batches of 8: 0.194 s")
    assert texts[1].endswith("recommended (red star)") and "recommended" not in texts[0]
    numbers = sorted(a.get_text() for a in ax.texts)
    assert numbers == ["1", "2"]  # the points carry the numbers the legend explains
    matplotlib.pyplot.close(fig)


def test_multi_stage_labels_give_every_stages_tier():
    assert point_label(WIDE.pareto[3]).startswith("4 stages x 4 replicas, 10240/10240/10240/10240 MB")


def test_a_wide_front_gets_log_axes_and_a_narrow_one_linear():
    assert axis_limits([1.568e-4, 1.568e-4 + 2e-8])[2] is False
    lo, hi, log = axis_limits([1.9, 15.5])
    assert log and lo < 1.9 and hi > 15.5
    fig, ax = drawn(WIDE)
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
    matplotlib.pyplot.close(fig)


def test_pareto_png_writes_a_png(tmp_path):
    p = pareto_png(CLOSE, tmp_path / "p.png")
    assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_every_column_is_explained_once():
    """`stagecoach plan` prints table_legend under the table: one line per column of plan_row, in
    its order, including the two that were unexplained (micro-batches as 8x8, weights as (1,2^16))."""
    from stagecoach.cli.plan_report import COLUMN_LEGEND, plan_row, table_legend

    row = plan_row(CLOSE.pareto[0], 50_000, "*")
    assert list(COLUMN_LEGEND) == list(row)
    legend = table_legend().splitlines()
    for key in row:
        explained = [line for line in legend if line.split("  ")[0].strip() == (key or "*")]
        assert len(explained) == 1, key
    assert "8x8: 8 micro-batches of 8" in table_legend() and "(1,2^22)" in table_legend()
