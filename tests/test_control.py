"""The control loop on the digital twin: chunk seams, watchdog, emergency stop, safe shutdown."""

import os
import signal
import threading
import time

import numpy as np
import pytest

os.environ.setdefault("MUJOCO_GL", "egl")

from embodied.robots.arm import ArmConfig, RobotEnv, connect, default_safety  # noqa: E402
from embodied.robots.control import (
    ChunkExecutor,
    EmergencyStop,
    RateTimer,
    run_episode,
    safe_shutdown,
)  # noqa: E402
from embodied.robots.servo_port import FEETECH_STS, ticks_to_rad  # noqa: E402

TORQUE_ENABLE = FEETECH_STS.torque[0]
from embodied.robots.safety import SafetyLayer  # noqa: E402

HZ = 30.0


def twin_env(tmp_path, **safety):
    from embodied.twin import make_twin_robot

    cfg = ArmConfig(robot="so101-sim", calibration_dir=str(tmp_path / "cal"), control_hz=HZ)
    robot, twin, port = make_twin_robot(cfg)
    connect(robot, cfg)
    return RobotEnv(robot, cfg, SafetyLayer(default_safety(robot, cfg, **safety))), twin, port


def _wait(ex: ChunkExecutor) -> None:
    deadline = time.monotonic() + 5
    while ex._results.empty() and time.monotonic() < deadline:
        time.sleep(0.001)


def test_chunks_are_requested_ahead_aligned_and_blended_at_the_seam():
    calls = []

    def infer(step):  # chunk k inferred at step s plans value 100 k + (s + i) for step s + i
        calls.append(step)
        return np.array([[100 * len(calls) + step + i] for i in range(4)], dtype=float)

    ex = ChunkExecutor(infer, request_when_left=2, blend_steps=2)
    try:
        assert ex.action(0, 0) is None  # nothing yet: asked for the first chunk
        _wait(ex)
        assert ex.action(1, 1)[0] == 101  # chunk 1 came a step late: step 0's action is dropped
        assert ex.action(2, 2)[0] == 102 and ex.pending  # 2 left: the next chunk is asked for now
        _wait(ex)
        # the seam: step 3 was planned as 103 by chunk 1 and as 203 by chunk 2; blended 2/3 : 1/3
        assert calls == [0, 2] and ex.action(3, 3)[0] == pytest.approx(2 / 3 * 103 + 1 / 3 * 203)
        assert ex.action(4, 4)[0] == 204  # chunk 1 planned nothing for step 4: chunk 2 alone
    finally:
        ex.close()


def test_second_seam_weight_and_a_failed_inference_is_counted():
    def infer(step):
        if step >= 4:
            raise ConnectionError("server gone")
        return np.full((6, 1), 10.0 * (step + 1))

    ex = ChunkExecutor(infer, request_when_left=4, blend_steps=2)
    try:
        ex.action(0, 0)
        _wait(ex)
        assert ex.action(1, 1)[0] == 10.0  # chunk of step 0 (value 10), 5 of 6 left
        assert ex.action(2, 2)[0] == 10.0  # 4 left: ask (step 2 -> value 30)
        _wait(ex)
        assert ex.action(3, 3)[0] == pytest.approx(2 / 3 * 10 + 1 / 3 * 30)
        assert ex.action(4, 4)[0] == pytest.approx(1 / 3 * 10 + 2 / 3 * 30)  # second blended step
        assert ex.action(5, 5)[0] == 30.0
        for step in range(6, 9):
            ex.action(step, step)
            _wait(ex)
        assert ex.errors >= 1
    finally:
        ex.close()


def test_one_action_chunks_are_used_within_their_step_or_a_step_late():
    ex = ChunkExecutor(lambda step: np.array([[float(step)]]), request_when_left=0, wait_s=1.0)
    try:
        assert [ex.action(t, t)[0] for t in range(5)] == [
            0.0,
            1.0,
            2.0,
            3.0,
            4.0,
        ]  # waited for: fresh each step
    finally:
        ex.close()
    late = ChunkExecutor(lambda step: np.array([[float(step)]]), request_when_left=0)
    try:
        assert late.action(0, 0) is None
        _wait(late)
        assert late.action(1, 1)[0] == 0.0  # the step-0 action, a step late, rather than nothing
    finally:
        late.close()


def test_watchdog_holds_then_stops_and_the_arm_reaches_the_safe_pose_before_torque_off(tmp_path):
    env, twin, port = twin_env(tmp_path, hold_after_s=0.15, stop_after_s=0.6)
    served = threading.Event()

    def infer(obs):  # the "server" answers three times, then stops answering
        if served.is_set():
            time.sleep(5)
        target = env.safety.last.copy()
        target[0] += 0.2
        return np.repeat(target[None], 8, 0)

    calls = {"n": 0}

    def counting(obs):
        calls["n"] += 1
        if calls["n"] > 3:
            served.set()
        return infer(obs)

    ex = ChunkExecutor(counting, request_when_left=2)
    try:
        with EmergencyStop(keyboard=False) as stop:
            result = run_episode(env, ex, stop, hz=HZ, max_steps=200)
        assert result.reason == "watchdog" and result.watchdog == {"hold": 1, "stop": 1}
        held = [f["sent"] for f in result.frames if f["interventions"] == ["watchdog_hold"]]
        assert len(held) >= 3 and all(
            np.array_equal(h, held[0]) for h in held
        )  # holding: the same command
        assert result.steps < 200
        log_before = len(port.log)
        assert safe_shutdown(env, hz=HZ, timeout_s=15)
        after = port.log[log_before:]
        torque_off = [i for i, c in enumerate(after) if c.address == TORQUE_ENABLE and c.value == 0]
        goals = [i for i, c in enumerate(after) if c.address != TORQUE_ENABLE]
        assert torque_off and max(g for g in goals if g < torque_off[0]) < torque_off[0]
        last_goal = port.goal_writes()[-1]
        safe = np.asarray(env.safety.cfg.safe_pose)
        np.testing.assert_allclose(
            [ticks_to_rad(last_goal[i + 1]) for i in range(6)], safe, atol=0.01
        )
        np.testing.assert_allclose(
            twin.joints()[:5], safe[:5], atol=0.06
        )  # it is there, not just told to go
        assert not any(port.torque().values())
    finally:
        ex.close()
        env.close()


def test_emergency_stop_by_signal_ends_the_episode(tmp_path):
    env, twin, port = twin_env(tmp_path)
    ex = ChunkExecutor(lambda obs: np.repeat(env.safety.last[None], 4, 0))
    original = signal.getsignal(signal.SIGUSR1)
    try:
        with EmergencyStop(keyboard=False) as stop:
            threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGUSR1)).start()
            result = run_episode(env, ex, stop, hz=HZ, max_steps=300)
        assert result.reason == "estop" and stop.reason == "SIGUSR1" and 3 <= result.steps < 300
        assert signal.getsignal(signal.SIGUSR1) == original  # handlers restored
    finally:
        ex.close()
        env.close()


def test_a_nan_chunk_never_reaches_the_motors(tmp_path):
    env, twin, port = twin_env(tmp_path)
    ex = ChunkExecutor(lambda obs: np.full((4, 6), np.nan))
    try:
        with EmergencyStop(keyboard=False) as stop:
            result = run_episode(env, ex, stop, hz=HZ, max_steps=10)
        assert env.safety.counts["nonfinite"] >= 5
        assert all(np.all(np.isfinite(list(g.values()))) for g in port.goal_writes())
        start = port.goal_writes()[0]
        assert all(g == start for g in port.goal_writes())  # held where it started
        assert result.reason == "done"
    finally:
        ex.close()
        env.close()


def test_rate_timer_reports_its_ticks():
    timer = RateTimer(200.0)
    for _ in range(20):
        timer.wait()
    stats = timer.stats()
    assert (
        stats["ticks"] == 20
        and stats["jitter_p50_ms"] <= stats["jitter_p99_ms"] <= stats["jitter_max_ms"]
    )


def test_emergency_stop_by_key(monkeypatch):
    read_end, write_end = os.pipe()
    monkeypatch.setattr("sys.stdin", os.fdopen(read_end))
    with EmergencyStop(keyboard=True) as stop:
        assert not stop.is_set()
        os.write(write_end, b"\n")  # Enter
        assert stop.event.wait(5) and stop.reason == "key"
    os.close(write_end)
