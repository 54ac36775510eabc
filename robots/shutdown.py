"""The safe shutdown: the arm to its safe pose (rate-limited, through the safety layer), torque off
only there, disconnect; each stage guarded. ``SafeShutdown`` wraps a deploy's episodes: a control
step's error (a bus error) is what the caller sees, the shutdown's own errors logged and noted on
it, never in its place. ``move_to_pose`` is also the move to an episode's start pose. The moves
read the joints alone (not the cameras), and arrive on the five arm joints (not the gripper).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np

from embodied.robots.control import Clock, EmergencyStop, RateTimer

log = logging.getLogger(__name__)

MOVE_ERRORS_MAX = 3  # consecutive bus errors that end the move to the safe pose
# noted on the error whose shutdown left the torque on (its line is all a user reads)
TORQUE_STAYS_ON = "the arm did not reach its safe pose: its torque stays on; move it by hand"
TORQUE_NOT_OFF = "the arm is at its safe pose, but its torque stays on (switching it off failed)"


@dataclass
class ShutdownReport:
    """What a shutdown did: whether torque went off at the safe pose, and the errors of its
    stages in order, as (stage, error); each was logged when it happened."""

    torque_off: bool = False
    failures: list[tuple[str, Exception]] = field(default_factory=list)
    arrived: set[str] = field(default_factory=set)  # moves that got there (errors retried)

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
        unsettled = [e for stage, e in self.failures if stage not in self.arrived]
        if unsettled:
            self.attach_to(unsettled[0])
            raise unsettled[0]


def _step_toward(env, pose: np.ndarray, tolerance: float, gripper_may_block: bool) -> bool:
    """One rate-limited command toward ``pose``; whether the arm is there: every joint within
    ``tolerance``, or with ``gripper_may_block`` the gripper's command at its target instead (a
    gripper closed on an object cannot reach its value, and an open one does not fall). It reads
    the joints alone: a failing camera cannot stop the move."""
    if env.safety.last is None:  # before the first episode began: start from the arm
        env.safety.start(env.read_joints())
    env.hold(pose)  # (where it fails, the next is rate-limited from the last command sent)
    target = env.safety.within_limits(pose)  # f64 [6]: where the commands stop, past a limit
    away = np.abs(env.read_joints() - target)  # f64 [6]
    if gripper_may_block:
        gripper = env.spec.action.gripper
        away[gripper] = abs(env.safety.last[gripper] - target[gripper])  # the command's
    return bool(np.all(away < tolerance))


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
    gripper_may_block: bool = False,
) -> bool:
    """Step toward ``pose`` (radians [6], the arm's frame) until the arm is there (True), or
    ``timeout_s`` beyond the time the rate limit needs to get there passes (so a slow
    ``max_speed`` still arrives), or ``stop`` is set (False). A bus error costs its tick and is
    retried; MOVE_ERRORS_MAX in a row end the move (False). ``what`` names the move in the
    report and the log; ``gripper_may_block``: the gripper's arrival is its command's
    (``_step_toward``)."""
    timer = RateTimer(hz, clock)
    limit_s = timeout_s + travel_s(env.safety, pose, hz)
    t_end = clock.monotonic() + limit_s
    errors_in_a_row = 0
    while clock.monotonic() < t_end:
        if stop is not None and stop.is_set():
            log.warning("the %s stopped: emergency stop (%s)", what, stop.reason)
            return False
        try:
            if _step_toward(env, pose, tolerance, gripper_may_block):
                report.arrived.add(what)
                return True
            errors_in_a_row = 0
        except Exception as e:
            report.failed(what, e)
            errors_in_a_row += 1
            if errors_in_a_row == MOVE_ERRORS_MAX:
                log.error("the bus keeps failing during the %s: holding the last command", what)
                return False
        timer.wait()
    log.error("the %s did not arrive within %.0f s: holding position", what, limit_s)
    return False


def travel_s(safety, pose: np.ndarray, hz: float) -> float:
    """Seconds the rate limit takes to carry the command to ``pose`` (within the joint limits)
    from the last one sent; before any, from the far end of each joint's range."""
    target = safety.within_limits(pose)  # f64 [6]
    if safety.last is None:
        gap = np.maximum(target - safety.low, safety.high - target)
    else:
        gap = np.abs(target - safety.last)
    return float(np.max(gap / safety.max_step)) / hz


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
        gripper_may_block=True,  # (the episode may end holding an object)
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
    timeout_s: float = 10.0,  # beyond the rate-limited move's own time (``move_to_pose``)
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
            if not self.report.torque_off:  # (a move that timed out notes no failure)
                at_safe_pose = "move to the safe pose" in self.report.arrived
                error.add_note(TORQUE_NOT_OFF if at_safe_pose else TORQUE_STAYS_ON)
        return False  # the body's error, if any, goes on
