"""`stagecoach train FILE` end to end on the local stack, with a manual plan from the options."""

import os
import subprocess
import sys
import textwrap

import pytest
from helpers import tiny_job

from stagecoach.planner.plan import DEFAULT_FAN_IN

JOB_FILE = textwrap.dedent(
    """
    import torch
    from torch import nn
    from stagecoach import Job
    from stagecoach.evaluation import accuracy

    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=g)
    y = (x[:, 0] > 0).long()

    def model():
        return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 2))

    job = Job(model=model, loss=nn.CrossEntropyLoss(), optimizer=lambda p: torch.optim.SGD(p, lr=0.5),
              train=(x, y), test=(x, y), metrics={"accuracy": accuracy}, global_batch=16, iterations=20, seed=0, name="cli")
    """
)


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def stagecoach(*args, cwd):
    exe = os.path.join(os.path.dirname(sys.executable), "stagecoach")
    return subprocess.run([exe, *args], cwd=cwd, capture_output=True, text=True, timeout=600)


def test_train_prints_loss_accuracy_and_results(tmp_path):
    (tmp_path / "tiny.py").write_text(JOB_FILE)
    r = stagecoach(
        "train", "tiny.py", "--stages", "2", "--replicas", "2", "--micro-batches", "2", "--iterations", "4", "--out", "out", cwd=tmp_path
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "plan: 2 stages (layers per stage [2, 1]) x 2 replicas, 2 micro-batches of 4" in r.stdout
    assert "after 4 iterations" in r.stdout
    assert "test accuracy" in r.stdout
    results = [line for line in r.stdout.splitlines() if line.startswith("results: ")]
    directory = results[0].split()[1]
    for f in ("model.safetensors", "plan.json", "metrics.jsonl", "losses.json"):
        assert (tmp_path / directory / f).exists(), f


@pytest.mark.slow  # batch norm across stages: tests/test_transparency.py; whole batches planned: tests/test_exactness.py
def test_the_resnet_example_trains_with_batchnorm_and_plans_whole_batches(tmp_path):
    """examples/resnet.py: BatchNorm on three stages through the state machines; its plans keep
    the global batch together (one replica, one micro-batch)."""
    example = os.path.join(ROOT, "examples", "resnet.py")
    r = stagecoach("train", example, "--iterations", "6", "--out", "out", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "plan: 3 stages (layers per stage [2, 2, 1]) x 1 replicas, 1 micro-batches of 64" in r.stdout
    assert "after 6 iterations" in r.stdout and "test accuracy" in r.stdout
    r = stagecoach("plan", example, "--time-limit", "10", "--plot", "p.png", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "planning one replica and one micro-batch of 64: its BatchNorm2d normalise over the batch" in r.stdout
    # the table's rows end with how each plan was found (the legend under it explains the word)
    plans = [line for line in r.stdout.splitlines() if line.rstrip().endswith(("milp", "milp(time_limit)", "heuristic"))]
    assert plans and all(" 1x64 " in line for line in plans)  # one replica, one micro-batch of 64


@pytest.mark.slow  # tuples across cuts: tests/test_exactness.py, fast
def test_the_amoebanet_example_trains_with_pairs_across_cuts(tmp_path):
    """examples/amoebanet.py: the zoo's AmoebaNet-D cells on three stages, (state, skip) tuples
    crossing both cuts through the state machines."""
    r = stagecoach("train", os.path.join(ROOT, "examples", "amoebanet.py"), "--iterations", "4", "--out", "out", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "plan: 3 stages (layers per stage [3, 3, 3]) x 1 replicas, 1 micro-batches of 64" in r.stdout
    assert "after 4 iterations" in r.stdout and "test accuracy" in r.stdout


@pytest.mark.slow  # a BERT cut at blocks: tests/test_any_model.py trains one exactly
def test_the_bert_example_is_cut_from_its_graph_and_trains(tmp_path):
    """examples/bert.py: an nn.Module (not an nn.Sequential) cut at ``blocks``; ids, mask and hidden
    states cross the cuts; the tied decoder comes back tied in model.safetensors."""
    example = os.path.join(ROOT, "examples", "bert.py")
    r = stagecoach("train", example, "--iterations", "4", "--out", "out", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "plan: 3 stages (layers per stage [2, 2, 2]) x 2 replicas, 2 micro-batches of 16" in r.stdout
    assert "after 4 iterations" in r.stdout and "test accuracy" in r.stdout
    directory = [line for line in r.stdout.splitlines() if line.startswith("results: ")][0].split()[1]
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / directory / "model.safetensors"))
    assert "embeddings.word.weight" in saved and "encoder.3.qkv.weight" in saved  # the user's own names
    # (`stagecoach plan examples/bert.py` runs as README shows it in tests/test_readme.py)


def test_bad_plan_options_are_refused_before_anything_runs(tmp_path):
    (tmp_path / "tiny.py").write_text(JOB_FILE)
    r = stagecoach("train", "tiny.py", "--replicas", "3", cwd=tmp_path)
    assert r.returncode != 0
    assert "not divisible into 3 replicas" in r.stderr
    assert "Traceback" not in r.stderr


def test_bad_sync_options_are_refused_with_the_fix(tmp_path):
    (tmp_path / "tiny.py").write_text(JOB_FILE)
    r = stagecoach("train", "tiny.py", "--replicas", "2", "--sync", "k_reduce", "--aggregators", "3", cwd=tmp_path)
    assert r.returncode != 0 and "K must be between 1 and the 2 replicas" in r.stderr, r.stderr
    r = stagecoach("train", "tiny.py", "--replicas", "2", "--sync", "scatter_reduce", "--aggregators", "1", cwd=tmp_path)
    assert r.returncode != 0 and "--aggregators only applies to --sync k_reduce or hierarchical" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_missing_file_is_a_clear_error(tmp_path):
    r = stagecoach("train", "nope.py", cwd=tmp_path)
    assert r.returncode != 0 and "no such file" in r.stderr and "Traceback" not in r.stderr


def test_without_a_manual_plan_train_uses_the_planners_recommendation(tmp_path):
    (tmp_path / "tiny.py").write_text(JOB_FILE)
    r = stagecoach("train", "tiny.py", "--iterations", "2", "--out", "out", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "planner: recommended plan of" in r.stdout
    assert "after 2 iterations" in r.stdout


def train_in_process(tmp_path, monkeypatch, *args):
    """`stagecoach train tiny.py ARGS` in this process, stopped once its plan is made: returns the
    CliRunner result, the plan it would have run (None if refused) and whether it chose a backend. No
    stack is started, nothing deployed: the backend is a stand-in, and the cost prediction, which
    comes before job.run, stops the command."""
    import click
    from click.testing import CliRunner

    from stagecoach.cli import train

    (tmp_path / "tiny.py").write_text(JOB_FILE)
    monkeypatch.chdir(tmp_path)
    plans, backends = [], []

    def stop(_job, plan, chosen, _max_cost):
        assert chosen == "no backend"
        plans.append(plan)
        raise click.ClickException("the test stops here, before job.run")

    monkeypatch.setattr(train, "_backend", lambda *_args: backends.append(1) or "no backend")
    monkeypatch.setattr(train, "_predict_cost", stop)
    r = CliRunner().invoke(train.train_command, ["tiny.py", *args])
    assert len(plans) <= 1
    return r, (plans[0] if plans else None), bool(backends)


def test_fan_in_sets_the_hierarchical_plans_fan_in_and_its_default_k(tmp_path, monkeypatch):
    """--fan-in with --sync hierarchical (or alone, which implies it): every stage gets the fan-in,
    and K defaults to min(d, fan-in); --aggregators still chooses K."""
    r, plan, _ = train_in_process(tmp_path, monkeypatch, "--stages", "2", "--replicas", "4", "--sync", "hierarchical", "--fan-in", "2")
    assert "the test stops here" in r.output and plan is not None, r.output
    assert plan.sync == ("hierarchical",) * 2 and plan.fan_in == (2, 2) and plan.aggregators == (2, 2)
    assert plan.blocks(0) == 2 and plan.sync_tasks(0) == 2 * (2 + 1)  # K roots and K chains of 2 links
    assert "sync hierarchical(K=2, fan_in=2), hierarchical(K=2, fan_in=2)" in r.output
    r, plan, _ = train_in_process(tmp_path, monkeypatch, "--replicas", "4", "--fan-in", "3", "--aggregators", "1")
    assert plan is not None, r.output
    assert plan.sync == ("hierarchical",) and plan.fan_in == (3,) and plan.aggregators == (1,), r.output
    r, plan, _ = train_in_process(tmp_path, monkeypatch, "--replicas", "4", "--sync", "hierarchical")
    assert plan is not None, r.output
    assert plan.fan_in == (DEFAULT_FAN_IN,) and plan.aggregators == (min(4, DEFAULT_FAN_IN),), r.output


def test_bad_fan_in_is_refused_before_any_backend(tmp_path, monkeypatch):
    """A fan-in Plan refuses is refused with Plan's message; one for another algorithm as --aggregators is."""
    r, plan, chose = train_in_process(tmp_path, monkeypatch, "--replicas", "4", "--sync", "hierarchical", "--fan-in", "1")
    assert r.exit_code != 0 and "plan.fan_in[0]=1: an aggregator sums at least 2 gradients" in r.output, r.output
    assert plan is None and not chose
    r, _, chose = train_in_process(tmp_path, monkeypatch, "--replicas", "4", "--fan-in", "0")
    assert r.exit_code != 0 and "plan.fan_in[0]=0: an aggregator sums at least 2 gradients" in r.output, r.output
    assert not chose
    r, _, chose = train_in_process(tmp_path, monkeypatch, "--replicas", "4", "--sync", "k_reduce", "--fan-in", "2")
    assert r.exit_code != 0 and "--fan-in only applies to --sync hierarchical, not k_reduce" in r.output, r.output
    assert not chose and "Traceback" not in r.output


# -- train --plan: the plan `stagecoach plan --json` writes ------------------------------------------


def test_train_takes_the_plan_that_plan_json_writes(tmp_path, monkeypatch):
    """`stagecoach plan FILE --json p.json` then `stagecoach train FILE --plan p.json`: train runs
    exactly the plan in the file (Plan's own JSON), and plan says how to train it."""
    from click.testing import CliRunner

    from stagecoach.cli.plan import plan_command
    from stagecoach.planner.plan import Plan

    (tmp_path / "tiny.py").write_text(JOB_FILE)
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(plan_command, ["tiny.py", "--time-limit", "2", "--plot", "p.png", "--json", "p.json"])
    assert r.exit_code == 0, r.output
    assert "recommended plan: p.json (train it: stagecoach train tiny.py --plan p.json)" in r.output
    written = Plan.from_json((tmp_path / "p.json").read_text())
    r, plan, chose = train_in_process(tmp_path, monkeypatch, "--plan", "p.json")
    assert plan == written and chose, r.output
    assert "plan: from p.json (predicted" in r.output and "planner: recommended" not in r.output  # not planned again
    # a run's results/plan.json is the same format, a plan written by hand too (its sync options apply)
    (tmp_path / "mine.json").write_text(Plan(balance=(2, 1), replicas=2, micro_batches=2, global_batch=16).to_json())
    r, plan, _ = train_in_process(tmp_path, monkeypatch, "--plan", "mine.json", "--sync", "k_reduce", "--aggregators", "1")
    assert plan is not None and plan.balance == (2, 1) and plan.replicas == 2, r.output
    assert plan.sync == ("k_reduce",) * 2 and plan.aggregators == (1, 1), r.output


def test_a_plan_file_is_checked_against_the_job_before_any_backend(tmp_path, monkeypatch):
    from stagecoach.planner.plan import Plan

    (tmp_path / "b32.json").write_text(Plan(balance=(3,), global_batch=32).to_json())
    r, plan, chose = train_in_process(tmp_path, monkeypatch, "--plan", "b32.json")
    assert r.exit_code != 0 and "b32.json plans a global batch of 32, but the job's global_batch is 16" in r.output, r.output
    assert "stagecoach plan tiny.py --json b32.json" in r.output and plan is None and not chose
    (tmp_path / "four.json").write_text(Plan(balance=(2, 2), global_batch=16).to_json())
    r, plan, chose = train_in_process(tmp_path, monkeypatch, "--plan", "four.json")
    assert r.exit_code != 0 and "covers 4 layers but the model has 3" in r.output, r.output
    assert plan is None and not chose
    r, _, chose = train_in_process(tmp_path, monkeypatch, "--plan", "four.json", "--stages", "2", "--micro-batches", "2")
    assert r.exit_code != 0 and "--plan gives the whole plan: drop --stages, --micro-batches" in r.output, r.output
    assert not chose
    (tmp_path / "bad.json").write_text('{"balance": [3], "stages": 1}')
    r, _, chose = train_in_process(tmp_path, monkeypatch, "--plan", "bad.json")
    assert r.exit_code != 0 and "bad.json: plan has unknown fields ['stages']" in r.output and not chose, r.output
    assert "Traceback" not in r.output


# -- train --no-wait ---------------------------------------------------------------------------------


def no_wait_train(tmp_path, monkeypatch, chosen, *args):
    """`stagecoach train tiny.py --no-wait ARGS` in this process on the stand-in backend ``chosen``:
    Job.run is replaced by a Run that fails the test if waited on. Returns the result and the Runs
    started."""
    import types

    from click.testing import CliRunner

    from stagecoach.cli import train
    from stagecoach.job import Job

    (tmp_path / "tiny.py").write_text(JOB_FILE)
    monkeypatch.chdir(tmp_path)
    started = []

    def wait(**_kw):
        raise AssertionError("--no-wait waited")

    def run(job, plan, backend, max_cost):
        assert backend is chosen
        arn = "arn:aws:states:eu-west-1:123456789012:execution:st-job:cli-0123abcd"
        started.append(
            types.SimpleNamespace(
                job_id="cli-0123abcd",
                execution_arn=arn,
                console_url="https://console/x",
                wait=wait,
                predictions=[],
                record_prediction=lambda report: started[-1].predictions.append(report),
                record_watching=lambda: None,
            )
        )
        return started[-1]

    monkeypatch.setattr(train, "_backend", lambda *_args: chosen)
    monkeypatch.setattr(train, "_predict_cost", lambda *_args: None)
    monkeypatch.setattr(Job, "run", run)
    r = CliRunner().invoke(train.train_command, ["tiny.py", "--stages", "2", "--no-wait", *args])
    return r, started


def test_no_wait_starts_the_job_and_says_how_to_follow_it(tmp_path, monkeypatch):
    """--no-wait returns once the job has started, with its job id and ARN and the commands that
    inspect, list and stop it from any shell (with the stack's options on AWS)."""
    from stagecoach.aws.backend import AwsBackend

    aws = AwsBackend.__new__(AwsBackend)  # no stack is reached: only its name and region are read
    aws.stack, aws.region = "st", "eu-west-1"
    r, started = no_wait_train(tmp_path, monkeypatch, aws)
    assert r.exit_code == 0 and len(started) == 1, r.output
    arn = started[0].execution_arn
    assert f"job cli-0123abcd: execution {arn}" in r.output
    assert "not waiting (--no-wait): job cli-0123abcd runs on" in r.output
    for command in (
        f"stagecoach inspect {arn}",
        "stagecoach list --stack st --region eu-west-1",
        "stagecoach stop cli-0123abcd --stack st",
    ):
        assert command in r.output, r.output
    assert "results:" not in r.output and "final loss" not in r.output
    assert started[0].predictions == [None]  # what _predict_cost returned (stubbed), kept beside the run


def test_no_wait_is_refused_where_the_job_would_end_with_the_command(tmp_path, monkeypatch):
    """The embedded stack of this process (job_commands None) ends with the command: refused
    before anything is deployed, with the way to a stack that outlives it."""
    import types

    from stagecoach.local.backend import LocalBackend

    owned = types.SimpleNamespace(job_commands=lambda _job, _arn: None)
    r, started = no_wait_train(tmp_path, monkeypatch, owned)
    assert r.exit_code != 0 and not started, r.output
    assert "the job would end with this command" in r.output and "stagecoach local start" in r.output
    daemon = types.SimpleNamespace(stack=object())  # a daemon's stack, not this process's own
    daemon.job_commands = lambda job, arn: LocalBackend.job_commands(daemon, job, arn)
    r, started = no_wait_train(tmp_path, monkeypatch, daemon)
    assert r.exit_code == 0 and len(started) == 1, r.output
    assert "stagecoach stop cli-0123abcd\n" in r.output and "stagecoach list\n" in r.output, r.output


# -- JOB: a job id or an execution ARN, for every command that names a job -------------------------

JOB = "tiny-0123abcd"
JOB_MACHINE = "arn:aws:states:us-east-1:210987654321:stateMachine:st-job"


def execution_arn(name, region="us-east-1"):
    """An execution of the job state machine of stack "st" in an AWS account (not the local stack's)."""
    return f"arn:aws:states:{region}:210987654321:execution:st-job:{name}"


class StandInStack:
    """A backend on a stack that holds a few job executions (name, status), oldest first: what
    ListExecutions and DescribeExecution answer, the spec and stop objects in S3, and the calls
    made. ``listed=False``: ListExecutions does not show them yet (it is eventually consistent)."""

    name = "aws"

    def __init__(self, executions, listed=True):
        import types

        from botocore.exceptions import ClientError

        from stagecoach.core import keys

        self.executions, self.listed, self.calls, self.objects = executions, listed, [], {keys.job_spec(JOB)}
        self.resources = types.SimpleNamespace(prefix="st", bucket="b", job_state_machine_arn=JOB_MACHINE)
        sfn = types.SimpleNamespace(get_paginator=self._paginator, describe_execution=self._describe)
        s3 = types.SimpleNamespace(head_object=self._head, put_object=self._put, exceptions=types.SimpleNamespace(ClientError=ClientError))
        self.clients = types.SimpleNamespace(sfn=sfn, s3=s3)

    def _items(self):
        return [{"name": n, "executionArn": execution_arn(n), "status": s, "startDate": i} for i, (n, s) in enumerate(self.executions)]

    def _paginator(self, operation):
        import types

        assert operation == "list_executions"
        pages = [{"executions": list(reversed(self._items())) if self.listed else []}]  # newest first, as Step Functions lists
        return types.SimpleNamespace(paginate=lambda stateMachineArn: pages)

    def _describe(self, executionArn):
        from botocore.exceptions import ClientError

        for item in self._items():
            if item["executionArn"] == executionArn:
                return {"executionArn": executionArn, "status": item["status"]}
        raise ClientError({"Error": {"Code": "ExecutionDoesNotExist", "Message": executionArn}}, "DescribeExecution")

    def _head(self, Bucket, Key):
        from botocore.exceptions import ClientError

        if Key not in self.objects:
            raise ClientError({"Error": {"Code": "404", "Message": "Not Found"}}, "HeadObject")
        return {}

    def _put(self, Bucket, Key, Body):
        self.objects.add(Key)

    def check_arn(self, arn):
        self.calls.append(("check_arn", arn))

    def resume(self, job_id, iterations):
        from stagecoach.deploy.resources import DeployError

        self.calls.append(("resume", job_id))
        raise DeployError("the test stops the resume here")

    def cleanup(self, job_id, **_options):
        import types

        self.calls.append(("cleanup", job_id))
        return types.SimpleNamespace(functions=[1], state_machines=[1], objects=[], roles=[], stopped=[])


def job_command(monkeypatch, stack, *args):
    """`stagecoach ARGS` in this process against ``stack``; returns the result and the (backend,
    stack, region) each backend was asked for with. inspect stops at the execution it would read."""
    from click.testing import CliRunner

    from stagecoach.cli import inspect, main, options
    from stagecoach.inspect.report import InspectError

    asked = []
    monkeypatch.delenv("AWS_REGION", raising=False)
    monkeypatch.delenv("STAGECOACH_STACK", raising=False)
    monkeypatch.setattr(
        options, "backend_for", lambda backend, stack_, region, need_daemon=False: asked.append((backend, stack_, region)) or stack
    )

    def inspected(_backend, arn):
        raise InspectError(f"inspected {arn}")

    monkeypatch.setattr(inspect, "inspect_execution", inspected)
    return CliRunner().invoke(main, list(args)), asked


def test_inspect_takes_a_job_id_and_reads_its_latest_execution(monkeypatch):
    """A job id: the job's latest execution (a resumption), as attach and resume find it, not
    another job's; an ARN: that execution, on the stack and region it names."""
    stack = StandInStack([(JOB, "FAILED"), (f"{JOB}-r1", "RUNNING"), ("other-0123abcd", "RUNNING")])
    r, asked = job_command(monkeypatch, stack, "inspect", JOB, "--stack", "st", "--region", "us-east-1")
    assert f"inspected {execution_arn(f'{JOB}-r1')}" in r.output and asked == [(None, "st", "us-east-1")], r.output
    r, asked = job_command(monkeypatch, stack, "inspect", execution_arn(JOB))
    assert f"inspected {execution_arn(JOB)}\n" in r.output and asked == [("aws", "st", "us-east-1")], r.output
    assert ("check_arn", execution_arn(JOB)) in stack.calls
    # not listed yet (ListExecutions is eventually consistent): the job's first execution, by its name
    r, _ = job_command(monkeypatch, StandInStack([(JOB, "RUNNING")], listed=False), "inspect", JOB, "--stack", "st")
    assert f"inspected {execution_arn(JOB)}" in r.output, r.output
    r, _ = job_command(monkeypatch, StandInStack([]), "inspect", "nosuch-0123abcd", "--stack", "st")
    assert r.exit_code == 1 and "no job nosuch-0123abcd in stack st (aws): `stagecoach list` shows its jobs" in r.output, r.output


def test_stop_resume_and_cleanup_take_an_arn_on_the_stack_it_names(monkeypatch):
    """Any execution's ARN names its job, stack and region: stop reaches the job's running
    resumption through its first execution's ARN; resume and cleanup act on the job."""
    from stagecoach.core import keys

    stack = StandInStack([(JOB, "FAILED"), (f"{JOB}-r1", "RUNNING")])
    r, asked = job_command(monkeypatch, stack, "stop", execution_arn(JOB))
    assert r.exit_code == 0 and f"job {JOB}: stop requested" in r.output, r.output
    assert keys.stop_request(JOB) in stack.objects and execution_arn(f"{JOB}-r1") in r.output
    assert asked == [("aws", "st", "us-east-1")]
    r, asked = job_command(monkeypatch, stack, "resume", execution_arn(f"{JOB}-r1", region="eu-west-1"))
    assert "the test stops the resume here" in r.output and ("resume", JOB) in stack.calls, r.output
    assert asked == [("aws", "st", "eu-west-1")]  # the ARN's region, not the default one
    r, asked = job_command(monkeypatch, stack, "cleanup", execution_arn(JOB, region="eu-west-1"), "--force")
    assert r.exit_code == 0 and "removed 1 functions, 1 state machines" in r.output, r.output
    assert ("cleanup", JOB) in stack.calls and asked == [("aws", "st", "eu-west-1")]


def test_a_job_argument_that_is_neither_is_refused_before_any_stack(monkeypatch):
    for command in ("inspect", "stop", "resume", "cleanup"):
        for ref in ("not-a-job", "arn:aws:s3:::bucket/key"):
            r, asked = job_command(monkeypatch, StandInStack([]), command, ref)
            assert r.exit_code != 0 and not asked, (command, r.output)
            assert f"{ref!r} is not a job id (NAME-xxxxxxxx" in r.output and "is not a job execution ARN" in r.output, r.output


def test_a_resumed_job_is_reached_by_its_id_or_any_arn_on_the_local_stack(backend, monkeypatch):
    """On the local stack: a finished job resumed through its first execution's ARN, stopped by its
    id (stop reaches the running resumption, not the first execution that ended), inspected by its
    id (the resumption, STOPPED) and cleaned up through the resumption's ARN."""
    from click.testing import CliRunner

    from stagecoach.cli import main, options

    monkeypatch.setattr(options, "running_stack", lambda: object())  # the session's stack stands in for the daemon
    job = tiny_job("cli-ids")
    run = job.run(stages=1, backend=backend)
    assert run.wait(progress=False, poll_s=0.2, timeout_s=240) == "SUCCEEDED"
    cli = CliRunner()
    r = cli.invoke(main, ["resume", run.execution_arn, "--iterations", "1000", "--no-wait"])  # far more than run before the stop
    assert r.exit_code == 0 and f"job {run.job_id}: resumed" in r.output, r.output
    resumed = r.output.split("execution ")[-1].strip()
    assert resumed.endswith(f":{run.job_id}-r1"), r.output
    r = cli.invoke(main, ["stop", run.job_id])
    assert r.exit_code == 0 and "stop requested" in r.output and resumed in r.output, r.output
    assert backend.attach(run.job_id).wait(progress=False, poll_s=0.2, timeout_s=300) == "STOPPED"
    r = cli.invoke(main, ["inspect", run.job_id])
    assert r.exit_code == 0 and f"job {run.job_id}: STOPPED" in r.output and f"execution {resumed}" in r.output, r.output
    r = cli.invoke(main, ["cleanup", resumed])
    assert r.exit_code == 0 and "removed 2 functions, 1 state machines" in r.output, r.output
