"""`stagecoach train FILE`: plan (or take a manual plan, or a plan file), deploy, watch, and report
the run (or, with --no-wait, say how to follow it and return)."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import click

from stagecoach.aws.backend import AwsBackend
from stagecoach.backend import Backend
from stagecoach.cli.jobfile import load_job_file
from stagecoach.cli.options import backend_for, region_option, stack_option
from stagecoach.cli.report import report_run
from stagecoach.cost import CostReport
from stagecoach.deploy.resources import DeployError
from stagecoach.job import Job, JobError
from stagecoach.planner.model.platforms import aws_platform
from stagecoach.planner.plan import DEFAULT_FAN_IN, MAX_FAN_IN, SYNC_ALGORITHMS, Plan, PlanError
from stagecoach.run import Run, RunFailed


@click.command("train")
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--stages", type=int, help="pipeline stages (manual plan)")
@click.option("--replicas", type=int, help="data-parallel degree d (manual plan)")
@click.option("--micro-batches", type=int, help="micro-batches per replica per iteration")
@click.option("--memory", "memory_mb", type=int, help="Lambda memory per stage, MB")
@click.option(
    "--sync", type=click.Choice(list(SYNC_ALGORITHMS)), help="gradient sync algorithm for every stage (docs/runtime.md, 'Sync algorithms')"
)
@click.option("--aggregators", type=int, help="K for --sync k_reduce or hierarchical: shards per stage (1..d)")
@click.option(
    "--fan-in",
    type=int,
    help=f"for --sync hierarchical (implied when no --sync is given): replicas per level-1 aggregator, 2..{MAX_FAN_IN} "
    f"(default {DEFAULT_FAN_IN}); K defaults to min(d, fan-in)",
)
@click.option("--iterations", type=int, help="override the job's iterations")
@click.option("--recommended", is_flag=True, help="use the planner's recommended plan even if FILE defines manual `defaults`")
@click.option("--backend", type=click.Choice(["local", "aws"]), default=None, help="local (default) or aws (default when --stack is given)")
@stack_option
@region_option
@click.option(
    "--emulate-network",
    is_flag=True,
    help="local backend: give every worker Lambda's bandwidth and S3 latency (the planner's AWS constants)",
)
@click.option(
    "--max-cost",
    type=float,
    callback=lambda _ctx, _param, v: _positive_usd(v),
    help="USD: stop the job at the last iteration boundary before its measured cost would pass this (it keeps its checkpoint)",
)
@click.option("--out", default="stagecoach-runs", show_default=True, help="directory for results")
@click.option(
    "--plan",
    "plan_file",
    type=click.Path(exists=True, dir_okay=False),
    help="train this plan (JSON): what `stagecoach plan FILE --json PATH` writes, or a run's results/plan.json; "
    "instead of the planner's recommendation and FILE's `defaults`",
)
@click.option(
    "--workflow",
    type=click.Choice(["auto", "standard", "express"]),
    default=None,
    help="the windows' Step Functions workflow type (default: the job's; docs/runtime.md 'Express windows'): "
    "express is billed per request and duration instead of per state transition",
)
@click.option(
    "--phase-watchers/--no-phase-watchers",
    default=None,
    help="run each window phase beside a phase watcher, which ends a hung task within a fraction of a second "
    "(default: the job's, Job.phase_watchers; docs/reliability.md 'The phase watcher')",
)
@click.option(
    "--wait/--no-wait",
    default=True,
    help="follow the run to its end and report it (default), or print its job id and how to follow it and return once it has started",
)
def train_command(
    file: str,
    stages: int | None,
    replicas: int | None,
    micro_batches: int | None,
    memory_mb: int | None,
    sync: str | None,
    aggregators: int | None,
    fan_in: int | None,
    iterations: int | None,
    recommended: bool,
    backend: str | None,
    stack: str | None,
    region: str | None,
    emulate_network: bool,
    max_cost: float | None,
    out: str,
    plan_file: str | None,
    workflow: str | None,
    phase_watchers: bool | None,
    wait: bool,
) -> None:
    """Train the `job` defined in FILE; print progress, final loss, test accuracy and where results are.

    The plan is the planner's recommendation, unless options (--stages, --replicas, --micro-batches,
    --memory) or FILE's `defaults` give a manual one, or --plan gives a whole plan. With --no-wait
    it returns once the job has started, saying how to follow it (a stack that outlives the command).
    """
    t0 = time.time()
    given = {
        k: v
        for k, v in (("stages", stages), ("replicas", replicas), ("micro_batches", micro_batches), ("memory_mb", memory_mb))
        if v is not None
    }
    if plan_file and (given or recommended):
        options = ", ".join(f"--{k.split('_mb')[0].replace('_', '-')}" for k in given) or "--recommended"
        raise click.BadParameter(f"--plan gives the whole plan: drop {options} (or --plan)", param_hint="--plan")
    job, manual = _job_and_manual(file, iterations, recommended, given)
    job.workflow = workflow or job.workflow
    job.phase_watchers = job.phase_watchers if phase_watchers is None else phase_watchers
    try:
        plan = _plan(job, manual, sync, aggregators, fan_in, _read_plan(plan_file, job, file) if plan_file else None)
        chosen = _backend(backend, stack, region, emulate_network)
        if not wait:
            _check_outlives(chosen)
        predicted = _predict_cost(job, plan, chosen, max_cost)
        run = job.run(plan=plan, backend=chosen, max_cost=max_cost)
        run.record_prediction(predicted)  # for readers without the Job: inspect's and the console's prediction
    except (JobError, PlanError, DeployError) as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"job {run.job_id}: execution {run.execution_arn}")
    click.echo(f"console: {run.console_url}")
    if not wait:
        run.record_watching()  # the prediction's PUT, billed as the run's (wait records it otherwise)
        _how_to_follow(chosen, run)
        return
    try:
        status = run.wait(progress=True)
    except (RunFailed, DeployError) as e:  # DeployError: e.g. AccessDenied while watching on AWS
        raise click.ClickException(str(e)) from None
    report_run(run, status, time.time() - t0, out, predicted)


def _job_and_manual(file: str, iterations: int | None, recommended: bool, given: dict[str, int]) -> tuple[Job, dict[str, Any]]:
    """FILE's job (``--iterations`` overriding its length) and the manual plan's settings: FILE's
    `defaults` under the options given, or none when --recommended asks for the planner's."""
    module = load_job_file(file)
    job: Job = module.job
    if iterations is not None:
        job.iterations, job.epochs = iterations, None
    manual = {} if recommended and not given else {**getattr(module, "defaults", {}), **given}
    return job, manual


def _read_plan(path: str, job: Job, file: str) -> Plan:
    """The plan in ``path``: Plan's own JSON (Plan.to_json), the one format `stagecoach plan --json`
    and Run.save's plan.json write. Its global batch must be the job's (a plan made with another
    -b splits another batch); its layers and sync are checked with the job's in ``_plan``."""
    with open(path) as f:
        text = f.read()
    try:
        plan = Plan.from_json(text)
    except PlanError as e:
        raise click.BadParameter(f"{path}: {e}", param_hint="--plan") from None
    if plan.global_batch != job.global_batch:
        raise click.BadParameter(
            f"{path} plans a global batch of {plan.global_batch}, but the job's global_batch is {job.global_batch}: "
            f"plan the job as it is (`stagecoach plan {file} --json {path}`, without -b)",
            param_hint="--plan",
        )
    click.echo(f"plan: from {path}" + (f" (predicted {plan.prediction.s_per_iteration:.2f} s/iteration on AWS)" if plan.prediction else ""))
    return plan


def _plan(
    job: Job, manual: dict[str, Any], sync: str | None, aggregators: int | None, fan_in: int | None, given: Plan | None = None
) -> Plan:
    """The job validated and its plan: ``given`` (--plan), the manual one, or the planner's
    recommendation (said with its predicted speed), with --sync / --aggregators / --fan-in applied
    and checked against the job."""
    job.validate()
    if given is not None:
        plan = given
    elif manual:
        plan = job.manual_plan(**manual)
    else:
        result = job.plan()
        plan = result.recommended.to_plan()
        click.echo(
            f"planner: recommended plan of {len(result.pareto)} on the Pareto front "
            f"(predicted {plan.prediction.s_per_iteration if plan.prediction else float('nan'):.2f} s/iteration on AWS)"
        )
    if sync or aggregators or fan_in is not None:
        plan = _with_sync(plan, sync, aggregators, fan_in)
    job.check_plan(plan)
    click.echo(
        f"plan: {plan.stages} stages (layers per stage {list(plan.balance)}) x {plan.replicas} replicas, "
        f"{plan.micro_batches} micro-batches of {plan.micro_batch_size}, memory {list(plan.memory_mb)} MB, "
        f"sync {_sync_label(plan)}"
    )
    return plan


def _predict_cost(job: Job, plan: Plan, chosen: Backend, max_cost: float | None) -> CostReport:
    """The run's predicted cost on AWS, said before it starts, with where a cap would stop it."""
    # at the prices of the stack's architecture, as the run will be metered (deploy/start.py)
    platform = aws_platform("x86_64" if chosen.resources.architecture == "x86_64" else "arm64")
    predicted = job.predict_cost(plan, platform, capped=max_cost is not None)
    click.echo(f"cost on AWS: predicted {predicted.summary()}" + (f"; cap ${max_cost:.4f}" if max_cost is not None else ""))
    if max_cost is not None and max_cost < predicted.usd:
        k = int(max_cost / predicted.per_iteration_usd())
        click.echo(f"  the cap is predicted to stop the job after about {k} of its {job.iterations} iterations")
    return predicted


def _check_outlives(chosen: Backend) -> None:
    """--no-wait returns while the job runs, so the stack must outlive this command: refused, before
    anything is deployed, where the job would end with it (``Backend.job_commands`` answers None
    there, whatever the job: the embedded local stack of this process, which the CLI uses only with
    --emulate-network or when STAGECOACH_LOCAL_START / STAGECOACH_LOCAL_ATTACH say "0"; otherwise it
    runs the job on this project's daemon, started on demand: stagecoach.local.daemon_state)."""
    if chosen.job_commands("", "") is None:
        raise click.BadParameter(
            "the job would end with this command: its local stack runs inside it (--emulate-network, or "
            "STAGECOACH_LOCAL_START=0 or STAGECOACH_LOCAL_ATTACH=0). Start this project's stack that outlives it "
            "with `stagecoach local start` (and train without --emulate-network), or train on AWS (--backend aws --stack NAME)",
            param_hint="--no-wait",
        )


def _how_to_follow(chosen: Backend, run: Run) -> None:
    """What --no-wait prints once the job has started: the commands that follow, stop and report it
    from any shell (the backend's, as Ctrl-C in Run.wait prints them, and `stagecoach list`), and
    locally how to stop the project's stack daemon the job runs on."""
    where = f" --stack {chosen.stack} --region {chosen.region}" if isinstance(chosen, AwsBackend) else ""
    commands = list(chosen.job_commands(run.job_id, run.execution_arn) or [])
    commands.insert(min(2, len(commands)), ("see the stack's jobs and their status:", f"stagecoach list{where}"))
    if not isinstance(chosen, AwsBackend):  # this project's local stack daemon, in the background
        commands.append(("stop the local stack (its jobs are kept):", "stagecoach local stop"))
    click.echo(f"started, not waiting (--no-wait): job {run.job_id} runs on. From any shell:")
    for what, command in commands:
        click.echo(f"  {what:<40} {command}")


def _backend(backend: str | None, stack: str | None, region: str | None, emulate_network: bool) -> Backend:
    if not emulate_network:
        return backend_for(backend, stack, region)
    if (backend or ("aws" if stack else "local")) != "local":
        raise click.BadParameter("only the local backend emulates a network; on AWS the network is real", param_hint="--emulate-network")
    plat = aws_platform()
    click.echo(
        f"network: emulating {plat.bandwidth_Bps / 1e6:.0f} MB/s each way and {plat.storage_latency_s * 1e3:.0f} ms "
        "per S3 request in every worker"
    )
    return backend_for("local", None, None, network=plat)


def _with_sync(plan: Plan, sync: str | None, aggregators: int | None, fan_in: int | None) -> Plan:
    """The plan with every stage's sync algorithm (and K, and fan-in) replaced; Plan validates them.
    Without --sync the options imply the algorithm that takes them: hierarchical for --fan-in,
    else k_reduce."""
    algo = sync or ("hierarchical" if fan_in is not None else "k_reduce")
    if algo not in ("k_reduce", "hierarchical") and aggregators:
        raise click.BadParameter(f"--aggregators only applies to --sync k_reduce or hierarchical, not {algo}", param_hint="--aggregators")
    if algo != "hierarchical" and fan_in is not None:
        raise click.BadParameter(f"--fan-in only applies to --sync hierarchical, not {algo}", param_hint="--fan-in")
    fans = plan.fan_in if fan_in is None else (fan_in,) * plan.stages
    # hierarchical: K shards, each summed by a chain of fan-in aggregators (K <= the fan-in by
    # default); max(1, ...) so that a fan-in below 1 is refused by Plan for what it is, not as a K
    default = {"all_reduce": 1, "hierarchical": min(plan.replicas, max(1, min(fans)))}.get(algo, plan.replicas)
    k = aggregators or default
    return dataclasses.replace(plan, sync=(algo,) * plan.stages, aggregators=(k,) * plan.stages, fan_in=fans)


def _positive_usd(value: float | None) -> float | None:
    if value is not None and not (0 < value < float("inf")):
        raise click.BadParameter(f"{value}: give a positive number of US dollars, e.g. --max-cost 0.50", param_hint="--max-cost")
    return value


def _sync_label(plan: Plan) -> str:
    if plan.replicas == 1:
        return "none (d = 1)"
    labels = {"k_reduce": "k_reduce(K={k})", "hierarchical": "hierarchical(K={k}, fan_in={f})"}
    return ", ".join(labels.get(a, a).format(k=k, f=f) for a, k, f in zip(plan.sync, plan.aggregators, plan.fan_in))
