"""A training job as the user describes it: model, loss, optimizer, data, batch, iterations, seed.

The job holds no operational settings (memory, retries, timeouts): those belong to the plan and the
backend, so the same job runs locally and on AWS unchanged.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from stagecoach import exactness
from stagecoach import history as learnt
from stagecoach.backend import Backend
from stagecoach.backends import get_backend
from stagecoach.lambdas import boundary
from stagecoach.lambdas.graph_split import Blocks, SplitError, SplitFactory, suggest
from stagecoach.lambdas.profiling import measure_model
from stagecoach.lambdas.training import DTYPE_NAMES, build_model
from stagecoach.planner.model.platforms import Platform, aws_platform
from stagecoach.planner.plan import PHASES, Plan, PlanError, even_balance
from stagecoach.planner.profile.layers import ModelProfile
from stagecoach.planner.solve.sweep import PlanningResult, plan_model
from stagecoach.profile_tiers import profile_tiers
from stagecoach.run import Run


class JobError(ValueError):
    """A job that cannot run; the message names what is wrong and how to fix it."""


@dataclass
class Job:
    """A training job.

    model:        zero-argument factory returning the model: an nn.Sequential of blocks (each
                  returning a tensor or a tuple/list/dict of tensors that the next block takes),
                  or any nn.Module together with ``blocks``. A block is the unit the planner
                  places on a stage.
    blocks:       for a model that is not an nn.Sequential: the submodules whose boundaries may
                  become cuts, as dotted names with wildcards per level (["embeddings",
                  "encoder.layer.*", "head"]). The model is captured with torch.export and split
                  before each of them by PyTorch's pipeline splitter (lambdas/graph_split.py);
                  the code before the first joins the first block.
    loss:         ``loss(output, target) -> scalar``, a mean over the batch (e.g. nn.CrossEntropyLoss()).
    optimizer:    ``optimizer(params) -> torch.optim.Optimizer`` with an elementwise update
                  (SGD, Adam, AdamW, RMSprop, ...): its state is sharded across sync tasks.
                  Parameter groups (built over ``params``, e.g. by ``p.ndim``) keep their own
                  hyperparameters. What the runtime cannot train exactly is refused by
                  ``validate`` (docs/exactness.md).
    train:        (inputs, labels) tensors; ``test`` likewise, optional, for evaluation.
    global_batch: samples per iteration over all replicas.
    deferred_batch_norm: let a plan split the global batch of a model with BatchNorm (as
                  torchgpipe's ``GPipe(..., deferred_batch_norm=True)`` does): each micro-batch
                  is normalised with its own statistics, as in data-parallel training without
                  SyncBatchNorm, and the running statistics are updated once per iteration with
                  the whole global batch's mean and unbiased variance (docs/exactness.md). Without
                  it such a model trains on one replica and one micro-batch only, exactly as
                  plain PyTorch; with one replica and one micro-batch it changes nothing.
    warm_state:   keep the state each worker owns in its container's memory between iterations
                  and store it in S3 only at window boundaries (docs/runtime.md "State that stays
                  warm"): with one replica a stage's parameters and optimizer state; with d > 1
                  (then every replica and sync task gets a function of its own) each shard's
                  optimizer state. False: store every iteration's, one function per stage (the
                  earlier behaviour, also what a restart-heavy run may prefer).
    """

    model: Callable[[], nn.Module]
    loss: Callable[..., torch.Tensor]
    optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer]
    train: tuple[torch.Tensor, torch.Tensor]
    global_batch: int
    iterations: int
    seed: int = 0
    test: tuple[torch.Tensor, torch.Tensor] | None = None
    dtype: torch.dtype = torch.float32
    name: str = "job"
    blocks: Sequence[str] | None = None
    deferred_batch_norm: bool = False
    warm_state: bool = True
    _facts: exactness.ModelFacts | None = field(default=None, init=False, repr=False)

    # -- validation (before any AWS call) --------------------------------------------------------
    def validate(self, plan: Plan | None = None) -> None:
        """Refuse, before anything is deployed, a job (and, if given, a plan) that cannot run or would
        train something other than plain PyTorch (stagecoach.exactness); the error says what to change."""
        if not re.fullmatch(r"[a-z0-9][a-z0-9-]{0,29}", self.name):
            raise JobError(f"job name {self.name!r}: use 1-30 lowercase letters, digits and '-'")
        for what in ("global_batch", "iterations", "seed"):
            v = getattr(self, what)
            if not isinstance(v, int) or isinstance(v, bool) or v < (0 if what == "seed" else 1):
                raise JobError(f"job.{what}={v!r}: must be a {'non-negative' if what == 'seed' else 'positive'} integer")
        if not isinstance(self.deferred_batch_norm, bool):
            raise JobError(f"job.deferred_batch_norm={self.deferred_batch_norm!r}: must be True or False")
        if not isinstance(self.warm_state, bool):
            raise JobError(f"job.warm_state={self.warm_state!r}: must be True or False")
        if self.dtype not in DTYPE_NAMES:
            raise JobError(f"job.dtype={self.dtype}: use torch.float32 or torch.float64")
        x, y = _split("train", self.train)
        if self.test is not None:
            _split("test", self.test)
        if self.global_batch > x.shape[0]:
            raise JobError(
                f"global batch {self.global_batch} is larger than the training set ({x.shape[0]} samples): use a smaller global batch"
            )
        for what in ("model", "loss", "optimizer"):
            if not callable(getattr(self, what)):
                raise JobError(
                    f"job.{what}={getattr(self, what)!r} is not callable: give "
                    + {
                        "model": "a zero-argument function returning an nn.Module",
                        "loss": "a function loss(output, target) -> scalar, e.g. nn.CrossEntropyLoss()",
                        "optimizer": "a function optimizer(params) -> torch.optim.Optimizer, e.g. lambda p: torch.optim.Adam(p, lr=1e-3)",
                    }[what]
                )
        model = self.build_model()
        n = min(4, x.shape[0])
        sample = x[:n].to(self.dtype) if x.is_floating_point() else x[:n]
        out = sample
        with torch.no_grad():
            for i, block in enumerate(model):
                try:
                    out = block(out)
                except Exception as e:
                    raise JobError(f"block {i} ({type(block).__name__}) fails on a sample batch: {e}") from None
                if not isinstance(out, torch.Tensor):
                    try:
                        boundary.check(out, f"block {i} ({type(block).__name__})")
                    except TypeError as e:
                        raise JobError(str(e)) from None
        try:
            loss = self.loss(out, y[:n])
        except Exception as e:
            raise JobError(f"job.loss fails on the model's output and the labels: {e}") from None
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise JobError("job.loss must return a scalar tensor (a mean over the batch)")
        del model, out  # examine builds its own: one paper-scale model at a time
        if self.blocks is not None:
            self._check_split(sample, y[:n])
        try:
            self._facts = exactness.examine(
                self.build_model, self.loss, self.optimizer, sample, y[:n], self.seed, self.dtype, factory=self.factory
            )
        except exactness.NotExact as e:
            raise JobError(str(e)) from None
        if plan is not None:
            self.check_plan(plan)

    def _check_split(self, x: Any, y: torch.Tensor) -> None:
        """The chain cut at ``blocks`` computes what job.model() itself does (exactness.check_split)."""
        chain = self.build_model()
        assert isinstance(chain, Blocks)
        user = build_model(self.model, self.seed, self.dtype)
        try:
            exactness.check_split(user, chain, chain.original_state_dict(keep_vars=True), self.loss, x, y, self.dtype)
        except exactness.NotExact as e:
            raise JobError(str(e)) from None

    def check_plan(self, plan: Plan) -> None:
        """Refuse a plan under which this job would train something other than plain PyTorch
        (a cut that a complex tensor would cross; a split batch with a batch-coupled model, unless
        its BatchNorms defer their running statistics, or a loss that is not a mean)."""
        plan.validate(layers=self.layers)
        try:
            exactness.check_plan(
                self.facts,
                plan.balance,
                plan.replicas,
                plan.micro_batches,
                deferred_batch_norm=self.deferred_batch_norm,
                micro_batch_size=plan.micro_batch_size,
            )
        except exactness.NotExact as e:
            raise JobError(str(e)) from None

    @property
    def facts(self) -> exactness.ModelFacts:
        if self._facts is None:
            self.validate()
        assert self._facts is not None
        return self._facts

    @property
    def factory(self) -> Callable[[], nn.Module]:
        """What the client, the workers and the reference build: the user's factory, or, with
        ``blocks``, that factory's model captured and cut into a chain of blocks."""
        if self.blocks is None:
            return self.model
        if isinstance(self.blocks, str) or not self.blocks or not all(isinstance(b, str) and b for b in self.blocks):
            raise JobError(f"job.blocks={self.blocks!r}: give a list of submodule names or patterns, e.g. ['embed', 'layers.*', 'head']")
        x = _split("train", self.train)[0]
        return SplitFactory(self.model, tuple(self.blocks), tuple(x.shape[1:]), x.dtype, self.dtype)

    def build_model(self) -> nn.Sequential:
        """The model at its initial parameters, as a chain of blocks: the factory run under the job's seed."""
        try:
            model = build_model(self.factory, self.seed, self.dtype)
        except SplitError as e:
            raise JobError(str(e)) from None
        except JobError:
            raise
        except Exception as e:
            raise JobError(f"job.model() fails: {e}") from None
        if not isinstance(model, nn.Sequential):
            hint = suggest(model) if isinstance(model, nn.Module) else "return an nn.Module"
            raise JobError(
                f"job.model() returned {type(model).__name__}, not an nn.Sequential: name the submodules "
                f"Stagecoach may cut between with Job(blocks=[...]), {hint}; or wrap the blocks in nn.Sequential(block0, block1, ...)"
            )
        if len(model) == 0:
            raise JobError("job.model() returned an empty nn.Sequential")
        return model

    def user_model(self, blocks: nn.Sequential) -> nn.Module:
        """The model as the user wrote it, holding ``blocks``' parameters and buffers (for a job
        without ``blocks``, the chain itself): what a trained run hands back."""
        if not isinstance(blocks, Blocks):
            return blocks
        model = build_model(self.model, self.seed, self.dtype)
        state = blocks.original_state_dict()
        model.load_state_dict({k: state[k] for k in model.state_dict()})
        return model

    @property
    def layers(self) -> int:
        """Blocks of the model: the units a plan's balance counts (a module used twice counts twice)."""
        return self.facts.blocks

    # -- running ---------------------------------------------------------------------------------
    def run(self, plan: Plan | None = None, backend: Backend | str | None = None, reserve_concurrency: bool = False, **manual: Any) -> Run:
        """Deploy and start the job; returns a Run to wait on and inspect.

        ``plan``: a Plan; else a manual one from ``stages``, ``replicas``, ``micro_batches``,
        ``memory_mb``, ``sync`` and ``aggregators`` (defaults: one stage, one replica, one
        micro-batch, scatter-reduce; see ``manual_plan``). ``reserve_concurrency``: reserve each
        stage function the concurrency its tasks need (twice its most tasks at once, for a window
        restart; 2 per function when every worker has its own), so other functions of the account
        cannot starve a phase of its workers.
        """
        self.validate()
        plan = plan if plan is not None else self.manual_plan(**manual)
        plan.validate(layers=self.layers)
        if plan.global_batch != self.global_batch:
            raise PlanError(f"plan.global_batch={plan.global_batch} differs from job.global_batch={self.global_batch}")
        self.check_plan(plan)
        backend = get_backend(backend)
        plan = learnt.refine(plan, self.name, backend.clients.s3, backend.resources.bucket)
        return backend.launch(self, plan, reserve_concurrency=reserve_concurrency)

    def plan(
        self, platform: Platform | None = None, profile_on: Backend | str | None = None, tiers: Sequence[int] | None = None, **options: Any
    ) -> PlanningResult:
        """Profile the model and plan it: the Pareto set of plans and FuncPipe's recommendation.

        Returns a stagecoach.planner.solve.sweep.PlanningResult; ``result.recommended.to_plan()`` is the
        Plan to pass to ``run(plan=...)``. ``platform`` defaults to AWS Lambda's constants
        (planner/model/platforms.py); ``options`` go to planner.solve.sweep.plan_model. The layers are timed here
        (one thread = one vCPU, scaled to each tier by the vCPU model) unless ``profile_on`` names a
        backend: then each of ``tiers`` is measured inside a Lambda function of that memory
        (stagecoach.profile_tiers), and planning uses those tiers.
        """
        self.validate()
        if profile_on is not None:
            tiers = tuple(tiers or (1024, 2048, 4096, 10240))
            profile = profile_tiers(self, get_backend(profile_on), tiers=tiers)
            platform = (platform or aws_platform()).replace(tiers_mb=tuple(sorted(tiers)))
        else:
            x = self.train[0]
            sample = x[0].to(self.dtype) if x.is_floating_point() else x[0]
            # a model that normalises over the batch cannot run one sample in train mode (BatchNorm1d)
            sizes = (2, 4, 8) if self.facts.batch_coupling else (1, 2, 4)
            profile = measure_model(self.build_model(), sample, micro_batch_sizes=sizes, name=self.name)
        if exactness.split_batch_refusal(self.facts, self.deferred_batch_norm):
            # only plans that keep the global batch together train this job exactly (check_plan)
            options.setdefault("replicas", (1,))
            options.setdefault("micro_batch_sizes", (self.global_batch,))
        elif self.facts.batch_coupling:  # deferred batch norm: micro-batches of at least two samples
            options.setdefault("micro_batch_sizes", (2, 4, 8))
        return plan_model(self.with_build_bytes(profile), self.global_batch, platform=platform, **options)

    def with_build_bytes(self, profile: ModelProfile) -> ModelProfile:
        """``profile`` with what every container allocates to build its stage: nothing beyond the
        stage when it builds on the meta device, the whole model when the factory needs the full
        build (exactness.meta_build_refusal), which the planner then counts (ModelProfile.build_bytes)."""
        if self.facts.full_build is None:
            return profile
        model = self.build_model()
        whole = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
        return dataclasses.replace(profile, build_bytes=float(whole))

    def manual_plan(
        self,
        stages: int = 1,
        replicas: int = 1,
        micro_batches: int = 1,
        memory_mb: int = 1024,
        timeout_s: int = 300,
        sync: str | Sequence[str] | None = None,
        aggregators: int | Sequence[int] | None = None,
    ) -> Plan:
        """A plan with layers split evenly. ``sync``: one algorithm for every stage or one per stage
        (planner/plan.py SYNC_ALGORITHMS); ``aggregators``: K for k_reduce (one, or one per stage)."""
        return Plan(
            balance=even_balance(self.layers, stages),
            replicas=replicas,
            micro_batches=micro_batches,
            global_batch=self.global_batch,
            sync=(sync,) * stages if isinstance(sync, str) else tuple(sync or ()),
            aggregators=(aggregators,) * stages if isinstance(aggregators, int) else tuple(aggregators or ()),
            memory_mb=(memory_mb,) * stages,
            timeouts_s=tuple({p: timeout_s for p in PHASES} for _ in range(stages)),
        )


def _split(what: str, data: Any) -> tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(data, (tuple, list)) or len(data) != 2:
        raise JobError(f"job.{what} must be an (inputs, labels) pair of tensors; a data set without labels cannot be trained")
    x, y = data
    if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
        raise JobError(f"job.{what} must hold tensors, got ({type(x).__name__}, {type(y).__name__})")
    if x.shape[0] != y.shape[0] or x.shape[0] == 0:
        raise JobError(f"job.{what}: {x.shape[0]} inputs but {y.shape[0]} labels; they must match and be non-empty")
    return x, y
