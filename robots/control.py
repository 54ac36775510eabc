"""The control loop: a fixed rate, action chunks executed one step at a time with the next chunk
inferred in the background, the watchdog, the emergency stop and the shutdown to a safe pose.

Timing: ``RateTimer`` keeps absolute deadlines (no drift) and records how late each tick was.
Every deadline, the watchdog and the shutdown's time limit read one ``Clock``: the ``time`` module
itself, or a test's clock whose time passes only when slept through (exact, on any machine).
Chunks: ``ChunkExecutor`` asks for the next chunk when ``request_when_left`` actions of the current
one remain, so inference overlaps execution; a chunk inferred from the observation of step s
covers steps s, s+1, ...: the steps that passed while it was computed are dropped, and the first
``blend_steps`` of the rest are blended linearly with what the old chunk planned for them instead
of jumping at the seam.
Shutdown: ``SafeShutdown`` wraps the episodes and always ends them at the safe pose, torque off,
disconnected, each stage guarded; a control step's error (a bus error) is what the caller sees,
the shutdown's own errors logged and noted on it, never in its place.
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
    """Ticks at ``hz`` on absolute deadlines; ``lateness`` holds seconds past each deadline."""

    def __init__(self, hz: float, clock: Clock = time):
        self.clock = clock
        self.period = 1.0 / hz
        self.deadline = clock.monotonic()
        self.lateness: list[float] = []

    def wait(self) -> None:
        self.deadline += self.period
        delay = self.deadline - self.clock.monotonic()
        if delay > 0:
            self.clock.sleep(delay)
        late = self.clock.monotonic() - self.deadline
        self.lateness.append(late)
        if late > self.period:  # missed a whole tick: start over rather than rush to catch up
            self.deadline = self.clock.monotonic()

    def stats(self) -> dict:
        """Achieved rate and jitter (milliseconds past the deadline, p50/p99/max)."""
        if not self.lateness:
            return {}
        late = np.asarray(self.lateness) * 1e3
        return {
            "ticks": len(late),
            "jitter_p50_ms": float(np.percentile(late, 50)),
            "jitter_p99_ms": float(np.percentile(late, 99)),
            "jitter_max_ms": float(late.max()),
        }


class ChunkExecutor:
    """``infer(obs) -> float [K, A]`` (joint targets) runs on a background thread; ``action(step,
    obs)`` returns the action for this control step, or None when none is ready (the watchdog's
    business). ``infer`` may raise: the error is logged and counted, and the chunk never comes."""

    def __init__(
        self,
        infer: Callable,
        *,
        request_when_left: int = 2,
        blend_steps: int = 2,
        wait_s: float = 0.0,
    ):
        self.infer = infer
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
            self._requests.put((step, obs))
            self.pending = True
        if not self.plan and self.pending and self.wait_s > 0:
            try:  # a fast policy answers within the step: use it now rather than a step late
                self._take(*self._results.get(timeout=self.wait_s), step)
            except queue.Empty:
                pass
        if not self.plan:
            return None
        self.plan_step = step + 1
        return self.plan.pop(0)

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
    cfg = env.safety.cfg
    obs = env.reset()
    timer = RateTimer(hz, clock)
    result = EpisodeResult(0, "done")
    last_fresh = clock.monotonic()
    holding = False
    for step in range(max_steps):
        if estop.is_set():
            result.reason = "estop"
            break
        seen = obs  # what this step's action is taken at: the frame keeps the two together
        action = executor.action(step, obs)
        now = clock.monotonic()
        if action is not None:
            last_fresh = now
            holding = False
            result.acted += 1
            command = torch.from_numpy(np.asarray(action, np.float32))[None]  # f32 [1, 6]
            # read a period after the command: what the policy was trained to see next
            out = env.step(command, settle=timer.wait)
            obs = out.obs
            sent = out.info["sent"]
            kinds = out.info["interventions"]
            result.successes.append(bool(out.success[0]))
        else:
            stale = now - last_fresh
            if stale > cfg.stop_after_s:
                result.watchdog["stop"] += 1
                result.reason = "watchdog"
                log.warning("watchdog: no action for %.2f s: stopping", stale)
                break
            if stale > cfg.hold_after_s and not holding:
                result.watchdog["hold"] += 1
                holding = True
                log.warning("watchdog: no action for %.2f s: holding position", stale)
            sent = env.to_policy(env.hold())
            kinds = ["watchdog_hold"] if holding else []
            timer.wait()
            obs = env.observe()
            result.successes.append(env.judge is not None and env.judge())
        result.frames.append({"t": now, "obs": seen, "sent": sent, "interventions": kinds})
        result.steps = step + 1
    result.timing = {
        **timer.stats(),
        "inference_ms_p50": float(np.median(executor.latencies) * 1e3)
        if executor.latencies
        else None,
    }
    return result


MOVE_ERRORS_MAX = 3  # consecutive bus errors that end the move to the safe pose


@dataclass
class ShutdownReport:
    """What a shutdown did: whether torque went off at the safe pose, and the errors of its
    stages in order, as (stage, error); each was logged when it happened."""

    torque_off: bool = False
    failures: list[tuple[str, Exception]] = field(default_factory=list)
    retried: set[str] = field(default_factory=set)  # moves that got there after their errors

    def failed(self, stage: str, error: Exception) -> None:
        log.error("safe shutdown: %s failed: %r", stage, error, exc_info=error)
        self.failures.append((stage, error))

    def notes(self) -> list[str]:
        return [f"safe shutdown: {stage} failed: {e!r}" for stage, e in self.failures]

    def attach_to(self, first: BaseException) -> None:
        """Note each error of the shutdown on ``first``, the error that came before them."""
        for note in self.notes():
            first.add_note(note)

    def raise_first(self) -> None:
        """Raise the first error (if any) of a stage that did not succeed in the end, every
        failure noted on it. A move that got there after a retried bus error raises nothing."""
        unsettled = [e for stage, e in self.failures if stage not in self.retried]
        if unsettled:
            self.attach_to(unsettled[0])
            raise unsettled[0]


def _step_toward(env, safe: np.ndarray, tolerance: float) -> bool:
    """One rate-limited command toward ``safe``; whether the arm is there (every joint but the
    gripper within ``tolerance``: a gripper closed on an object cannot reach its value, and an
    open one does not fall). It reads the joints alone: a failing camera cannot stop the move."""
    if env.safety.last is None:  # before the first episode began: start from the arm
        env.safety.start(env.read_joints())
    env.hold(safe)  # (where it fails, the next is rate-limited from the last command sent)
    away = np.abs(env.read_joints() - safe)  # f64 [6]
    return bool(np.all(np.delete(away, env.spec.action.gripper) < tolerance))


def move_to_pose(
    env,
    pose: np.ndarray,
    report: ShutdownReport,
    *,
    hz,
    timeout_s,
    tolerance,
    clock,
    what,
    stop: EmergencyStop | None = None,
) -> bool:
    """Step toward ``pose`` (radians [6], the arm's frame) until the arm is there (True),
    ``timeout_s`` passes or ``stop`` is set (False). A bus error costs its tick and is retried;
    MOVE_ERRORS_MAX in a row end the move (False). ``what`` names the move in the report and the
    log."""
    timer = RateTimer(hz, clock)
    t_end = clock.monotonic() + timeout_s
    errors_in_a_row = 0
    while clock.monotonic() < t_end:
        if stop is not None and stop.is_set():
            log.warning("the %s stopped: emergency stop (%s)", what, stop.reason)
            return False
        try:
            if _step_toward(env, pose, tolerance):
                report.retried.add(what)  # (its errors, if any, were retried)
                return True
            errors_in_a_row = 0
        except Exception as e:
            report.failed(what, e)
            errors_in_a_row += 1
            if errors_in_a_row == MOVE_ERRORS_MAX:
                log.error("the bus keeps failing during the %s: holding the last command", what)
                return False
        timer.wait()
    log.error("the %s did not arrive within %.0f s: holding position", what, timeout_s)
    return False


def _move_to_safe_pose(env, report: ShutdownReport, *, hz, timeout_s, tolerance, clock) -> bool:
    """Step toward the safe pose until the arm is there (True) or ``timeout_s`` passes; torque
    stays on where it is not reached."""
    safe = np.asarray(env.safety.cfg.safe_pose, float)
    arrived = move_to_pose(
        env,
        safe,
        report,
        hz=hz,
        timeout_s=timeout_s,
        tolerance=tolerance,
        clock=clock,
        what="move to the safe pose",
    )
    if not arrived:
        log.error("not at the safe pose: torque stays on")
    return arrived


def _torque_off(env, report: ShutdownReport) -> None:
    try:
        env.robot.bus.disable_torque()
    except Exception as e:
        report.failed("torque off", e)
        return
    report.torque_off = True
    log.info("at the safe pose: torque off")


def _disconnect(env, report: ShutdownReport) -> None:
    try:
        env.close()
    except Exception as e:
        report.failed("disconnect", e)


def shut_down(
    env,
    *,
    hz: float,
    timeout_s: float = 10.0,
    tolerance: float = 0.05,
    disconnect: bool = True,
    clock: Clock = time,
) -> ShutdownReport:
    """Move to the safe pose (rate-limited, inside the workspace), switch torque off there and
    disconnect. Every stage runs guarded: its errors are logged and reported, never raised. Torque
    goes off only at the safe pose (elsewhere the arm would drop: it stays on, holding); the
    disconnect is tried whatever happened before it (the servos keep holding their last goal)."""
    report = ShutdownReport()
    at_safe_pose = _move_to_safe_pose(
        env, report, hz=hz, timeout_s=timeout_s, tolerance=tolerance, clock=clock
    )
    if at_safe_pose:
        _torque_off(env, report)
    if disconnect:
        _disconnect(env, report)
    return report


def safe_shutdown(
    env, *, hz: float, timeout_s: float = 10.0, tolerance: float = 0.05, clock: Clock = time
) -> bool:
    """``shut_down`` without the disconnect; returns whether torque was switched off, or raises
    the first error of its stages (the later ones noted on it)."""
    report = shut_down(
        env, hz=hz, timeout_s=timeout_s, tolerance=tolerance, disconnect=False, clock=clock
    )
    report.raise_first()
    return report.torque_off


class SafeShutdown:
    """``with SafeShutdown(env, hz=...) as shutdown:`` runs the body (the episodes), then always
    ``shut_down`` (safe pose, torque off, disconnect), whether the body raised or not. The body's
    error (a bus error in a control step) propagates unchanged, the shutdown's errors noted on it,
    never in its place; without one, the shutdown's first error is raised. Afterwards
    ``shutdown.torque_off`` says whether torque went off at the safe pose."""

    def __init__(
        self,
        env,
        *,
        hz: float,
        timeout_s: float = 10.0,
        tolerance: float = 0.05,
        clock: Clock = time,
    ):
        self.env = env
        self.hz = hz
        self.timeout_s = timeout_s
        self.tolerance = tolerance
        self.clock = clock
        self.report: ShutdownReport | None = None

    @property
    def torque_off(self) -> bool:
        return self.report is not None and self.report.torque_off

    def __enter__(self):
        return self

    def __exit__(self, kind, error, traceback) -> bool:
        if error is not None:
            log.error("stopping on %r: shutting down to the safe pose", error)
        self.report = shut_down(
            self.env,
            hz=self.hz,
            timeout_s=self.timeout_s,
            tolerance=self.tolerance,
            clock=self.clock,
        )
        if error is None:
            self.report.raise_first()
        else:
            self.report.attach_to(error)
        return False  # the body's error, if any, goes on
