"""Upload what the workers read: the data set (content-addressed), the model code, the plan and
the initial parameters in the plan's shard and chunk layout."""

from __future__ import annotations

import inspect
import sys
import sysconfig
import time
from types import ModuleType
from typing import TYPE_CHECKING

import cloudpickle
import torch
from safetensors.torch import save as st_save

from stagecoach.core import keys, versions
from stagecoach.core.records import DatasetRef, EvalSpec, JobSpec
from stagecoach.core.samples import LocalSamples
from stagecoach.core.stagebuild import stage_buffers
from stagecoach.core.stored_layout import stored_layout
from stagecoach.core.training import DTYPE_NAMES, flat_params, master_dtype, ownership, running_stats, stage_writes_through
from stagecoach.deploy.dataset import upload_samples
from stagecoach.deploy.resources import Clients, StackResources
from stagecoach.deploy.roles import grant_datasets
from stagecoach.errors import StagecoachError
from stagecoach.planner.plan import Plan

if TYPE_CHECKING:
    from stagecoach.job import Job


def _safetensors(tensors: dict[str, torch.Tensor]) -> bytes:
    return st_save({k: v.contiguous() for k, v in tensors.items()})


def _user_modules(*objs: object) -> list[ModuleType]:
    """Modules of the user's callables that workers cannot import (scripts, tests, notebooks)."""

    site = sysconfig.get_paths()["purelib"]
    out = []
    for obj in objs:
        mod = inspect.getmodule(obj) or inspect.getmodule(type(obj))
        if mod is None or mod.__name__ == "__main__" or mod.__name__.split(".")[0] in ("torch", "stagecoach", "builtins"):
            continue
        path = getattr(mod, "__file__", None) or ""
        if not path.startswith(site) and not path.startswith(sys.base_prefix) and mod not in out:
            out.append(mod)
    return out


def _evaluation(job: Job, c: Clients, res: StackResources) -> EvalSpec | None:
    """Upload the validation set (or the test set) and say which versions to evaluate."""
    data = job.evaluation_set
    if data is None:
        return None
    samples = LocalSamples(data, "validation")
    ds_id = upload_samples(c.s3, res.bucket, samples, progress=sys.stderr.isatty(), what="validation")
    return EvalSpec(
        dataset=DatasetRef(id=ds_id, n_train=len(samples)),
        versions=job.eval_versions(),
        metrics=list(job.metrics or {}),
        every=job.eval_every,
    )


class JobCodeError(StagecoachError, TypeError):
    """A function of the job cannot be pickled to travel to the workers; the message names it."""


def pickle_job_code(job: Job) -> bytes:
    """cloudpickle the model factory, loss and optimizer; user code ships by value, not by import.
    Raises JobCodeError naming the field that cannot be pickled (Job.validate calls this first)."""
    modules = _user_modules(
        job.model,
        job.loss,
        job.optimizer,
        *([job.transform] if job.transform else []),
        *(job.metrics or {}).values(),
        *([job.scheduler] if job.scheduler else []),
        *([job._replica_policy.choose] if job._replica_policy else []),
    )
    for m in modules:
        cloudpickle.register_pickle_by_value(m)
    code: dict[str, object] = {
        "model": job.factory,
        "loss": job.loss,
        "optimizer": job.optimizer,
        "transform": job.transform,
        "metrics": job.metrics,
        "scheduler": job.scheduler,
        "replica_policy": job._replica_policy,  # Job.run(replicas=policy): the gate calls it (lambdas/gate.py)
    }
    try:
        body: bytes = cloudpickle.dumps(code)  # cloudpickle ships no type information
        return body
    except Exception as e:
        raise JobCodeError(_unpicklable(code, e)) from None
    finally:
        for m in modules:
            cloudpickle.unregister_pickle_by_value(m)


def _unpicklable(code: dict[str, object], error: Exception) -> str:
    """Which of the job's functions cannot be pickled, and what to do."""
    field = "code"
    for name, value in code.items():
        try:
            cloudpickle.dumps(value)
        except Exception:
            field = name
            break
    return (
        f"job.{field} cannot be pickled to travel to the workers ({type(error).__name__}: {error}): it, or something it "
        "refers to (a closure's variable, a global of its module), holds an object pickle cannot copy (a lock, an open "
        "file, a client, a generator). Use a module-level function or a class whose state is plain values and tensors, "
        "and create such objects inside the function"
    )


def upload_job(
    job: Job, plan: Plan, res: StackResources, c: Clients, job_id: str, window_length: int | None, window_state_machine: str | None
) -> JobSpec:
    """Upload what the workers read: the data set, the model code, the plan and the initial
    parameters (version 0, in the plan's shard and chunk layout), and grant the job's role its data
    sets (deploy/roles.py grant_datasets). Returns the job's spec (the
    caller writes it last: its presence means the job is complete)."""
    code = pickle_job_code(job)  # before any upload: code that cannot travel fails here (Job.validate checks it first)
    samples = job.samples
    ds_id = upload_samples(c.s3, res.bucket, samples, progress=sys.stderr.isatty())
    evaluation = _evaluation(job, c, res)
    # the job's workers read these data sets and no other (deploy/roles.py): granted now, before the
    # code, parameters and functions, so IAM propagates the grant meanwhile
    grant_datasets(res, c, job_id, [ds_id] + ([evaluation.dataset.id] if evaluation else []))
    groups = job.facts.optimizer_groups  # the workers apply each parameter group's own hyperparameters
    model = job.build_model()
    master = job.build_model(master_dtype(job.dtype)) if master_dtype(job.dtype) != job.dtype else model  # fp32 under bf16
    own = ownership(list(master), [plan.stage_layers(s) for s in range(plan.stages)])
    # the stored (master) parameters each stage owns: a parameter shared with an earlier stage is that stage's
    flats = [flat_params(own.owned[s]) for s in range(plan.stages)]
    spec = JobSpec(
        job=job_id,
        name=job.name,
        seed=job.seed,
        iterations=job.iterations,
        global_batch=job.global_batch,
        dtype=DTYPE_NAMES[job.dtype],
        layers=job.layers,
        dataset=DatasetRef(id=ds_id, n_train=len(samples)),
        plan=plan.to_dict(),
        created=time.time(),
        window_length=window_length,
        window_state_machine=window_state_machine,
        build="full" if job.facts.full_build else "meta",
        full_build_reason=job.facts.full_build,
        optimizer_groups=list(groups.hparams) if groups is not None else None,
        param_groups=list(groups.of_param) if groups is not None else None,
        deferred_batch_norm=job.deferred_batch_norm,
        flows=job.flows,
        evaluation=evaluation,
        clip_grad_norm=float(job.clip_grad_norm) if job.clip_grad_norm is not None else None,
        init_from=job.init_from is not None,
        checkpoint_every=job.checkpoint_every,
        optimizer_state=versions.optimizer_keeps_state(job.optimizer),
        warm_state=job.warm_state,
        write_through=[stage_writes_through(f.numel(), f.element_size(), plan.grad_shards(s), plan.replicas) for s, f in enumerate(flats)],
        stop_on_nonfinite_loss=job.stop_on_nonfinite_loss,
    )
    c.s3.put_object(Bucket=res.bucket, Key=keys.job_code(job_id), Body=code)
    c.s3.put_object(Bucket=res.bucket, Key=keys.plan(job_id), Body=plan.to_json().encode())
    for s in range(plan.stages):
        flat = flats[s]
        for k, chunks in enumerate(stored_layout(plan, s, flat.numel(), flat.element_size())):  # every segment's chunks
            for ci, (a, b) in enumerate(chunks):
                c.s3.put_object(Bucket=res.bucket, Key=keys.params(job_id, 0, s, k, ci), Body=_safetensors({"p": flat[a:b]}))
        # a container that builds only its stage on the meta device has no values for its buffers
        # (BatchNorm's running statistics, positional tables...): the factory's, from this build
        layers, first = [model[i] for i in plan.stage_layers(s)], plan.stage_layers(s).start
        buffers = stage_buffers(layers, first)
        if (spec.build == "meta" or spec.init_from) and buffers:
            c.s3.put_object(Bucket=res.bucket, Key=keys.initial_buffers(job_id, s), Body=_safetensors(buffers))
        # version 0 of the running statistics, as every later version is stored: a task of
        # iteration 0 that updated them and failed, retried in the same container, reloads them
        stats = running_stats(layers, first)
        if stats:
            c.s3.put_object(Bucket=res.bucket, Key=keys.buffers(job_id, 0, s), Body=_safetensors(stats))
    return spec
