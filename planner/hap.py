"""FasDL's Hybrid Asynchronous Parallel (HAP) with unequal data partitioning: the semantics, as data.

FasDL (seed 001, §IV-B) names K of the d data-parallel workers aggregators and the others
non-aggregators; non-aggregators take ``extra`` more samples per iteration than aggregators (for
the time aggregators spend aggregating) and train with staleness 1, on the previous iteration's
merged parameters. It does not train what plain PyTorch trains, so it is a sync mode of its own,
``HAP_SYNC``, that a job must ask for by name; docs/exactness.md "FasDL's HAP" states the
semantics, stagecoach.reference_hap computes them in one process.

This module is the one definition the single-process reference, the planner's checks and the
runtime (lambdas/phases.py) read: who is an aggregator, how the global batch is cut, which parameter
version each replica computes on. It imports nothing (not even torch), so that planner/plan.py
can ask it why a plan is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Self, TypeVar


class Indices(Protocol):
    """A global batch's sample indices (a 1-d tensor in practice; planner/plan.py imports this
    module, and the planner does not import torch)."""

    def __len__(self) -> int: ...
    def __getitem__(self, key: slice, /) -> Self: ...


I = TypeVar("I", bound=Indices)


HAP_SYNC = "k_reduce_hap"  # the sync mode's name (not in planner/plan.py SYNC_ALGORITHMS: no planner chooses it)


@dataclass(frozen=True)
class HapSplit:
    """One HAP configuration: d ``replicas``, the first K (``aggregators``) of which aggregate, a
    ``global_batch`` of G samples, each non-aggregator taking ``extra`` = B^n - B^a samples more
    than each aggregator, every replica's share cut into ``micro_batches`` equal micro-batches.

    B^a = (G - (d - K) extra) / d, B^n = B^a + extra, so K B^a + (d - K) B^n = G."""

    replicas: int
    aggregators: int
    global_batch: int
    extra: int = 0
    micro_batches: int = 1

    def __post_init__(self) -> None:
        problem = self.problem()
        if problem is not None:
            raise ValueError(problem)

    def problem(self) -> str | None:
        """What makes this configuration impossible, with the fix; None if it is one."""
        d, k, g, e, m = self.replicas, self.aggregators, self.global_batch, self.extra, self.micro_batches
        for name, v in (("replicas", d), ("aggregators", k), ("global_batch", g), ("micro_batches", m)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                return f"HAP {name}={v!r}: must be a positive integer"
        if not isinstance(e, int) or isinstance(e, bool) or e < 0:
            return f"HAP extra={e!r}: the extra samples of a non-aggregator must be an integer >= 0"
        if d < 2 or k >= d:
            return (
                f"HAP with {d} replicas and K={k} aggregators has no non-aggregator: HAP needs 1 <= K < d "
                "(with K = d every replica aggregates: use sync 'k_reduce', which trains what plain PyTorch trains)"
            )
        rest = g - (d - k) * e
        if rest < d * m or rest % d:
            return (
                f"global batch {g} does not split into {k} aggregators of B^a and {d - k} non-aggregators of "
                f"B^a + {e} samples with B^a >= {m} (micro-batches) a whole number: choose a global batch "
                f"G with (G - {(d - k) * e}) a positive multiple of {d}, or another extra"
            )
        if (rest // d) % m or e % m:
            return (
                f"B^a = {rest // d} and B^n = {rest // d + e} must both split into {m} equal micro-batches: choose extra and G so they do"
            )
        return None

    @property
    def aggregator_batch(self) -> int:
        """B^a: samples per aggregator per iteration."""
        return (self.global_batch - (self.replicas - self.aggregators) * self.extra) // self.replicas

    @property
    def non_aggregator_batch(self) -> int:
        """B^n = B^a + extra: samples per non-aggregator per iteration."""
        return self.aggregator_batch + self.extra

    def is_aggregator(self, replica: int) -> bool:
        """Replicas 0..K-1 aggregate (they host sync tasks 0..K-1, K-reduce's shard owners)."""
        self._check_replica(replica)
        return replica < self.aggregators

    def batch_of(self, replica: int) -> int:
        """Replica ``replica``'s samples per iteration: B^a or B^n."""
        return self.aggregator_batch if self.is_aggregator(replica) else self.non_aggregator_batch

    def start_of(self, replica: int) -> int:
        """Where replica r's slice of the global batch starts: aggregators first, in rank order."""
        self._check_replica(replica)
        ba, k = self.aggregator_batch, self.aggregators
        return replica * ba if replica < k else k * ba + (replica - k) * self.non_aggregator_batch

    def rows(self, batch: I, replica: int, mb: int) -> I:
        """Micro-batch ``mb`` of replica ``replica`` out of the iteration's global batch ``batch``
        (G sample indices): the replica's contiguous slice, cut into equal contiguous micro-batches.
        With extra = 0 it is core.training.micro_batch's split."""
        if len(batch) != self.global_batch:
            raise ValueError(f"a global batch of {len(batch)} samples, the split expects {self.global_batch}")
        if not 0 <= mb < self.micro_batches:
            raise ValueError(f"micro-batch {mb} of {self.micro_batches}")
        size = self.batch_of(replica) // self.micro_batches
        start = self.start_of(replica) + mb * size
        return batch[start : start + size]

    def weight(self, replica: int) -> float:
        """The factor on a micro-batch's mean loss so that all d m of them sum to the global batch's
        mean: the micro-batch's samples over G (1 / (d m) when extra = 0)."""
        return self.batch_of(replica) / self.micro_batches / self.global_batch

    def param_version(self, t: int, replica: int) -> int:
        """The parameter version replica r computes iteration t's gradient on: t for an aggregator
        (BSP), t - 1 for a non-aggregator (staleness 1), 0 at t = 0 (no earlier version exists)."""
        if t < 0:
            raise ValueError(f"iteration {t} < 0")
        return t if self.is_aggregator(replica) else max(t - 1, 0)

    def _check_replica(self, replica: int) -> None:
        if not 0 <= replica < self.replicas:
            raise ValueError(f"replica {replica} of {self.replicas}")


class HapPlan(Protocol):
    """What HAP reads of a plan (planner/plan.py Plan; this module does not import it: plan.py imports this one)."""

    @property
    def stages(self) -> int: ...
    @property
    def replicas(self) -> int: ...
    @property
    def micro_batches(self) -> int: ...
    @property
    def global_batch(self) -> int: ...
    @property
    def aggregators(self) -> tuple[int, ...]: ...
    @property
    def hap_extra(self) -> int: ...


def split_of(plan: HapPlan) -> HapSplit:
    """The HAP configuration a one-stage plan names: d = its replicas, K = its aggregators, G, its
    ``hap_extra`` and m (the runtime's and the reference's split: they must agree)."""
    return HapSplit(plan.replicas, plan.aggregators[0], plan.global_batch, plan.hap_extra, plan.micro_batches)


def plan_problem(plan: HapPlan, stage: int) -> str | None:
    """Why a plan whose stage ``stage`` names HAP is refused, and what to do (planner/plan.py);
    None when the runtime runs it: one stage (HAP is data-parallel, FasDL's), and a split HapSplit
    admits. The runtime runs a one-stage plan (lambdas/phases.py): the unequal cut, and
    non-aggregators computing on the previous version."""
    if plan.stages != 1:
        return (
            f"plan.sync[{stage}]={HAP_SYNC!r}: FasDL's HAP is data-parallel only, but the plan has {plan.stages} stages: "
            f"use stages=1 (balance of one stage), or sync 'k_reduce' for a pipelined plan"
        )
    problem = HapSplit.problem(_Unchecked(plan.replicas, plan.aggregators[0], plan.global_batch, plan.hap_extra, plan.micro_batches))
    return None if problem is None else f"plan.sync[{stage}]={HAP_SYNC!r}: {problem}"


@dataclass(frozen=True)
class _Unchecked(HapSplit):
    """A split not checked on construction, for ``plan_problem`` to ask what is wrong with it."""

    def __post_init__(self) -> None:
        pass
