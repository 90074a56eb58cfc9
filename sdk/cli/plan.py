"""`stagecoach plan TARGET`: profile a model, plan it, print the Pareto table, write the plot.

TARGET is a job file (defining ``job``, like `stagecoach train`'s) or ``zoo:NAME`` (resnet101,
amoebanet_d18, amoebanet_d36, bert_large). Zoo models are sized on the meta device; a job's model
is measured by running it (--meta sizes it on the meta device instead). A job's model too big for
Lambda is refused before anything builds it (Job.validate sizes it on the meta device first).
"""

from __future__ import annotations

from pathlib import Path

import click

from stagecoach.cli.jobfile import load_job_file
from stagecoach.cli.plan_report import pareto_png, result_table, table_legend
from stagecoach.core.boundary import map_leaves
from stagecoach.core.profiling import measure_model
from stagecoach.exactness import split_batch_refusal
from stagecoach.job import JobError
from stagecoach.planner.emit import asl, workflow
from stagecoach.planner.limits import LAMBDA_ACCOUNT_CONCURRENCY
from stagecoach.planner.model.platforms import aws_platform, local_platform
from stagecoach.planner.plan import SYNC_ALGORITHMS
from stagecoach.planner.profile.layers import ModelProfile
from stagecoach.planner.profile.meta import profile_meta
from stagecoach.planner.profile.zoo import zoo_profile
from stagecoach.planner.solve.sweep import PlanningResult, default_micro_batch_sizes, plan_model


def _load(target: str, meta: bool, sizes: tuple[int, ...]) -> tuple[ModelProfile, int | None, str | None, tuple[int, ...]]:
    """The profile, the job's global batch, why the batch must stay together (None: it need not),
    and the micro-batch sizes to plan: ``sizes``, else default_micro_batch_sizes, the rule Job.plan
    follows too; without 1 for a model that normalises over the batch. A job's model is timed at
    those sizes; with ``meta`` it is built on the meta device and sized there instead."""
    if target.startswith("zoo:"):
        try:
            return zoo_profile(target), None, None, sizes or default_micro_batch_sizes()
        except KeyError as e:
            raise click.BadParameter(str(e.args[0]), param_hint="TARGET") from None
    if not Path(target).exists():
        raise click.BadParameter(f"{target}: no such file (or use zoo:NAME)", param_hint="TARGET")
    job = load_job_file(target).job
    try:
        job.validate()  # sizes the model on the meta device first: one too big for Lambda is refused unbuilt
    except JobError as e:
        raise click.ClickException(str(e)) from None
    sample = map_leaves(lambda t: t[0], job.head(1)[0])
    whole = split_batch_refusal(job.facts, job.deferred_batch_norm)
    coupled = job.facts.batch_coupling is not None  # it cannot run one sample in train mode (BatchNorm)
    sizes = tuple(b for b in sizes or default_micro_batch_sizes(coupled) if b > 1 or not coupled) or (2,)
    if meta:
        model = job.meta_model()
        if model is None:
            raise click.ClickException(f"{target}: job.model() cannot build on the meta device; plan it without --meta")
        return job.with_job_bytes(profile_meta(model, sample, name=job.name, batch=2 if coupled else 1)), job.global_batch, whole, sizes
    return job.with_job_bytes(measure_model(job.build_model(), sample, sizes, name=job.name)), job.global_batch, whole, sizes


def workflow_line(res: PlanningResult, iterations: int = 1000) -> str:
    """The recommended plan's windows as Step Functions Standard and as Express (planner/emit/
    workflow.py): what orchestrating ``iterations`` of it costs each way, and what
    ``workflow="auto"`` would pick (docs/runtime.md "Express windows")."""
    plan, rec = res.recommended.to_plan(), res.recommended
    c = workflow.choose("auto", plan, iterations, rec.time_s, rec.platform)
    length = asl.window_length(plan)
    std = f"Standard ${c.standard_usd:.4f} (windows of {length} iterations)"
    if c.express_usd is None:
        return f"Step Functions per {iterations:,} iterations: {std}; Express cannot run it ({c.why_not}); auto: Standard"
    express = f"Express ${c.express_usd:.4f} (windows of {min(length, workflow.express_fit(rec.time_s))})"
    return f"Step Functions per {iterations:,} iterations: {std}, {express}; auto: {c.workflow.title()}"


def _write_plan(res: PlanningResult, path: str, train: str | None) -> None:
    """The recommended plan in Plan's own JSON (Plan.to_json), the one format `stagecoach train
    --plan` reads (Plan.from_json), as a run's results/plan.json is; ``train``: the command that
    trains it, for a job file planned at its own global batch (another -b plans another job)."""
    Path(path).write_text(res.recommended.to_plan().to_json())
    click.echo(f"recommended plan: {path}" + (f" (train it: {train})" if train else ""))


@click.command("plan")
@click.argument("target")
@click.option("--global-batch", "-b", type=int, default=None, help="samples per iteration (default: the job's global_batch, or 64)")
@click.option("--samples-per-epoch", type=int, default=50_000, show_default=True, help="for the $/epoch column")
@click.option("--platform", "platform_name", type=click.Choice(["aws", "aws-arm64", "local"]), default="aws", show_default=True)
@click.option("--max-layers", type=int, default=12, show_default=True, help="merge layers to at most this many before the MILP")
@click.option("--max-stages", type=int, default=8, show_default=True)
@click.option(
    "--micro-batch-sizes",
    default="",
    help="comma-separated micro-batch sizes to time and plan (default: 1,2,4,8; 2,4,8 for a model that normalises over the batch)",
)
@click.option(
    "--sync",
    "sync_algos",
    multiple=True,
    type=click.Choice(list(SYNC_ALGORITHMS)),
    help="sync algorithms the planner may choose per stage (repeatable; default: all four)",
)
@click.option(
    "--time-limit", type=float, default=60.0, show_default=True, help="seconds per exact solve (one per d, micro-batch size, weight)"
)
@click.option(
    "--concurrency",
    type=click.IntRange(min=3),
    default=LAMBDA_ACCOUNT_CONCURRENCY,
    show_default=True,
    help="your account's Lambda concurrent executions: plans run stages x replicas invocations at once, twice that while a window restarts",
)
@click.option("--meta", is_flag=True, help="size the job's model on the meta device (FLOP-based times) instead of running it")
@click.option("--plot", type=click.Path(dir_okay=False), default=None, help="Pareto PNG (default: plan-<name>.png)")
@click.option(
    "--json",
    "json_out",
    type=click.Path(dir_okay=False),
    default=None,
    help="write the recommended Plan as JSON (Plan's own format: `stagecoach train FILE --plan PATH` trains it)",
)
def plan_command(
    target: str,
    global_batch: int | None,
    samples_per_epoch: int,
    platform_name: str,
    max_layers: int,
    max_stages: int,
    micro_batch_sizes: str,
    sync_algos: tuple[str, ...],
    time_limit: float,
    concurrency: int,
    meta: bool,
    plot: str | None,
    json_out: str | None,
) -> None:
    """Plan TARGET (a job file or zoo:NAME): Pareto plans and a recommendation."""
    try:
        sizes = tuple(int(x) for x in micro_batch_sizes.split(",") if x.strip())
    except ValueError:
        raise click.BadParameter(
            f"{micro_batch_sizes!r}: give positive integers separated by commas, e.g. 1,2,4,8", param_hint="--micro-batch-sizes"
        ) from None
    if (micro_batch_sizes.strip() and not sizes) or min(sizes, default=1) < 1:
        raise click.BadParameter(
            f"{micro_batch_sizes!r}: give positive integers separated by commas, e.g. 1,2,4,8", param_hint="--micro-batch-sizes"
        )
    prof, file_batch, whole, sizes = _load(target, meta, sizes)
    G = global_batch or file_batch or 64
    replicas: tuple[int, ...] | None = None  # the powers of two the account's concurrency fits
    if whole:  # only plans that keep the global batch together train this job exactly
        click.echo(f"planning one replica and one micro-batch of {G}: {whole}")
        sizes, replicas = (G,), (1,)
    plat = {"aws": aws_platform, "aws-arm64": lambda: aws_platform("arm64"), "local": local_platform}[platform_name]()
    try:
        res = plan_model(
            prof,
            G,
            plat,
            max_layers=max_layers,
            max_stages=max_stages,
            micro_batch_sizes=sizes,
            time_limit=time_limit,
            sync_algos=sync_algos or None,
            replicas=replicas,
            concurrency=concurrency,
        )
    except ValueError as e:  # too large a layer, no plan fits: the message says what to change
        raise click.ClickException(str(e)) from None
    click.echo(
        f"{prof.name}: {prof.original_layers} layers, {prof.param_bytes / 2**20:.0f} MiB of parameters, global batch {G}, "
        f"platform {plat.name} (prices as of {plat.prices_as_of}), account concurrency {concurrency}; planned in {res.solve_s:.1f} s"
        + ("" if res.proven else " (some solves hit the time limit: not proven optimal)")
    )
    click.echo(result_table(res, samples_per_epoch))
    click.echo(table_legend())
    click.echo(workflow_line(res))
    png = pareto_png(res, plot or f"plan-{prof.name}.png")
    click.echo(f"Pareto plot: {png}")
    if json_out:
        _write_plan(res, json_out, f"stagecoach train {target} --plan {json_out}" if G == file_batch else None)
