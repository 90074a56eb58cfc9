"""Models too big for Lambda are refused before anything is built (issue 28 item 6): sized on the
meta device, the refusal names Lambda's 10,240 MB and the smallest stage count that fits, or says
that no count fits because one layer alone is too big. Every model here refuses to be built off
the meta device, so a check that built it would fail these tests with that error instead of
allocating tens of GB."""

import itertools
import time

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from stagecoach import Job, JobError
from stagecoach.cli.plan import plan_command
from stagecoach.planner.limits import LAMBDA_QUOTAS_URL
from stagecoach.planner.model.fits import lambda_refusal, least_stage_bytes, smallest_stage_count
from stagecoach.planner.model.platforms import aws_platform
from stagecoach.planner.plan import Plan
from stagecoach.planner.profile.layers import LayerTooLargeError
from stagecoach.planner.profile.state import optimizer_state_ratio, state_profile
from stagecoach.planner.solve.sweep import plan_model

X = torch.randn(16, 8)
Y = torch.randint(0, 4, (16,))


def meta_only(*layers: nn.Module) -> nn.Sequential:
    """The model, provided it is being built on the meta device."""
    if torch.get_default_device().type != "meta":
        raise RuntimeError("built off the meta device")
    return nn.Sequential(*layers)


def job(factory, optimizer=lambda p: torch.optim.SGD(p, lr=0.1)) -> Job:
    return Job(model=factory, loss=nn.CrossEntropyLoss(), optimizer=optimizer, train=(X, Y), global_batch=8, iterations=2, name="big")


def huge() -> nn.Sequential:
    """The issue's model: 40 GB of float32 weights in one layer."""
    return meta_only(nn.Linear(8, 100_000), nn.Linear(100_000, 100_000), nn.Linear(100_000, 4))


def test_a_layer_no_lambda_holds_is_refused_unbuilt_naming_the_limit():
    t0 = time.perf_counter()
    with pytest.raises(JobError) as e:
        job(huge).validate()
    msg = str(e.value)
    assert "10,240 MB" in msg and LAMBDA_QUOTAS_URL in msg
    assert "layer '1:Linear' alone" in msg and "38,147 MB of parameters" in msg and "no stage count fits" in msg
    assert time.perf_counter() - t0 < 30  # sized, not built


def test_plan_meta_refuses_it_before_building(tmp_path):
    f = tmp_path / "big.py"
    f.write_text(
        "import torch\nfrom torch import nn\nfrom stagecoach import Job\n"
        "def model():\n"
        "    assert torch.get_default_device().type == 'meta', 'built off the meta device'\n"
        "    return nn.Sequential(nn.Linear(8, 100_000), nn.Linear(100_000, 100_000), nn.Linear(100_000, 4))\n"
        "job = Job(model=model, loss=nn.CrossEntropyLoss(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1),\n"
        "          train=(torch.randn(16, 8), torch.randint(0, 4, (16,))), global_batch=8, iterations=2, name='big')\n"
    )
    r = CliRunner().invoke(plan_command, [str(f), "--meta"])
    assert r.exit_code == 1, r.output
    assert "cannot train on Lambda" in r.output and "10,240 MB" in r.output and "no stage count fits" in r.output


def two_big() -> nn.Sequential:
    """Two layers of 2.3 GB (float32): each fits a 10,240 MB function alone, both together do not."""
    return meta_only(nn.Linear(8, 25_000), nn.Linear(25_000, 25_000), nn.Linear(25_000, 25_000), nn.Linear(25_000, 4))


def test_a_plan_whose_stage_cannot_hold_its_layers_is_refused_naming_the_smallest_count():
    plan = Plan(balance=[4], global_batch=8, memory_mb=10240)
    with pytest.raises(JobError, match=r"stage 0 of the plan \(layers 0-3\).*10,240 MB: use at least 2 stages"):
        job(two_big).validate(plan)


def test_the_planner_refuses_fewer_stages_than_fit():
    with torch.device("meta"):
        prof = state_profile(two_big(), "two")
    plat = aws_platform()
    assert smallest_stage_count(prof, plat) == 2
    with pytest.raises(LayerTooLargeError, match=r"'two' cannot train on Lambda in 1 stage\(s\).*at least 2 stages"):
        plan_model(prof, 8, plat, max_stages=1)


def test_the_smallest_stage_count_is_the_fewest_of_any_partition():
    """Greedy against every contiguous partition of a mixed model."""
    sizes = [9_000, 20_000, 4_000, 15_000, 12_000, 30_000, 3_000]
    with torch.device("meta"):
        model = nn.Sequential(*(nn.Linear(n, 16_000, bias=False) for n in sizes))
    prof, plat = state_profile(model, "mixed"), aws_platform()
    cap = plat.usable_bytes(max(plat.tiers_mb))
    L, best = len(sizes), None
    for cuts in itertools.chain.from_iterable(itertools.combinations(range(1, L), k) for k in range(L)):
        bounds = (0, *cuts, L)
        if all(least_stage_bytes(prof.layers[a:b], plat) <= cap for a, b in zip(bounds, bounds[1:])):
            best = len(bounds) - 1
            break  # combinations by k ascending: the first that fits has the fewest stages
    assert best is not None and best > 1
    assert smallest_stage_count(prof, plat) == best
    assert lambda_refusal(prof, plat, max_stages=best) is None
    assert f"at least {best} stages" in (lambda_refusal(prof, plat, max_stages=best - 1) or "")


def test_the_optimizers_state_ratio_is_read_off_one_step():
    assert optimizer_state_ratio(lambda p: torch.optim.Adam(p)) == 2
    assert optimizer_state_ratio(lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)) == 1
    assert optimizer_state_ratio(lambda p: torch.optim.SGD(p, lr=0.1)) == 0
    assert optimizer_state_ratio(lambda p: 1 / 0) is None


def test_a_model_that_fits_is_validated_as_before():
    job(lambda: nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))).validate()
