"""A run's TensorBoard event files, so ``tensorboard --logdir stagecoach-runs`` shows every run
saved there (each run's folder is a TensorBoard run, named by its job id).

Written with PyTorch's own ``torch.utils.tensorboard.SummaryWriter``, the writer PyTorch users
already read, from what the run recorded in S3 (task metrics, evaluation records, histories):
nothing extra is measured for it. Steps count iterations done (the step after iteration t is
t + 1, as the optimizer steps count them), so an evaluation at version v sits on the same step as
the training loss that produced it; each point carries the wall time its iteration ended.

Tags:
- ``train/loss``: the global batch's mean loss (NaN when a replica's was);
- ``train/lr`` (``train/lr/group{i}`` with several parameter groups), ``train/grad_norm`` (under
  clipping): what the updating tasks recorded;
- ``eval/loss`` and ``eval/{metric}``: the validation set's means (Job.evaluation);
- ``time/{forward,backward,sync}_s`` and ``time/iteration_s``: each phase's span (first start to
  last end) and the iteration's;
- ``cost/tasks_usd``: the tasks' cumulative Lambda and S3 cost per step; ``cost/measured_usd``
  and its parts ``cost/lambda_usd``, ``cost/step_functions_usd``, ``cost/s3_usd`` at the last step
  (transitions are known per execution, not per iteration).
"""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING, Any

from stagecoach.core.cost import Usage, task_usage
from stagecoach.core.records import TaskMetrics

if TYPE_CHECKING:
    from stagecoach.run import Run

__all__ = ["write_summaries"]

TRAINING_PHASES = ("forward", "backward", "sync")


def write_summaries(run: Run, logdir: str) -> str:
    """Write the run's scalars as TensorBoard event files in ``logdir``; returns ``logdir``."""
    # imported here (heavy: tensorboard and protobuf, ~1-2 s): only a save writes events
    from torch.utils.tensorboard import SummaryWriter

    by_t = _training_tasks(run.metrics(), run.iterations_done())
    ends = {t: max(m.end for m in ms) for t, ms in by_t.items()}
    with SummaryWriter(log_dir=logdir) as w:
        _training(w, run, ends)
        _phases(w, by_t, ends)
        _evaluations(w, run, ends)
        _cost(w, run, by_t, ends)
    return logdir


def _training_tasks(metrics: list[TaskMetrics], done: int) -> dict[int, list[TaskMetrics]]:
    """The finished iterations' training tasks (evaluate and checkpoint tasks are left out)."""
    out: dict[int, list[TaskMetrics]] = defaultdict(list)
    for m in metrics:
        if m.phase in TRAINING_PHASES and m.t < done:
            out[m.t].append(m)
    return dict(out)


def _training(w: Any, run: Run, ends: dict[int, float]) -> None:
    for t, loss in enumerate(run.losses()):
        w.add_scalar("train/loss", loss, t + 1, walltime=ends.get(t))
    for t, groups in enumerate(run.learning_rates()):
        for i, lr in enumerate(groups):
            w.add_scalar("train/lr" if len(groups) == 1 else f"train/lr/group{i}", lr, t + 1, walltime=ends.get(t))
    for t, norm in enumerate(run.grad_norms()):
        w.add_scalar("train/grad_norm", norm, t + 1, walltime=ends.get(t))


def _phases(w: Any, by_t: dict[int, list[TaskMetrics]], ends: dict[int, float]) -> None:
    for t, ms in sorted(by_t.items()):
        for phase in TRAINING_PHASES:
            pm = [m for m in ms if m.phase == phase]
            if pm:
                w.add_scalar(f"time/{phase}_s", max(m.end for m in pm) - min(m.start for m in pm), t + 1, walltime=ends[t])
        w.add_scalar("time/iteration_s", ends[t] - min(m.start for m in ms), t + 1, walltime=ends[t])


def _evaluations(w: Any, run: Run, ends: dict[int, float]) -> None:
    for e in run.evaluations():
        at = ends.get(e.version - 1)
        w.add_scalar("eval/loss", e.loss, e.version, walltime=at)
        for k, v in e.metrics.items():
            w.add_scalar(f"eval/{k}", v, e.version, walltime=at)


def _cost(w: Any, run: Run, by_t: dict[int, list[TaskMetrics]], ends: dict[int, float]) -> None:
    report = run.cost()
    total = Usage()
    for t, ms in sorted(by_t.items()):
        for m in ms:
            total = total + task_usage(m)
        w.add_scalar("cost/tasks_usd", total.usd(report.prices), t + 1, walltime=ends[t])
    if not by_t:
        return
    last = max(by_t)
    u, p = report.total, report.prices
    parts = {
        "cost/measured_usd": report.usd,
        "cost/lambda_usd": u.gb_s * p.gb_s + u.invocations * p.request,
        "cost/step_functions_usd": u.transitions * p.transition,
        "cost/s3_usd": u.puts * p.put + u.gets * p.get,
    }
    for tag, usd in parts.items():
        w.add_scalar(tag, usd, last + 1, walltime=ends[last])
