"""`stagecoach train FILE` end to end on the local stack, with a manual plan from the options."""

import os
import subprocess
import sys
import textwrap

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
    plans = [line for line in r.stdout.splitlines() if line.rstrip().endswith(("milp", "heuristic")) or " milp" in line]
    assert plans and all(" 1x64 " in line for line in plans)  # one replica, one micro-batch of 64


def test_the_amoebanet_example_trains_with_pairs_across_cuts(tmp_path):
    """examples/amoebanet.py: the zoo's AmoebaNet-D cells on three stages, (state, skip) tuples
    crossing both cuts through the state machines."""
    r = stagecoach("train", os.path.join(ROOT, "examples", "amoebanet.py"), "--iterations", "4", "--out", "out", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "plan: 3 stages (layers per stage [3, 3, 3]) x 1 replicas, 1 micro-batches of 64" in r.stdout
    assert "after 4 iterations" in r.stdout and "test accuracy" in r.stdout


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
