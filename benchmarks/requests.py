"""S3 requests per iteration of the README demo, by kind of object: measured, before and after, and the model's count.

Runs the demo (examples/digits.py: 3 stages x 2 replicas x 2 micro-batches, scatter-reduce, Adam,
its test set evaluated after the last iteration) for ``--iterations`` iterations on an embedded
local stack of its own, twice:

  before  every replica writes its gradient as K shard objects (``STAGECOACH_GRADIENT_OBJECTS=chunks``,
          the layout before issue 26's cut)
  after   as the runtime does now: a small stage's gradient is one object, each sync task reads
          its shard with a ranged GET (planner/model/syncmodel.py ``one_gradient_object``)

Every S3 request the stack serves is counted from its request log (sdk/local/access.py
``REQUEST_LOG_ENV``: what AWS would bill, whoever makes it — workers, gates, the client), by
kind of object and by class: PUT (PutObject), LIST (ListObjectsV2, billed as a PUT), GET (GetObject,
HeadObject; a 404 is a poll for an object not there yet). Requests whose key names an iteration or
version t are per iteration: the steady state, t = 1 .. N-2, averaged; the rest (the launch, the
containers' cold reads of the job's spec and code, the gates' stop-request GETs, listings) are
shown per run. Beside them, the performance model's count per iteration (``Job.predict``:
``Estimate.s3_puts``/``s3_gets``, the tasks' requests; sdk/cost.py adds a PUT per task for its
metrics object), before (the model with one-object gradients off) and after.

Run: python benchmarks/requests.py [--iterations 8]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import runpy
import tempfile
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from unittest import mock
from urllib.parse import parse_qs

from stagecoach.lambdas.jobctx import GRADIENT_OBJECTS_ENV
from stagecoach.local.access import REQUEST_LOG_ENV
from stagecoach.local.backend import BUCKET, LocalBackend
from stagecoach.planner.model import syncmodel
from stagecoach.planner.model.platforms import Platform

DEMO = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "digits.py")

# (kind, pattern on the key below jobs/{job}/), first match wins
KINDS = [
    ("metrics", r"^metrics/"),
    ("activations", r"^iter/\d+/act/"),
    ("input gradients", r"^iter/\d+/grad/"),
    ("evaluation hand-offs", r"^iter/\d+/eval/"),
    ("gradient (one object)", r"^sync\d+/iter/\d+/gshard/.*/all$"),
    ("gradient shards", r"^sync\d+/iter/\d+/gshard/"),
    ("partials", r"^sync\d+/iter/\d+/partial/"),
    ("parameter read copies", r"^sync\d+/iter/\d+/params/"),
    ("parameters", r"^params/"),
    ("optimizer state", r"^optim/"),
    ("running statistics", r"^(buffers|iter/\d+/bnstats)/"),
    ("job spec and code", r"^(job\.json|model/|plan\.json)"),
    ("gate: stop request", r"^stop/"),
    ("gate: learnt timeouts", r"^timeouts\.json$"),
    ("abort markers", r"^abort/"),
    ("evaluation results", r"^eval/"),
    ("cost records", r"^cost/"),
]
_ITERATION = re.compile(r"(?:^|/)(?:it|iter/|v)(\d+)(?:/|$)")


@dataclass(frozen=True)
class Request:
    """One request the stack served: its billing class, the kind of object, the iteration it names (or None)."""

    cls: str  # "PUT", "LIST", "GET", "POLL" (a GET answered 404), "DELETE"
    kind: str
    t: int | None


def kind_of(rest: str) -> str:
    """The kind of object a key names, ``rest`` being the key without ``jobs/{job}/``."""
    for name, pattern in KINDS:
        if re.search(pattern, rest):
            return name
    return "other"


def parse_line(line: str) -> Request | None:
    """A request log line (sdk/local/access.py) as a Request; None for one outside the bucket's objects."""
    method, path, query, status = line.rstrip("\n").split("\t")
    bucket, _, key = path.lstrip("/").partition("/")
    if bucket != BUCKET:
        return None
    q = parse_qs(query, keep_blank_values=True)
    if not key:
        if "list-type" in q:
            key = q.get("prefix", [""])[0]
            cls = "LIST"
        elif "delete" in q:
            return Request("DELETE", "deletes", None)
        else:
            return None
    elif method in ("GET", "HEAD"):
        cls = "POLL" if status == "404" else "GET"
    elif method in ("PUT", "POST"):
        cls = "PUT"
    else:
        cls = "DELETE"
    rest = re.sub(r"^jobs/[^/]+/", "", key)
    if rest == key:  # outside the job's prefix: the data sets, the job name's history
        return Request(cls, "data set" if key.startswith("data/") else "history", None)
    found = _ITERATION.search(rest)
    return Request(cls, kind_of(rest), int(found.group(1)) if found else None)


def read_log(path: str) -> Iterator[Request]:
    with open(path) as f:
        for line in f:
            r = parse_line(line)
            if r is not None:
                yield r


def per_iteration(requests: list[Request], iterations: int) -> tuple[Counter[tuple[str, str]], Counter[tuple[str, str]]]:
    """(per iteration in the steady state, per run): request counts by (kind, class)."""
    steady = range(1, iterations - 1)
    each: Counter[tuple[str, str]] = Counter()
    run: Counter[tuple[str, str]] = Counter()
    for r in requests:
        if r.t is not None and r.t in steady:
            each[r.kind, r.cls] += 1
        elif r.t is None:
            run[r.kind, r.cls] += 1
    return Counter({k: v / len(steady) for k, v in each.items()}), run


def demo_job(iterations: int, name: str) -> tuple[Any, dict[str, Any]]:
    ns = runpy.run_path(DEMO)
    return dataclasses.replace(ns["job"], iterations=iterations, name=name), dict(ns["defaults"])


def measure(iterations: int, layout: str) -> tuple[list[Request], Any]:
    """Run the demo on a stack of its own with the request log on; its requests and the Run."""
    log = os.path.join(tempfile.mkdtemp(prefix="stagecoach-requests-"), "s3.log")
    env = {REQUEST_LOG_ENV: log, "STAGECOACH_LOCAL_ATTACH": "0", "STAGECOACH_LOCAL_START": "0"}
    if layout == "before":
        env[GRADIENT_OBJECTS_ENV] = "chunks"
    with mock.patch.dict(os.environ, env):
        backend = LocalBackend()  # started now: the stack and its workers inherit the variables
        try:
            job, defaults = demo_job(iterations, f"requests-{layout}")
            run = job.run(backend=backend, **defaults)
            run.wait(progress=False, timeout_s=1800)
            run.metrics()
        finally:
            backend.stack.close()
    return list(read_log(log)), run


def model_counts(iterations: int) -> dict[str, tuple[float, float, float, float]]:
    """The model's (PUTs, GETs, GETs without polls, tasks) per iteration of the demo's plan, before
    and after the cut. Its polls are AWS's (30 ms requests): the local stack's, a few ms, poll less."""
    job, defaults = demo_job(iterations, "requests-model")
    plan = job.manual_plan(**defaults)
    out = {}
    for layout, limit in (("before", 0), ("after", syncmodel.ONE_OBJECT_GRADIENT_BYTES)):
        with mock.patch.object(syncmodel, "ONE_OBJECT_GRADIENT_BYTES", limit):
            est = job.predict(plan)
            with mock.patch.object(Platform, "polls_while_waiting", lambda self, wait_s, *_, **__: 0.0):
                quiet = job.predict(plan)
        out[layout] = (est.s3_puts, est.s3_gets, quiet.s3_gets, est.invocations)
    return out


def _sum(c: Counter[tuple[str, str]], classes: tuple[str, ...], skip: tuple[str, ...] = ()) -> float:
    return sum(v for (kind, cls), v in c.items() if cls in classes and kind not in skip)


def report(
    counts: dict[str, tuple[Counter[tuple[str, str]], Counter[tuple[str, str]]]],
    model: dict[str, tuple[float, float, float, float]],
    n: int,
) -> None:
    layouts = list(counts)
    kinds = sorted({k for each, _ in counts.values() for (k, _c) in each})
    print(f"per iteration (steady state, iterations 1..{n - 2}); GET includes HEAD; POLL = a GET answered 404")
    head = "".join(f" | {lay + ' PUT':>11} {'LIST':>5} {'GET':>6} {'POLL':>5}" for lay in layouts)
    print(f"{'kind':<24}{head}")
    for kind in kinds:
        cells = "".join(
            f" | {counts[lay][0][kind, 'PUT']:>11.2f} {counts[lay][0][kind, 'LIST']:>5.2f} {counts[lay][0][kind, 'GET']:>6.2f} {counts[lay][0][kind, 'POLL']:>5.2f}"
            for lay in layouts
        )
        print(f"{kind:<24}{cells}")
    totals = "".join(
        f" | {_sum(counts[lay][0], ('PUT',)):>11.2f} {_sum(counts[lay][0], ('LIST',)):>5.2f} {_sum(counts[lay][0], ('GET',)):>6.2f} {_sum(counts[lay][0], ('POLL',)):>5.2f}"
        for lay in layouts
    )
    print(f"{'total':<24}{totals}")
    print("\nper run (no iteration in the key)")
    for lay in layouts:
        run = counts[lay][1]
        print(f"  {lay}: " + ", ".join(f"{kind} {cls} {v}" for (kind, cls), v in sorted(run.items()) if cls != "DELETE"))
    print("\nmeasured vs the performance model, per iteration (the model: the tasks' requests, polls as expected values;")
    print("its PUTs leave out each task's metrics object, which sdk/cost.py adds: one per task)")
    print(
        f"{'':<8} {'tasks PUT':>10} {'model':>7} | {'metrics PUT':>11} {'tasks':>6} | {'tasks GET':>10} {'model':>7} | {'POLL':>6} {'model':>7}"
    )
    for lay in layouts:
        each = counts[lay][0]
        puts, gets, quiet, tasks = model[lay]
        others = ("metrics", "gate: learnt timeouts", "gate: stop request")
        print(
            f"{lay:<8} {_sum(each, ('PUT',), others):>10.2f} {puts:>7.2f} | {each['metrics', 'PUT']:>11.2f} {tasks:>6.0f} | "
            f"{_sum(each, ('GET',), others):>10.2f} {quiet:>7.2f} | {_sum(each, ('POLL',), others):>6.2f} {gets - quiet:>7.2f}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iterations", type=int, default=8, help="iterations per run (at least 3)")
    args = ap.parse_args()
    n = max(3, args.iterations)
    counts = {}
    for layout in ("before", "after"):
        requests, _run = measure(n, layout)
        counts[layout] = per_iteration(requests, n)
    report(counts, model_counts(n), n)


if __name__ == "__main__":
    main()
