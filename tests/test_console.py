"""`stagecoach console`: the JSON views on a real run (Flask's test client), the page in headless
Chromium (Debian's package), the state machine graph and its statuses, and the libraries served
from node_modules (never a CDN).

The run: a short job on a stack of its own whose first forward task at iteration 1 fails
(LocalBackend(faults=...), sdk/local/faults.py): its window fails and is restarted, so the job
succeeds with one failed task in its history — what the console's failed-task panel shows.
"""

import json
import os
import re
import shutil
import subprocess
import threading
import time

import pytest
from click.testing import CliRunner
from helpers import recovery_job

from stagecoach.console import create_app, serve
from stagecoach.console.app import STATIC, VENDOR
from stagecoach.console.graph import elements, state_statuses
from stagecoach.local.backend import LocalBackend
from stagecoach.planner.model.platforms import aws_platform

SHOTS = "/tmp/console-shots"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FAULT = {"kind": "fail", "phase": "forward", "t": 1, "stage": 0}


# ------------------------------------------------------------------------------------ no stack
def _definition():
    """A window-like definition: a Parallel holding a Map whose task retries, a catch, a Fail."""
    task = {"Type": "Task", "Resource": "arn:aws:states:::lambda:invoke", "End": True}
    inner = {"StartAt": "FTask", "States": {"FTask": task}}
    return {
        "StartAt": "Init",
        "States": {
            "Init": {"Type": "Pass", "Next": "Forward"},
            "Forward": {
                "Type": "Parallel",
                "Branches": [{"StartAt": "F0", "States": {"F0": {"Type": "Map", "ItemProcessor": inner, "End": True}}}],
                "Catch": [{"ErrorEquals": ["States.ALL"], "Next": "Failed"}],
                "Next": "Done",
            },
            "Failed": {"Type": "Fail"},
            "Done": {"Type": "Succeed"},
        },
    }


def _entered(i, typ, name):
    return {"id": i, "previousEventId": i - 1, "type": typ, "stateEnteredEventDetails": {"name": name}}


def _exited(i, typ, name):
    return {"id": i, "previousEventId": i - 1, "type": typ, "stateExitedEventDetails": {"name": name}}


def test_the_graph_has_every_state_inside_its_map_and_parallel_and_the_console_s_start_and_end():
    els = elements(_definition())
    nodes = {e["data"]["id"]: e["data"] for e in els if "source" not in e["data"]}
    edges = {(e["data"]["source"], e["data"]["target"]) for e in els if "source" in e["data"]}
    assert set(nodes) == {"__start__", "__end__", "Init", "Forward", "F0", "FTask", "Failed", "Done"}
    assert nodes["F0"]["parent"] == "Forward" and nodes["FTask"]["parent"] == "F0"
    assert {("__start__", "Init"), ("Init", "Forward"), ("Forward", "Done"), ("Forward", "Failed"), ("Done", "__end__")} <= edges


def test_state_statuses_follow_the_history():
    """A task that failed inside a Map inside a Parallel whose Catch took the error: the task and
    its Map failed, the Parallel caught the error, the Fail state failed, Done never ran."""
    events = [
        {"id": 1, "previousEventId": 0, "type": "ExecutionStarted"},
        _entered(2, "PassStateEntered", "Init"),
        _exited(3, "PassStateExited", "Init"),
        _entered(4, "ParallelStateEntered", "Forward"),
        _entered(5, "MapStateEntered", "F0"),
        _entered(6, "TaskStateEntered", "FTask"),
        {"id": 7, "previousEventId": 6, "type": "TaskScheduled", "taskScheduledEventDetails": {"parameters": "{}"}},
        {"id": 8, "previousEventId": 7, "type": "TaskStarted"},
        {"id": 9, "previousEventId": 8, "type": "TaskFailed", "taskFailedEventDetails": {"error": "E", "cause": "c"}},
        {"id": 10, "previousEventId": 9, "type": "MapStateFailed"},
        {"id": 11, "previousEventId": 10, "type": "ParallelStateFailed"},
        _exited(12, "ParallelStateExited", "Forward"),
        _entered(13, "FailStateEntered", "Failed"),
        {"id": 14, "previousEventId": 13, "type": "ExecutionFailed"},
    ]
    got = state_statuses(_definition(), events, "FAILED")
    assert got == {
        "Init": "SUCCEEDED",
        "Forward": "CAUGHT_ERROR",
        "F0": "FAILED",
        "FTask": "FAILED",
        "Failed": "FAILED",
        "Done": "NOT_STARTED",
    }
    running = state_statuses(_definition(), events[:8], "RUNNING")
    assert running["FTask"] == running["F0"] == running["Forward"] == "IN_PROGRESS"
    assert state_statuses(_definition(), events[:8], "ABORTED")["FTask"] == "CANCELLED"


def test_the_page_loads_its_libraries_from_node_modules_never_a_cdn():
    html = (STATIC / "index.html").read_text()
    scripts = re.findall(r'<script src="([^"]+)"', html)
    assert scripts == [f"/vendor/{name}" for name in VENDOR] + ["/static/console.js"]
    for name in ("index.html", "console.js", "console.css"):
        assert not re.search(r"https?://", (STATIC / name).read_text()), name


# ------------------------------------------------------------------------------------ a real run
@pytest.fixture(scope="module")
def faulty():
    b = LocalBackend(faults={"once": [FAULT]})
    yield b
    b.stack.close()


@pytest.fixture(scope="module")
def run(faulty):
    r = recovery_job("console").run(stages=2, replicas=1, micro_batches=2, timeout_s=20, backend=faulty)
    r.wait(progress=False, poll_s=0.2, timeout_s=600)
    return r


@pytest.fixture(scope="module")
def client(faulty, run):
    return create_app(faulty).test_client()


def test_the_jobs_view_lists_the_job(client, run):
    jobs = client.get("/api/jobs").get_json()
    assert [(j["job"], j["status"], j["iterations"]) for j in jobs] == [(run.job_id, "SUCCEEDED", 5)]


def test_the_job_view_has_its_chain_and_both_windows(client, run):
    j = client.get(f"/api/jobs/{run.job_id}").get_json()
    assert j["status"] == "SUCCEEDED" and j["iterations_done"] == 5
    assert [e["arn"] for e in j["executions"]] == run.executions()
    assert [w["status"] for w in j["windows"]] == ["FAILED", "SUCCEEDED"]  # the window failed, then ran again
    assert all((w["start"], w["end"]) == (0, 5) for w in j["windows"])
    assert client.get("/api/jobs/nosuch-00000000").status_code == 404


def test_the_execution_view_colours_the_failed_window_s_states(client, run):
    failed = client.get(f"/api/jobs/{run.job_id}").get_json()["windows"][0]["arn"]
    x = client.get(f"/api/executions/{failed}").get_json()
    assert x["status"] == "FAILED"
    assert x["states"]["Forward0Task"] == "FAILED" and x["states"]["Init"] == "SUCCEEDED"
    assert x["states"]["Failed"] == "FAILED" and x["states"]["Done"] == "NOT_STARTED"
    ids = {e["data"]["id"] for e in x["elements"]}
    assert set(x["states"]) <= ids and "Gate" in ids
    assert any(e["type"] == "TaskFailed" and e["error"] == "Stagecoach.InjectedFailure" for e in x["events"])


def test_the_curves_gantt_and_cost_views_are_the_run_s(client, run):
    c = client.get(f"/api/jobs/{run.job_id}/curves").get_json()
    assert c["losses"] == pytest.approx(run.losses())
    g = client.get(f"/api/jobs/{run.job_id}/gantt").get_json()
    assert g["rows"] == ["stage 0 replica 0", "stage 1 replica 0"]
    assert {t["phase"] for t in g["tasks"]} == {"forward", "backward"} and g["iterations"] == [0, 4]
    cost = client.get(f"/api/jobs/{run.job_id}/cost").get_json()
    assert cost["measured"]["usd"] == pytest.approx(run.cost().usd, rel=0.05)
    assert cost["measured_s_per_iteration"] > 0


def test_a_failed_task_shows_its_error_cause_and_worker_log(client, run):
    fs = client.get(f"/api/jobs/{run.job_id}/failures").get_json()
    assert [(f["phase"], f["stage"], f["t"], f["error"]) for f in fs] == [("forward", 0, 1, "Stagecoach.InjectedFailure")]
    assert "injected" in fs[0]["cause"]
    assert fs[0]["log"]["source"].endswith("workers.log")
    assert any("injected fail" in line for line in fs[0]["log"]["lines"]), fs[0]["log"]


def test_the_libraries_are_served_or_a_clear_error_names_npm_ci(client, monkeypatch, tmp_path):
    js = client.get("/vendor/cytoscape.min.js")
    assert js.status_code == 200 and js.mimetype == "text/javascript" and len(js.data) > 100_000
    assert client.get("/vendor/anything.js").status_code == 404
    monkeypatch.setenv("STAGECOACH_NODE_MODULES", str(tmp_path))
    for path in ("/", "/vendor/chart.umd.min.js"):
        r = client.get(path)
        assert r.status_code == 503 and "npm ci" in r.get_data(as_text=True)


def test_the_command_refuses_without_a_local_daemon(monkeypatch, tmp_path):
    from stagecoach.cli import main

    monkeypatch.setenv("STAGECOACH_HOME", str(tmp_path))  # no daemon's record there
    monkeypatch.setenv("STAGECOACH_LOCAL_START", "0")  # and none started on demand
    r = CliRunner().invoke(main, ["console", "--no-open", "--port", "0"])
    assert r.exit_code == 1 and "local stack" in r.output, r.output


# ------------------------------------------------------------------------------------ the browser
@pytest.fixture(scope="module")
def server(faulty, run):
    srv = serve(create_app(faulty))
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{srv.server_port}/"
    srv.shutdown()


def _chromium(url, *extra):
    if CHROMIUM is None:
        pytest.skip("chromium is not installed (apt-get install -y chromium; .ci/run installs it)")
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=8000", *extra, url]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def _dom(url):
    out = _chromium(url, "--dump-dom")
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_the_page_shows_the_job_its_graph_and_its_failed_task(server, run):
    dom = _dom(server)
    assert f'data-job="{run.job_id}"' in dom
    assert "error:" not in re.search(r'<span id="updated">([^<]*)</span>', dom).group(1)
    rendered = re.search(r'<div id="graph"[^>]*data-rendered="([^"]*)"', dom).group(1).split(",")
    assert {"Init", "Gate", "Forward", "Forward0Task", "BackwardSync", "Done"} <= set(rendered)
    assert 'data-state="Done" data-status="SUCCEEDED"' in dom  # the latest window, which succeeded
    assert 'data-error="Stagecoach.InjectedFailure"' in dom and "injected fail" in dom
    points = dict(re.findall(r'<canvas id="(\w+)"[^>]*data-points="(\d+)"', dom))
    # 5 iterations x (forward of stage 0, backward of stage 1 (its forward fused in), backward of stage 0)
    assert int(points["loss"]) == 5 and int(points["gantt"]) == 15


def test_the_failed_window_s_graph_shows_where_it_failed(server, run, faulty):
    failed = create_app(faulty).test_client().get(f"/api/jobs/{run.job_id}").get_json()["windows"][0]["arn"]
    dom = _dom(f"{server}#job={run.job_id}&exec={failed}")
    assert 'data-state="Forward0Task" data-status="FAILED"' in dom
    assert 'data-state="Forward" data-status="CAUGHT_ERROR"' in dom


def test_screenshots(server, run, faulty):
    """Screenshots to look at (/tmp/console-shots): the page on the job, and on its failed window."""
    os.makedirs(SHOTS, exist_ok=True)
    failed = create_app(faulty).test_client().get(f"/api/jobs/{run.job_id}").get_json()["windows"][0]["arn"]
    for name, url in (("job", server), ("failed-window", f"{server}#job={run.job_id}&exec={failed}")):
        path = os.path.join(SHOTS, f"{name}.png")
        out = _chromium(url, f"--screenshot={path}", "--window-size=1400,3200", "--hide-scrollbars")
        assert out.returncode == 0 and os.path.getsize(path) > 10_000, out.stderr[-2000:]


def _refuse(constant):
    raise ValueError(f"{constant} in the JSON")


def test_the_json_views_are_json(client, run):
    """No NaN or Infinity in any answer (the browser's JSON.parse refuses them)."""
    for view in ("", "/curves", "/gantt", "/cost", "/failures"):
        body = client.get(f"/api/jobs/{run.job_id}{view}").get_data(as_text=True)
        json.loads(body, parse_constant=_refuse)  # NaN, Infinity, -Infinity


def test_a_prediction_train_recorded_is_shown_beside_the_measured_cost(faulty, run):
    """A plan given by hand carries no planner prediction; the cost `stagecoach train` predicts and
    prints is kept beside the run (Run.record_prediction) and the cost view shows it."""
    view = f"/api/jobs/{run.job_id}/cost"
    assert create_app(faulty).test_client().get(view).get_json()["predicted_usd_per_iteration"] is None
    platform = aws_platform("x86_64" if faulty.resources.architecture == "x86_64" else "arm64")
    report = run.job.predict_cost(run.plan, platform)
    run.record_prediction(report)
    cost = create_app(faulty).test_client().get(view).get_json()  # a new console: none of the first's cache
    assert cost["predicted_usd_per_iteration"] == pytest.approx(report.usd / report.iterations)
    assert cost["predicted_usd"] == pytest.approx(report.usd)


def test_the_views_follow_a_job_while_it_runs(faulty):
    """What the page polls every 2 s changes as the job runs: the job's status and iterations done,
    read again on each request (a running job's records are never kept as final)."""
    r = recovery_job("console-live").run(stages=2, replicas=1, micro_batches=2, timeout_s=20, backend=faulty)
    client = create_app(faulty).test_client()
    seen = []
    deadline = time.time() + 300
    while time.time() < deadline:
        j = client.get(f"/api/jobs/{r.job_id}").get_json()
        seen.append((j["status"], j["iterations_done"]))
        if j["status"] != "RUNNING":
            break
        time.sleep(0.3)
    assert seen[0][0] == "RUNNING" and seen[-1] == ("SUCCEEDED", 5), seen
    done = [n for status, n in seen if status == "RUNNING"]
    assert done == sorted(done) and len(set(done)) >= 2, seen  # progress seen while it ran
