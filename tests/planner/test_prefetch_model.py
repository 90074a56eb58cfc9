"""The model of a stage that downloads its next input while it computes (docs/performance-model.md
§3.1-§3.2; the runtime: lambdas/stageio.py one_ahead): the first micro-batch still waits for its
GET, every later step is the longest of compute, GET and PUT — never more than without it."""

import pytest

from stagecoach.planner.model.perfmodel import stage_terms
from stagecoach.planner.model.platforms import aws_platform
from stagecoach.planner.model.syncmodel import SyncChoice

OURS = aws_platform()
MEASURED = OURS.replace(recompute_forward=False)  # the seed papers' workers: no prefetch
W, LAT = OURS.bandwidth_Bps, OURS.storage_latency_s
B = 4


def terms(first, last, f, g, in_ps, out_ps, plat=OURS):
    return stage_terms(4e6, f, g, 1e5, in_ps, out_ps, in_ps, 0.0, first, last, 2048, SyncChoice("none", 1), 1, B, 4, plat)


CASES = [  # (compute-bound, GET-bound, PUT-bound)
    (0.2, 0.3, 1e5, 1e5),
    (0.001, 0.002, 2e6, 1e4),
    (0.001, 0.002, 1e4, 5e6),
]


@pytest.mark.parametrize("f,g,in_ps,out_ps", CASES)
def test_a_middle_stages_forward_step_overlaps_its_next_input_and_its_first_costs_the_same(f, g, in_ps, out_ps):
    t = terms(False, False, f, g, in_ps, out_ps)
    get_in, put = LAT + B * in_ps / W, B * out_ps / W
    assert t.fwd_step_s == pytest.approx(max(f, get_in, put), rel=1e-12)
    # the first micro-batch: its GET, then its compute (or its PUT), then the PUT's end
    first = max(get_in + f, put) + LAT + put
    assert t.fwd_step_s + t.fwd_hop_own_s == pytest.approx(first, rel=1e-12)
    assert t.fwd_hop_s - t.fwd_hop_own_s == pytest.approx(OURS.poll_delay_s)
    plain = terms(False, False, f, g, in_ps, out_ps, MEASURED)
    for m in (1, 2, 8):  # a stage's own time over m micro-batches: never longer, equal for one
        ours, theirs = m * t.fwd_step_s + t.fwd_hop_own_s, m * plain.fwd_step_s + plain.fwd_hop_own_s
        assert ours <= theirs + 1e-12 and (m > 1 or ours == pytest.approx(theirs))


@pytest.mark.parametrize("f,g,in_ps,out_ps", CASES)
def test_the_last_stages_backward_reads_its_next_input_while_it_computes(f, g, in_ps, out_ps):
    t = terms(False, True, f, g, in_ps, out_ps)
    get_in, ig_put = LAT + B * in_ps / W, B * in_ps / W
    assert t.bwd_step_s == pytest.approx(max(f + g, get_in, ig_put), rel=1e-12)
    first = max(get_in + f + g, ig_put) + LAT + ig_put
    assert t.bwd_step_s + t.bwd_hop_own_s == pytest.approx(first, rel=1e-12)
    plain = terms(False, True, f, g, in_ps, out_ps, MEASURED)
    assert t.bwd_step_s <= plain.bwd_step_s


def test_the_first_stage_reads_its_samples_locally_and_has_nothing_to_prefetch():
    t = terms(True, False, 0.2, 0.3, 1e5, 1e5)
    assert t.fwd_step_s == pytest.approx(max(0.2, B * 1e5 / W)) and t.fwd_hop_own_s == pytest.approx(LAT + B * 1e5 / W)
