"""The plan contract: valid plans round-trip; every malformed one is refused with an actionable message."""

import pytest

from stagecoach.planner.plan import Plan, PlanError, even_balance


def test_round_trip_and_derived_fields():
    p = Plan(balance=[2, 3, 1], replicas=2, micro_batches=4, global_batch=32, memory_mb=1024)
    assert Plan.from_json(p.to_json()) == p
    assert p.stages == 3 and p.layers == 6 and p.micro_batch_size == 4
    assert list(p.stage_layers(1)) == [2, 3, 4]
    assert list(p.workers()) == [(s, r) for s in range(3) for r in range(2)]
    assert p.memory_mb == (1024, 1024, 1024)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(balance=[]), "balance is empty"),
        (dict(balance=[2, 0]), "at least one layer"),
        (dict(balance=[2, "x"]), "integer"),
        (dict(balance=[2], replicas=0), "replicas"),
        (dict(balance=[2], replicas=2, micro_batches=3, global_batch=16), "not divisible"),
        # a stage's Map runs at most 40 groups of 40 tasks at once (planner/emit/groups.py)
        (dict(balance=[1] * 2, replicas=1601, global_batch=1601), "1601 workers in one stage's phase exceed the 1600 tasks"),
        (dict(balance=[1] * 41, replicas=1, global_batch=1), "41 stages exceed the 40 tasks one inline Map"),
        (dict(balance=[2], memory_mb=[20000]), "128-10240 MB"),
        (dict(balance=[2, 2], memory_mb=[1024]), "one per stage"),
        (dict(balance=[2], sync="magic"), "unknown"),
        (dict(balance=[2], timeouts_s=[{"forward": 10, "backward": 1000, "sync": 10}]), "more stages"),
        (dict(balance=[2], timeouts_s=[{"forward": 10}]), "lacks"),
    ],
)
def test_malformed_plans_are_refused(kwargs, message):
    with pytest.raises(PlanError, match=message):
        Plan(**kwargs)


def test_balance_must_cover_the_model():
    p = Plan(balance=[2, 2])
    with pytest.raises(PlanError, match="covers 4 layers but the model has 5"):
        p.validate(layers=5)


@pytest.mark.parametrize(
    "text, message",
    [
        ("[1,2]", "JSON object"),
        ("{", "not valid JSON"),
        ('{"replicas": 1}', "lacks 'balance'"),
        ('{"balance": [1], "x": 1}', "unknown fields"),
    ],
)
def test_malformed_plan_json(text, message):
    with pytest.raises(PlanError, match=message):
        Plan.from_json(text)


def test_even_balance():
    assert even_balance(7, 3) == (3, 2, 2)
    with pytest.raises(PlanError):
        even_balance(2, 3)


def test_a_plan_saved_with_free_form_extras_loads_its_predictions_typed():
    """Plans saved before Prediction existed kept the predictions in ``extras``."""
    from stagecoach.planner.plan import Plan, Prediction

    old = {
        "balance": [1, 1],
        "extras": {
            "predicted_task_s": [{"forward": 1.0, "backward": 2.0, "sync": 0.5}, {"backward": 3.0, "sync": 0.5}],
            "predicted_s_per_iteration": 4.2,
            "predicted_usd_per_iteration": 1e-5,
            "platform": "aws",
        },
    }
    p = Plan.from_dict(old)
    assert isinstance(p.prediction, Prediction) and p.prediction.task_s[1] == {"backward": 3.0, "sync": 0.5}
    assert p.prediction.s_per_iteration == 4.2 and p.prediction.platform == "aws"
    assert Plan.from_json(p.to_json()) == p
    assert Plan.from_dict({"balance": [2], "extras": {}}).prediction is None
