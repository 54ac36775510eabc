"""The control loop on the digital twin: chunk seams, watchdog, emergency stop, safe shutdown.

The loop, the arm and the twin read a ``FakeClock``: a tick passes only when the loop sleeps
through it, so the watchdog holds and stops at exact steps and the twin moves exactly a period per
tick, however busy the machine is. Where a chunk is inferred on the executor's thread, the test
waits for it (``settle``) or the executor waits for it (``wait_s``, a ceiling), never a time."""

import os
import signal

import numpy as np
import pytest
from clocks import CEILING_S, FakeClock, wait_until

os.environ.setdefault("MUJOCO_GL", "egl")

from embodied.robots.arm import ArmConfig, RobotEnv, connect, default_safety  # noqa: E402
from embodied.robots.control import (  # noqa: E402
    ChunkExecutor,
    EmergencyStop,
    RateTimer,
    run_episode,
)
from embodied.robots.safety import SafetyLayer  # noqa: E402
from embodied.robots.servo_port import FEETECH_STS, ticks_to_rad  # noqa: E402
from embodied.robots.shutdown import ShutdownReport, move_to_pose, safe_shutdown  # noqa: E402

TORQUE_ENABLE = FEETECH_STS.torque[0]
HZ = 30.0


def twin_env(tmp_path, clock, **safety):
    from embodied.twin import make_twin_robot

    cfg = ArmConfig(robot="so101-sim", calibration_dir=str(tmp_path / "cal"), control_hz=HZ)
    robot, twin, port = make_twin_robot(cfg, clock=clock)
    connect(robot, cfg)
    layer = SafetyLayer(default_safety(robot, cfg, **safety))
    return RobotEnv(robot, cfg, layer, clock), twin, port


def settle(ex: ChunkExecutor) -> None:
    """Until the chunk asked for, if any, has come back: the next ``action`` takes it."""
    wait_until(lambda: not ex.pending or not ex._results.empty(), "the chunk in flight")


def test_chunks_are_requested_ahead_aligned_and_blended_at_the_seam():
    calls = []

    def infer(step):  # chunk k inferred at step s plans value 100 k + (s + i) for step s + i
        calls.append(step)
        return np.array([[100 * len(calls) + step + i] for i in range(4)], dtype=float)

    ex = ChunkExecutor(infer, request_when_left=2, blend_steps=2)
    try:
        assert ex.action(0, 0) is None  # nothing yet: asked for the first chunk
        settle(ex)
        assert ex.action(1, 1)[0] == 101  # chunk 1 came a step late: step 0's action is dropped
        assert ex.action(2, 2)[0] == 102 and ex.pending  # 2 left: the next chunk is asked for now
        settle(ex)
        # the seam: step 3 was planned as 103 by chunk 1 and as 203 by chunk 2; blended 2/3 : 1/3
        assert calls == [0, 2] and ex.action(3, 3)[0] == pytest.approx(2 / 3 * 103 + 1 / 3 * 203)
        assert ex.action(4, 4)[0] == 204  # chunk 1 planned nothing for step 4: chunk 2 alone
    finally:
        ex.close()


def test_second_seam_weight_and_each_failed_inference_is_counted():
    def infer(step):
        if step >= 4:
            raise ConnectionError("server gone")
        return np.full((6, 1), 10.0 * (step + 1))

    ex = ChunkExecutor(infer, request_when_left=4, blend_steps=2)
    actions = []
    try:
        for step in range(9):  # each chunk asked for at step s is taken at step s + 1
            actions.append(ex.action(step, step))
            settle(ex)
    finally:
        ex.close()
    assert actions[0] is None and actions[8] is None
    assert [a[0] for a in actions[1:3]] == [10.0, 10.0]  # chunk of step 0 (value 10); 2: ask
    # chunk of step 2 (value 30), its first two steps blended with what chunk 0 planned
    assert actions[3][0] == pytest.approx(2 / 3 * 10 + 1 / 3 * 30)
    assert actions[4][0] == pytest.approx(1 / 3 * 10 + 2 / 3 * 30)
    assert [a[0] for a in actions[5:8]] == [30.0, 30.0, 30.0]
    # asked at steps 4, 5, 6, 7 (4 or fewer left, none in flight), each failed; step 8 had none
    assert ex.errors == 4 and len(ex.latencies) == 6


def test_one_action_chunks_are_used_within_their_step_or_a_step_late():
    waited = ChunkExecutor(
        lambda step: np.array([[float(step)]]), request_when_left=0, wait_s=CEILING_S
    )
    try:  # waited for: fresh each step
        assert [waited.action(t, t)[0] for t in range(5)] == [0.0, 1.0, 2.0, 3.0, 4.0]
    finally:
        waited.close()
    late = ChunkExecutor(lambda step: np.array([[float(step)]]), request_when_left=0)
    try:
        assert late.action(0, 0) is None
        settle(late)
        assert late.action(1, 1)[0] == 0.0  # the step-0 action, a step late, rather than nothing
    finally:
        late.close()


def test_watchdog_holds_then_stops_at_exact_steps_then_the_safe_pose_before_torque_off(tmp_path):
    clock = FakeClock()
    env, twin, port = twin_env(tmp_path, clock, hold_after_s=0.15, stop_after_s=0.61)
    chunk = 8
    calls = []

    def infer(obs):  # the "server" answers three chunks, then it is gone
        calls.append(obs)
        if len(calls) > 3:
            raise ConnectionError("server gone")
        target = env.safety.last.copy()
        target[0] += 0.2
        return np.repeat(target[None], chunk, 0)

    # every chunk is waited for when the last one runs out: steps 0-23 act
    ex = ChunkExecutor(infer, request_when_left=0, wait_s=CEILING_S)
    try:
        with EmergencyStop(keyboard=False) as stop:
            result = run_episode(env, ex, stop, hz=HZ, max_steps=200, clock=clock)
        # no action after step 23: at step s it is (s - 23) / 30 s old; held from step 28
        # (0.167 s > 0.15 s), stopped at step 42 (0.633 s > 0.61 s) before acting
        assert result.reason == "watchdog" and result.watchdog == {"hold": 1, "stop": 1}
        assert result.acted == 3 * chunk and result.steps == 42
        kinds = [f["interventions"] for f in result.frames]
        assert kinds[24:] == [[]] * 4 + [["watchdog_hold"]] * 14
        sent = [f["sent"] for f in result.frames]
        assert all(np.array_equal(s, sent[23]) for s in sent[24:])  # holding the last command
        log_before = len(port.log)
        assert safe_shutdown(env, hz=HZ, timeout_s=15, clock=clock)
        after = port.log[log_before:]
        torque_off = [i for i, c in enumerate(after) if c.address == TORQUE_ENABLE and c.value == 0]
        goals = [i for i, c in enumerate(after) if c.address != TORQUE_ENABLE]
        assert torque_off and max(g for g in goals if g < torque_off[0]) < torque_off[0]
        last_goal = port.goal_writes()[-1]
        safe = np.asarray(env.safety.cfg.safe_pose)
        np.testing.assert_allclose(
            [ticks_to_rad(last_goal[i + 1]) for i in range(6)], safe, atol=0.01
        )
        # it is there, not just told to go
        np.testing.assert_allclose(twin.joints()[:5], safe[:5], atol=0.06)
        assert not any(port.torque().values())
    finally:
        ex.close()
        env.close()


def test_a_policy_of_only_non_finite_actions_is_stopped_by_the_watchdog(tmp_path):
    """Every command rejected (the safety layer holds) is no fresh action: the watchdog stops
    the episode as it would without actions (it ran to its clock, holding, before)."""
    clock = FakeClock()
    env, twin, port = twin_env(tmp_path, clock, hold_after_s=0.15, stop_after_s=0.61)
    ex = ChunkExecutor(lambda obs: np.full((4, 6), np.inf), wait_s=CEILING_S)
    try:
        with EmergencyStop(keyboard=False) as stop:
            result = run_episode(env, ex, stop, hz=HZ, max_steps=200, clock=clock)
        # step s at s / 30 s: stopped at step 19 (0.633 s > 0.61 s), before acting
        assert result.reason == "watchdog" and result.steps == 19
        assert env.safety.counts["nonfinite"] == 19 and result.acted == 0  # (all held)
        assert result.watchdog == {"hold": 1, "stop": 1}
    finally:
        ex.close()
        env.close()


class SignallingClock(FakeClock):
    """A FakeClock that raises SIGUSR1 in its ``nth`` sleep: a signal that lands while the loop
    waits for a tick."""

    def __init__(self, nth: int):
        super().__init__()
        self.nth = nth

    def sleep(self, seconds: float) -> None:
        super().sleep(seconds)
        if self.sleeps == self.nth:
            signal.raise_signal(signal.SIGUSR1)


def test_emergency_stop_by_signal_ends_the_episode_at_the_next_step(tmp_path):
    clock = SignallingClock(nth=10)
    env, twin, port = twin_env(tmp_path, clock)
    ex = ChunkExecutor(lambda obs: np.repeat(env.safety.last[None], 4, 0))
    original = signal.getsignal(signal.SIGUSR1)
    try:
        with EmergencyStop(keyboard=False) as stop:
            result = run_episode(env, ex, stop, hz=HZ, max_steps=300, clock=clock)
        # the signal came in the wait after step 9: step 10 never ran
        assert result.reason == "estop" and stop.reason == "SIGUSR1" and result.steps == 10
        assert signal.getsignal(signal.SIGUSR1) == original  # handlers restored
    finally:
        ex.close()
        env.close()


def test_a_nan_chunk_never_reaches_the_motors(tmp_path):
    clock = FakeClock()
    env, twin, port = twin_env(tmp_path, clock)
    ex = ChunkExecutor(lambda obs: np.full((4, 6), np.nan), wait_s=CEILING_S)
    try:
        with EmergencyStop(keyboard=False) as stop:
            result = run_episode(env, ex, stop, hz=HZ, max_steps=10, clock=clock)
        assert result.reason == "done" and result.acted == 0  # every (NaN) action held
        assert env.safety.counts["nonfinite"] == 10  # and every one was rejected
        assert all(np.all(np.isfinite(list(g.values()))) for g in port.goal_writes())
        start = port.goal_writes()[0]
        assert all(g == start for g in port.goal_writes())  # held where it started
    finally:
        ex.close()
        env.close()


def test_a_policy_holding_a_joint_at_its_limit_is_no_joint_limit_intervention(tmp_path):
    """A target the deploy's side clipped to a joint's limit reaches the safety layer as it was:
    sent as float32, the twin's gripper limit (-0.12453) rounded outside it, and a grasp counted
    a joint_limit intervention at every step. A target a micro-radian outside still counts."""
    clock = FakeClock()
    env, twin, port = twin_env(tmp_path, clock)
    low = env.safety.low  # f64 [6], the arm's frame
    assert np.float32(low[5]) < low[5]  # (the case: float32 rounds this limit outside)

    def infer(obs):  # the joints where they are, the gripper closed to its limit
        target = env.safety.last.copy()
        target[5] = low[5]
        return np.repeat(env.to_policy(target)[None], 4, 0)

    ex = ChunkExecutor(infer, request_when_left=0, wait_s=CEILING_S)
    try:
        with EmergencyStop(keyboard=False) as stop:
            result = run_episode(env, ex, stop, hz=HZ, max_steps=20, clock=clock)
        assert result.acted == 20 and env.safety.counts["joint_limit"] == 0
        _, kinds = env.safety.filter(low - np.array([0, 0, 0, 0, 0, 1e-6]))
        assert kinds[:1] == ["joint_limit"]
    finally:
        ex.close()
        env.close()


def test_rate_timer_keeps_absolute_deadlines_and_starts_over_after_a_missed_tick():
    clock = FakeClock(overshoot=[0.0, 0.002, 0.001, 0.025, 0.0])  # how late each sleep wakes
    timer = RateTimer(100.0, clock)
    ticks = []
    for _ in range(5):
        timer.wait()
        ticks.append(clock.now)
    # deadlines every 10 ms from 0, not from each wake-up; the fourth woke 25 ms late (more than
    # a period), so the fifth is a period after it, not at 0.05 (two ticks rushed together)
    assert ticks == pytest.approx([0.01, 0.022, 0.031, 0.065, 0.075])
    stats = timer.stats()
    assert stats["ticks"] == 5
    assert stats["achieved_hz"] == pytest.approx(5 / 0.075)  # not the 100 Hz asked for
    assert stats["missed_ticks"] == 2  # (the fourth: 25 ms late, two whole periods)
    assert stats["jitter_p50_ms"] == pytest.approx(1.0)  # of 0, 2, 1, 25, 0 ms
    assert stats["jitter_p99_ms"] == pytest.approx(2 + 0.96 * 23)  # numpy's linear interpolation
    assert stats["jitter_max_ms"] == pytest.approx(25.0)


def test_emergency_stop_by_key(monkeypatch):
    read_end, write_end = os.pipe()
    monkeypatch.setattr("sys.stdin", os.fdopen(read_end))
    with EmergencyStop(keyboard=True) as stop:
        assert not stop.is_set()
        os.write(write_end, b"\n")  # Enter
        assert stop.event.wait(CEILING_S) and stop.reason == "key"
    os.close(write_end)


def test_each_recorded_frame_holds_the_observation_its_action_was_taken_at(tmp_path):
    """A frame pairs the action sent at a step with the observation the policy acted on at that
    step (a dataset's state and action), not with the one read after the command."""
    clock = FakeClock()
    env, twin, port = twin_env(tmp_path, clock)
    seen = []

    def infer(obs):  # one fresh action a step, moving the pan joint, from this step's obs
        seen.append(obs)
        target = obs.state[0, :6].double().numpy().copy()
        target[0] += 0.05
        return target[None]

    ex = ChunkExecutor(infer, request_when_left=0, wait_s=CEILING_S)
    try:
        with EmergencyStop(keyboard=False) as stop:
            result = run_episode(env, ex, stop, hz=HZ, max_steps=6, clock=clock)
    finally:
        ex.close()
        env.close()
    assert result.acted == 6 and len(seen) == 6
    assert all(f["obs"] is obs for f, obs in zip(result.frames, seen, strict=True))
    pans = [f["obs"].state[0, 0].item() for f in result.frames]
    assert all(b > a for a, b in zip(pans, pans[1:]))  # the arm moved between the frames


class StoppingClock(FakeClock):
    """A FakeClock that triggers ``stop`` in its ``nth`` sleep."""

    def __init__(self, stop: EmergencyStop, nth: int):
        super().__init__()
        self.stop = stop
        self.nth = nth

    def sleep(self, seconds: float) -> None:
        super().sleep(seconds)
        if self.sleeps == self.nth:
            self.stop.trigger("key")


def test_the_emergency_stop_ends_a_move_to_a_pose_at_its_next_tick(tmp_path):
    stop = EmergencyStop(keyboard=False)
    clock = StoppingClock(stop, nth=5)
    env, twin, port = twin_env(tmp_path, clock)
    try:
        env.reset()
        far = env.safety.last.copy()
        far[0] += 1.0  # a second's move at the rate limit: far more than 5 ticks
        before = len(port.goal_writes())
        report = ShutdownReport()
        arrived = move_to_pose(
            env,
            far,
            report,
            hz=HZ,
            timeout_s=10,
            tolerance=0.05,
            clock=clock,
            what="move",
            stop=stop,
        )
        assert not arrived and report.failures == []
        assert len(port.goal_writes()) - before == 5  # a command a tick, none after the stop
    finally:
        env.close()


def test_a_move_to_a_start_pose_waits_for_the_gripper_to_get_there(tmp_path):
    """Only the safe pose's move may leave a blocked gripper behind: a start pose is reached when
    the gripper reads its value too (episodes start where training did)."""
    from embodied.robots.arm import GRIPPER

    clock = FakeClock()
    env, twin, port = twin_env(tmp_path, clock)
    try:
        env.reset()
        pose = env.safety.last.copy()
        pose[GRIPPER] = env.safety.low[GRIPPER] + 0.05  # shut, from open: ~0.7 rad away
        assert abs(env.present[GRIPPER] - pose[GRIPPER]) > 0.5
        report = ShutdownReport()
        arrived = move_to_pose(
            env, pose, report, hz=HZ, timeout_s=10, tolerance=0.05, clock=clock, what="move"
        )
        assert arrived and abs(env.read_joints()[GRIPPER] - pose[GRIPPER]) < 0.05
    finally:
        env.close()


def test_an_episode_starts_at_rest_as_a_simulators_does(tmp_path):
    """reset()'s velocities are zero, as a simulator's reset gives (the start move's last
    reading, a moment before, made one encoder tick 0.77 rad/s)."""
    clock = FakeClock()
    env, _, _ = twin_env(tmp_path, clock, hold_after_s=1.0, stop_after_s=2.0)
    env.read_joints()
    env.present = env.present + 2 * np.pi / 4096  # (a tick since: the arm still settling)
    assert env.reset().state[0, 6:].abs().max() == 0
