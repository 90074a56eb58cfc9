import atexit
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

# Tests run on stacks of their own: never attach to a developer's daemon of this project (a home of
# the session's own) nor start one on demand (STAGECOACH_LOCAL_START=0, also in the `stagecoach`
# subprocesses tests run). A test that needs a daemon starts one in a temporary STAGECOACH_HOME.
os.environ["STAGECOACH_HOME"] = tempfile.mkdtemp(prefix="stagecoach-test-home-")
atexit.register(shutil.rmtree, os.environ["STAGECOACH_HOME"], ignore_errors=True)
os.environ["STAGECOACH_LOCAL_START"] = "0"


@pytest.fixture(scope="session")
def backend():
    """One embedded local stack for the whole session (as one SDK process would use it)."""
    from stagecoach.local.backend import LocalBackend

    return LocalBackend()


@pytest.fixture(scope="session")
def asl_validator():
    exe = os.path.join(ROOT, "node_modules", ".bin", "asl-validator")
    if not os.path.exists(exe):
        npm = shutil.which("npm")
        assert npm, "npm is needed for asl-validator (see README: make test installs it)"
        subprocess.run([npm, "ci", "--no-audit", "--no-fund"], cwd=ROOT, check=True)
    return exe


@pytest.fixture(scope="module", autouse=True)
def _the_shared_stack_outlives_each_module(request: pytest.FixtureRequest):
    """A bare LocalBackend() is the process's one shared stack, the session's ``backend``: a module
    that closes it (``backend.stack.close()`` on its own LocalBackend()) fails every later stack test
    with connection errors far from the cause. Name the module that did it instead."""
    yield
    local = sys.modules.get("stagecoach.local.backend")  # not imported: no stack was started
    shared = local.LocalBackend._shared if local is not None else None
    if shared is not None and not shared.alive() and not getattr(shared, "_reported_dead", False):
        shared._reported_dead = True
        pytest.fail(
            f"{request.module.__name__} left the session's shared local stack dead: a LocalBackend() without "
            "options is that stack, never close it (use the `backend` fixture, or a stack of its own: faults=...)"
        )


_STACK_FIXTURES = {"backend"}


def _starts_a_stack(item: pytest.Item) -> bool:
    """A test that uses the session stack, or whose module builds a LocalBackend of its own."""
    if _STACK_FIXTURES & set(getattr(item, "fixturenames", ())):
        return True
    module = getattr(item, "module", None)
    if module is None:
        return False
    cached = getattr(module, "_stagecoach_starts_stack", None)
    if cached is None:
        with open(module.__file__) as f:
            source = f.read()
        # its own LocalBackend (directly or through helpers.capped_backend), or a `stagecoach train`
        # subprocess (which starts one)
        cached = "LocalBackend(" in source or "capped_backend(" in source or '"train"' in source
        module._stagecoach_starts_stack = cached
    return bool(cached)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _starts_a_stack(item):
            item.add_marker(pytest.mark.stack)
