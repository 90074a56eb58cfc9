"""Count the S3 requests a client makes, by S3's price classes, for the run's measured cost.

A botocore ``before-call`` handler on the client: every API call it makes is one billed request
(a retried one is billed again, which this undercounts). Used around the launch's uploads
(sdk/deploy/start.py) and by ``Run`` while it watches (sdk/run.py).
"""

from __future__ import annotations

import threading
from typing import Any

from stagecoach.deploy.resources import BotoClient

# S3's first price class (PUT, COPY, POST, LIST) and second (GET, HEAD, and every other request
# but DELETE, which is free): https://aws.amazon.com/s3/pricing/ "Requests & data retrievals"
PUT_CLASS = {
    "PutObject",
    "CopyObject",
    "ListObjects",
    "ListObjectsV2",
    "CreateMultipartUpload",
    "UploadPart",
    "CompleteMultipartUpload",
    "PutObjectTagging",
}
FREE = {"DeleteObject", "DeleteObjects"}


class RequestCounter:
    """Counts ``puts`` (PUT class) and ``gets`` (GET class) of an S3 client from ``start()`` on."""

    def __init__(self, s3: BotoClient) -> None:
        self.s3 = s3
        self.puts = 0
        self.gets = 0
        self._lock = threading.Lock()
        self._on = False

    def _count(self, model: Any = None, **_: Any) -> None:
        name = getattr(model, "name", "")
        if name in FREE:
            return
        with self._lock:
            if name in PUT_CLASS:
                self.puts += 1
            else:
                self.gets += 1

    def start(self) -> RequestCounter:
        if not self._on:
            self.s3.meta.events.register("before-call.s3", self._count)
            self._on = True
        return self

    def stop(self) -> None:
        if self._on:
            self.s3.meta.events.unregister("before-call.s3", self._count)
            self._on = False

    def __enter__(self) -> RequestCounter:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def as_dict(self) -> dict[str, int]:
        return {"puts": self.puts, "gets": self.gets}
