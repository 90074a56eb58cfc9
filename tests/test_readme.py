"""README.md's commands work as written: every fenced shell command that needs no AWS account is
run, and the Python example is executed, on a fresh directory that sees the repository's examples/.
Commands that need AWS or that are the test suite itself are listed with why they are not run here."""

import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)

# command prefix -> why this test does not run it (each is still run elsewhere or needs AWS)
NOT_HERE = {
    "make demo": "the main job: .ci/run runs it after the tests",
    "make test": "the test suite itself",
    "sam ": "needs an AWS account (sam deploy)",
    "stagecoach train examples/digits.py --backend aws": "needs an AWS account",
    "stagecoach train examples/resnet.py": "tests/test_cli.py runs it (fewer iterations)",
    "stagecoach train examples/amoebanet.py": "tests/test_cli.py runs it (fewer iterations)",
    "stagecoach train examples/bert.py": "tests/test_cli.py runs it (fewer iterations)",
    "stagecoach inspect EXECUTION_ARN": "needs an execution of a real run (tests/test_inspect.py runs inspect on one)",
    "stagecoach cleanup JOB_ID --stack": "needs an AWS account",
    "stagecoach stop JOB_ID --stack": "needs an AWS account (tests/test_cost.py runs `stagecoach stop` on the local stack)",
    "stagecoach train examples/digits.py --no-wait": "leaves a daemon stack running: tests/test_local_daemon.py runs --no-wait on one of its own",
    "stagecoach console": "serves until Ctrl-C: tests/test_console.py serves it and loads its page in headless Chromium",
}


def blocks(lang: str) -> list[str]:
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    return re.findall(rf"^```{lang}\n(.*?)^```", text, flags=re.S | re.M)


def shell_commands() -> list[str]:
    out = []
    for block in blocks("bash"):
        for line in block.splitlines():
            cmd = line.split("  #")[0].strip()
            if cmd:
                out.append(cmd)
    return out


def test_every_readme_command_is_run_here_or_says_why_not():
    cmds = shell_commands()
    assert len(cmds) >= 6
    unknown = [c for c in cmds if not c.startswith("stagecoach plan") and not any(c.startswith(p) for p in NOT_HERE)]
    assert not unknown, f"README commands this test neither runs nor explains: {unknown}"


@pytest.fixture
def workdir(tmp_path):
    os.symlink(os.path.join(ROOT, "examples"), tmp_path / "examples")
    return tmp_path


@pytest.mark.parametrize("cmd", [c for c in shell_commands() if c.startswith("stagecoach plan")])
def test_readme_plan_commands_run_as_written(cmd, workdir):
    env = {**os.environ, "PATH": BIN + os.pathsep + os.environ.get("PATH", "")}
    assert shutil.which("stagecoach", path=env["PATH"]), "stagecoach is not installed in this environment"
    r = subprocess.run(cmd, shell=True, cwd=workdir, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"{cmd}\n{r.stdout}\n{r.stderr}"
    assert "recommended" in r.stdout
    png = re.search(r"Pareto plot: (\S+)", r.stdout)
    assert png and os.path.getsize(os.path.join(workdir, png.group(1))) > 0


@pytest.mark.stack  # Job.run starts the embedded local stack
def test_readme_python_example_trains_on_the_local_stack(workdir, monkeypatch):
    (code,) = blocks("python")
    monkeypatch.chdir(workdir)
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    losses = scope["run"].losses()
    assert len(losses) == scope["job"].iterations and all(loss == loss for loss in losses)  # no NaN: every iteration ran
    assert scope["model"] is not None


def test_every_module_path_the_docs_name_exists():
    """README.md and docs/*.md name files of this repository (sdk/..., planner/..., lambdas/...,
    tests/...); each must exist, so a move or rename cannot leave the docs pointing nowhere."""
    pages = [os.path.join(ROOT, "README.md")] + [
        os.path.join(ROOT, "docs", f) for f in sorted(os.listdir(os.path.join(ROOT, "docs"))) if f.endswith(".md")
    ]
    missing = []
    for page in pages:
        with open(page) as f:
            text = f.read()
        for path in set(re.findall(r"(?<![\w/.-])((?:sdk|planner|lambdas|tests|benchmarks|examples)/[\w/]*\w(?:\.py)?)", text)):
            full = os.path.join(ROOT, path)
            if not (os.path.exists(full) or os.path.exists(full + ".py")):  # `core/training.build_model`
                missing.append(f"{os.path.relpath(page, ROOT)}: {path}")
    assert not missing, "\n".join(sorted(missing))
