"""The console's web server: JSON views of a stack (stagecoach.console.data) and one static page.

Flask serves both (a small, well-kept framework the local stack already depends on through
moto's server). The page's JavaScript libraries — Cytoscape.js with the Eclipse Layout Kernel's
layered layout (elkjs, cytoscape-elk) for the state machine graph, Chart.js for the curves, the Gantt chart and the cost — are npm packages
(package.json), installed into the checkout's node_modules by ``npm ci`` (``make install``) and
served from there: the page loads nothing from the internet.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from botocore.exceptions import ClientError
from flask import Flask, Response, abort, jsonify, send_file
from werkzeug.serving import BaseWSGIServer, make_server

from stagecoach.backend import Backend
from stagecoach.console.data import ConsoleData, NoSuchJob
from stagecoach.deploy.resources import DeployError
from stagecoach.inspect.report import InspectError

STATIC = Path(__file__).parent / "static"
# the browser libraries, by the name the page asks for: their dist file in node_modules
VENDOR = {
    "cytoscape.min.js": "cytoscape/dist/cytoscape.min.js",
    "elk.bundled.js": "elkjs/lib/elk.bundled.js",
    "cytoscape-elk.js": "cytoscape-elk/dist/cytoscape-elk.js",
    "chart.umd.min.js": "chart.js/dist/chart.umd.min.js",
}


def node_modules() -> Path:
    """Where ``npm ci`` put the libraries: the checkout's node_modules (sdk/console -> the
    checkout's root), or STAGECOACH_NODE_MODULES."""
    env = os.environ.get("STAGECOACH_NODE_MODULES")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "node_modules"


def missing_libraries() -> list[str]:
    """The libraries' files that are not installed (the page cannot draw without them)."""
    root = node_modules()
    return [rel for rel in VENDOR.values() if not (root / rel).is_file()]


def missing_message(missing: list[str]) -> str:
    return (
        f"the console's JavaScript libraries are not installed ({', '.join(missing)} missing under {node_modules()}): "
        f"run `npm ci` in the checkout ({node_modules().parent}), as `make install` does"
    )


def _finite(value: Any) -> Any:
    """JSON has no NaN or Infinity (the browser's JSON.parse refuses them): a non-finite loss
    becomes null, which the charts draw as a gap."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _json(view: Callable[[], Any]) -> Response:
    """A view's answer as JSON; a job that is not there is a 404, a stack error a 502."""
    try:
        return jsonify(_finite(view()))
    except NoSuchJob as e:
        return Response(str(e), status=404, mimetype="text/plain")
    except (ClientError, DeployError, InspectError) as e:
        return Response(f"the stack answered: {e}", status=502, mimetype="text/plain")


def create_app(backend: Backend) -> Flask:
    """The console for one backend's stack."""
    app = Flask(__name__, static_folder=str(STATIC), static_url_path="/static")
    data = ConsoleData(backend)

    @app.get("/")
    def index() -> Response:
        missing = missing_libraries()
        if missing:
            return Response(missing_message(missing), status=503, mimetype="text/plain")
        return send_file(STATIC / "index.html")

    @app.get("/vendor/<name>")
    def vendor(name: str) -> Response:
        if name not in VENDOR:
            abort(404)
        path = node_modules() / VENDOR[name]
        if not path.is_file():
            return Response(missing_message([VENDOR[name]]), status=503, mimetype="text/plain")
        return send_file(path, mimetype="text/javascript")

    @app.get("/api/stack")
    def stack() -> Response:
        r = backend.resources
        return _json(lambda: {"backend": backend.name, "prefix": r.prefix, "region": r.region, "bucket": r.bucket})

    @app.get("/api/jobs")
    def jobs() -> Response:
        return _json(data.jobs)

    @app.get("/api/jobs/<job_id>")
    def job(job_id: str) -> Response:
        return _json(lambda: data.job(job_id))

    @app.get("/api/jobs/<job_id>/<view>")
    def job_view(job_id: str, view: str) -> Response:
        views = {"curves": data.curves, "gantt": data.gantt, "cost": data.cost, "failures": data.failures}
        if view not in views:
            abort(404)
        return _json(lambda: views[view](job_id))

    @app.get("/api/executions/<path:arn>")
    def execution(arn: str) -> Response:
        return _json(lambda: data.execution(arn))

    return app


def serve(app: Flask, host: str = "127.0.0.1", port: int = 0) -> BaseWSGIServer:
    """A threaded HTTP server for the console (``port`` 0: any free port, ``server_port`` says
    which); the caller runs ``serve_forever`` and ``shutdown``s it."""
    return make_server(host, port, app, threaded=True)
