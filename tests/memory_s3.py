"""An in-memory object store with the slice of the boto3 S3 client the channel uses.

For unit tests of the collectives: d replicas as threads in one process, each with its own
channel, exchanging objects with S3's semantics (a PUT is atomic and immediately visible, a GET
of a missing key raises NoSuchKey). The same code runs against moto in the end-to-end tests.
"""

from __future__ import annotations

import io
import threading
import time


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

    def get_object(self, Bucket: str, Key: str, **_: object) -> dict:
        with self.lock:
            if Key not in self.objects:
                raise _Exceptions.NoSuchKey(Key)
            body = self.objects[Key]
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
