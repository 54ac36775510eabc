"""The safe shutdown after a bus error, on the digital twin (LeRobot's driver over the software
serial port): the control step's error is the one raised, the shutdown still runs every stage
it safely can, and its own errors are logged and noted on the first one, never in its place.
The loop, the arm and the twin read a FakeClock: the steps and the move are the same on any
machine (tests/test_control.py)."""

import itertools
import logging
import os

import numpy as np
import pytest
from clocks import CEILING_S, FakeClock

os.environ.setdefault("MUJOCO_GL", "egl")

from embodied.robots.arm import ArmConfig, RobotEnv, connect, default_safety  # noqa: E402
from embodied.robots.control import ChunkExecutor, EmergencyStop, run_episode  # noqa: E402
from embodied.robots.safety import SafetyLayer  # noqa: E402
from embodied.robots.servo_port import FEETECH_STS, INST_SYNC_WRITE, ticks_to_rad  # noqa: E402
from embodied.robots.shutdown import (  # noqa: E402
    MOVE_ERRORS_MAX,
    TORQUE_NOT_OFF,
    TORQUE_STAYS_ON,
    SafeShutdown,
)

HZ = 30.0
FAILING_STEP = 10  # the control step whose goal write fails


def twin_env(tmp_path, start: dict[str, float] | None = None, **arm):
    from embodied.twin import make_twin_robot

    clock = FakeClock()
    cfg = ArmConfig(robot="so101-sim", calibration_dir=str(tmp_path / "cal"), control_hz=HZ, **arm)
    robot, twin, port = make_twin_robot(cfg, start=start, clock=clock)
    connect(robot, cfg)
    return RobotEnv(robot, cfg, SafetyLayer(default_safety(robot, cfg)), clock), twin, port


def fail_goal_writes(monkeypatch, port, fails) -> None:
    """The k-th goal write from now on (a sync write of Goal_Position, k from 0) comes out short
    when ``fails(k)``: the servo SDK reports a failed transmission and LeRobot's driver raises its
    own ConnectionError, as when the serial link drops a write."""
    write, count = port.write, itertools.count()

    def flaky(data) -> int:
        packet = bytes(data)
        goal = len(packet) > 5 and packet[4] == INST_SYNC_WRITE and packet[5] == FEETECH_STS.goal[0]
        if goal and fails(next(count)):
            return 0
        return write(data)

    monkeypatch.setattr(port, "write", flaky)


def record_errors(monkeypatch, env, method: str) -> list[Exception]:
    """The errors ``env.<method>`` raises from now on, in order (it still raises them)."""
    call, errors = getattr(env, method), []

    def recorded(*args, **kwargs):
        try:
            return call(*args, **kwargs)
        except Exception as e:
            errors.append(e)
            raise

    monkeypatch.setattr(env, method, recorded)
    return errors


def holding_policy() -> ChunkExecutor:
    """Chunks that hold the arm where it was observed; each step waits for its action, so every
    control step is a policy step (``env.step``)."""
    return ChunkExecutor(lambda obs: np.repeat(obs.state[:, :6].numpy(), 50, 0), wait_s=CEILING_S)


def run_then_shut_down(env, *, max_steps: int = 100) -> SafeShutdown:
    """The episode inside a SafeShutdown, as a deploy runs it; raises what the shutdown lets out."""
    executor = holding_policy()
    shutdown = SafeShutdown(env, hz=HZ, timeout_s=15, clock=env.clock)
    try:
        with shutdown:
            with EmergencyStop(keyboard=False) as stop:
                run_episode(env, executor, stop, hz=HZ, max_steps=max_steps, clock=env.clock)
    finally:
        executor.close()
    return shutdown


def largest_goal_jump(port) -> float:
    """Radians: the largest change of any joint between two goal writes that reached the bus."""
    goals = np.array([[ticks_to_rad(g[i]) for i in sorted(g)] for g in port.goal_writes()])
    return float(np.abs(np.diff(goals, axis=0)).max())


def torque_off_writes(port, since: int) -> list:
    """Torque-off writes that reached the bus after the first ``since`` of its log (connecting
    switches torque off and on once itself)."""
    torque = FEETECH_STS.torque[0]
    return [c for c in port.log[since:] if c.address == torque and c.value == 0]


def test_a_step_error_survives_a_shutdown_whose_move_fails_once(tmp_path, monkeypatch, caplog):
    env, twin, port = twin_env(tmp_path)
    connected = len(port.log)
    fail_goal_writes(monkeypatch, port, lambda k: k in (FAILING_STEP, FAILING_STEP + 1))
    step_errors = record_errors(monkeypatch, env, "step")
    move_errors = record_errors(monkeypatch, env, "hold")  # only the shutdown holds here
    caplog.set_level(logging.INFO, logger="embodied.robots.shutdown")
    try:
        with pytest.raises(ConnectionError) as raised:
            run_then_shut_down(env)
    finally:
        env.close()
    # the error raised is the control step's own, not the shutdown's
    assert len(step_errors) == 1 and raised.value is step_errors[0]
    assert "Goal_Position" in str(raised.value)
    assert len(move_errors) == 1 and move_errors[0] is not raised.value
    assert raised.value.__notes__ == [
        f"safe shutdown: move to the safe pose failed: {move_errors[0]!r}"
    ]
    logged = [r for r in caplog.records if r.levelno == logging.ERROR and r.exc_info]
    assert [r.exc_info[1] for r in logged] == move_errors
    # the move was retried: the arm is at the safe pose, torque off there, the bus disconnected
    assert torque_off_writes(port, connected) and not any(port.torque().values())
    safe = np.asarray(env.safety.cfg.safe_pose)
    np.testing.assert_allclose(twin.joints()[:5], safe[:5], atol=0.06)
    assert not env.robot.is_connected
    # from the last command that reached the arm, never a jump past the rate limit
    assert largest_goal_jump(port) <= env.safety.cfg.max_step + 1e-3
    assert "at the safe pose: torque off" in caplog.text


def test_a_dead_bus_keeps_the_torque_on_but_still_disconnects(tmp_path, monkeypatch, caplog):
    env, twin, port = twin_env(tmp_path)
    connected = len(port.log)
    fail_goal_writes(monkeypatch, port, lambda k: k >= FAILING_STEP)
    step_errors = record_errors(monkeypatch, env, "step")
    move_errors = record_errors(monkeypatch, env, "hold")
    caplog.set_level(logging.INFO, logger="embodied.robots.shutdown")
    try:
        with pytest.raises(ConnectionError) as raised:
            run_then_shut_down(env)
    finally:
        env.close()
    assert raised.value is step_errors[0]
    assert len(move_errors) == MOVE_ERRORS_MAX  # then the move gave up
    assert raised.value.__notes__ == [
        *(f"safe shutdown: move to the safe pose failed: {e!r}" for e in move_errors),
        TORQUE_STAYS_ON,
    ]
    assert not torque_off_writes(port, connected) and all(port.torque().values())  # not dropped
    assert not env.robot.is_connected  # the disconnect was still tried, and done
    assert "the bus keeps failing during the move to the safe pose" in caplog.text
    assert "not at the safe pose: torque stays on" in caplog.text


def test_an_error_that_leaves_the_arm_short_of_its_safe_pose_says_its_torque_stays_on(
    tmp_path, monkeypatch
):
    """What stopped the episode (a stalled joint, an obstacle) stops the move to the safe pose
    too: it times out, with no failure to note, and the error's line (all a user reads) said
    nothing of the torque left on."""
    from embodied.robots import shutdown

    env, twin, port = twin_env(tmp_path)
    monkeypatch.setattr(shutdown, "_step_toward", lambda *args, **kwargs: False)  # (stalled)
    try:
        with pytest.raises(ValueError) as raised:
            with SafeShutdown(env, hz=HZ, timeout_s=2, clock=env.clock) as stopping:
                raise ValueError("episode 0: the arm did not reach its start pose")
    finally:
        env.close()
    assert raised.value.__notes__ == [TORQUE_STAYS_ON] and not stopping.torque_off
    assert all(port.torque().values())


def no_torque_off(monkeypatch, env) -> None:
    """The bus answers no torque-off write."""

    def no_answer(*args, **kwargs):
        raise ConnectionError("torque off: no status packet")

    monkeypatch.setattr(env.robot.bus, "disable_torque", no_answer)


def test_an_error_whose_shutdown_could_not_switch_the_torque_off_says_so(tmp_path, monkeypatch):
    """At the safe pose, a torque off that fails: noted as such, not as a pose missed."""
    env, twin, port = twin_env(tmp_path)
    no_torque_off(monkeypatch, env)
    try:
        with pytest.raises(ValueError) as raised:
            with SafeShutdown(env, hz=HZ, timeout_s=15, clock=env.clock):
                raise ValueError("episode 0: stopped")
    finally:
        env.close()
    assert raised.value.__notes__[-1] == TORQUE_NOT_OFF
    assert TORQUE_STAYS_ON not in raised.value.__notes__


def test_a_failed_torque_off_is_raised_after_the_disconnect(tmp_path, monkeypatch):
    env, twin, port = twin_env(tmp_path)
    no_torque_off(monkeypatch, env)
    try:
        with pytest.raises(ConnectionError, match="torque off: no status packet") as raised:
            run_then_shut_down(env, max_steps=5)  # the episode itself ends well
    finally:
        env.close()
    assert raised.value.__notes__ == [f"safe shutdown: torque off failed: {raised.value!r}"]
    assert all(port.torque().values())
    assert not env.robot.is_connected


def test_a_clean_shutdown_reports_torque_off_and_disconnects(tmp_path):
    env, twin, port = twin_env(tmp_path)
    try:
        shutdown = run_then_shut_down(env, max_steps=5)
    finally:
        env.close()
    assert shutdown.torque_off and shutdown.report.failures == []
    assert not any(port.torque().values()) and not env.robot.is_connected


def test_a_camera_that_fails_after_the_episode_does_not_stop_the_shutdown(tmp_path, monkeypatch):
    """The move to the safe pose reads the joints from the bus alone: a camera whose reads fail
    (its thread dead, a stale frame) leaves the arm at the safe pose with torque off, as a
    clean run does."""
    env, twin, port = twin_env(tmp_path)
    executor = holding_policy()

    def camera_gone():
        raise RuntimeError("camera read thread is not running")

    shutdown = SafeShutdown(env, hz=HZ, timeout_s=15, clock=env.clock)
    try:
        with shutdown:
            with EmergencyStop(keyboard=False) as stop:
                run_episode(env, executor, stop, hz=HZ, max_steps=5, clock=env.clock)
            monkeypatch.setattr(env.robot, "get_observation", camera_gone)
    finally:
        executor.close()
        env.close()
    assert shutdown.torque_off and shutdown.report.failures == []
    safe = np.asarray(env.safety.cfg.safe_pose)
    np.testing.assert_allclose(twin.joints()[:5], safe[:5], atol=0.06)
    assert not any(port.torque().values()) and not env.robot.is_connected


def shut_down_after(env, change) -> SafeShutdown:
    """A clean 5-step episode, then ``change()`` (what goes wrong after it), then the shutdown."""
    executor = holding_policy()
    shutdown = SafeShutdown(env, hz=HZ, timeout_s=15, clock=env.clock)
    try:
        with shutdown:
            with EmergencyStop(keyboard=False) as stop:
                run_episode(env, executor, stop, hz=HZ, max_steps=5, clock=env.clock)
            change()
    finally:
        executor.close()
        env.close()
    return shutdown


def test_a_bus_error_retried_on_the_way_to_the_safe_pose_does_not_fail_a_clean_run(
    tmp_path, monkeypatch
):
    env, twin, port = twin_env(tmp_path)
    shutdown = shut_down_after(env, lambda: fail_goal_writes(monkeypatch, port, lambda k: k == 0))
    assert shutdown.torque_off and not any(port.torque().values())  # there, and nothing raised
    ((stage, error),) = shutdown.report.failures  # the error is still reported
    assert stage == "move to the safe pose" and isinstance(error, ConnectionError)


def test_a_gripper_held_open_by_an_object_still_ends_at_the_safe_pose_with_torque_off(
    tmp_path, monkeypatch
):
    """The gripper cannot close on a held object: the arm's five joints decide the arrival."""
    from embodied.robots.arm import GRIPPER

    env, twin, port = twin_env(tmp_path)
    read_joints = env.read_joints

    def gripper_blocked_open():
        joints = read_joints()
        joints[GRIPPER] = 0.6  # radians: open, where an object stops it
        return joints

    shutdown = shut_down_after(
        env, lambda: monkeypatch.setattr(env, "read_joints", gripper_blocked_open)
    )
    assert shutdown.torque_off and shutdown.report.failures == []
    assert not any(port.torque().values())


def test_after_a_failed_write_the_next_command_is_rate_limited_from_the_last_one_sent(
    tmp_path, monkeypatch
):
    """A policy that heads for the safe pose (the shoulder 1.2 rad away: cut to the rate limit
    each step); its 10th write fails. The shutdown goes on the same way, its first command a
    rate-limited step from the 9th command, the last the arm was sent, not from the 10th, which
    never reached it (two steps' worth)."""
    env, twin, port = twin_env(tmp_path)
    fail_goal_writes(monkeypatch, port, lambda k: k == FAILING_STEP)

    def onward(obs):
        return env.to_policy(np.asarray(env.safety.cfg.safe_pose))[None]

    executor = ChunkExecutor(onward, request_when_left=0, wait_s=CEILING_S)
    try:
        with pytest.raises(ConnectionError):
            with SafeShutdown(env, hz=HZ, timeout_s=15, clock=env.clock):
                with EmergencyStop(keyboard=False) as stop:
                    run_episode(env, executor, stop, hz=HZ, max_steps=50, clock=env.clock)
    finally:
        executor.close()
        env.close()
    assert largest_goal_jump(port) <= env.safety.cfg.max_step + 1e-3


def test_a_slow_arm_gets_the_time_its_speed_needs_for_the_moves_to_both_poses(tmp_path):
    """At 0.1 rad/s (--robot.max-speed, lowered for a first run) a folded arm and the home pose
    are over 12 s of rate-limited travel apart, both ways: each move's 10 s allowance comes on
    top of the travel now. Before, both moves gave up at 10 s, and the torque stayed on."""
    from embodied.robots.shutdown import ShutdownReport, move_to_pose, shut_down, travel_s
    from embodied.simulators.mujoco.worlds import HOME_POSE

    folded = {"shoulder_lift": -1.6, "elbow_flex": 1.6}  # (the model's frame)
    env, twin, port = twin_env(tmp_path, start=folded, max_speed=0.1)
    home = env.to_arm(np.asarray(HOME_POSE, np.float64))
    env.safety.start(env.read_joints())
    assert travel_s(env.safety, home, HZ) > 12  # (the elbow: 1.2 rad at 0.1 rad/s)
    moved = ShutdownReport()
    options = dict(hz=HZ, tolerance=0.05, clock=env.clock, what="move to the start pose")
    assert move_to_pose(env, home, moved, timeout_s=10.0, **options)
    assert travel_s(env.safety, np.asarray(env.safety.cfg.safe_pose), HZ) > 12
    report = shut_down(env, hz=HZ, timeout_s=10.0, clock=env.clock)
    assert report.torque_off and not report.failures
    assert largest_goal_jump(port) <= 0.1 / HZ + 2 * 2 * np.pi / 4096  # (two encoder ticks)


def test_a_pose_just_past_a_limit_is_reached_at_the_limit_by_a_sagging_joint():
    """The start pose's wrist flex 0.04 rad past the calibrated range (within the 0.05 rad the
    deploy lets through) and a loaded servo that settles 0.015 rad short of its command: the
    arm is there when it is at the limit. Measured against the pose itself it never was, and
    the move timed out without naming the joint."""
    from types import SimpleNamespace

    from embodied.robots.safety import SafetyConfig
    from embodied.robots.shutdown import ShutdownReport, move_to_pose

    limits = dict(joint_low=(-2.0,) * 6, joint_high=(2.0, 2.0, 2.0, 1.40, 2.0, 2.0))
    safety = SafetyLayer(SafetyConfig(**limits, max_step=0.1, workspace_low=(-9.0,) * 3))
    safety.start(np.zeros(6))
    sag = np.array([0.0, 0.0, 0.0, 0.015, 0.0, 0.0])

    class SaggingArm:
        spec = SimpleNamespace(action=SimpleNamespace(gripper=5))

        def __init__(self):
            self.safety = safety

        def hold(self, pose):
            return self.safety.toward(pose)

        def read_joints(self):
            return self.safety.last - sag

    pose = np.array([0.0, 0.0, 0.0, 1.44, 0.0, 0.0])
    options = dict(hz=HZ, timeout_s=1.0, tolerance=0.05, clock=FakeClock(), what="start pose")
    assert move_to_pose(SaggingArm(), pose, ShutdownReport(), **options)
    assert safety.last[3] == pytest.approx(1.40)
