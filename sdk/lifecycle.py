"""A job's life after its start, from anywhere: attach to it, resume it, list the stack's jobs.

    run = stagecoach.attach("digits-1a2b3c4d", job=job)     # a Run, as job.run() returned it
    run = stagecoach.resume("digits-1a2b3c4d", iterations=200)
    for j in stagecoach.list_jobs(): print(j.job, j.status)

``backend``: as everywhere (None: the local stack, or AWS when STAGECOACH_STACK names a stack).
Locally a job outlives its process only on the `stagecoach local` daemon's stack.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Unpack

from stagecoach.backends import Where, get_backend
from stagecoach.deploy.resume import JobStatus

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
    """The stack's jobs, newest first, with their status."""
    return get_backend(backend, **where).jobs()
