"""The control loop: a fixed rate, action chunks executed one step at a time with the next chunk
inferred in the background, the watchdog and the emergency stop.

Timing: ``RateTimer`` keeps absolute deadlines (no drift) and records how late each tick was.
Every deadline, the watchdog and the shutdown's time limit read one ``Clock``: the ``time`` module
itself, or a test's clock whose time passes only when slept through (exact, on any machine).
Chunks: ``ChunkExecutor`` asks for the next chunk when ``request_when_left`` actions of the current
one remain, so inference overlaps execution; a chunk inferred from the observation of step s
covers steps s, s+1, ...: the steps that passed while it was computed are dropped, and the first
``blend_steps`` of the rest are blended linearly with what the old chunk planned for them instead
of jumping at the seam.
The shutdown to the safe pose that ends every deploy is robots/shutdown.py.
"""

from __future__ import annotations

import logging
import queue
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

log = logging.getLogger(__name__)


class Clock(Protocol):
    """Where the loop reads the time and waits: the ``time`` module, or a test's clock."""

    def monotonic(self) -> float: ...

    def sleep(self, seconds: float) -> None: ...


class RateTimer:
    """Ticks at ``hz`` on absolute deadlines; ``lateness`` holds seconds past each deadline,
    ``missed`` the whole periods given up after late ticks."""

    def __init__(self, hz: float, clock: Clock = time):
        self.clock = clock
        self.period = 1.0 / hz
        self.deadline = clock.monotonic()
        self.started = self.deadline
        self.lateness: list[float] = []
        self.missed = 0

    def wait(self) -> None:
        self.deadline += self.period
        delay = self.deadline - self.clock.monotonic()
        if delay > 0:
            self.clock.sleep(delay)
        late = self.clock.monotonic() - self.deadline
        self.lateness.append(late)
        if late > self.period:  # missed a whole tick: start over rather than rush to catch up
            self.missed += int(late // self.period)
            self.deadline = self.clock.monotonic()

    def stats(self) -> dict:
        """Achieved rate (ticks per second since the start), ticks missed, and jitter
        (milliseconds past the deadline, p50/p99/max)."""
        if not self.lateness:
            return {}
        late = np.asarray(self.lateness) * 1e3
        elapsed = self.clock.monotonic() - self.started
        return {
            "ticks": len(late),
            "achieved_hz": len(late) / elapsed if elapsed > 0 else None,
            "missed_ticks": self.missed,
            "jitter_p50_ms": float(np.percentile(late, 50)),
            "jitter_p99_ms": float(np.percentile(late, 99)),
            "jitter_max_ms": float(late.max()),
        }


class ChunkExecutor:
    """``infer(obs) -> float [K, A]`` (joint targets) runs on a background thread; ``action(step,
    obs)`` returns the action for this control step, or None when none is ready (the watchdog's
    business). ``infer`` may raise: the error is logged and counted, and the chunk never comes.
    ``prepare(obs)``, when given, runs on the control loop's thread as the request is made, and
    ``infer`` gets what it returns: what the chunk starts from, before this step's command.
    ``command(planned)``, when given, makes a planned action what is sent, as its step comes."""

    def __init__(
        self,
        infer: Callable,
        *,
        prepare: Callable | None = None,
        command: Callable | None = None,
        request_when_left: int = 2,
        blend_steps: int = 2,
        wait_s: float = 0.0,
    ):
        self.infer = infer
        self.prepare = prepare
        self.command = command
        self.request_when_left = request_when_left
        self.blend_steps = blend_steps
        # with nothing planned, wait this long for the chunk in flight before giving up the step
        self.wait_s = wait_s
        self.plan: list[
            np.ndarray
        ] = []  # actions for steps self.plan_step, self.plan_step + 1, ...
        self.plan_step = 0
        self.pending = False
        self.latencies: list[float] = []
        self.errors = 0
        self._requests: queue.Queue = queue.Queue(maxsize=1)
        self._results: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while (item := self._requests.get()) is not None:
            step, obs = item
            t0 = time.monotonic()
            try:
                chunk = np.asarray(self.infer(obs), dtype=np.float64)
            except (
                Exception
            ) as e:  # a server gone, a timeout: the loop goes on, the watchdog decides
                log.warning("inference failed: %s", e)
                self._results.put((step, None, time.monotonic() - t0))
                continue
            self._results.put((step, chunk, time.monotonic() - t0))

    def _merge(self, inferred_at: int, chunk: np.ndarray, step: int) -> None:
        """``chunk[i]`` is for step ``inferred_at + i``; the plan (``plan[0]`` for ``step``) becomes
        the chunk from ``step`` on, its first ``blend_steps`` blended with the old plan."""
        # steps that passed while it was computed are gone, but never the last one: a one-action
        # chunk that comes a step late is still the freshest plan there is
        new = list(chunk[min(max(0, step - inferred_at), len(chunk) - 1) :])
        for i in range(min(self.blend_steps, len(self.plan), len(new))):
            w = (i + 1) / (self.blend_steps + 1)
            new[i] = (1 - w) * self.plan[i] + w * new[i]
        self.plan = new

    def _take(self, inferred_at: int, chunk: np.ndarray | None, latency: float, step: int) -> None:
        self.pending = False
        self.latencies.append(latency)
        if chunk is None:
            self.errors += 1
        else:
            self._merge(inferred_at, chunk, step)

    def action(self, step: int, obs) -> np.ndarray | None:
        """The joint targets for control step ``step`` (observation ``obs``), or None."""
        while self.plan and self.plan_step < step:  # keep plan[0] aligned with this step
            self.plan.pop(0)
            self.plan_step += 1
        self.plan_step = step
        while not self._results.empty():
            self._take(*self._results.get(), step)
        if not self.pending and len(self.plan) <= self.request_when_left:
            self._requests.put((step, obs if self.prepare is None else self.prepare(obs)))
            self.pending = True
        if not self.plan and self.pending and self.wait_s > 0:
            try:  # a fast policy answers within the step: use it now rather than a step late
                self._take(*self._results.get(timeout=self.wait_s), step)
            except queue.Empty:
                pass
        if not self.plan:
            return None
        self.plan_step = step + 1
        planned = self.plan.pop(0)
        return planned if self.command is None else self.command(planned)

    def close(self) -> None:
        try:
            self._requests.put_nowait(None)
        except queue.Full:
            self._requests.get_nowait()
            self._requests.put_nowait(None)


class EmergencyStop:
    """Set by SIGINT, SIGTERM or SIGUSR1, by a line typed on the terminal (Enter), or by code."""

    def __init__(self, keyboard: bool | None = None):
        self.event = threading.Event()
        self.reason = ""
        self._old = {}
        self.keyboard = sys.stdin.isatty() if keyboard is None else keyboard

    def trigger(self, reason: str) -> None:
        if self.event.is_set():  # a second Ctrl-C: the stop is under way, not to be cut short
            log.warning("already stopping (%s): the arm goes to its safe pose", reason)
            return
        self.reason = reason
        log.warning("emergency stop: %s", reason)
        self.event.set()

    def is_set(self) -> bool:
        return self.event.is_set()

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
                self._old[sig] = signal.signal(
                    sig, lambda s, f: self.trigger(signal.Signals(s).name)
                )
        if self.keyboard:
            threading.Thread(target=self._keys, daemon=True).start()
        return self

    def _keys(self) -> None:
        for _ in sys.stdin:
            self.trigger("key")
            return

    def __exit__(self, *exc):
        for sig, handler in self._old.items():
            signal.signal(sig, handler)
        self._old = {}


@dataclass
class EpisodeResult:
    steps: int
    reason: str  # "done" | "estop" | "watchdog"
    # per step: t, the observation the action was taken at, the action sent, interventions
    frames: list[dict] = field(default_factory=list)
    watchdog: Counter = field(default_factory=Counter)  # "hold" and "stop" events
    acted: int = 0  # steps that executed a policy action (the others held)
    timing: dict = field(default_factory=dict)
    successes: list[bool] = field(default_factory=list)  # per step: the scene's judge (the twin)

    @property
    def success(self) -> bool:
        """Whether the task was done at some step (never on a scene that cannot judge)."""
        return any(self.successes)


class Watchdog:
    """How long since the last fresh action: past ``hold_after_s`` the arm holds its last command,
    past ``stop_after_s`` the episode stops; each counted in ``events`` ("hold", "stop")."""

    def __init__(self, cfg, now: float, events: Counter):
        self.cfg = cfg  # SafetyConfig
        self.last_fresh = now
        self.events = events
        self.holding = False

    def fresh(self, now: float) -> None:
        self.last_fresh = now
        self.holding = False

    def stops(self, now: float) -> bool:
        """Without a fresh action at ``now``: whether the episode stops (else it holds on)."""
        stale = now - self.last_fresh
        if stale > self.cfg.stop_after_s:
            self.events["stop"] += 1
            log.warning("watchdog: no action for %.2f s: stopping", stale)
            return True
        if stale > self.cfg.hold_after_s and not self.holding:
            self.events["hold"] += 1
            self.holding = True
            log.warning("watchdog: no action for %.2f s: holding position", stale)
        return False


def run_episode(
    env,
    executor: ChunkExecutor,
    estop: EmergencyStop,
    *,
    hz: float,
    max_steps: int,
    clock: Clock = time,
) -> EpisodeResult:
    """Drive ``env`` (a RobotEnv) at ``hz`` for up to ``max_steps`` steps. Without a fresh action
    for ``hold_after_s`` the arm holds its last command; after ``stop_after_s`` the episode ends
    with reason "watchdog" (the caller then shuts down to the safe pose)."""
    obs = env.reset()
    timer = RateTimer(hz, clock)
    result = EpisodeResult(0, "done")
    watchdog = Watchdog(env.safety.cfg, clock.monotonic(), result.watchdog)
    for step in range(max_steps):
        if estop.is_set():
            result.reason = "estop"
            break
        seen = obs  # what this step's action is taken at: the frame keeps the two together
        action = executor.action(step, obs)
        now = clock.monotonic()
        finite = action is not None and bool(np.isfinite(action).all())
        if finite:
            watchdog.fresh(now)
        elif watchdog.stops(now):  # (a non-finite one is no action: the safety layer holds)
            result.reason = "watchdog"
            break
        if action is not None:
            result.acted += finite  # (a non-finite one is rejected whole: the arm held)
            obs, sent, kinds, success = _act(env, action, timer)
        else:
            obs, sent, kinds, success = _hold(env, timer, watchdog.holding)
        result.successes.append(success)
        result.frames.append({"t": now, "obs": seen, "sent": sent, "interventions": kinds})
        result.steps = step + 1
    latencies = executor.latencies
    median_ms = float(np.median(latencies) * 1e3) if latencies else None
    result.timing = {**timer.stats(), "inference_ms_p50": median_ms}
    return result


def _act(env, action: np.ndarray, timer: RateTimer) -> tuple:
    """Send ``action`` and read the arm a period later (what the policy was trained to see
    next): (observation, what was sent, interventions, the judge's success)."""
    # (float64: a target the policy's side clipped to a joint's limit stays within it)
    command = torch.from_numpy(np.asarray(action, np.float64))[None]  # f64 [1, 6]
    out = env.step(command, settle=timer.wait)
    return out.obs, out.info["sent"], out.info["interventions"], bool(out.success[0])


def _hold(env, timer: RateTimer, holding: bool) -> tuple:
    """No action this step: hold the last command and read the arm a period later, as ``_act``
    does (``holding``: the watchdog's hold, named among the interventions)."""
    sent = env.to_policy(env.hold())
    kinds = ["watchdog_hold"] if holding else []
    timer.wait()
    obs = env.observe()
    return obs, sent, kinds, bool(env.judge is not None and env.judge())
