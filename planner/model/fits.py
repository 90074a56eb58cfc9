"""Whether a model can be planned at all: every layer alone must fit the largest memory tier."""

from __future__ import annotations

from stagecoach.planner.model.perfmodel import stage_memory_bytes
from stagecoach.planner.model.platforms import Platform
from stagecoach.planner.model.syncmodel import sync_choices
from stagecoach.planner.profile.layers import LayerTooLargeError, ModelProfile


def check_fits(profile: ModelProfile, platform: Platform, micro_batch: int = 1) -> None:
    """Raise LayerTooLargeError naming the first layer that cannot fit the largest tier alone.

    A layer alone in a stage at micro-batch ``micro_batch`` needs at least its weights, gradients
    and a flat gradient copy plus one micro-batch's saved activations and boundary tensors; if that
    exceeds the largest tier, no plan exists. Fix: split the layer into smaller children of the
    nn.Sequential, or use a smaller micro-batch.
    """
    top = max(platform.tiers_mb)
    cap = platform.usable_bytes(top)
    if profile.build_bytes > cap:
        raise LayerTooLargeError(
            f"{profile.name!r} is built whole in every container ({profile.build_bytes / 2**20:.0f} MB of parameters and "
            f"buffers: its factory cannot be built on the meta device, see JobSpec.full_build_reason), but at most "
            f"{cap / 2**20:.0f} MB of {top} MB is usable. Keep the model's state in parameters and buffers so each "
            "container builds only its stage (docs/runtime.md, 'Building a stage')."
        )
    for l in profile.layers:
        # the least it needs under any data-parallel degree and sync algorithm (they differ in the
        # buffers they add), so a layer is refused only if no plan at all can hold it
        need = min(
            stage_memory_bytes([l], micro_batch, replicas=d, platform=platform, sync=ch)
            for d in (1, 2, 4, 8, 16, 32)
            for ch in sync_choices(d)
        )
        if need > cap:
            raise LayerTooLargeError(
                f"layer {l.name!r} of {profile.name!r} cannot fit in {top} MB of Lambda memory: it has "
                f"{l.param_bytes / 2**20:.0f} MB of parameters and needs about {need / 2**20:.0f} MB alone "
                f"(weights, gradients, a flat gradient copy and {micro_batch} sample(s) of activations: "
                f"{l.saved_bytes_per_sample / 2**20:.0f} MB/sample) but at most {cap / 2**20:.0f} MB is usable. "
                "Split this layer into several children of the nn.Sequential."
            )
