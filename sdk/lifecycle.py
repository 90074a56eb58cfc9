"""A job's life after its start, from anywhere: attach to it, resume it, list the stack's jobs.

    run = stagecoach.attach("digits-1a2b3c4d", job=job)     # a Run, as job.run() returned it
    run = stagecoach.resume("digits-1a2b3c4d", iterations=200)
    for j in stagecoach.list_jobs(): print(j.job, j.status)

``backend``: as everywhere (None: the local stack, or AWS when STAGECOACH_STACK names a stack).
Locally a job outlives its process on this project's daemon's stack: the `stagecoach` command
starts one on demand, a script attaches to a running one (or starts one with
STAGECOACH_LOCAL_START=1); otherwise a script's stack ends with it (docs/local-stack.md).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Unpack

from stagecoach.backends import Where, get_backend
from stagecoach.deploy.resume import JobStatus
from stagecoach.run import status_of

if TYPE_CHECKING:
    from stagecoach.backend import Backend
    from stagecoach.job import Job
    from stagecoach.run import Run


def attach(job_id: str, job: Job | None = None, backend: Backend | str | None = None, **where: Unpack[Where]) -> Run:
    """The Run of a job started elsewhere (``job``: its Job, for Run.trained_model())."""
    return get_backend(backend, **where).attach(job_id, job)


def resume(
    job_id: str, iterations: int | None = None, job: Job | None = None, backend: Backend | str | None = None, **where: Unpack[Where]
) -> Run:
    """Continue a stopped, failed or finished job from its last complete checkpoint."""
    return get_backend(backend, **where).resume(job_id, iterations, job)


def list_jobs(backend: Backend | str | None = None, **where: Unpack[Where]) -> list[JobStatus]:
    """The stack's jobs, newest first, each with its status as `inspect` and `train` show it:
    run.py ``status_of`` its latest execution. ListExecutions' own status is not that: a link
    that continued says SUCCEEDED while the job runs on, and a stopped job says FAILED (told
    apart here by the execution's error, which outlives `stagecoach cleanup`; the stop record,
    which ``Backend.jobs`` reads, does not). One DescribeExecution per job (more per chain)."""
    b = get_backend(backend, **where)
    return [dataclasses.replace(j, status=status_of(b.clients.sfn, j.execution_arn)[0]) for j in b.jobs()]
