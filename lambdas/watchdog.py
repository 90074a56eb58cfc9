"""Evidence of memory pressure, left where the remediation step can read it after a kill.

AWS does not always say that a worker was killed for memory (``Lambda.Unknown`` carries no error
type, ``Runtime.ExitError`` may be any kill). While a task runs, a thread samples the container's
resident memory; the first time it passes PRESSURE_SHARE of the function's memory, it writes
``keys.memory_pressure`` (once per container and job stage: one PUT, not one per task). A
container killed later for memory has then said so first (lambdas/remediate.py classify).
"""

from __future__ import annotations

import threading
import time
from types import TracebackType
from typing import Any

from stagecoach.core import keys
from stagecoach.core.records import MemoryPressure
from stagecoach.lambdas.remediate import PRESSURE_SHARE

SAMPLE_S = 0.02
_reported: set[tuple[str, int]] = set()


def rss_mb() -> float:
    """This process's resident set in MB (Linux /proc, as on Lambda)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return 0.0


class MemoryWatch:
    """``with MemoryWatch(s3, bucket, job, stage, limit_mb): ...`` around a task's work."""

    def __init__(self, s3: Any, bucket: str, job: str, stage: int, limit_mb: int) -> None:
        self.s3, self.bucket, self.job, self.stage, self.limit_mb = s3, bucket, job, stage, limit_mb
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> MemoryWatch:
        if (self.job, self.stage) not in _reported:
            self._thread.start()
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _watch(self) -> None:
        threshold = PRESSURE_SHARE * self.limit_mb
        while not self._stop.is_set():
            rss = rss_mb()
            if rss >= threshold:
                _reported.add((self.job, self.stage))
                body = MemoryPressure(stage=self.stage, rss_mb=round(rss, 1), memory_mb=self.limit_mb, time=time.time())
                self.s3.put_object(Bucket=self.bucket, Key=keys.memory_pressure(self.job, self.stage), Body=body.model_dump_json().encode())
                return
            self._stop.wait(SAMPLE_S)
