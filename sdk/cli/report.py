"""What `stagecoach train` and `stagecoach resume` print and save once a run has ended: one report,
so the two commands say the same things in the same words (why it stopped early, the results
saved, the loss, the end-of-run evaluation, where the time went, the measured cost)."""

from __future__ import annotations

import os

import click

from stagecoach.cost import CostReport
from stagecoach.run import Run

# why a job stopped (core/records.py StopReason), as the report says it
WHY_STOPPED = {"max_cost": "its next iteration would pass the cost cap", "nonfinite_loss": "its loss was NaN or infinite"}


def report_run(run: Run, status: str, wall: float, out: str, predicted: CostReport | None = None) -> None:
    """After the run: why it stopped early (if it did), the results saved under ``out``/JOB, the
    loss, the end-of-run evaluation, where the time went, and the measured cost (beside the
    predicted one where the command made a prediction: `train`; a resumed job has no Job to
    predict with). Everything is read from the stack, so a Run without its Job reports alike."""
    _stopped_line(run, status)
    losses = run.losses()
    directory = run.save(os.path.join(out, run.job_id))
    if losses:
        click.echo(f"final loss {losses[-1]:.4f} (first {losses[0]:.4f}) after {len(losses)} iterations")
    evaluations = run.evaluations()
    spec = run.spec()
    if evaluations and evaluations[-1].version == spec.iterations:  # the end-of-run evaluation, on Lambda
        click.echo(evaluations[-1].describe(_evaluation_label(run)))
    _time_line(run, wall)
    measured = run.cost()
    against = f"; predicted ${predicted.usd:.4f} for {predicted.iterations}" if predicted is not None else ""
    click.echo(f"cost on AWS: measured {measured.summary()}{against}")
    click.echo(f"  {measured.quantities()} (AWS list prices of {measured.prices.as_of})")
    click.echo(f"results: {directory} (model.safetensors, plan.json, metrics.jsonl, losses.json, TensorBoard events)")


def _stopped_line(run: Run, status: str) -> None:
    if status != "STOPPED":
        return
    record = run.stopped()
    if record is not None:
        why = WHY_STOPPED.get(record.reason, "on request")
        click.echo(f"stopped before iteration {record.version} ({why}): the results are version {record.version}'s checkpoint")


def _evaluation_label(run: Run) -> str:
    """The set the job evaluates, as the job file names it: "validation", else "test" (Job.evaluation_set);
    "held-out" for a Run without its Job (the spec records the data set, not its name)."""
    if run.job is None:
        return "held-out"
    return "validation" if run.job.validation is not None else "test"


def _time_line(run: Run, wall: float) -> None:
    b = run.time_breakdown()
    if not b:
        return
    it = b["iteration_s"]
    click.echo(
        f"wall time {wall:.1f} s; {it:.2f} s per iteration after the first: orchestration "
        f"{b['orchestration_s'] / it:.0%}, in tasks: compute {b['compute_s'] / it:.0%}, "
        f"S3 transfer {b['transfer_s'] / it:.0%}, waiting on other workers {b['wait_s'] / it:.0%}"
    )
