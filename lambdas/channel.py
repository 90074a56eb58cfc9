"""The S3 channel between workers: tensors as safetensors, waiting by GET with backoff.

S3 is strongly consistent, so a worker that needs an object another worker writes simply GETs it
until it exists (never LIST). Requests may run concurrently (``submit_put``/``submit_wait``: one
pool for uploads, one for downloads, since a Lambda's network is full duplex), so the collectives
can upload while they download and keep several requests in flight to hide S3's latency.

For the task's metrics the channel records bytes, requests and *union* times: ``upload_s`` is the
time at least one upload was in flight, ``download_s`` likewise, ``transfer_s`` the time any
transfer was, ``wait_s`` the time spent only waiting for another worker's object. With concurrent
requests these overlap each other and compute, so the task's compute share is
duration - transfer_s - wait_s.

On the local stack each worker process may emulate Lambda's network (core/netem.py): a request
completes no earlier than its emulated link allows.
"""

from __future__ import annotations

import functools
import json
import os
import random
import re
import struct
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from pydantic import ValidationError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from stagecoach.core.netem import Network, network
from stagecoach.core.records import TaskMetrics
from stagecoach.errors import StagecoachError
from stagecoach.planner.limits import JOB_POLL_BUDGET_PER_S, POLL_BUDGET_ENV, UPLOADS_IN_FLIGHT

# Iteration objects carry this tag; the bucket's lifecycle rule expires tagged objects as a safety net
# (S3 lifecycle filters cannot match jobs/*/iter/ by prefix).
TRANSIENT_TAG = "stagecoach%3Atransient=true"
# A waiter's pause between GETs is WAIT_FACTOR x the time it has waited so far, at least WAIT_FIRST_S
# and at most WAIT_MAX_S (or its budget's cap, ``poll_cap_s``): docs/runtime.md "Waiting for an
# object" says why these numbers; planner/model/platforms.py counts the same loop.
WAIT_FIRST_S = 0.005
WAIT_FACTOR = 0.2
WAIT_MAX_S = 0.04
WAIT_JITTER = 0.25  # each pause is drawn between 1 -/+ this times it, so waiters do not poll in step
# A wait that recurs every iteration (its key names an iteration or a version: ``wait_pattern``) sleeps
# WAIT_AHEAD x the shortest of its last WAIT_MEMORY waits in this process before its first GET,
# then polls as a fresh wait (``expected_wait_s``; docs/runtime.md "Waiting for an object").
WAIT_AHEAD_ENV = "STAGECOACH_WAIT_AHEAD"  # another share, 0: off (to measure the loop without it: benchmarks/wait_schedule.py)
WAIT_AHEAD = float(os.environ.get(WAIT_AHEAD_ENV) or 0.8)
WAIT_MEMORY = 3
WAIT_SLEEP_STEP_S = 0.05  # how often a sleeping waiter looks whether its task failed elsewhere (no GET)


def poll_cap_s(waiters: int) -> float:
    """The pause between one waiter's GETs at which ``waiters`` waiting workers together poll at the
    job's budget (planner/limits.py JOB_POLL_BUDGET_PER_S, or the endpoint's own in
    ``POLL_BUDGET_ENV``): 1 s at 1,000 waiters. A worker's pause grows with its wait up to the
    larger of WAIT_MAX_S and this times the number of objects it waits for at once
    (``Channel.wait_bytes``), so a worker waiting for eight objects polls no faster than one
    waiting for one; each pause is jittered between 3/4 and 5/4 of it."""
    budget = float(os.environ.get(POLL_BUDGET_ENV) or JOB_POLL_BUDGET_PER_S)
    return waiters / budget


# Requests in flight per direction: enough to keep a ~78 MB/s link busy through S3's first-byte
# latency with chunks of a few MB, few enough that objects arrive in the order they are needed.
# (UPLOADS_IN_FLIGHT lives in planner/limits.py: the performance model prices its grouping.)
DOWNLOADS_IN_FLIGHT = 8
# Pipeline hand-offs (activations, input gradients) another stage is waiting on go in a lane of
# their own, so they never queue behind the gradient shards the last backward pass streams out.
HANDOFFS_IN_FLIGHT = 2
# Deletes of what nobody reads any more run beside the task's work, in a lane of their own: a
# request's latency on a task's end (or queued behind its last uploads) would be on the
# iteration's critical path, and nobody waits on a delete.
DELETES_IN_FLIGHT = 2
_LANES = {"up": UPLOADS_IN_FLIGHT, "down": DOWNLOADS_IN_FLIGHT, "handoff": HANDOFFS_IN_FLIGHT, "delete": DELETES_IN_FLIGHT}


# safetensors dtype names -> torch; tensors are viewed in the downloaded bytes, not copied out of them
_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}  # torch -> safetensors' name
warnings.filterwarnings("ignore", message="The given buffer is not writable")


def flat_safetensors(name: str, flat: torch.Tensor, header_bytes: int) -> bytes:
    """``{name: flat}`` as safetensors with its header padded to ``header_bytes`` (the format pads
    headers with spaces), so the data of a 1-D tensor starts at a known offset, 8 + header_bytes:
    a reader can fetch any part of it with one ranged GET and no look at the header first."""
    data = flat.contiguous().view(torch.uint8).numpy().tobytes()
    info = {name: {"dtype": DTYPE_NAMES[flat.dtype], "shape": [flat.numel()], "data_offsets": [0, len(data)]}}
    header = json.dumps(info, separators=(",", ":")).encode()
    if len(header) > header_bytes:
        raise ValueError(f"a safetensors header of {len(header)} bytes does not fit {header_bytes}")
    return struct.pack("<Q", header_bytes) + header.ljust(header_bytes, b" ") + data


def load_tensors(body: bytes) -> dict[str, torch.Tensor]:
    """A safetensors body as tensors that view its bytes (no copy).

    The tensors are read-only in spirit: every consumer either reads them or copies first (the
    reduction clones its first operand, the optimizer clones the parameters), and a recompute's
    input is a detached leaf on which autograd refuses in-place ops anyway.
    """
    (n,) = struct.unpack("<Q", body[:8])
    header = json.loads(body[8 : 8 + n])
    base, view = 8 + n, memoryview(body)
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _DTYPES.get(info["dtype"])
        if dtype is None:
            return st_load(body)
        a, b = info["data_offsets"]
        t = torch.frombuffer(view[base + a : base + b], dtype=dtype) if b > a else torch.empty(0, dtype=dtype)
        out[name] = t.reshape(info["shape"])
    return out


class ObjectWaitTimeout(StagecoachError):
    """An object another worker should have written did not appear in time."""


class ObjectLost(StagecoachError):
    """A hand-off object is missing although the task that writes it finished in this window attempt.

    A task writes its metrics only after every upload of it has landed (lambdas/handler.py), and
    S3 is strongly consistent: its metrics of this attempt without the object mean the object was
    written and is gone (deleted, expired), and will not come back. The waiter stops at once rather
    than at its Task's timeout, and the window restarts from its resume point. Not retried by the
    Task's Retry (planner/emit/asl.py): running the consumer again would not bring the object back.
    """


class WindowAborted(StagecoachError):
    """The window this task belongs to has failed (its abort marker exists): stop waiting."""


ABORT_CHECK_S = 1.0  # how often a waiting task looks for its window's abort marker

# The waits this process made, by ``wait_pattern``: the last WAIT_MEMORY times after which each
# object was still missing (a warm Lambda container keeps them from one task to the next).
_WAITS: dict[str, list[float]] = {}
_WAITS_LOCK = threading.Lock()
_NUMBERED = re.compile(r"^(r|sync|v|it)[0-9]+$")
_VERSIONED = re.compile(r"^(v|it)[0-9]+$")


def wait_pattern(key: str, waits_of: str = "") -> str | None:
    """What a wait for ``key`` has in common with the same wait of other iterations and replicas:
    the key with its iteration (the component after ``iter``) or version (``v{n}``, ``it{n}``),
    its replicas (``r{n}``) and its spread prefix (``sync{nn}``) left out, so a container that
    serves another replica next iteration still knows the wait, after ``waits_of`` (the waiting
    task's phase). None for a key that names no iteration or version: a one-off object, nothing
    to learn from. Several objects of one task may share a pattern (the peers' chunks of an
    exchange): ``Channel.wait_bytes`` tells them apart by their order in the task."""
    parts = key.split("/")
    if not any(part == "iter" or _VERSIONED.match(part) for part in parts[:-1]):
        return None
    out = []
    for i, part in enumerate(parts):
        out.append("*" if i and parts[i - 1] == "iter" else _NUMBERED.sub(r"\1*", part))
    return f"{waits_of}:" + "/".join(out)


def expected_wait_s(pattern: str | None) -> float:
    """The shortest of the last WAIT_MEMORY waits of ``pattern`` in this process (0: none yet): a
    lower bound of when its object lands, so a single slow iteration does not make the next one late."""
    if pattern is None:
        return 0.0
    with _WAITS_LOCK:
        seen = _WAITS.get(pattern)
        return min(seen) if seen else 0.0


def remember_wait(pattern: str | None, missing_s: float | None) -> None:
    """After a wait of ``pattern``: ``missing_s``, the time after its start at which its object was
    still missing (the end of its last 404). None, the object was there at the first GET: when it
    landed is unknown (an upstream faster than before, or no wait at all), so the pattern is
    forgotten and the next wait polls from its start, as a first one does, and learns again: a
    wait that came early makes one wait late, not the next ones."""
    if pattern is None:
        return
    with _WAITS_LOCK:
        if missing_s is None:
            _WAITS.pop(pattern, None)
            return
        seen = _WAITS.setdefault(pattern, [])
        seen.append(max(0.0, missing_s))
        del seen[:-WAIT_MEMORY]


@dataclass
class ChannelStats:
    upload_s: float = 0.0
    download_s: float = 0.0
    transfer_s: float = 0.0
    wait_s: float = 0.0
    bytes_up: int = 0
    bytes_down: int = 0
    puts: int = 0
    gets: int = 0
    misses: int = 0  # of the gets, those answered 404: a wait's polls (and a lookup of what is not there)
    _active: dict[str, int] = field(default_factory=lambda: {"up": 0, "down": 0, "wait": 0}, repr=False)
    _last: float = field(default_factory=time.perf_counter, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def _advance(self) -> None:
        now = time.perf_counter()
        dt, self._last = now - self._last, now
        a = self._active
        if a["up"]:
            self.upload_s += dt
        if a["down"]:
            self.download_s += dt
        if a["up"] or a["down"]:
            self.transfer_s += dt
        elif a["wait"]:
            self.wait_s += dt

    @contextmanager
    def activity(self, kind: str) -> Iterator[None]:
        with self._lock:
            self._advance()
            self._active[kind] += 1
        try:
            yield
        finally:
            with self._lock:
                self._advance()
                self._active[kind] -= 1

    def count(self, **increments: int) -> None:
        with self._lock:
            for k, v in increments.items():
                setattr(self, k, getattr(self, k) + v)

    def as_dict(self) -> dict[str, Any]:
        with self._lock:
            self._advance()
            return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}


class Pools:
    """A worker's concurrent requests: a thread pool per lane (bulk uploads, downloads, hand-offs)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pools: dict[str, ThreadPoolExecutor] = {}

    def __call__(self, kind: str) -> ThreadPoolExecutor:
        with self._lock:
            if kind not in self._pools:
                n = _LANES[kind]
                self._pools[kind] = ThreadPoolExecutor(max_workers=n, thread_name_prefix=f"s3-{kind}")
            return self._pools[kind]


_PROCESS_POOLS: tuple[int, Pools] | None = None


def process_pools() -> Pools:
    """The process's pools, made on first use (after a fork, in the process that uses them): one
    Lambda execution environment runs one task at a time, so its tasks share them."""
    global _PROCESS_POOLS
    if _PROCESS_POOLS is None or _PROCESS_POOLS[0] != os.getpid():
        _PROCESS_POOLS = (os.getpid(), Pools())
    return _PROCESS_POOLS[1]


@dataclass
class Channel:
    s3: Any
    bucket: str
    stats: ChannelStats = field(default_factory=ChannelStats)
    net: Network = field(default_factory=network)
    pools: Pools = field(default_factory=process_pools)
    poll_cap: float = 0.0  # poll_cap_s(the plan's peak invocations): set by the handler
    abort_key: str | None = None  # keys.window_abort of the task's window attempt: set by the handler
    attempt: str = ""  # the task's window attempt (execution name): set by the handler
    # the task's phase: a forward task's wait for an input and the backward task's re-read of it
    # (there at once) are different waits of one key (``wait_pattern``): set by the handler
    waits_of: str = ""
    _pending: list[Future[Any]] = field(default_factory=list, repr=False)
    _aborted: threading.Event = field(default_factory=threading.Event, repr=False)
    # how many of this task's threads wait for an object now (``wait_bytes``)
    _waiting: int = field(default=0, repr=False)
    _waiting_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _begun: dict[str, int] = field(default_factory=dict, repr=False)  # waits begun per pattern (``_nth``)

    # -- single requests -------------------------------------------------------------------------
    def put_bytes(self, key: str, body: bytes) -> None:
        with self.stats.activity("up"):
            extra = {"Tagging": TRANSIENT_TAG} if "/iter/" in key else {}
            if not self.net.up:
                self.s3.put_object(Bucket=self.bucket, Key=key, Body=body, **extra)
            else:  # emulated: the object appears once its bytes and its latency have passed
                self.net.up.transfer(len(body))
                self.net.latency(self.net.expected_put_s(len(body)))  # the real PUT takes part of it
                t0 = time.perf_counter()
                self.s3.put_object(Bucket=self.bucket, Key=key, Body=body, **extra)
                self.net.observed_put(len(body), time.perf_counter() - t0)
        self.stats.count(bytes_up=len(body), puts=1)

    def put_tensors(self, key: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
        body = st_save({k: v.detach().contiguous() for k, v in tensors.items()}, metadata=metadata)
        self.put_bytes(key, body)

    def get_bytes(self, key: str, byte_range: tuple[int, int] | None = None) -> bytes | None:
        """The object's bytes (``byte_range``: [start, end) of them, one ranged GET), or None if
        it does not exist (yet)."""
        with self.stats.activity("down"):
            t0 = time.perf_counter()
            extra = {"Range": f"bytes={byte_range[0]}-{byte_range[1] - 1}"} if byte_range else {}
            try:
                resp = self.s3.get_object(Bucket=self.bucket, Key=key, **extra)
                body: bytes = resp["Body"].read()
            except self.s3.exceptions.NoSuchKey:
                self.net.latency(time.perf_counter() - t0)  # a 404 costs its round trip
                self.stats.count(gets=1, misses=1)
                return None
            if self.net.down:  # emulated: the first byte after the latency (the real GET took part of it)
                self.net.latency(time.perf_counter() - t0)
                self.net.down.transfer(len(body))
        self.stats.count(bytes_down=len(body), gets=1)
        return body

    def any_under(self, prefix: str) -> bool:
        """Whether some object's key starts with ``prefix`` (one LIST request)."""
        with self.stats.activity("down"):
            t0 = time.perf_counter()
            resp = self.s3.list_objects_v2(Bucket=self.bucket, Prefix=prefix, MaxKeys=1)
            self.net.latency(time.perf_counter() - t0)
        # S3 bills a LIST at the PUT class's price, not a GET's (https://aws.amazon.com/s3/pricing/,
        # "PUT, COPY, POST, LIST requests"): counted with the PUTs, so the measured cost prices it so
        self.stats.count(puts=1)
        return bool(resp.get("KeyCount", 0))

    def wait_bytes(self, key: str, deadline: float, producer: str | None = None, byte_range: tuple[int, int] | None = None) -> bytes:
        """GET until the object exists (``byte_range``: [start, end) of it, each GET a ranged one);
        between GETs pause ``pause_s`` (a fifth of the time waited so far, jittered, capped; a
        job's waiters together stay within its GET budget); give up at ``deadline`` (epoch s).

        Every ``ABORT_CHECK_S`` of waiting (not every poll: a GET costs money), and once more at
        the deadline, it also looks for the window's abort marker and, given ``producer`` (the
        metrics key of the task that writes ``key``), for a lost object (``_look_around``)."""
        with self._waiting_lock:
            self._waiting += 1
        try:
            return self._wait_bytes(key, deadline, producer, byte_range, self._nth(wait_pattern(key, self.waits_of)))
        finally:
            with self._waiting_lock:
                self._waiting -= 1

    def pause_s(self, waited_s: float) -> float:
        """The pause before the next GET after ``waited_s`` of waiting, before jitter: WAIT_FACTOR of
        the wait so far, within [WAIT_FIRST_S, cap]. Proportional, so a short wait's GETs grow with
        the log of its length (1 + WAIT_FACTOR more waited per GET) while the object is noticed
        ~WAIT_FACTOR/2 of the wait late; the cap keeps a long wait's lateness at ~20 ms more than
        a round trip, because the waits are on the pipeline's critical path, where a millisecond
        of Lambda costs more than a GET (docs/runtime.md). The task's waiters together poll no
        faster than one at the job's budget, so the cap grows with their number (``poll_cap_s``)."""
        cap = max(WAIT_MAX_S, self.poll_cap * self._waiting)
        return min(cap, max(WAIT_FIRST_S, WAIT_FACTOR * waited_s))

    def _nth(self, pattern: str | None) -> str | None:
        """``pattern`` and how many waits of it this task began before: the n-th wait of a pattern
        in a task is the same wait every iteration (a task's waits start in the order it submits
        them), the peers' chunks of an exchange or the replicas' gradients a sync task reads each
        its own."""
        if pattern is None:
            return None
        with self._waiting_lock:
            n = self._begun[pattern] = self._begun.get(pattern, -1) + 1
        return f"{pattern}#{n}"

    def _wait_bytes(
        self, key: str, deadline: float, producer: str | None, byte_range: tuple[int, int] | None = None, pattern: str | None = None
    ) -> bytes:
        start = time.time()
        # a recurring wait sleeps most of what it took before, then polls as a fresh wait: its
        # pauses start at WAIT_FIRST_S again near the expected landing, so it is noticed no later
        wake = min(deadline, start + WAIT_AHEAD * expected_wait_s(pattern))
        body, next_check = self._sleep_until(wake, start + ABORT_CHECK_S, key, producer, byte_range)
        polling_from, missing = time.time(), None
        while body is None:
            body = self.get_bytes(key, byte_range)
            if body is not None:
                break
            missing = time.time() - start
            if self._aborted.is_set():
                raise ObjectWaitTimeout(f"s3://{self.bucket}/{key}: the task failed elsewhere, stopped waiting")
            if time.time() >= next_check:
                next_check = time.time() + ABORT_CHECK_S
                body = self._look_around(key, producer, byte_range)
                if body is not None:
                    break
            pause = self.pause_s(time.time() - polling_from) * random.uniform(1 - WAIT_JITTER, 1 + WAIT_JITTER)
            if time.time() + pause > deadline:
                # a last look first: a deadline shorter than a check's period (a learnt timeout,
                # lambdas/timeouts.py) still tells a lost object from a late one
                body = self._look_around(key, producer, byte_range)
                if body is not None:
                    break
                raise ObjectWaitTimeout(f"s3://{self.bucket}/{key} did not appear before the task's deadline")
            with self.stats.activity("wait"):
                time.sleep(pause)
        remember_wait(pattern, missing)
        return body

    def _sleep_until(
        self, wake: float, next_check: float, key: str, producer: str | None, byte_range: tuple[int, int] | None
    ) -> tuple[bytes | None, float]:
        """Sleep without a GET of ``key`` until ``wake`` (epoch s), in steps of at most
        WAIT_SLEEP_STEP_S, so a task that failed elsewhere stops the wait as soon as a poll would
        have, and still look around every ABORT_CHECK_S (the abort marker, a lost object): a
        stopped or aborted window is noticed as soon as without the sleep. Returns the object if
        a look found it, and the next look's time."""
        while (now := time.time()) < wake:
            if self._aborted.is_set():
                raise ObjectWaitTimeout(f"s3://{self.bucket}/{key}: the task failed elsewhere, stopped waiting")
            if now >= next_check:
                next_check = now + ABORT_CHECK_S
                body = self._look_around(key, producer, byte_range)
                if body is not None:
                    return body, next_check
                continue
            with self.stats.activity("wait"):
                time.sleep(min(wake, next_check, now + WAIT_SLEEP_STEP_S) - now)
        return None, next_check

    def _look_around(self, key: str, producer: str | None, byte_range: tuple[int, int] | None = None) -> bytes | None:
        """While waiting for ``key``: WindowAborted if another task of the window attempt failed
        (its abort marker exists); ObjectLost if ``producer``'s metrics say it finished in this
        attempt and the object is still missing; the object if it landed meanwhile."""
        if self.abort_key is not None and self.get_bytes(self.abort_key) is not None:
            raise WindowAborted(f"stopped waiting for s3://{self.bucket}/{key}: another task of this window failed")
        if producer is None or not self.attempt or not self._finished_here(producer):
            return None
        # GET once more after the metrics: the object may have landed just before them
        body = self.get_bytes(key, byte_range)
        if body is None:
            raise ObjectLost(
                f"s3://{self.bucket}/{key} is lost: the task that writes it finished in this window attempt "
                f"({self.attempt}; its metrics: s3://{self.bucket}/{producer}) and the object is gone"
            )
        return body

    def _finished_here(self, producer: str) -> bool:
        """Whether the task whose metrics are at ``producer`` finished in this window attempt (an
        earlier attempt's record, or one that does not parse, says nothing about this one's objects)."""
        body = self.get_bytes(producer)
        if body is None:
            return False
        try:
            return TaskMetrics.model_validate_json(body).attempt == self.attempt
        except ValidationError:
            return False

    def wait_tensors(self, key: str, deadline: float, producer: str | None = None) -> dict[str, torch.Tensor]:
        return load_tensors(self.wait_bytes(key, deadline, producer))

    def get_tensors(self, key: str) -> dict[str, torch.Tensor] | None:
        body = self.get_bytes(key)
        return None if body is None else load_tensors(body)

    def delete(self, keys: list[str]) -> None:
        """Delete up to 1,000 keys per request; missing keys are fine (idempotent)."""
        for i in range(0, len(keys), 1000):
            chunk = keys[i : i + 1000]
            if chunk:
                self.s3.delete_objects(Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in chunk], "Quiet": True})

    # -- concurrent requests ---------------------------------------------------------------------
    def _submit(self, kind: str, fn: Any, *args: Any) -> Future[Any]:
        f = self.pools(kind).submit(fn, *args)
        self._pending.append(f)
        return f

    def submit_put(self, key: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> Future[None]:
        """Upload in the background (the caller keeps the tensors unchanged until the future is done)."""
        return self._submit("up", self.put_tensors, key, tensors, metadata)

    def submit_handoff(self, key: str, tensors: dict[str, torch.Tensor]) -> Future[None]:
        """Upload what a neighbouring stage waits on (an activation, an input gradient) ahead of
        any bulk upload already queued."""
        return self._submit("handoff", self.put_tensors, key, tensors, None)

    def submit_delete(self, keys: list[str]) -> Future[None]:
        """Delete in the background; the task's settle waits for it."""
        return self._submit("delete", self.delete, keys)

    def submit_put_bytes(self, key: str, body: bytes) -> Future[None]:
        return self._submit("up", self.put_bytes, key, body)

    def submit_wait(self, key: str, deadline: float, producer: str | None = None) -> Future[dict[str, torch.Tensor]]:
        """Wait for and download an object in the background; requests start in submission order."""
        return self._submit("down", self.wait_tensors, key, deadline, producer)

    def submit_wait_range(
        self, key: str, byte_range: tuple[int, int], dtype: torch.dtype, deadline: float
    ) -> Future[dict[str, torch.Tensor]]:
        """Wait for an object of raw tensor bytes and download [start, end) of it (one ranged GET
        per poll) as ``{"g": tensor}`` of ``dtype``, in the background (keys.gradient)."""
        return self._submit("down", self.wait_raw, key, byte_range, dtype, deadline)

    def wait_raw(self, key: str, byte_range: tuple[int, int], dtype: torch.dtype, deadline: float) -> dict[str, torch.Tensor]:
        body = self.wait_bytes(key, deadline, byte_range=byte_range)
        # a view of the downloaded bytes, as load_tensors gives (the reduction clones what it changes)
        return {"g": torch.frombuffer(body, dtype=dtype) if body else torch.empty(0, dtype=dtype)}

    def submit_get_bytes(self, key: str, byte_range: tuple[int, int] | None = None) -> Future[bytes | None]:
        return self._submit("down", self.get_bytes, key, byte_range)

    def submit_window(self, calls: Sequence[Callable[[], Future[Any]]], window: int) -> list[Future[Any]]:
        """Start ``calls`` (each submits one request and returns its future) in order, at most
        ``window`` at a time, the next as soon as one finishes; returns a future per call.

        Requests in flight share the link (core/netem.py; TCP flows through one interface
        likewise), so a consumer that needs objects in order should keep only enough in flight to
        hide the request latency: with everything requested at once, every object would arrive
        near the end together.
        """
        out: list[Future[Any]] = [Future() for _ in calls]
        lock = threading.Lock()
        nxt = [0]

        def start_next() -> None:
            while True:
                with lock:
                    i = nxt[0]
                    nxt[0] += 1
                if i >= len(calls):
                    return
                try:
                    if self._aborted.is_set():
                        raise ObjectWaitTimeout("the task failed elsewhere; request not started")
                    real = calls[i]()
                except BaseException as e:  # noqa: BLE001 - handed to whoever waits on it
                    out[i].set_exception(e)
                    continue
                real.add_done_callback(functools.partial(done, i))
                return

        def done(i: int, f: Future[Any]) -> None:
            e = f.exception()
            if e is not None:
                out[i].set_exception(e)
            else:
                out[i].set_result(f.result())
            start_next()

        for _ in range(min(window, len(calls))):
            start_next()
        return out

    def settle(self, failed: bool = False) -> None:
        """Wait for every background request of this task; after a failure, stop the waits first.

        A task must not return (or be frozen by Lambda) with requests still running for it: an
        upload could land after a retry rewrote the object, or a wait could poll into the next task.
        """
        if failed:
            self._aborted.set()
        pending, self._pending = self._pending, []
        for f in pending:
            try:
                f.result()
            except BaseException:  # noqa: BLE001 - the task's own error is what matters
                if not failed:
                    raise


def results(futures: list[Future[Any]]) -> list[Any]:
    """Results in order; raises the first failure (``Channel.settle`` then stops the rest)."""
    return [f.result() for f in futures]
