"""The local stack's server listens with a backlog of LISTEN_BACKLOG, not werkzeug's 128.

With werkzeug's 128 a 2 x 128 job overflowed the accept queue (sdk/local/stack.py ``serve``). The
test starts a stack process of its own, as every LocalBackend does, and reads the backlog of the
socket it listens on from the kernel: for a listening TCP socket ``ss -ltn`` prints in Send-Q the
socket's sk_max_ack_backlog, the backlog of its last listen() (capped by net.core.somaxconn), and
in Recv-Q the connections waiting to be accepted (net/ipv4/tcp_diag.c; sock_diag(7);
https://serverfault.com/questions/432022/linux-netstat-listening-queue-length).
"""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
from werkzeug.serving import LISTEN_QUEUE

from stagecoach.local.process import OwnedStack
from stagecoach.local.stack import LISTEN_BACKLOG

pytestmark = pytest.mark.stack  # it starts a stack process (conftest marks by LocalBackend only)


def somaxconn() -> int:
    with open("/proc/sys/net/core/somaxconn") as f:
        return int(f.read())


def listen_backlog(port: int) -> int:
    """Send-Q of the one TCP socket listening on 127.0.0.1:``port``: its backlog."""
    out = subprocess.run(["ss", "-Hltn", f"sport = :{port}"], capture_output=True, text=True, check=True).stdout
    rows = [line.split() for line in out.splitlines() if line.strip()]
    assert len(rows) == 1, f"one socket listens on port {port}, ss shows: {out!r}"
    state, _recv_q, send_q, local = rows[0][:4]
    assert state == "LISTEN" and local == f"127.0.0.1:{port}", rows[0]
    return int(send_q)


@pytest.mark.skipif(not sys.platform.startswith("linux") or shutil.which("ss") is None, reason="reads the backlog with Linux's ss")
def test_the_stack_listens_with_a_backlog_above_werkzeugs():
    expected = min(LISTEN_BACKLOG, somaxconn())  # the kernel caps listen()'s backlog at somaxconn
    if expected <= LISTEN_QUEUE:
        pytest.skip(f"net.core.somaxconn={somaxconn()} caps any backlog at werkzeug's {LISTEN_QUEUE}: nothing to tell apart")
    stack = OwnedStack()
    try:
        assert stack.alive()
        assert listen_backlog(stack.port) == expected
    finally:
        stack.close()
