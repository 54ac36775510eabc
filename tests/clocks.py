"""Time in tests, without timing anything.

``FakeClock`` stands in for the ``time`` module where code takes a clock (the control loop, the
twin): its time passes only when slept through, so every tick is exactly on time and a watchdog
fires at an exact step, on any machine and under any load.

``wait_until`` polls a condition and fails loudly, naming what it waited for, when its ceiling runs
out. The ceiling only turns a hang into a failure: it is never a bound the behaviour must meet, so
a busy machine makes a test slower, not red.
"""

import time
from collections.abc import Callable

CEILING_S = 300.0  # far beyond any wait here on a loaded 2-core machine


def wait_until(
    condition: Callable[[], bool],
    what: str,
    *,
    ceiling_s: float = CEILING_S,
    every_s: float = 0.01,
    gone: Callable[[], bool] = lambda: False,
) -> None:
    """Return once ``condition()`` holds; raise AssertionError naming ``what`` if it still does
    not after ``ceiling_s``, or as soon as ``gone()`` (e.g. the process it waits on exited)."""
    deadline = time.monotonic() + ceiling_s
    while not condition():
        if gone():
            raise AssertionError(f"stopped waiting for {what}: what it waited on is gone")
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what} after {ceiling_s:.0f} s")
        time.sleep(every_s)


class FakeClock:
    """``monotonic()`` and ``sleep()`` as the ``time`` module has them; time starts at 0 and moves
    only in ``sleep``, by the seconds asked plus the next of ``overshoot`` (how late a real sleep
    would wake), if any."""

    def __init__(self, overshoot=()):
        self.now = 0.0
        self.overshoot = list(overshoot)
        self.sleeps = 0  # how many times it was slept through

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds + (self.overshoot.pop(0) if self.overshoot else 0.0)
        self.sleeps += 1
