"""A simulated clock for the channel's real wait loop (tests/test_polling.py,
tests/test_wait_schedule.py): ``sleep`` advances it, nothing waits."""


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def time(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s
