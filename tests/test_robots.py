"""The real-arm path on the digital twin: LeRobot's SOFollower and Feetech bus code, a software
serial port, the MuJoCo arm. Assertions read the goal positions that reached the "motors"."""

import math
import os

import numpy as np
import pytest
import torch

os.environ.setdefault("MUJOCO_GL", "egl")

from embodied.contract import check_env  # noqa: E402
from embodied.robots.arm import (
    JOINTS,
    ArmConfig,
    RobotEnv,
    RobotError,
    connect,
    default_safety,
    from_radians,
    make_robot,
)  # noqa: E402
from embodied.robots.kinematics import tool_point  # noqa: E402
from embodied.robots.safety import SafetyLayer  # noqa: E402
from embodied.robots.servo_port import (
    FEETECH_STS,
    DynamixelPort,
    FeetechPort,
    attach,
    rad_to_ticks,
    ticks_to_rad,
)  # noqa: E402

TICK = 2 * math.pi / 4096  # one encoder tick in radians
BUS = (
    2 * TICK
)  # LeRobot's degrees <-> ticks (360/4095 per tick, truncating) is within 2 ticks of exact


def twin_env(tmp_path, **overrides):
    from embodied.twin import make_twin_robot

    cfg = ArmConfig(
        robot="so101-sim",
        calibration_dir=str(tmp_path / "cal"),
        instruction="pick up the cube",
        **overrides,
    )
    robot, twin, port = make_twin_robot(cfg)
    connect(robot, cfg)
    return RobotEnv(robot, cfg, SafetyLayer(default_safety(robot, cfg))), twin, port


def command(env, joints: np.ndarray):
    """One step of the arm toward ``joints`` (radians [6], the policy's frame)."""
    return env.step(torch.tensor(joints, dtype=torch.float32)[None])  # f32 [1, 6]


def sent_radians(port: FeetechPort) -> np.ndarray:
    """The last goal positions written on the bus, radians, in joint order."""
    goals = port.goal_writes()[-1]
    return np.array([ticks_to_rad(goals[i + 1]) for i in range(len(JOINTS))])


def test_forward_kinematics_matches_the_mujoco_arm():
    import mujoco

    from embodied.simulators.mujoco.arm import RANGES, scene

    model = mujoco.MjModel.from_xml_string(scene(""))
    data = mujoco.MjData(model)
    rng = np.random.default_rng(0)
    adr = [model.jnt_qposadr[model.joint(j).id] for j in JOINTS]
    for _ in range(20):
        q = np.array([rng.uniform(*RANGES[j]) for j in JOINTS])
        data.qpos[adr] = q
        mujoco.mj_kinematics(model, data)
        np.testing.assert_allclose(tool_point(q), data.site("tcp").xpos, atol=1e-9)


def test_lerobot_bus_reads_and_writes_through_the_software_port():
    # LeRobot's FeetechMotorsBus, unchanged, against ideal servos: ping/model/firmware handshake,
    # register writes, sync write of goals and sync read of positions, raw ticks both ways

    from lerobot.motors import Motor, MotorNormMode
    from lerobot.motors.feetech import FeetechMotorsBus

    bus = FeetechMotorsBus(
        "fake",
        {
            "a": Motor(1, "sts3215", MotorNormMode.DEGREES),
            "b": Motor(2, "sts3215", MotorNormMode.DEGREES),
        },
    )
    port = FeetechPort({1: (1000, 3000), 2: (500, 3500)})
    attach(bus, port)
    bus.connect()
    assert bus.read_calibration()["b"].range_max == 3500
    bus.enable_torque()
    assert port.torque() == {1: True, 2: True}
    bus.sync_write("Goal_Position", {"a": 1234, "b": 3210}, normalize=False)
    assert port.goal_writes()[-1] == {1: 1234, 2: 3210}
    assert bus.sync_read("Present_Position", normalize=False) == {"a": 1234, "b": 3210}
    port.unplugged = True  # a cut cable: the driver's own error, not a hang
    with pytest.raises(ConnectionError):
        bus.sync_read("Present_Position", normalize=False)


def test_twin_connects_with_lerobots_calibration_and_passes_the_contract(tmp_path):
    env, twin, port = twin_env(
        tmp_path, cameras={"front": "", "wrist": ""}, image_size=48, max_episode_steps=4
    )
    try:
        twin.frozen = True  # the simulated arm stands still while we compare
        obs = env.reset()
        assert (
            obs.images["front"].shape == (1, 48, 48, 3) and obs.images["wrist"].dtype == torch.uint8
        )
        np.testing.assert_allclose(
            obs.state[0, :6].numpy(), twin.joints(), atol=2 * TICK
        )  # radians, via degrees and ticks
        twin.frozen = False
        assert env.spec.action.space == "joint_pos" and env.spec.obs.privileged == {}
        check_env(env, seed=0, deterministic=False)  # a physical scene cannot be reset to a seed
    finally:
        env.close()


def test_each_safety_limit_reaches_the_bus_clipped_never_raw(tmp_path):
    env, twin, port = twin_env(tmp_path)
    try:
        env.reset()
        safety = env.safety
        start = safety.last.copy()
        # joint limit + rate limit: a far target beyond the pan limit moves one step, clipped
        far = start.copy()
        far[0] = 10.0
        command(env, far)
        np.testing.assert_allclose(sent_radians(port)[0], start[0] + safety.max_step[0], atol=BUS)
        assert env.interventions == ["joint_limit", "rate_limit"]
        np.testing.assert_allclose(
            sent_radians(port)[1:], start[1:], atol=BUS
        )  # nothing else moved
        # walking to the limit never passes it
        for _ in range(80):
            command(env, far)
        assert abs(sent_radians(port)[0] - safety.high[0]) <= BUS
        # NaN: rejected whole, the arm keeps the last command
        before = sent_radians(port)
        bad = far.copy()
        bad[2] = float("nan")
        command(env, bad)
        assert env.interventions == ["nonfinite"] and safety.counts["nonfinite"] == 1
        np.testing.assert_allclose(sent_radians(port), before, atol=BUS)
        inf = far.copy()
        inf[1] = float("inf")
        command(env, inf)
        assert safety.counts["nonfinite"] == 2
    finally:
        env.close()


def test_workspace_box_stops_the_tool_short_of_the_table(tmp_path):
    env, twin, port = twin_env(tmp_path)
    try:
        env.reset()
        # lean forward and down: shoulder lift toward the table until the tool point would go
        # below 1 cm
        target = env.safety.last.copy()
        target[1], target[2], target[3] = 1.0, 0.3, 0.5
        for _ in range(120):
            command(env, target)
        sent = sent_radians(port)
        assert env.safety.counts["workspace"] > 0
        z = tool_point(sent)[2]
        assert (
            env.safety.cfg.workspace_low[2] - 0.002 <= z < 0.03
        )  # at the floor of the box, not through it
        assert tool_point(target)[2] < 0  # what was asked would have hit the table
    finally:
        env.close()


def test_a_policy_frame_with_a_mirrored_pan_and_an_offset_elbow(tmp_path):
    # policy = sign * arm + offset: another simulator's conventions, mapped at the policy boundary
    # only
    env, twin, port = twin_env(
        tmp_path, joint_signs=(-1, 1, 1, 1, 1, 1), joint_offsets=(0, 0, 0.25, 0, 0, 0)
    )
    try:
        twin.frozen = True
        obs = env.reset()
        arm = twin.joints()
        assert obs.state[0, 0].item() == pytest.approx(-arm[0], abs=BUS) and obs.state[
            0, 2
        ].item() == pytest.approx(arm[2] + 0.25, abs=BUS)
        twin.frozen = False
        target = obs.state[0, :6].numpy().astype(np.float64)
        target[0] += 0.04  # +pan in the policy's frame ...
        command(env, target)
        assert sent_radians(port)[0] == pytest.approx(
            arm[0] - 0.04, abs=BUS
        )  # ... is -pan on the arm
        low, high = env.spec.action.bounds()
        assert low[0].item() == pytest.approx(-env.safety.high[0]) and high[
            2
        ].item() == pytest.approx(env.safety.high[2] + 0.25)
    finally:
        env.close()


def test_an_uncalibrated_arm_is_refused_with_the_calibration_command(tmp_path):
    cfg = ArmConfig(robot="so101", port="/dev/ttyFAKE0", id="nobody", calibration_dir=str(tmp_path))
    robot = make_robot(cfg)
    port = FeetechPort({i: (0, 4095) for i in range(1, 7)})
    attach(robot.bus, port)
    with pytest.raises(
        RobotError,
        match="lerobot-calibrate --robot.type=so101_follower --robot.port=/dev/ttyFAKE0 "
        "--robot.id=nobody",
    ):
        connect(robot, cfg)  # would prompt on stdin if it tried LeRobot's interactive calibration
    # LeRobot's connect switched torque on (its configure ends so); the refusal switches it off
    assert any(c.address == FEETECH_STS.torque[0] and c.value == 1 for c in port.log)
    assert not any(port.torque().values()) and not robot.is_connected


def test_koch_arm_on_dynamixel_servos_passes_the_contract_with_its_limits(tmp_path):
    # LeRobot's KochFollower and DynamixelMotorsBus (protocol 2.0, CRC, byte stuffing) on a
    # software port with ideal servos, with a calibration as lerobot-calibrate would save it
    import json

    ranges = {i: (2048 - 900, 2048 + 900) for i in range(1, 7)}
    cal = {
        j: {
            "id": i + 1,
            "drive_mode": 0,
            "homing_offset": 0,
            "range_min": ranges[i + 1][0],
            "range_max": ranges[i + 1][1],
        }
        for i, j in enumerate(JOINTS)
    }
    (tmp_path / "koch.json").write_text(json.dumps(cal))
    cfg = ArmConfig(
        robot="koch",
        port="/dev/ttyFAKE1",
        id="koch",
        calibration_dir=str(tmp_path),
        max_episode_steps=3,
    )
    robot = make_robot(cfg)
    models = {1: 1060, 2: 1060, 3: 1200, 4: 1200, 5: 1200, 6: 1200}  # XL430-W250 x2, XL330-M288 x4
    port = DynamixelPort(ranges, model_numbers=models)
    attach(robot.bus, port)
    connect(robot, cfg)
    env = RobotEnv(robot, cfg, SafetyLayer(default_safety(robot, cfg)))
    try:
        check_env(env, seed=0, deterministic=False)
        env.reset()
        far = env.safety.last.copy()
        far[1] = -10.0
        command(env, far)
        goal = ticks_to_rad(port.goal_writes()[-1][2])
        assert goal == pytest.approx(env.safety.last[1], abs=BUS) and env.interventions == [
            "joint_limit",
            "rate_limit",
        ]
        # the calibrated range of motion (900 ticks each way) less the margin, in radians
        assert env.safety.high[0] == pytest.approx(
            900 * 2 * math.pi / 4095 - cfg.joint_margin, abs=1e-6
        )
    finally:
        env.close()


def test_bad_robot_config_is_a_clear_error():
    with pytest.raises(ValueError, match="robot: one of"):
        ArmConfig(robot="ur5").validate()
    with pytest.raises(ValueError, match="serial port"):
        ArmConfig(robot="so101").validate()


def test_unit_conversions_round_trip():
    q = np.array([0.1, -0.2, 0.3, -0.4, 0.5, 0.85])
    values = from_radians(q, (0.0, 1.7))
    assert values["gripper.pos"] == pytest.approx(50.0) and values[
        "shoulder_pan.pos"
    ] == pytest.approx(math.degrees(0.1))
    assert rad_to_ticks(0.0) == 2048 and abs(ticks_to_rad(rad_to_ticks(1.0)) - 1.0) <= TICK / 2


def test_an_arm_outside_the_workspace_may_move_back_in_but_not_further_out():
    # an arm pressed below the box's floor (the twin pushing on the table) starts an episode there:
    # a command that raises the tool point goes through, one that lowers it further is held
    from embodied.robots.safety import SafetyConfig, SafetyLayer

    layer = SafetyLayer(SafetyConfig(joint_low=(-3.0,) * 6, joint_high=(3.0,) * 6, max_step=0.2))
    low = np.array([0.0, 0.3, 0.9, 1.2, 0.0, 0.0])  # the tool point at the table
    below = tool_point(low)[2]
    assert below < layer.cfg.workspace_low[2]
    layer.start(low)
    up = low + np.array([0.0, 0.0, 0.0, 0.1, 0.0, 0.0])  # the wrist bends on: the tool rises
    down = low + np.array([0.0, 0.0, 0.0, -0.1, 0.0, 0.0])
    assert tool_point(up)[2] > below > tool_point(down)[2]
    sent, kinds = layer.filter(up)
    np.testing.assert_allclose(sent, up)  # back toward the box: allowed
    assert kinds == []
    sent, kinds = layer.filter(sent + (down - low) * 1.5)  # lower than where it started
    np.testing.assert_allclose(sent, up)  # further out than it is: held
    assert kinds == ["workspace"]


def test_moving_to_a_pose_makes_headway_where_the_straight_way_dips_out_of_the_box():
    # from the fingers at the table to the home pose: the straight line in joint space first
    # lowers the tool into the table; joint by joint the layer still gets there, staying in
    from embodied.robots.safety import SafetyConfig, SafetyLayer
    from embodied.simulators.mujoco.arm import HOME

    home = np.array([HOME[j] for j in JOINTS])
    low = np.array([-0.12, 0.24, 1.12, 1.33, 0.07, 0.6])  # the tool point 7.7 mm up
    layer = SafetyLayer(SafetyConfig(joint_low=(-3.0,) * 6, joint_high=(3.0,) * 6, max_step=0.1))
    floor = layer.cfg.workspace_low[2]
    line = [low + t * (home - low) for t in np.linspace(0, 1, 50)]
    assert tool_point(low)[2] > floor > min(tool_point(q)[2] for q in line)  # it dips out
    layer.start(low)
    heights = [tool_point(layer.toward(home))[2] for _ in range(100)]
    np.testing.assert_allclose(layer.last, home, atol=1e-9)  # it arrived
    assert min(heights) >= floor - 1e-9  # never out of the box on the way
    # the rate limit is the move's plan, not an intervention (steps of max_step, taken as
    # last + s, were counted where s came back an ulp over)
    assert layer.counts["rate_limit"] == 0


def test_a_policy_pressing_on_a_limit_is_logged_at_its_1st_10th_and_100th_time(caplog):
    """Every intervention is counted; the log names a kind at its 1st, 10th, 100th, ... time,
    not every step (20-30 lines a second), and rate limits only at debug level."""
    import logging

    from embodied.robots.safety import SafetyConfig

    layer = SafetyLayer(SafetyConfig(joint_low=(-3.0,) * 6, joint_high=(3.0,) * 6, max_step=0.2))
    layer.start(np.zeros(6))
    caplog.set_level(logging.INFO, logger="embodied.robots.safety")
    pressing = np.array([3.5, 0.0, 0.0, 0.0, 0.0, 0.0])  # past the first joint's top
    for _ in range(150):
        layer.filter(pressing)
    # 0.2 rad a step to the top (3.0): 14 steps cut short, the 15th lands on it without a cut
    assert layer.counts["joint_limit"] == 150 and layer.counts["rate_limit"] == 14
    assert layer.last[0] == 3.0
    logged = [r.getMessage() for r in caplog.records]
    assert [m.split("; ")[-1] for m in logged] == ["1 so far)", "10 so far)", "100 so far)"]


def test_read_arm_prints_the_joints_as_lerobot_reads_them_with_torque_off(tmp_path):
    """`embodied read-arm`'s work: each line the twin's joints in degrees (the model's frame, as
    LeRobot reads a calibrated arm), the gripper as LeRobot's 0-100 and the model's radians; the
    arm is left with torque off, disconnected."""
    from embodied.read_arm import read_arm
    from embodied.twin import make_twin_robot

    cfg = ArmConfig(robot="so101-sim", calibration_dir=str(tmp_path / "cal"))
    robot, twin, port = make_twin_robot(cfg)
    twin.frozen = True  # (torque off: the twin's arm would sag between readings)
    for servo in port.servos.values():  # powered: read-arm switches it off
        servo.set(*FEETECH_STS.torque, 1)
    lines = []
    assert read_arm(robot, cfg, readings=3, hz=100.0, write=lines.append) == 3
    assert lines[0].startswith("torque off") and len(lines) == 4
    joints = twin.joints()  # f64 [6], radians
    for line in lines[1:]:
        words = line.split()
        degrees = [float(words[words.index(j) + 1]) for j in JOINTS[:-1]]
        np.testing.assert_allclose(degrees, np.degrees(joints[:5]), atol=np.degrees(BUS) + 0.05)
        gripper = float(words[words.index("gripper") + 2].strip("(rad)"))
        assert gripper == pytest.approx(joints[5], abs=BUS + 1e-3)
        assert float(words[words.index("gripper") + 1]) == pytest.approx(
            from_radians(joints, cfg.gripper_range)["gripper.pos"], abs=0.5
        )
    assert not any(port.torque().values()) and not robot.is_connected


def test_read_arm_ends_on_ctrl_c_and_says_when_the_torque_may_still_be_on(tmp_path, monkeypatch):
    from embodied.read_arm import read_arm
    from embodied.twin import make_twin_robot

    cfg = ArmConfig(robot="so101-sim", calibration_dir=str(tmp_path / "cal"))
    robot, twin, port = make_twin_robot(cfg)
    lines = []

    def write_then_ctrl_c(line: str) -> None:
        lines.append(line)
        if len(lines) == 3:  # the second reading
            raise KeyboardInterrupt

    assert read_arm(robot, cfg, readings=None, hz=100.0, write=write_then_ctrl_c) == 1
    assert not robot.bus.is_connected and not any(port.torque().values())

    def no_answer(*args, **kwargs):
        raise ConnectionError("Failed to write 'Torque_Enable'")

    monkeypatch.setattr(robot.bus, "disable_torque", no_answer)
    with pytest.raises(ConnectionError) as raised:
        read_arm(robot, cfg, readings=1, hz=100.0, write=lines.append)
    assert raised.value.__notes__ == ["the servos' torque may still be on"]
    assert not robot.bus.is_connected


def test_the_watchdogs_times_follow_the_arms_setting(tmp_path):
    """``robot.watchdog`` (seconds): the episode stops after it without a fresh action, the arm
    holds from a quarter of it; 1 s by default (the times tests/test_control.py steps through)."""

    for watchdog, hold, stop in ((None, 0.25, 1.0), (4.0, 1.0, 4.0)):
        extra = {} if watchdog is None else {"watchdog_s": watchdog}
        safety = _twin_safety(tmp_path, **extra)
        assert (safety.hold_after_s, safety.stop_after_s) == (hold, stop)


def test_the_rate_limit_follows_the_arms_max_speed(tmp_path):
    """``robot.max_speed`` (rad/s) over the control rate is the most a joint moves in a step."""
    assert _twin_safety(tmp_path).max_step == pytest.approx(2.0 / 30.0)  # the defaults
    assert _twin_safety(tmp_path, max_speed=0.5, control_hz=20.0).max_step == 0.025


def _twin_safety(tmp_path, **arm):
    """The twin's default safety settings for an ArmConfig of ``arm``."""
    from embodied.twin import make_twin_robot

    cfg = ArmConfig(robot="so101-sim", calibration_dir=str(tmp_path / "cal"), **arm)
    robot, _, _ = make_twin_robot(cfg)
    connect(robot, cfg)
    try:
        return default_safety(robot, cfg)
    finally:
        robot.disconnect()


def test_a_camera_frame_is_cropped_to_its_centred_square_not_squashed():
    """A 640x480 camera into the policy's 120x120 image: its middle 480x480 (the simulators'
    cameras are square); resized whole, the 80 white columns left of it were squashed in."""
    from embodied.robots.safety import SafetyConfig

    frame = np.zeros((480, 640, 3), np.uint8)
    frame[:, :80] = 255  # outside the centred square, left

    class Camera640:
        cameras = {"front": None}

        def get_observation(self):
            return {**{f"{joint}.pos": 0.0 for joint in JOINTS}, "front": frame}

    cfg = ArmConfig(robot="so101", port="/dev/null", image_size=120)
    layer = SafetyLayer(SafetyConfig(joint_low=(-3.0,) * 6, joint_high=(3.0,) * 6))
    image = RobotEnv(Camera640(), cfg, layer).observe().images["front"][0]
    assert image.shape == (120, 120, 3) and int(image.max()) == 0
