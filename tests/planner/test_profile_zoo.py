"""Profiler measurements, meta sizing, the zoo's sizes and the too-large-layer error."""

import pytest
import torch

from stagecoach.lambdas.profiling import combine_tier_phases, measure_model, profile_phase
from stagecoach.planner.platforms import aws_platform
from stagecoach.planner.profile import LayerTooLargeError, ModelProfile, check_fits, profile_meta
from stagecoach.planner.zoo import FUNCPIPE_TABLE1_MIB, amoebanet_d, bert_large, resnet101


def _params_mib(factory):
    with torch.device("meta"):
        m = factory()
    return sum(p.numel() * p.element_size() for p in m.parameters()) / 2**20, m


def test_linear_relu_sizes_measured_and_meta_agree_with_hand_computation():
    model = torch.nn.Sequential(torch.nn.Linear(100, 50), torch.nn.ReLU(), torch.nn.Linear(50, 10))
    sample = torch.randn(100)
    for prof in (measure_model(model, sample, (1, 2), repeats=1), profile_meta(model, sample)):
        lin, relu, lin2 = prof.layers
        assert lin.param_bytes == (100 * 50 + 50) * 4
        assert lin.saved_bytes_per_sample == 100 * 4  # Linear saves its input for the weight gradient
        assert lin.out_bytes_per_sample == 50 * 4 and lin.in_bytes_per_sample == 100 * 4
        assert relu.saved_bytes_per_sample == 50 * 4 and relu.param_bytes == 0
        assert lin2.out_bytes_per_sample == 10 * 4
    meta = profile_meta(model, sample)
    assert meta.layers[0].fwd_flops_per_sample == 2 * 100 * 50
    measured = measure_model(model, sample, (1, 4), repeats=1)
    assert all(l.fwd_s[4] > 0 and l.bwd_s[1] >= 0 for l in measured.layers)


def test_profile_phase_is_json_and_combines_tiers(monkeypatch):
    import json

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
    out = []
    for tier in (1024, 2048):
        monkeypatch.setenv("AWS_LAMBDA_FUNCTION_MEMORY_SIZE", str(tier))
        out.append(json.loads(json.dumps(profile_phase(model, torch.randn(8), (1, 2), repeats=1))))
    prof = combine_tier_phases(out)
    assert set(prof.layers[0].tier_s) == {1024, 2048}
    f, g = prof.layers[0].times(2048, 2, aws_platform())
    assert f == prof.layers[0].tier_s[2048][2][0]


@pytest.mark.parametrize(
    "key,factory,part",
    [
        ("resnet101", resnet101, None),
        ("amoebanet_d18", lambda: amoebanet_d(18, 256), None),
        ("amoebanet_d36", lambda: amoebanet_d(36, 256), None),
        ("bert_large", bert_large, "encoder"),
    ],
)
def test_zoo_parameter_sizes_match_funcpipe_table1(key, factory, part):
    total, m = _params_mib(factory)
    if part:  # FuncPipe's 1153 MB is BERT-Large's 24 encoder layers (embeddings add 121 MiB)
        total = sum(p.numel() * 4 for n, p in m.named_parameters() if n.split(".")[0].startswith(part)) / 2**20
    ref = FUNCPIPE_TABLE1_MIB[key][0]
    assert abs(total - ref) / ref < 0.05, f"{key}: {total:.0f} MiB vs FuncPipe {ref} MiB"


def test_a_layer_that_cannot_fit_10gb_is_named():
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 200_000_000 // 16 * 16))
    prof = profile_meta(model, torch.randn(16), name="huge")
    n = 200_000_000 // 16 * 16
    mib = round((16 * n + n) * 4 / 2**20)  # weight + bias of the second Linear
    with pytest.raises(LayerTooLargeError, match=rf"layer '1:Linear'.*cannot fit in 10240 MB.*{mib} MB of parameters"):
        check_fits(prof, aws_platform())
    from stagecoach.planner.api import plan_model

    with pytest.raises(LayerTooLargeError, match="1:Linear"):
        plan_model(prof, 8)


def test_profile_roundtrips_through_json():
    import json

    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    prof = measure_model(model, torch.randn(4), (1,), repeats=1)
    again = ModelProfile.from_dict(json.loads(json.dumps(prof.to_dict())))
    assert again == prof
