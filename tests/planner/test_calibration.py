"""The compute constants equal what their published sources give (planner/model/calibration.py)."""

import pytest

from stagecoach.planner.model.calibration import (
    FASDL_TABLE2,
    FUNCPIPE_FIG1A_COMPUTE,
    calibrate_flops_per_vcpu,
    compute_seconds,
    param_pass_s_per_byte,
    tier_offset_mb,
)
from stagecoach.planner.model.platforms import FUNCPIPE_BANDWIDTH_BPS, aws_platform, emulated_platform
from stagecoach.planner.profile.zoo import zoo_profile


def test_aws_compute_constants_are_their_sources_fits():
    plat = aws_platform()
    assert plat.tier_offset_mb == pytest.approx(tier_offset_mb(), abs=0.01)
    assert plat.param_pass_s_per_byte == pytest.approx(param_pass_s_per_byte(), rel=1e-3)
    assert plat.flops_per_vcpu == pytest.approx(calibrate_flops_per_vcpu(FUNCPIPE_FIG1A_COMPUTE, plat), rel=1e-3)
    # and the model then reproduces the measurement it was fitted to
    m = FUNCPIPE_FIG1A_COMPUTE
    assert compute_seconds(zoo_profile(m.model), m.tier_mb, m.batch, plat, m.optimizer_state_ratio) == pytest.approx(m.seconds, rel=1e-3)


def test_fasdl_fits_read_in_mib_and_per_parameter_byte():
    # FasDL's model sizes are MiB: torchvision's ResNet-50 has 25,557,032 fp32 parameters
    resnet50 = next(f for f in FASDL_TABLE2 if f.model.startswith("ResNet50"))
    assert resnet50.size_mib == pytest.approx(25_557_032 * 4 / 2**20, abs=0.01)
    per = sorted(f.fixed_s_per_byte() for f in FASDL_TABLE2)
    assert 2.5e-9 < per[0] and per[-1] < 6e-9  # the fixed part is proportional to the model's size


def test_bandwidth_is_funcpipes_70_mib_per_s_and_the_emulated_platform_computes_locally():
    assert aws_platform().bandwidth_Bps == FUNCPIPE_BANDWIDTH_BPS == 70 * 2**20
    plat = emulated_platform(aws_platform(), request_s=0.02, invoke_s=0.1, dispatch_s=0.01, iteration_s=0.0)
    assert plat.speedup(128) == plat.speedup(10240) == 1.0
    assert plat.param_pass_s_per_byte > 0 and plat.param_pass_s_per_byte != aws_platform().param_pass_s_per_byte
