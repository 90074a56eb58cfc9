"""A training job as the user describes it: model, loss, optimizer, data, batch, iterations, seed.

The job holds no operational settings (memory, retries, timeouts): those belong to the plan and the
backend, so the same job runs locally and on AWS unchanged.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypedDict, Unpack

import torch
from safetensors.torch import load_file
from torch import nn

from stagecoach import cost as costs
from stagecoach import dynamic, exactness
from stagecoach import history as learnt
from stagecoach.backend import Backend
from stagecoach.backends import get_backend
from stagecoach.core import boundary, stagebuild
from stagecoach.core.graph_split import Blocks, SplitError, SplitFactory, suggest
from stagecoach.core.profiling import measure_model
from stagecoach.core.samples import LocalSamples, as_dtype, encode
from stagecoach.core.schedule import MakeScheduler, Schedule, stand_in
from stagecoach.core.training import DTYPE_NAMES, build_model, master_dtype, tracked_norms
from stagecoach.deploy.upload import JobCodeError, pickle_job_code
from stagecoach.errors import StagecoachError
from stagecoach.planner import hap
from stagecoach.planner.emit.workflow import CHOICES as WORKFLOWS
from stagecoach.planner.emit.workflow import WorkflowChoice
from stagecoach.planner.emit.workflow import choose as choose_workflow
from stagecoach.planner.limits import EXECUTION_INPUT_MAX_BYTES
from stagecoach.planner.model.fits import lambda_refusal, least_stage_bytes, smallest_stage_count
from stagecoach.planner.model.passes import PassEstimate, checkpoint_pass, evaluate_pass
from stagecoach.planner.model.perfmodel import Config, Estimate, evaluate
from stagecoach.planner.model.platforms import Platform, aws_platform
from stagecoach.planner.model.syncmodel import SyncChoice
from stagecoach.planner.plan import PHASES, Plan, PlanError, even_balance
from stagecoach.planner.profile.flows import Flow
from stagecoach.planner.profile.layers import ModelProfile
from stagecoach.planner.profile.state import optimizer_state_ratio, state_profile
from stagecoach.planner.segments import segment_bounds
from stagecoach.planner.solve.sweep import PlanningResult, default_micro_batch_sizes, plan_model
from stagecoach.profile_tiers import profile_tiers
from stagecoach.run import Run


class JobError(StagecoachError, ValueError):
    """A job that cannot run; the message names what is wrong and how to fix it."""


class ManualPlan(TypedDict, total=False):
    """A manual plan's settings, as ``Job.run`` takes them without a plan (``Job.manual_plan``)."""

    stages: int
    replicas: int | Mapping[int, int] | dynamic.ByEpoch | dynamic.ReplicaPolicy  # dynamic workers (sdk/dynamic.py)
    micro_batches: int
    memory_mb: int
    timeout_s: int
    sync: str | Sequence[str] | None
    aggregators: int | Sequence[int] | None
    fan_in: int | Sequence[int] | None
    global_batch: Mapping[int, int] | dynamic.ByEpoch  # a growing batch, {first iteration: G} (sdk/dynamic.py)
    lr_scale: Mapping[int, float] | dynamic.ByEpoch  # with it, {first iteration: lr factor}, cumulative (sdk/dynamic.py)
    hap_extra: int  # sync "k_reduce_hap": a non-aggregator's samples beyond an aggregator's (planner/hap.py)


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
                  before each of them by PyTorch's pipeline splitter (core/graph_split.py);
                  the code before the first joins the first block.
    loss:         ``loss(output, target) -> scalar``, a mean over the batch (e.g. nn.CrossEntropyLoss()).
    optimizer:    ``optimizer(params) -> torch.optim.Optimizer`` with an elementwise update
                  (SGD, Adam, AdamW, RMSprop, ...): its state is sharded across sync tasks.
                  Parameter groups (built over ``params``, e.g. by ``p.ndim``) keep their own
                  hyperparameters. What the runtime cannot train exactly is refused by
                  ``validate`` (docs/exactness.md).
    train:        (inputs, targets) tensors or numpy arrays, or any map-style torch Dataset whose items are
                  (input, target) pairs of tensors or tensor structures (Python numbers become
                  tensors, as torch's default_collate makes them). It is uploaded once, in
                  content-addressed shards, and a worker reads only its micro-batches' samples
                  (docs/data.md). ``test`` likewise, optional, for evaluation.
    transform:    ``transform(input) -> input``, applied to each sample's input in the worker
                  (augmentation), with torch's RNG seeded per (seed, epoch, sample index), so a
                  retry and the reference draw the same.
    scheduler:    ``scheduler(optimizer) -> torch.optim.lr_scheduler.X(optimizer, ...)``, any
                  PyTorch scheduler stepped once per iteration after the optimizer (as
                  ``optimizer.step(); scheduler.step()`` in a plain loop); every task that updates
                  parameters applies iteration t's group hyperparameters (core/schedule.py);
                  each iteration's learning rates are in the metrics (Run.learning_rates()).
    init_from:    pretrained weights to start from: a state_dict of the model (the user's own
                  module's names, e.g. ``run.trained_model().state_dict()``) or the path of a
                  safetensors file of one (``run.save()``'s model.safetensors); every parameter and
                  buffer must be in it, with its shape.
    checkpoint_every: keep a loadable state_dict (safetensors, the user's names) every N
                  iterations, written by the workers (Run.checkpoints(), Run.checkpoint(t); it
                  stays after the run and can start another: init_from=run.checkpoint(t)).
    clip_grad_norm: ``max_norm``: before any update, the gradient of the whole model (every stage,
                  every shard) is scaled as torch.nn.utils.clip_grad_norm_(model.parameters(),
                  max_norm) scales it; the norm per iteration is in the metrics (Run.grad_norms()).
    validation:   a data set like ``train`` evaluated on Lambda (forward only, eval mode) every
                  ``eval_every`` iterations and after the last: the loss and each of ``metrics``
                  ({"name": fn(output, target) -> scalar mean over the batch}, e.g.
                  stagecoach.evaluation.accuracy), as means over the set, in the progress bar,
                  Run.evaluations() and `stagecoach inspect`. ``test`` without ``validation`` is
                  evaluated the same way, after the last iteration.
    iterations:   how many iterations to train; or ``epochs``: passes over the training set
                  (each ``len(train) // global_batch`` iterations; the last partial batch is dropped).
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
    workflow:     the window state machines' type (docs/runtime.md "Express windows"): "standard"
                  (billed per state transition), "express" (billed per request and duration, at
                  most five minutes a window: the windows are sized to fit, with room to spare;
                  refused for a plan whose phases run in groups, past 40 tasks) or "auto" (Express
                  where it fits and the planner predicts it cheaper). The job's own execution stays
                  Standard: it chains the windows and restarts, remediates and stops them.
    phase_watchers: run each window phase beside a phase watcher (docs/reliability.md "The phase
                  watcher"; default True): a hung task costs a fraction of a second past its
                  expected end instead of its Task's whole timeout. False leaves it out (a watcher
                  function less; per iteration two invocations less, and with Standard windows six
                  state transitions less): for a job that prefers the lower bill to faster recovery.
    stop_on_nonfinite_loss: end the job at the iteration boundary after an iteration whose loss
                  is NaN or infinite on any replica (status STOPPED, reason "nonfinite_loss",
                  its checkpoint kept, as ``Run.stop()`` ends it; docs/cost.md "Stopping"), as
                  Lightning's ``EarlyStopping(check_finite=True)`` does. False: train on, the
                  losses reported as NaN (Run.losses(), the progress bar, `stagecoach inspect`).
    """

    model: Callable[[], nn.Module]
    loss: Callable[..., torch.Tensor]
    optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer]
    train: Any  # (inputs, targets) tensors, or a map-style torch Dataset of (input, target) items
    global_batch: int
    iterations: int = None  # type: ignore[assignment]  # or epochs=: set from it in __post_init__
    seed: int = 0
    test: Any = None
    transform: Callable[[Any], Any] | None = None
    epochs: int | None = None
    scheduler: MakeScheduler | None = None
    clip_grad_norm: float | None = None
    init_from: str | os.PathLike[str] | Mapping[str, torch.Tensor] | None = None  # a safetensors file or a state_dict
    checkpoint_every: int | None = None
    validation: Any = None
    eval_every: int | None = None
    metrics: dict[str, Callable[[Any, Any], Any]] | None = None
    dtype: torch.dtype = torch.float32  # torch.bfloat16: mixed precision (core/training.py master_dtype)
    name: str = "job"
    blocks: Sequence[str] | None = None
    deferred_batch_norm: bool = False
    warm_state: bool = True
    stop_on_nonfinite_loss: bool = False
    workflow: str = "standard"
    phase_watchers: bool = True
    _facts: exactness.ModelFacts | None = field(default=None, init=False, repr=False)
    _replica_policy: dynamic.ReplicaPolicy | None = field(default=None, init=False, repr=False)  # run(replicas=policy)
    _samples: LocalSamples | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.iterations is None and isinstance(self.epochs, int) and not isinstance(self.epochs, bool) and self.epochs > 0:
            try:
                steps = len(self.samples) // self.global_batch
            except (JobError, TypeError, ZeroDivisionError):
                return  # validate says what is wrong
            self.iterations = self.epochs * steps

    @property
    def samples(self) -> LocalSamples:
        """The training set as samples (core/samples.py LocalSamples)."""
        if self._samples is None or self._samples.data is not self.train:
            self._samples = _samples(self.train, "train")
        return self._samples

    def head(self, n: int) -> tuple[Any, Any]:
        """The first ``n`` training samples stacked as a worker stacks a micro-batch (transformed
        as in epoch 0, floating inputs in the job's dtype): what the checks run the model on."""
        try:
            x, y = self.samples.batch(torch.arange(n), self.transform, self.seed, 0)
        except TypeError as e:
            raise JobError(str(e)) from None
        return as_dtype(x, self.dtype), y

    def _check_version_lists(self) -> None:
        """The window state machine carries the versions to evaluate and to checkpoint in its
        state, which Step Functions caps at 256 KB (its payload quota, planner/limits.py; checked
        by States.ArrayContains): refuse lists that would take more than a quarter of it."""
        if not (isinstance(self.iterations, int) and self.iterations > 0):
            return
        ok_every = all(
            isinstance(e, int) and not isinstance(e, bool) and e > 0 for e in (self.eval_every, self.checkpoint_every) if e is not None
        )
        if not ok_every:
            return  # their own checks name the bad value
        size = len(json.dumps(self.eval_versions())) + len(json.dumps(self.checkpoint_versions()))
        if size > EXECUTION_INPUT_MAX_BYTES // 4:
            raise JobError(
                f"evaluating every {self.eval_every} and checkpointing every {self.checkpoint_every} of {self.iterations} iterations "
                f"lists {size:,} bytes of versions in the window's state, over a quarter of Step Functions' 256 KB payload: "
                "evaluate and checkpoint less often (larger eval_every / checkpoint_every)"
            )

    def _check_scheduler(self) -> None:
        if self.scheduler is None:
            return
        if not callable(self.scheduler):
            raise JobError(
                f"job.scheduler={self.scheduler!r} is not callable: give lambda optimizer: torch.optim.lr_scheduler.StepLR(optimizer, ...)"
            )
        try:
            opt = stand_in(self.optimizer, None)
            sched = self.scheduler(opt)
        except Exception as e:
            raise JobError(f"job.scheduler fails on the job's optimizer: {type(e).__name__}: {e}") from None
        if isinstance(sched, torch.optim.lr_scheduler.ReduceLROnPlateau):
            raise JobError(
                "job.scheduler is ReduceLROnPlateau, which steps on a measured metric: Stagecoach steps the scheduler once per "
                "iteration from the iteration count alone, so every worker applies the same values; use a schedule of the "
                "iteration (StepLR, CosineAnnealingLR, OneCycleLR, LambdaLR, ...)"
            )
        if not callable(getattr(sched, "step", None)):
            raise JobError(
                f"job.scheduler returned {type(sched).__name__}, which has no step(): return a torch.optim.lr_scheduler scheduler"
            )

    def _check_schedule_length(self) -> None:
        """The scheduler steps through every iteration, as the workers step it (core/schedule.py,
        with the job's parameter groups) and a plain loop would: a schedule shorter than the job
        (OneCycleLR's total_steps) raises past its end, which would fail a task mid-run."""
        if self.scheduler is None:
            return
        groups = self._facts.optimizer_groups if self._facts is not None else None
        schedule = Schedule(self.optimizer, self.scheduler, list(groups.hparams) if groups is not None else None)
        try:
            schedule.at(self.iterations)
        except Exception as e:
            raise JobError(
                f"job.scheduler fails at step {schedule.t + 1} of the job's {self.iterations} iterations ({type(e).__name__}: {e}): "
                f"it is stepped once per iteration, as optimizer.step(); scheduler.step() in a plain loop; give a "
                f"schedule that covers all {self.iterations} iterations (e.g. OneCycleLR(total_steps={self.iterations}))"
            ) from None

    def _check_code(self) -> None:
        """What travels to the workers pickles (cloudpickle, as the upload pickles it), before
        anything is uploaded: a lock, a file or a client held by a function would fail there."""
        try:
            pickle_job_code(self)
        except JobCodeError as e:
            raise JobError(str(e)) from None

    @property
    def evaluation_set(self) -> Any:
        """What the evaluate tasks run on: ``validation``, else ``test``, else None."""
        return self.validation if self.validation is not None else self.test

    def _evaluation_samples(self) -> LocalSamples:
        """The evaluation set as samples, named in errors as the job's field that holds it."""
        return _samples(self.evaluation_set, "validation" if self.validation is not None else "test")

    def checkpoint_versions(self) -> list[int]:
        """The versions (iterations done) kept as loadable state_dicts: every ``checkpoint_every``."""
        if not self.checkpoint_every:
            return []
        return list(range(self.checkpoint_every, self.iterations + 1, self.checkpoint_every))

    def eval_versions(self) -> list[int]:
        """The versions (iterations done) evaluated: every ``eval_every`` and the last."""
        if self.evaluation_set is None:
            return []
        every = self.eval_every or self.iterations
        return sorted({*range(every, self.iterations + 1, every), self.iterations})

    def _check_evaluation(self) -> None:
        if self.eval_every is not None and (
            not isinstance(self.eval_every, int) or isinstance(self.eval_every, bool) or self.eval_every < 1
        ):
            raise JobError(f"job.eval_every={self.eval_every!r}: must be a positive number of iterations")
        if self.eval_every is not None and self.evaluation_set is None:
            raise JobError("job.eval_every is set but there is nothing to evaluate on: give validation= (a data set like train=)")
        if self.metrics is not None:
            bad = [
                k
                for k, fn in self.metrics.items()
                if not isinstance(k, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,39}", k) or not callable(fn)
            ]
            if not isinstance(self.metrics, dict) or bad:
                raise JobError(
                    f"job.metrics: give {{name: fn(output, target) -> scalar}} with names of letters, digits and '_' (got {bad[:1] or self.metrics!r})"
                )
        if self.evaluation_set is not None:
            data = self._evaluation_samples()
            x, y = data.batch(torch.arange(min(4, len(data))))
            model = self.build_model().eval()
            out = as_dtype(x, self.dtype)
            try:
                with torch.no_grad():
                    for block in model:
                        out = block(out)
                    for name, fn in {"loss": self.loss, **(self.metrics or {})}.items():
                        value = fn(out, y)
                        if not (isinstance(value, (int, float)) or (isinstance(value, torch.Tensor) and value.numel() == 1)):
                            raise JobError(
                                f"job.metrics[{name!r}] returned {type(value).__name__}: it must return a scalar (a mean over the batch)"
                            )
            except JobError:
                raise
            except Exception as e:
                raise JobError(f"evaluating the model on the validation set fails: {type(e).__name__}: {e}") from None

    def _check_epochs(self, n: int) -> None:
        if self.epochs is None:
            return
        if not isinstance(self.epochs, int) or isinstance(self.epochs, bool) or self.epochs < 1:
            raise JobError(f"job.epochs={self.epochs!r}: must be a positive integer")
        if self.iterations != self.epochs * (n // self.global_batch):
            raise JobError(
                f"job.iterations={self.iterations} and job.epochs={self.epochs} disagree ({n // self.global_batch} iterations per "
                f"epoch of {n} samples at a global batch of {self.global_batch}): give one of them"
            )

    # -- validation (before any AWS call) --------------------------------------------------------
    def validate(self, plan: Plan | None = None) -> None:
        """Refuse, before anything is deployed, a job (and, if given, a plan) that cannot run or would
        train something other than plain PyTorch (stagecoach.exactness); the error says what to change."""
        self._check_counts()
        self._check_switches()
        samples = self._check_data()
        self._check_epochs(len(samples))
        self._check_evaluation()
        self._check_scheduler()
        self._check_version_lists()
        self._check_checkpoints_and_clipping()
        self._check_callables()
        self._check_lambda_size(plan)  # before anything below builds the model
        sample, labels = self._check_forward(min(4, len(samples)))
        if self.blocks is not None:
            self._check_split(sample, labels)
        try:
            self._facts = exactness.examine(
                self.build_model, self.loss, self.optimizer, sample, labels, self.seed, self.dtype, factory=self.factory
            )
        except exactness.NotExact as e:
            raise JobError(str(e)) from None
        self._check_schedule_length()
        self._check_code()
        if plan is not None:
            self.check_plan(plan)

    def meta_model(self) -> nn.Sequential | None:
        """The model built on the meta device (``torch.device("meta")``: shapes and dtypes, no
        storage) as the workers build their stages, under the job's seed and dtype; None when the
        factory cannot build there (the job's checks then build it for real and name what fails)."""
        try:
            model = stagebuild.build_meta(self.factory, self.seed, self.dtype)
        except Exception:
            return None
        if not isinstance(model, nn.Sequential) or len(model) == 0:
            return None
        # a lazy module's parameters have no shape until a forward pass (_check_lazy names it)
        return None if any(isinstance(p, nn.parameter.UninitializedParameter) for p in model.parameters()) else model

    def _check_lambda_size(self, plan: Plan | None) -> None:
        """Refuse a model too big for Lambda before anything allocates it (a 40 GB layer would fail
        in this machine's allocator first): sized on the meta device, every child's weights,
        gradients and optimizer state (the job's optimizer, stepped on a stand-in) against Lambda's
        10,240 MB per function, naming the smallest stage count that fits (planner/model/fits.py);
        with ``plan``, each of its stages against that limit too."""
        model = self.meta_model()
        if model is None:
            return
        platform = self.runtime_platform(aws_platform())
        ratio = optimizer_state_ratio(self.optimizer)
        if ratio is not None:
            platform = platform.replace(optimizer_state_ratio=ratio)
        profile = state_profile(model, self.name)
        why = lambda_refusal(profile, platform)
        if why is not None:
            raise JobError(why)
        if plan is None or plan.layers != len(profile.layers):
            return  # plan.validate names a balance that does not cover the model
        cap = platform.usable_bytes(max(platform.tiers_mb))
        for s in range(plan.stages):
            need = least_stage_bytes(profile.layers[plan.stage_layers(s).start : plan.stage_layers(s).stop], platform)
            if need > cap:
                raise JobError(
                    f"stage {s} of the plan (layers {plan.stage_layers(s).start}-{plan.stage_layers(s).stop - 1}) needs at least "
                    f"{need / 2**20:,.0f} MB for its weights, gradients and optimizer state, more than the {cap / 2**20:,.0f} MB "
                    f"a stage may use of one Lambda function's 10,240 MB: use at least {smallest_stage_count(profile, platform)} "
                    "stages (the smallest count whose every stage fits), balanced by their parameters"
                )

    def _check_counts(self) -> None:
        """The name (every resource of the job is named after it, within AWS's name limits) and the
        integers the job counts by: checked first, since every later check uses them."""
        if not re.fullmatch(r"[a-z0-9][a-z0-9-]{0,29}", self.name):
            raise JobError(f"job name {self.name!r}: use 1-30 lowercase letters, digits and '-'")
        if self.iterations is None and self.epochs is None:
            raise JobError("job.iterations is missing: give iterations= (how many iterations to train) or epochs= (passes over job.train)")
        for what in ("global_batch", "iterations", "seed"):
            v = getattr(self, what)
            if not isinstance(v, int) or isinstance(v, bool) or v < (0 if what == "seed" else 1):
                raise JobError(f"job.{what}={v!r}: must be a {'non-negative' if what == 'seed' else 'positive'} integer")
        if self.seed >= 2**64:  # torch.manual_seed takes [-2**63, 2**64): every build and draw is seeded by it
            raise JobError(f"job.seed={self.seed}: torch.manual_seed takes seeds below 2**64; give an integer in [0, 2**64)")

    def _check_switches(self) -> None:
        """The settings that choose how the runtime trains (deferred batch norm, warm state, the
        dtype): a value outside their few choices would silently pick one of them."""
        if not isinstance(self.deferred_batch_norm, bool):
            raise JobError(f"job.deferred_batch_norm={self.deferred_batch_norm!r}: must be True or False")
        if not isinstance(self.warm_state, bool):
            raise JobError(f"job.warm_state={self.warm_state!r}: must be True or False")
        if not isinstance(self.stop_on_nonfinite_loss, bool):
            raise JobError(f"job.stop_on_nonfinite_loss={self.stop_on_nonfinite_loss!r}: must be True or False")
        if self.workflow not in WORKFLOWS:
            raise JobError(f"job.workflow={self.workflow!r}: choose one of {', '.join(WORKFLOWS)}")
        if self.dtype not in DTYPE_NAMES:
            raise JobError(
                f"job.dtype={self.dtype}: use torch.float32, torch.float64, or torch.bfloat16 (mixed precision: bf16 compute "
                "and transfers, float32 master weights and optimizer state)"
            )

    def _check_data(self) -> LocalSamples:
        """The training and test sets are data sets a worker can read by sample, one global batch
        fits the training set, and the transform can be applied: returns the training samples."""
        samples = self.samples
        # every item read once, as the upload reads them: what only a worker would trip on
        for data in [samples, *(_samples(d, w) for d, w in ((self.validation, "validation"), (self.test, "test")) if d is not None)]:
            try:
                data.check_all()
            except TypeError as e:
                raise JobError(str(e)) from None
        if self.global_batch > len(samples):
            raise JobError(
                f"global batch {self.global_batch} is larger than the training set ({len(samples)} samples): use a smaller global batch"
            )
        if self.transform is not None and not callable(self.transform):
            raise JobError(f"job.transform={self.transform!r} is not callable: give a function input -> input, applied per sample")
        return samples

    def _check_checkpoints_and_clipping(self) -> None:
        """``checkpoint_every`` and ``clip_grad_norm``, the optional numbers the workers act on every
        iteration (a version list, a barrier): refused here rather than inside a running job."""
        if self.checkpoint_every is not None and (
            not isinstance(self.checkpoint_every, int) or isinstance(self.checkpoint_every, bool) or self.checkpoint_every < 1
        ):
            raise JobError(f"job.checkpoint_every={self.checkpoint_every!r}: must be a positive number of iterations")
        if self.clip_grad_norm is not None and (
            isinstance(self.clip_grad_norm, bool) or not isinstance(self.clip_grad_norm, (int, float)) or not self.clip_grad_norm > 0
        ):
            raise JobError(f"job.clip_grad_norm={self.clip_grad_norm!r}: give the largest gradient norm, a positive number (e.g. 1.0)")

    def _check_callables(self) -> None:
        """The model, loss and optimizer are functions (a module or optimizer instance given in place
        of its factory is the usual mistake): the error says what each must be."""
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

    def _check_forward(self, n: int) -> tuple[Any, torch.Tensor]:
        """The model's blocks run one after another on the first ``n`` samples, each passing on what
        may cross a stage boundary, and the loss makes a scalar of the output: the first error names
        the block. Returns the samples and labels the exactness checks run on; the model built here
        is gone on return (they build their own: one paper-scale model at a time)."""
        model = self.build_model()
        sample, labels = self.head(n)
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
            loss = self.loss(out, labels)
        except Exception as e:
            raise JobError(f"job.loss fails on the model's output and the labels: {e}") from None
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise JobError("job.loss must return a scalar tensor (a mean over the batch)")
        if not bool(torch.isfinite(loss)):
            raise JobError(self._not_finite(n, float(loss)))
        return sample, labels

    def _not_finite(self, n: int, loss: float) -> str:
        """Why the loss of the first ``n`` samples is not finite, for the refusal: the exactness
        checks compare values on them (a NaN equals nothing), and training would be NaN from the
        first iteration that reads them."""
        for i in range(n):
            for part, name in zip(self.samples[i], ("input", "target")):
                bad = [t for t in boundary.leaves(part) if t.is_floating_point() and not bool(torch.isfinite(t).all())]
                if bad:
                    what = "NaN" if bool(bad[0].isnan().any()) else "an infinity"
                    return (
                        f"job.train[{i}]'s {name} holds {what}, so the loss of the first {n} samples is {loss}: training would "
                        "be NaN, and the checks that decide exactness run on these samples. Clean or impute the data "
                        "(e.g. torch.nan_to_num), or replace NaN inside the model's first block"
                    )
        return (
            f"the loss of the first {n} samples of job.train is {loss} (their inputs and targets are finite): the model's output "
            "or job.loss overflows or divides by zero on them, so training would not be finite; check the model's "
            "initialisation and the loss (e.g. log of 0)"
        )

    def _check_split(self, x: Any, y: torch.Tensor) -> None:
        """The chain cut at ``blocks`` computes what job.model() itself does (exactness.check_split)."""
        chain = self.build_model()
        assert isinstance(chain, Blocks)
        user = build_model(self.model, self.seed, self.dtype)
        if self.init_from is not None:  # the chain starts from them too
            self._load_initial(user)
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
        norms = tracked_norms(list(self.build_model()), 0) if hap.HAP_SYNC in plan.sync else {}
        if norms:  # HAP, asked for by name: as stagecoach.reference_hap.check_hap_job refuses
            raise JobError(
                f"sync {hap.HAP_SYNC!r}: HAP's stale replicas would update running statistics at an older parameter version "
                f"({', '.join(sorted(norms))}): use a model without BatchNorm running statistics (track_running_stats=False, "
                "or GroupNorm/LayerNorm), or sync 'k_reduce'"
            )

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
        # one sample as the model sees it (transformed: a crop may change its shape)
        x = self.head(1)[0] if self.transform is not None else _first_input(self.samples)
        if not isinstance(x, torch.Tensor):
            raise JobError(
                f"job.train's inputs are {type(x).__name__}: a model cut at blocks= takes one tensor per sample; "
                "give tensors, or write the model as an nn.Sequential whose first block takes the structure"
            )
        return SplitFactory(self.model, tuple(self.blocks), tuple(x.shape[1:]), x.dtype, self.dtype)

    def build_model(self, dtype: torch.dtype | None = None) -> nn.Sequential:
        """The model at its initial parameters, as a chain of blocks: the factory run under the
        job's seed, in the job's dtype (``dtype``: another, e.g. the master weights' float32 of a
        bfloat16 job)."""
        try:
            model = build_model(self.factory if dtype is None else self._factory_in(dtype), self.seed, dtype or self.dtype)
        except SplitError as e:
            self._check_lazy_before_split()
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
        self._check_lazy(model)
        if self.init_from is not None:
            self._load_initial(model)
        return model

    def _check_lazy(self, model: nn.Module) -> None:
        """No lazy module (nn.LazyLinear, ...) is left uninitialised: its parameters get their
        shapes at its first forward pass, which every container would otherwise reach only after
        loading the parameters it has no shapes for. torch's docs advise a dry run after building."""
        lazy = next((m for m in model.modules() if isinstance(m, nn.modules.lazy.LazyModuleMixin) and m.has_uninitialized_params()), None)
        if lazy is None:
            return
        x = self.samples[0][0]
        dry = f"model(torch.zeros(1, {', '.join(map(str, x.shape))}))" if isinstance(x, torch.Tensor) else "model(one_sample_batch)"
        raise JobError(
            f"job.model() builds a {type(lazy).__name__} whose parameters are uninitialized until a first forward pass: "
            "every container must build them with their shapes before loading the trained values. Materialise them in "
            f"the factory with a dry run, as torch's docs advise (model = Net(); {dry} under torch.no_grad(); return "
            "model), or give the layer its input size (nn.Linear(in_features, ...))"
        )

    def _check_lazy_before_split(self) -> None:
        """A model cut at ``blocks`` that torch.export could not capture: if it holds an
        uninitialised lazy module, that is the reason to give (``_check_lazy``)."""
        try:
            model = build_model(self.model, self.seed, self.dtype)
        except Exception:
            return  # the split's own error says why
        self._check_lazy(model)

    def _initial_state(self) -> Mapping[str, torch.Tensor]:
        """``init_from`` as a state_dict (read from its file if it is a path)."""
        source = self.init_from
        if isinstance(source, (str, os.PathLike)):
            path = os.fspath(source)
            try:
                source = load_file(path)
            except Exception as e:
                raise JobError(f"job.init_from={path!r} is not a readable safetensors file: {e}") from None
        if not isinstance(source, Mapping) or not all(isinstance(v, torch.Tensor) for v in source.values()):
            raise JobError("job.init_from: give a state_dict (name -> tensor) or the path of a safetensors file of one")
        return source

    def _load_initial(self, model: nn.Module) -> None:
        """``init_from``'s values into the model's parameters and buffers, by the user's names
        (a chain cut at ``blocks`` holds them under those names too)."""
        source = self._initial_state()
        target = model.original_state_dict(keep_vars=True) if isinstance(model, Blocks) else model.state_dict(keep_vars=True)
        source = _with_aliases(source, target)
        missing, extra = sorted(set(target) - set(source)), sorted(set(source) - set(target))
        if missing or extra:
            raise JobError(
                f"job.init_from does not fit the model: missing {missing[:5]}{' ...' if len(missing) > 5 else ''}, "
                f"unexpected {extra[:5]}{' ...' if len(extra) > 5 else ''}: give the state_dict of job.model()'s own module"
            )
        bad = [k for k in target if tuple(source[k].shape) != tuple(target[k].shape)]
        if bad:
            raise JobError(
                f"job.init_from[{bad[0]!r}] has shape {tuple(source[bad[0]].shape)}, the model's is {tuple(target[bad[0]].shape)}"
            )
        with torch.no_grad():
            for k, t in target.items():
                t.copy_(source[k].to(t.dtype))

    def _factory_in(self, dtype: torch.dtype) -> Callable[[], nn.Module]:
        factory = self.factory
        return dataclasses.replace(factory, dtype=dtype) if isinstance(factory, SplitFactory) else factory

    def user_model(self, blocks: nn.Sequential) -> nn.Module:
        """The model as the user wrote it, holding ``blocks``' parameters and buffers (for a job
        without ``blocks``, the chain itself): what a trained run hands back."""
        return blocks.user_module(self.model, self.seed, self.dtype) if isinstance(blocks, Blocks) else blocks

    @property
    def flows(self) -> list[Flow] | None:
        """The named values crossing the blocks' boundaries of a model cut at ``blocks`` (each goes
        straight from the stage computing it to the stages reading it); None for an nn.Sequential."""
        return list(self.facts.flows) if self.facts.flows is not None else None

    @property
    def layers(self) -> int:
        """Blocks of the model: the units a plan's balance counts (a module used twice counts twice)."""
        return self.facts.blocks

    # -- running ---------------------------------------------------------------------------------
    def run(
        self,
        plan: Plan | None = None,
        backend: Backend | str | None = None,
        reserve_concurrency: bool = False,
        max_cost: float | None = None,
        **manual: Unpack[ManualPlan],
    ) -> Run:
        """Deploy and start the job; returns a Run to wait on and inspect.

        ``plan``: a Plan; else a manual one from ``stages``, ``replicas``, ``micro_batches``,
        ``memory_mb``, ``sync``, ``aggregators`` and ``fan_in`` (defaults: one stage, one replica,
        one micro-batch, scatter-reduce; see ``manual_plan``). ``reserve_concurrency``: reserve each
        stage function the concurrency its tasks need (twice its most tasks at once, for a window
        restart; 2 per function when every worker has its own), so other functions of the account
        cannot starve a phase of its workers. ``max_cost``: USD; the job stops at the last
        iteration boundary before its measured cost would pass it, keeping its checkpoint (the engine
        checks it, whether or not a client watches: docs/cost.md).
        """
        check_max_cost(max_cost)
        self.validate()
        job = self
        if plan is None and dynamic.wants_schedule(manual):  # dynamic workers (sdk/dynamic.py)
            plan = dynamic.manual_scheduled_plan(self, manual, self.manual_plan)
            job = dynamic.with_policy(self, manual.get("replicas"))  # a policy ships with the job's code
        plan = self.as_run(plan if plan is not None else self.manual_plan(**manual))  # type: ignore[arg-type, misc]  # replicas: an int here
        plan.validate(layers=self.layers)
        if plan.plan_at(0).global_batch != self.global_batch:  # a growing batch starts at the job's
            raise PlanError(f"plan.global_batch={plan.plan_at(0).global_batch} differs from job.global_batch={self.global_batch}")
        self.check_plan(plan)
        for _, segment in plan.segments:  # each segment's d is checked as a plan of its own would be
            self.check_plan(segment)
        dynamic.check_scheduled(self, plan)
        dynamic.check_policy_run(job, plan, max_cost)
        backend = get_backend(backend)
        plan = learnt.refine(plan, self.name, backend.clients.s3, backend.resources.bucket)
        return backend.launch(job, plan, reserve_concurrency=reserve_concurrency, max_cost_usd=max_cost)

    def as_run(self, plan: Plan) -> Plan:
        """``plan`` as this job runs it: without phase watchers when the job leaves them out
        (``phase_watchers``), which changes its functions, its windows and their cost."""
        return plan if self.phase_watchers else dataclasses.replace(plan, phase_watchers=False)

    def predict(self, plan: Plan, platform: Platform | None = None) -> Estimate:
        """The performance model's estimate of one iteration of ``plan`` on AWS (or ``platform``),
        for any plan, the planner's or one written by hand: the model's layers are timed here at
        the plan's micro-batch size (one thread = one vCPU), as ``plan()`` times them. A replica
        schedule (``plan.segments``) has no one iteration: ``predict_schedule`` predicts each segment's."""
        dynamic.check_no_policy(plan)
        if plan.segments:
            raise PlanError(
                "plan has segments (a replica schedule): its iterations differ by segment; Job.predict_schedule(plan) "
                "estimates each segment's, Job.predict_cost(plan) the whole run's cost"
            )
        return evaluate(*self._model_of(plan, platform))

    def predict_schedule(self, plan: Plan, platform: Platform | None = None) -> list[dynamic.ScheduleSegment]:
        """Each segment of a replica schedule (``plan.segments``; a fixed plan is one segment) as
        the performance model predicts it, on AWS (or ``platform``): its first iteration and
        iterations, d, global batch, micro-batch size, one iteration's Estimate as ``predict``
        gives an ordinary plan's, and what the change to it adds (sdk/dynamic.py ScheduleSegment)."""
        plan = self.as_run(plan)
        return dynamic.predict_schedule(plan, self.iterations, lambda p: self._model_of(p, platform))

    def predict_cost(
        self, plan: Plan, platform: Platform | None = None, capped: bool = False, workflow: str | None = None
    ) -> costs.CostReport:
        """The whole run's predicted cost on AWS (or ``platform``): its iterations (``predict``),
        and the evaluations and checkpoints the job asks for (planner/model/passes.py), each
        per phase as ``Run.cost()`` measures it. ``capped``: the job runs under a cost cap,
        whose gate reads the iteration's metrics (docs/cost.md). ``workflow``: the windows' type
        (default: the plan's, else the job's; ``window_choice``). A replica schedule's: the sum of
        its segments' (docs/runtime.md "Dynamic workers")."""
        plan = self.as_run(plan)
        dynamic.check_no_policy(plan)
        if plan.segments:  # a replica schedule: each segment predicted as an ordinary plan for its iterations
            dynamic.check_predictable(self, plan, workflow)
            length, saves, parts = self.window_choice(plan, platform, workflow).window_length, self.checkpoint_versions(), []
            for first, end, seg in segment_bounds(plan, self.iterations):
                profile, cfg, runtime = self._model_of(seg, platform)
                ck = checkpoint_pass(profile, cfg, runtime) if saves else None
                parts.append(costs.SegmentCost(first, end - first, seg, evaluate(profile, cfg, runtime), ck))
            return costs.predict_schedule(parts, self.iterations, runtime, length, capped=capped, saves=saves)
        profile, cfg, platform = self._model_of(plan, platform)
        evals, saves = self.eval_versions(), self.checkpoint_versions()
        samples = len(self._evaluation_samples()) if evals else 0
        estimate = evaluate(profile, cfg, platform)
        ev = evaluate_pass(profile, cfg, platform, samples) if evals else None
        ck = checkpoint_pass(profile, cfg, platform) if saves else None
        choice = self._choose(plan, platform, workflow, estimate, [p for p in (ev, ck) if p is not None])
        windows = costs.WindowRun(choice.workflow, choice.window_length, choice.memory_mb)
        return costs.predict(
            plan, estimate, self.iterations, platform, capped=capped, evals=evals, saves=saves, evaluate=ev, checkpoint=ck, windows=windows
        )

    def window_choice(self, plan: Plan, platform: Platform | None = None, workflow: str | None = None) -> WorkflowChoice:
        """How the job's windows run (planner/emit/workflow.py): ``workflow`` or the plan's or the
        job's, for "auto" and "express" from the predicted seconds of an iteration, with an
        evaluation and a checkpoint pass as a bound if the job has them. Refuses an "express" that
        cannot run."""
        plan = self.as_run(plan)
        requested = workflow or plan.workflow or self.workflow
        if requested == "standard":
            return self._choose(plan, platform or aws_platform(), requested, None, [])
        profile, cfg, platform = self._model_of(plan, platform)
        passes = [checkpoint_pass(profile, cfg, platform)] if self.checkpoint_versions() else []
        if self.eval_versions():
            passes.append(evaluate_pass(profile, cfg, platform, len(self._evaluation_samples())))
        return self._choose(plan, platform, requested, evaluate(profile, cfg, platform), passes)

    def _choose(
        self, plan: Plan, platform: Platform, workflow: str | None, estimate: Estimate | None, passes: Sequence[PassEstimate]
    ) -> WorkflowChoice:
        requested = workflow or plan.workflow or self.workflow
        seconds = None
        if estimate is not None:
            seconds = (plan.prediction.s_per_iteration if plan.prediction else estimate.time_s) + sum(
                max(p.task_s, default=0.0) for p in passes
            )
        evals, saves = self.eval_versions(), self.checkpoint_versions()
        return choose_workflow(requested, plan, self.iterations, seconds, platform, evals=evals, saves=saves)

    def _model_of(self, plan: Plan, platform: Platform | None) -> tuple[ModelProfile, Config, Platform]:
        """What the performance model evaluates ``plan`` from: the model's layers timed here at the
        plan's micro-batch size, the plan as a Config, and the platform as this job uses it."""
        if plan.segments:  # a replica schedule's d per segment (planner/segments.py): not one Config
            raise PlanError(
                "a replica schedule (plan.segments) is not one Config: Job.predict_schedule(plan) predicts each segment, "
                "Job.predict_cost(plan) the run's cost"
            )
        if hap.HAP_SYNC in plan.sync:  # its non-aggregators' stale reads and unequal cut are not in the model
            raise PlanError(
                f"predicting sync={hap.HAP_SYNC!r} is not supported: FasDL's own time model for it is "
                "stagecoach.planner.baselines.fasdl.hap_prediction; a run's measured cost is Run.cost()"
            )
        platform = self.runtime_platform(platform or aws_platform())
        sample = boundary.map_leaves(lambda t: t[0], self.head(1)[0])  # as plan() times it: any data set, numpy too
        b = plan.micro_batch_size
        profile = self.with_job_bytes(measure_model(self.build_model(), sample, micro_batch_sizes=(b,), name=self.name))
        choices = tuple(
            SyncChoice("none", 1) if plan.replicas == 1 else SyncChoice(a, k, f, c)
            for a, k, f, c in zip(plan.sync, plan.aggregators, plan.fan_in, plan.chunks)
        )
        cfg = Config(tuple(plan.balance), tuple(plan.memory_mb), plan.replicas, b, plan.micro_batches, choices)
        return profile, cfg, platform

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
        platform = self.runtime_platform(platform or aws_platform())
        if profile_on is not None:
            tiers = tuple(tiers or (1024, 2048, 4096, 10240))
            profile = profile_tiers(self, get_backend(profile_on), tiers=tiers)
            platform = platform.replace(tiers_mb=tuple(sorted(tiers)))
        else:
            sample = boundary.map_leaves(lambda t: t[0], self.head(1)[0])
            # the sizes planned are the sizes timed (one rule with `stagecoach plan`)
            coupled = self.facts.batch_coupling is not None  # BatchNorm cannot run one sample in train mode
            sizes = tuple(b for b in options.get("micro_batch_sizes") or default_micro_batch_sizes(coupled) if b > 1 or not coupled) or (2,)
            profile = measure_model(self.build_model(), sample, micro_batch_sizes=sizes, name=self.name)
        if exactness.split_batch_refusal(self.facts, self.deferred_batch_norm):
            # only plans that keep the global batch together train this job exactly (check_plan)
            options.setdefault("replicas", (1,))
            options.setdefault("micro_batch_sizes", (self.global_batch,))
        else:  # deferred batch norm: micro-batches of at least two samples
            options.setdefault("micro_batch_sizes", default_micro_batch_sizes(self.facts.batch_coupling is not None))
        return plan_model(self.with_job_bytes(profile), self.global_batch, platform=platform, **options)

    def runtime_platform(self, platform: Platform) -> Platform:
        """``platform`` as this job's runtime uses it: without warm state (``warm_state=False``)
        every iteration loads and stores the parameters and optimizer state, which the model
        charges with ``warm_checkpoint_every`` = 0 (docs/performance-model.md §5)."""
        return platform if self.warm_state else platform.replace(warm_checkpoint_every=0)

    def with_job_bytes(self, profile: ModelProfile) -> ModelProfile:
        """``profile`` with what the job adds to the model's own bytes: what every container
        allocates to build its stage (nothing beyond the stage when it builds on the meta device,
        the whole model when the factory needs the full build: exactness.meta_build_refusal;
        ModelProfile.build_bytes), and the training set's bytes as stored, by which the planner
        knows whether workers keep it or read it by sample (ModelProfile.data_bytes); and whether
        the job clips its gradient norm (a barrier the performance model charges)."""
        first = self.samples[0]
        data = float(len(self.samples) * sum(len(encode(part)) for part in first))
        clip = self.clip_grad_norm is not None
        ratio = torch.empty(0, dtype=master_dtype(self.dtype)).element_size() / torch.empty(0, dtype=self.dtype).element_size()
        profile = dataclasses.replace(profile, master_ratio=ratio)
        if self.facts.full_build is None:
            return dataclasses.replace(profile, data_bytes=data, clip_grad_norm=clip)
        model = self.build_model()
        whole = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
        return dataclasses.replace(profile, build_bytes=float(whole), data_bytes=data, clip_grad_norm=clip)

    def manual_plan(
        self,
        stages: int = 1,
        replicas: int = 1,
        micro_batches: int = 1,
        memory_mb: int = 1024,
        timeout_s: int = 300,
        sync: str | Sequence[str] | None = None,
        aggregators: int | Sequence[int] | None = None,
        fan_in: int | Sequence[int] | None = None,
        hap_extra: int = 0,
    ) -> Plan:
        """A plan with layers split evenly. ``sync``: one algorithm for every stage or one per stage
        (planner/plan.py SYNC_ALGORITHMS); ``aggregators``: K for k_reduce or hierarchical (one, or
        one per stage); ``fan_in``: a hierarchical stage's replicas per level-1 aggregator (one, or
        one per stage; 2..MAX_FAN_IN, default DEFAULT_FAN_IN in planner/plan.py), which also sets
        that stage's default K, min(d, fan_in); ``hap_extra``: with sync "k_reduce_hap", each
        non-aggregator's samples beyond an aggregator's (planner/hap.py). Plan checks each and names the fix."""
        return Plan(
            balance=even_balance(self.layers, stages),
            replicas=replicas,
            micro_batches=micro_batches,
            global_batch=self.global_batch,
            sync=(sync,) * stages if isinstance(sync, str) else tuple(sync or ()),
            aggregators=(aggregators,) * stages if isinstance(aggregators, int) else tuple(aggregators or ()),
            fan_in=(fan_in,) * stages if isinstance(fan_in, int) else tuple(fan_in or ()),
            hap_extra=hap_extra,
            memory_mb=(memory_mb,) * stages,
            timeouts_s=tuple({p: timeout_s for p in PHASES} for _ in range(stages)),
        )


def check_max_cost(max_cost: float | None) -> None:
    """A cost cap must be a positive number of US dollars."""
    if max_cost is None:
        return
    if isinstance(max_cost, bool) or not isinstance(max_cost, (int, float)) or not (0 < max_cost < float("inf")):
        raise JobError(f"max_cost={max_cost!r}: give a positive number of US dollars, e.g. max_cost=0.50")


def _with_aliases(source: Mapping[str, torch.Tensor], target: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    """``source`` with a value for every name of a tensor the model holds under several (tied
    weights) that it gives under one of them — safetensors' save_model (Hugging Face's files)
    keeps a tied tensor once. Refuses names of one tensor given different values."""
    names: dict[int, list[str]] = {}
    for k, t in target.items():
        names.setdefault(id(t), []).append(k)
    out = dict(source)
    for group in (g for g in names.values() if len(g) > 1):
        given = [k for k in group if k in source]
        for k in given[1:]:
            if source[k].shape != source[given[0]].shape or not torch.equal(source[k], source[given[0]]):
                raise JobError(
                    f"job.init_from gives {given[0]!r} and {k!r} different values, but they are one tensor in the model "
                    "(tied weights): give one value for both"
                )
        for k in group:
            if given:
                out.setdefault(k, source[given[0]])
    return out


def _first_input(samples: LocalSamples) -> Any:
    """Sample 0's input as a batch of one, without copying it (a view of the tensors)."""
    try:
        return boundary.map_leaves(lambda t: t.unsqueeze(0), samples[0][0])
    except TypeError as e:
        raise JobError(str(e)) from None


def _samples(data: Any, what: str) -> LocalSamples:
    try:
        samples = LocalSamples(data, what)
    except TypeError as e:
        raise JobError(str(e)) from None
    if len(samples) == 0:
        raise JobError(f"job.{what} is empty: give at least one sample")
    return samples
