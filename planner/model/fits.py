"""Whether a model can be planned at all: every layer alone must fit the largest memory tier, and
the smallest number of stages whose every stage fits it (issue 28: a model too big for Lambda is
refused before anything is built, naming Lambda's limit and that count)."""

from __future__ import annotations

from collections.abc import Sequence

from stagecoach.planner.limits import INLINE_MAP_MAX_CONCURRENCY, LAMBDA_MAX_MB, LAMBDA_QUOTAS_URL
from stagecoach.planner.model.perfmodel import stage_memory_bytes
from stagecoach.planner.model.platforms import Platform
from stagecoach.planner.model.syncmodel import sync_choices
from stagecoach.planner.profile.layers import LayerProfile, LayerTooLargeError, ModelProfile

# The data-parallel degrees a layer's least memory is taken over: a stage's optimizer state is
# sharded over its replicas (warm state), so more replicas need a little less per worker.
FIT_REPLICAS = (1, 2, 4, 8, 16, 32)


def least_stage_bytes(layers: Sequence[LayerProfile], platform: Platform, micro_batch: int = 1) -> float:
    """The least a stage holding ``layers`` needs under any data-parallel degree and sync algorithm
    (they differ in the buffers they add) at ``micro_batch``: weights, gradients, a flat gradient
    copy, the optimizer state the lightest plan keeps (docs/performance-model.md §2), and the
    activations the profile knows (none for a state profile: then it is a lower bound)."""
    return min(
        stage_memory_bytes(list(layers), micro_batch, replicas=d, platform=platform, sync=ch)
        for d in FIT_REPLICAS
        for ch in sync_choices(d)
    )


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
        # the least it needs under any data-parallel degree and sync algorithm, so a layer is
        # refused only if no plan at all can hold it
        need = least_stage_bytes([l], platform, micro_batch)
        if need > cap:
            raise LayerTooLargeError(
                f"layer {l.name!r} of {profile.name!r} cannot fit in {top} MB of Lambda memory: it has "
                f"{l.param_bytes / 2**20:.0f} MB of parameters and needs about {need / 2**20:.0f} MB alone "
                f"(weights, gradients, a flat gradient copy and {micro_batch} sample(s) of activations: "
                f"{l.saved_bytes_per_sample / 2**20:.0f} MB/sample) but at most {cap / 2**20:.0f} MB is usable. "
                "Split this layer into several children of the nn.Sequential."
            )


def smallest_stage_count(profile: ModelProfile, platform: Platform, micro_batch: int = 1) -> int | None:
    """The fewest stages (contiguous runs of layers) whose every stage fits the largest tier
    (``least_stage_bytes`` within ``Platform.usable_bytes``); None when one layer alone does not.
    Greedy is exact here: a run that fits stays fitting when a layer leaves it (a stage's bytes
    only grow with its layers), so extending each stage as far as it fits never needs more stages."""
    cap = platform.usable_bytes(max(platform.tiers_mb))
    stages, start = 0, 0
    layers = profile.layers
    while start < len(layers):
        if least_stage_bytes(layers[start : start + 1], platform, micro_batch) > cap:
            return None
        lo, hi = start + 1, len(layers)  # the run [start, lo) fits; find the longest by bisection
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if least_stage_bytes(layers[start:mid], platform, micro_batch) <= cap else (lo, mid - 1)
        stages, start = stages + 1, lo
    return stages


def lambda_refusal(profile: ModelProfile, platform: Platform, max_stages: int = INLINE_MAP_MAX_CONCURRENCY) -> str | None:
    """Why ``profile`` cannot train on Lambda with at most ``max_stages`` stages, naming Lambda's
    per-function memory limit and the smallest stage count that fits (None: some count up to
    ``max_stages`` does). The bytes are the performance model's least for a stage (weights,
    gradients, a flat gradient copy and the lightest plan's optimizer state, §2), so nothing that
    some plan could hold is refused."""
    top = max(platform.tiers_mb)
    cap_mb = platform.usable_bytes(top) / 2**20
    limit = (
        f"one Lambda function has at most {LAMBDA_MAX_MB:,} MB of memory ({LAMBDA_QUOTAS_URL}), of which a stage's "
        f"state may use {cap_mb:,.0f} MB at the {top:,} MB tier (the rest: headroom and the runtime)"
    )
    total = least_stage_bytes(profile.layers, platform, 1) / 2**20
    count = smallest_stage_count(profile, platform)
    if count is None:
        big = max(profile.layers, key=lambda l: least_stage_bytes([l], platform))
        need = least_stage_bytes([big], platform) / 2**20
        return (
            f"{profile.name!r} cannot train on Lambda: {limit}; layer {big.name!r} alone needs at least {need:,.0f} MB "
            f"({big.param_bytes / 2**20:,.0f} MB of parameters, their gradients and optimizer state), so no stage count "
            "fits. Split that layer into several children of the nn.Sequential (or shrink it)."
        )
    if count <= max_stages:
        return None
    return (
        f"{profile.name!r} cannot train on Lambda in {max_stages} stage(s): {limit}; its weights, gradients and "
        f"optimizer state need at least {total:,.0f} MB, so it needs at least {count} stages whose each fits. "
        + (
            f"Allow at least {count} stages (plan_model's max_stages, `stagecoach plan --max-stages {count}`)."
            if count <= INLINE_MAP_MAX_CONCURRENCY
            else f"A job runs at most {INLINE_MAP_MAX_CONCURRENCY} stages: make the model smaller."
        )
    )


def check_plannable(profile: ModelProfile, platform: Platform, max_stages: int) -> None:
    """Raise LayerTooLargeError if no plan of at most ``max_stages`` stages can hold ``profile``:
    a layer alone too big (check_fits, which names it), or more stages needed than allowed
    (lambda_refusal, which names the smallest count)."""
    check_fits(profile, platform, micro_batch=1)
    why = lambda_refusal(profile, platform, max_stages)
    if why is not None:
        raise LayerTooLargeError(why)
