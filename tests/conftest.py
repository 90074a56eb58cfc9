import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))


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
