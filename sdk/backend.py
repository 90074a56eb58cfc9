"""Where jobs run: one abstract backend, implemented by the embedded local stack and by AWS.

A backend is a handle on a stack (its clients and resources) plus the few places the two differ:
how deployment calls are made (AWS: idempotent, waiting until functions are Active), long calls,
and which ARNs it can read. Launching a job and cleaning one up are written once, here.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar

from stagecoach.deploy.cleanup import Removed, cleanup_job
from stagecoach.deploy.resources import BotoClient, Clients, DeployError, StackResources, check_name_lengths
from stagecoach.deploy.resume import JobStatus, job_executions, list_jobs, resume_job
from stagecoach.deploy.start import check_concurrency, deploy_and_start, preflight
from stagecoach.planner.plan import per_worker_functions
from stagecoach.run import Run, read_spec

if TYPE_CHECKING:
    from stagecoach.job import Job
    from stagecoach.planner.plan import Plan


class Backend(ABC):
    """A deployed stack a job can run on: ``clients`` and ``resources`` are set by the constructor."""

    name: ClassVar[str]
    clients: Clients
    resources: StackResources

    @abstractmethod
    def long_call_client(self, service: str) -> BotoClient:
        """A client whose calls may wait up to Lambda's 15 minutes (a synchronous profile invocation)."""

    def deploy_clients(self) -> Clients:
        """The clients deployment creates resources with (AWS: idempotent, Active-waiting ones)."""
        return self.clients

    def available_concurrency(self) -> tuple[int | None, str]:
        """How many Lambda invocations may run at once for a job here (None: unknown), and where."""
        return None, "this backend"

    def job_commands(self, job_id: str, execution_arn: str) -> list[tuple[str, str]] | None:
        """The CLI commands that reach a running job from another process, as (what, command)
        pairs; None where the job cannot outlive this process (an embedded local stack)."""
        return None

    def check_arn(self, arn: str) -> None:  # noqa: B027 - an optional hook: the local stack reads every ARN it made
        """Raise if ``arn`` cannot be read through this backend (another region or account)."""

    def launch(self, job: Job, plan: Plan, reserve_concurrency: bool = False, max_cost_usd: float | None = None) -> Run:
        """Deploy the job's functions and window state machine, start its job execution; a Run.
        ``max_cost_usd``: stop the job at the last iteration boundary before its cost would pass this."""
        workers = max([plan.replicas, *(plan.sync_tasks(s) for s in range(plan.stages))])
        check_name_lengths(self.resources.prefix, job.name, plan.stages, workers if per_worker_functions(plan, job.warm_state) else 0)
        preflight(self.resources, self.clients)
        check_concurrency(plan, *self.available_concurrency())
        job_id, arn = deploy_and_start(
            job, plan, self.resources, self.deploy_clients(), reserve_concurrency=reserve_concurrency, max_cost_usd=max_cost_usd
        )
        return Run(self, job, plan, job_id, arn)

    def attach(self, job_id: str, job: Job | None = None) -> Run:
        """The Run of a job started elsewhere (its latest execution; ``job``: its Job, for the
        trained model; the Job's iterations follow the deployed spec's)."""
        execs = job_executions(self.clients, self.resources, job_id)
        if not execs:
            raise DeployError(f"no job {job_id} in stack {self.resources.prefix} ({self.name}): `stagecoach list` shows its jobs")
        return self._run(job_id, job, execs[-1]["executionArn"])

    def resume(self, job_id: str, iterations: int | None = None, job: Job | None = None, max_cost_usd: float | None = None) -> Run:
        """Continue a stopped, failed or finished job from its last complete checkpoint, to its
        iterations or to ``iterations`` in all (sdk/deploy/resume.py); ``max_cost_usd``: a new cap."""
        arn, _, _ = resume_job(self.clients, self.resources, job_id, iterations, max_cost_usd)
        return self._run(job_id, job, arn)

    def jobs(self) -> list[JobStatus]:
        """The stack's jobs, newest first, with their status."""
        return list_jobs(self.clients, self.resources)

    def _run(self, job_id: str, job: Job | None, arn: str) -> Run:
        spec = read_spec(self.clients.s3, self.resources.bucket, job_id)
        # the Job's iterations follow the deployed spec's (a resumed job's total)
        job = dataclasses.replace(job, iterations=spec.iterations, epochs=None) if job is not None else None
        return Run(self, job, spec.to_plan(), job_id, arn)

    def cleanup(
        self, job_id: str, keep_results: bool = False, stop_running: bool = False, log: Callable[[str], None] | None = None
    ) -> Removed:
        """Remove the job's functions, window state machine and (unless ``keep_results``) objects."""
        return cleanup_job(self.resources, self.clients, job_id, keep_results=keep_results, stop_running=stop_running, log=log)
