"""Connecting to an arm through LeRobot's own driver, on the digital twin's software serial
port: what fails to connect is one RobotError, what did connect is released, and the servos'
torque goes off only where LeRobot's connect had begun configuring them (it switches it on there);
before that, an arm a previous run left holding keeps holding. A camera whose capture stopped
gives no more frames."""

import pytest

from embodied.robots.arm import ArmConfig, RobotError, connect
from embodied.robots.servo_port import FEETECH_STS


def test_a_failed_handshake_on_an_arm_without_cameras_leaves_the_torque_on(tmp_path, monkeypatch):
    """The bus's port opened, then its servo check failed (a missing motor, another firmware):
    the servos were never configured, so the torque stays as they had it. It was switched off
    when no camera was configured, since "all cameras connected" stood for "configuring"."""
    from embodied.twin import make_twin_robot

    cfg = ArmConfig(robot="so101-sim", calibration_dir=str(tmp_path / "cal"))
    robot, twin, port = make_twin_robot(cfg)

    def missing_motor():
        raise RuntimeError("Missing motor IDs: 4")

    monkeypatch.setattr(robot.bus, "_handshake", missing_motor)
    for servo in port.servos.values():  # an arm a previous run left holding
        servo.set(*FEETECH_STS.torque, 1)
    with pytest.raises(RobotError, match="so101-sim on the twin: cannot connect: Missing motor"):
        connect(robot, cfg)
    assert not robot.bus.is_connected and all(port.torque().values())
    assert "configure" not in vars(robot)  # LeRobot's own method again


def test_a_camera_that_cannot_open_is_one_error_and_the_bus_is_released(tmp_path, monkeypatch):
    """LeRobot connects the bus, then the cameras: a camera that cannot open at its settings is
    a RobotError naming it, and the bus it left open is closed. The servos were not configured
    yet: their torque stays as it was (here on: an arm a previous run left holding)."""
    from embodied.twin import make_twin_robot

    cfg = ArmConfig(
        robot="so101-sim", calibration_dir=str(tmp_path / "cal"), cameras={"wrist": "wrist"}
    )
    robot, twin, port = make_twin_robot(cfg)

    def unsupported(*args, **kwargs):
        raise RuntimeError("wrist: failed to set 640x480 at 30 fps")

    monkeypatch.setattr(robot.cameras["wrist"], "connect", unsupported)
    for servo in port.servos.values():
        servo.set(*FEETECH_STS.torque, 1)
    with pytest.raises(RobotError, match="so101-sim on the twin: cannot connect: wrist: failed"):
        connect(robot, cfg)
    assert not robot.bus.is_connected and all(port.torque().values())


def test_a_ctrl_c_while_the_cameras_open_still_closes_the_bus(tmp_path, monkeypatch):
    from embodied.twin import make_twin_robot

    cfg = ArmConfig(
        robot="so101-sim", calibration_dir=str(tmp_path / "cal"), cameras={"wrist": "wrist"}
    )
    robot, twin, port = make_twin_robot(cfg)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(robot.cameras["wrist"], "connect", interrupted)
    for servo in port.servos.values():  # an arm a previous run left holding
        servo.set(*FEETECH_STS.torque, 1)
    with pytest.raises(KeyboardInterrupt):
        connect(robot, cfg)
    assert not robot.bus.is_connected and all(port.torque().values())  # before the servos' set-up


def test_a_connect_that_fails_while_configuring_the_servos_leaves_their_torque_off(
    tmp_path, monkeypatch
):
    """LeRobot's configure runs with torque off and switches it on as it ends, even on an
    error: a failure there (or after it) leaves the arm released, torque off."""
    from embodied.twin import make_twin_robot

    cfg = ArmConfig(robot="so101-sim", calibration_dir=str(tmp_path / "cal"))
    robot, twin, port = make_twin_robot(cfg)

    def failing_configure():
        robot.bus.enable_torque()  # (what LeRobot's torque_disabled() does on its way out)
        raise ConnectionError("Failed to write 'P_Coefficient' on id_=3")

    monkeypatch.setattr(robot, "configure", failing_configure)
    with pytest.raises(RobotError, match="cannot connect: Failed to write 'P_Coefficient'"):
        connect(robot, cfg)
    assert not robot.bus.is_connected and not any(port.torque().values())


def test_a_twin_camera_whose_capture_thread_died_is_the_observations_error(tmp_path):
    """As with LeRobot's OpenCV camera: a stopped capture thread is the camera's error when the
    arm is observed, not its last frame served on, nor "SOFollower is not connected" (the twin
    camera counted itself disconnected, and the arm's close then left the bus open)."""
    from embodied.robots.arm import RobotEnv, default_safety
    from embodied.robots.safety import SafetyLayer
    from embodied.twin import make_twin_robot

    cfg = ArmConfig(
        robot="so101-sim", calibration_dir=str(tmp_path / "cal"), cameras={"wrist": "wrist"}
    )
    robot, twin, port = make_twin_robot(cfg)
    connect(robot, cfg)
    env = RobotEnv(robot, cfg, SafetyLayer(default_safety(robot, cfg)))
    assert env.observe().images["wrist"].shape[-1] == 3
    camera = robot.cameras["wrist"]
    camera._stop.set()  # the thread ends, as on an error in a render
    camera._thread.join()
    with pytest.raises(RobotError, match="twin camera wrist_camera: its capture thread is not"):
        env.observe()
    env.close()
    assert not robot.bus.is_connected and not camera.is_connected


def test_a_twin_camera_whose_renderer_cannot_start_says_why_at_once(tmp_path, monkeypatch):
    """A renderer that cannot start (no EGL on the machine) is the connect's one error, naming
    the cause; it was a thread's traceback and, 30 s later, "no frame within 30 s"."""
    import embodied.twin_camera
    from embodied.twin import make_twin_robot

    def no_display(*args, **kwargs):
        raise RuntimeError("EGL: no display")

    cfg = ArmConfig(
        robot="so101-sim", calibration_dir=str(tmp_path / "cal"), cameras={"wrist": "wrist"}
    )
    robot, twin, port = make_twin_robot(cfg)
    monkeypatch.setattr(embodied.twin_camera.mujoco, "Renderer", no_display)
    with pytest.raises(RobotError, match="cannot connect: twin camera wrist_camera: EGL: no disp"):
        connect(robot, cfg)
    assert not robot.bus.is_connected
    with pytest.raises(RuntimeError, match="twin camera wrist_camera: EGL: no display"):
        robot.cameras["wrist"].read()  # (a read waits for a frame: the failure is the answer)


def test_the_twin_leaves_no_calibration_behind_and_replaces_none(tmp_path, monkeypatch):
    """Without a calibration directory the twin's lives only while LeRobot reads it (every twin
    run left one in /tmp); a directory holding another calibration of the same id (a real
    arm's) is refused, not overwritten."""
    import json
    import tempfile

    from embodied.twin import make_twin_robot

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    robot, _, _ = make_twin_robot(ArmConfig(robot="so101-sim"))
    assert robot.calibration and list(tmp_path.glob("embodied-twin-*")) == []
    real = tmp_path / "cal" / "embodied.json"
    real.parent.mkdir()
    real.write_text(json.dumps({"shoulder_pan": {"id": 1}}))
    with pytest.raises(ValueError, match="holds another calibration than the twin's"):
        make_twin_robot(ArmConfig(robot="so101-sim", calibration_dir=str(real.parent)))
    assert json.loads(real.read_text()) == {"shoulder_pan": {"id": 1}}
