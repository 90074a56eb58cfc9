"""An in-memory object store with the slice of the boto3 S3 client the channel uses.

For unit tests of the collectives: d replicas as threads in one process, each with its own
channel, exchanging objects with S3's semantics (a PUT is atomic and immediately visible, a GET
of a missing key raises NoSuchKey). The same code runs against moto in the end-to-end tests.
"""

from __future__ import annotations

import io
import threading
import time


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


class MemoryS3:
    exceptions = _Exceptions

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.written: dict[str, float] = {}  # key -> time of its first PUT
        self.lock = threading.Lock()
        self.puts = 0

    def put_object(self, Bucket: str, Key: str, Body: bytes, **_: object) -> dict:
        with self.lock:
            self.objects[Key] = bytes(Body)
            self.written.setdefault(Key, time.monotonic())
            self.puts += 1
        return {}

    def get_object(self, Bucket: str, Key: str, Range: str | None = None, **_: object) -> dict:
        with self.lock:
            if Key not in self.objects:
                raise _Exceptions.NoSuchKey(Key)
            body = self.objects[Key]
        body = ranged(body, Range)
        return {"Body": io.BytesIO(body), "ContentLength": len(body)}

    def delete_objects(self, Bucket: str, Delete: dict) -> dict:
        with self.lock:
            for o in Delete["Objects"]:
                self.objects.pop(o["Key"], None)
        return {}

    def list_objects_v2(self, Bucket: str, Prefix: str = "", MaxKeys: int = 1000, **_: object) -> dict:
        found = self.keys(Prefix)[:MaxKeys]
        return {"KeyCount": len(found), "Contents": [{"Key": k} for k in found]}

    def keys(self, prefix: str = "") -> list[str]:
        with self.lock:
            return sorted(k for k in self.objects if k.startswith(prefix))
