"""DiSDeL's analytical memory estimate, used as a cross-check of our profiled stage memory.

DiSDeL sizes a serverless training function before running it:

    m_a = fit + pkg + dta + mod + saf
    fit = 4 * (m_par + m_act + m_misc)      4 bytes per fp32 element
    m_par = 4 * t_par                        weights, gradients, and two optimizer buffers
    m_act = 2 * b * t_act                    activations and their gradients, b samples
    saf = 256 MB                             safety margin

(t_par: trainable parameters, t_act: activation elements per sample, both counted on the model;
pkg: the libraries loaded; dta: the data the function holds; mod: the model file it loads.)

Why here: our stage memory (perfmodel.stage_memory_bytes) comes from measured saved-for-backward
bytes and the runtime's known buffers; DiSDeL's is a generic, deliberately conservative formula.
Where the two disagree by more than a factor, one of them is wrong for that stage (an unusual
layer, an optimizer with more state, a runtime change) — ``memory_crosscheck`` lists those
stages as warnings the planner can show. tests/planner/test_disdel.py compares both against the
peak RSS of a real forward + backward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from stagecoach.planner.model.perfmodel import stage_memory_bytes

if TYPE_CHECKING:  # pragma: no cover
    from stagecoach.planner.model.platforms import Platform
    from stagecoach.planner.model.syncmodel import SyncChoice
    from stagecoach.planner.profile.layers import LayerProfile

MB = 2**20
SAFETY_MB = 256.0  # DiSDeL's saf
BYTES_PER_ELEMENT = 4  # fp32


@dataclass(frozen=True)
class DisdelEstimate:
    """DiSDeL's terms for one function, in bytes."""

    fit: float
    pkg: float
    dta: float
    mod: float
    saf: float

    @property
    def total(self) -> float:
        return self.fit + self.pkg + self.dta + self.mod + self.saf


def disdel_estimate(layers: Sequence[LayerProfile], micro_batch: int, pkg_mb: float, misc_elements: float = 0.0) -> DisdelEstimate:
    """DiSDeL's m_a for a stage holding ``layers``, running ``micro_batch`` samples at a time.

    Mapping to our profile: t_par = parameter bytes / 4; t_act = saved-for-backward bytes per
    sample / 4 (DiSDeL counts layer outputs as a model summary does; autograd's saved tensors are
    the exact version of that count); dta = one micro-batch of the stage's input; mod = the
    stage's parameters as downloaded; pkg = the worker runtime's libraries (``pkg_mb``, e.g.
    Platform.runtime_base_mb)."""
    if not layers:
        raise ValueError("a stage needs at least one layer")
    t_par = sum(l.param_bytes for l in layers) / BYTES_PER_ELEMENT
    t_act = sum(l.saved_bytes_per_sample for l in layers) / BYTES_PER_ELEMENT
    m_par = 4 * t_par
    m_act = 2 * micro_batch * t_act
    fit = BYTES_PER_ELEMENT * (m_par + m_act + misc_elements)
    return DisdelEstimate(
        fit=fit,
        pkg=pkg_mb * MB,
        dta=micro_batch * layers[0].in_bytes_per_sample,
        mod=t_par * BYTES_PER_ELEMENT,
        saf=SAFETY_MB * MB,
    )


@dataclass(frozen=True)
class MemoryCheck:
    """Our estimate (stage memory + runtime base) against DiSDeL's, for one stage."""

    stage: int
    ours_bytes: float
    disdel_bytes: float

    @property
    def ratio(self) -> float:
        """DiSDeL / ours (DiSDeL is conservative, so usually > 1)."""
        return self.disdel_bytes / self.ours_bytes


def memory_checks(
    layers: Sequence[LayerProfile],
    balance: Sequence[int],
    micro_batch: int,
    replicas: int,
    platform: Platform,
    sync: Sequence[SyncChoice] | None = None,
) -> list[MemoryCheck]:
    """Per stage of ``balance``: our peak (perfmodel.stage_memory_bytes + runtime base) and DiSDeL's."""

    if sum(balance) != len(layers) or min(balance) < 1:
        raise ValueError(f"balance {tuple(balance)} does not split {len(layers)} layers into non-empty stages")
    out, i = [], 0
    for s, n in enumerate(balance):
        st = layers[i : i + n]
        ours = stage_memory_bytes(st, micro_batch, replicas, platform, sync[s] if sync else None) + platform.runtime_base_mb * MB
        out.append(MemoryCheck(s, ours, disdel_estimate(st, micro_batch, platform.runtime_base_mb).total))
        i += n
    return out


def memory_crosscheck(
    layers: Sequence[LayerProfile],
    balance: Sequence[int],
    micro_batch: int,
    replicas: int,
    platform: Platform,
    factor: float = 2.5,
    sync: Sequence[SyncChoice] | None = None,
) -> list[str]:
    """Warnings for stages where ours and DiSDeL's memory differ by more than ``factor`` either way.

    Fed the same profile, DiSDeL's formula (4 parameter copies + the model file, 2x the
    activations, a 256 MB margin) lies between about 0.5x and 2x ours by construction: on the zoo
    it is 1.6x-1.9x ours with d > 1, and 0.75x-1.7x with d = 1, where our backward task also runs
    the Adam update ((5 + 2 rho) parameter copies). The default factor 2.5 therefore flags stages
    where our runtime holds far more than a conventional trainer would — typically layers that
    save little for backward but move huge boundary tensors, which our runtime keeps twice per
    micro-batch — i.e. where a plan's memory rests on runtime buffers rather than on the model."""
    warnings = []
    for c in memory_checks(layers, balance, micro_batch, replicas, platform, sync):
        if c.ratio > factor or c.ratio < 1 / factor:
            side = "above" if c.ratio < 1 else "below"
            warnings.append(
                f"stage {c.stage}: our memory estimate {c.ours_bytes / MB:.0f} MB is far {side} DiSDeL's "
                f"{c.disdel_bytes / MB:.0f} MB (ratio {c.ratio:.2f}; tolerated 1/{factor:g}..{factor:g}): check the profile of its layers"
            )
    return warnings
