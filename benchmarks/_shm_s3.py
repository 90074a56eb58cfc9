"""A shared-memory object store with the slice of the boto3 S3 client the channel uses.

For benchmarks/sync.py only. With d = 8 workers each moving 70 MB/s up and down, the collectives
need ~1.1 GB/s through the store; the embedded moto server sustains ~150 MB/s on this 2-core
machine, so it, not the algorithm, would set the time. On AWS, S3's aggregate throughput is not
the limit either (each worker's own network is), so the benchmark keeps objects in tmpfs files:
a PUT is an atomic rename (S3 PUTs are atomic), a GET of a missing key raises NoSuchKey. The
emulated per-worker links of core/netem.py then set the pace, as Lambda's network does.
"""

from __future__ import annotations

import io
import os
import tempfile
import urllib.parse


def ranged(body: bytes, header: str | None) -> bytes:
    """The part of ``body`` a GetObject ``Range`` header (``bytes=a-b``, both ends included, b
    clipped to the object) asks for, as S3 serves it; the whole body without one."""
    if header is None:
        return body
    a, _, b = header.removeprefix("bytes=").partition("-")
    start, end = int(a), min(len(body) - 1, int(b)) if b else len(body) - 1
    if start > end:
        raise ValueError(f"range {header} of a {len(body)}-byte object is not satisfiable (S3: 416)")
    return body[start : end + 1]


class _Exceptions:
    class NoSuchKey(Exception):
        pass


class ShmS3:
    exceptions = _Exceptions

    def __init__(self, root: str) -> None:
        self.root = root
        os.makedirs(root, exist_ok=True)

    def _path(self, key: str) -> str:
        return os.path.join(self.root, urllib.parse.quote(key, safe=""))

    def put_object(self, Bucket: str, Key: str, Body: bytes, **_: object) -> dict:
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".put-")
        with os.fdopen(fd, "wb") as f:
            f.write(Body)
        os.rename(tmp, self._path(Key))
        return {}

    def get_object(self, Bucket: str, Key: str, Range: str | None = None, **_: object) -> dict:
        try:
            with open(self._path(Key), "rb") as f:
                body = f.read()
        except FileNotFoundError:
            raise _Exceptions.NoSuchKey(Key) from None
        body = ranged(body, Range)
        return {"Body": io.BytesIO(body), "ContentLength": len(body)}

    def delete_objects(self, Bucket: str, Delete: dict) -> dict:
        for o in Delete["Objects"]:
            try:
                os.unlink(self._path(o["Key"]))
            except FileNotFoundError:
                pass
        return {}
