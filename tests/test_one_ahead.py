"""The input schedule of a stage's tasks (lambdas/stageio.py ``one_ahead``): each micro-batch's
input is asked for before the previous one is computed — exactly one request ahead, in order."""

import pytest

from stagecoach.lambdas.stageio import one_ahead


def trace(order):
    log = []

    def fetch(j):
        log.append(("ask", j))

        def get():
            log.append(("get", j))
            return f"x{j}"

        return get

    for j, x in one_ahead(order, fetch):
        assert x == f"x{j}"
        log.append(("compute", j))
    return log


def test_the_next_input_is_asked_for_before_the_current_one_computes():
    assert trace([0, 1, 2]) == [
        ("ask", 0),
        ("get", 0),
        ("ask", 1),
        ("compute", 0),
        ("get", 1),
        ("ask", 2),
        ("compute", 1),
        ("get", 2),
        ("compute", 2),
    ]


@pytest.mark.parametrize("order", [[3, 2, 1, 0], [5], [], range(4)])
def test_any_order_is_walked_once_with_the_next_request_in_flight_while_one_computes(order):
    log = trace(order)
    assert [j for kind, j in log if kind == "compute"] == list(order)
    assert [j for kind, j in log if kind == "ask"] == list(order)
    asked = got = done = 0
    for kind, _ in log:
        asked += kind == "ask"
        got += kind == "get"
        if kind == "compute":  # the k-th computes holding k+1 inputs, the next one asked for
            assert (asked, got) == (min(done + 2, len(order)), done + 1)
            done += 1
