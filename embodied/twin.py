"""The digital twin: LeRobot's own SO-100/SO-101 driver driving the MuJoCo desktop arm.

``make_twin_robot`` builds the real ``SOFollower`` (LeRobot's class, its Feetech bus, its
calibration code) and plugs a software serial port (robots/servo_port.py) where /dev/ttyACM0
would be. Goal positions written on that port become the targets of the MuJoCo arm's position
servos (simulators/mujoco/arm.py); present positions read from it are the simulated joints. The
physics runs in its clock's time (the wall clock's, or a test's), advanced whenever the driver
reads, so a control loop sees the arm lag and move as a real one does. Cameras render the same
scene ("front": the table camera, "wrist": on the hand). Nothing above the serial port knows it is
not hardware.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("MUJOCO_GL", "egl")

import mujoco  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from embodied.robots.arm import JOINTS, ArmConfig, make_robot  # noqa: E402
from embodied.robots.servo_port import FeetechPort, attach, rad_to_ticks, ticks_to_rad  # noqa: E402
from embodied.simulators.mujoco.arm import HOME, RANGES, scene  # noqa: E402
from embodied.simulators.mujoco.tasks import TASKS  # noqa: E402

SERVO_IDS = {
    j: i + 1 for i, j in enumerate(JOINTS)
}  # LeRobot's SO follower: ids 1..6 in this order
TWIN_CAMERAS = {"front": "base_camera", "wrist": "wrist_camera"}
MAX_CATCH_UP_S = 1.0  # simulate at most this much at once after a long pause (a debugger, a stall)


class ArmTwin:
    """MuJoCo arm whose servos take goals in encoder ticks (``ServoPhysics`` of the fake port)."""

    def __init__(self, task: str = "push", start: dict[str, float] | None = None, clock=time):
        self.clock = clock  # simulated time follows it (``control.Clock``): the wall's, or a test's
        self.task = TASKS[task]
        self.model = mujoco.MjModel.from_xml_string(scene(self.task.bodies, self.task.sensors))
        self.data = mujoco.MjData(self.model)
        self._sensors = {
            self.model.sensor(i).name: slice(
                self.model.sensor_adr[i], self.model.sensor_adr[i] + self.model.sensor_dim[i]
            )
            for i in range(self.model.nsensor)
        }
        self._qpos = [self.model.jnt_qposadr[self.model.joint(j).id] for j in JOINTS]
        self._act = [self.model.actuator(j).id for j in JOINTS]
        self._kp = self.model.actuator_gainprm[self._act, 0].copy()
        pose = {**HOME, **(start or {})}
        for j, a, q in zip(JOINTS, self._act, self._qpos):
            self.data.qpos[q] = self.data.ctrl[a] = pose[j]
        mujoco.mj_forward(self.model, self.data)
        self.torque = {
            j: True for j in JOINTS
        }  # it starts holding its start pose, as if resting there
        self._set_gains()
        self._lock = threading.Lock()
        self._t = clock.monotonic()
        self.frozen = False

    def _set_gains(self) -> None:
        """A servo without torque applies none: gain and position feedback both zero."""
        for j, a in zip(JOINTS, self._act):
            on = self.torque[j]
            self.model.actuator_gainprm[a, 0] = self._kp[JOINTS.index(j)] if on else 0.0
            self.model.actuator_biasprm[a, 1] = -self._kp[JOINTS.index(j)] if on else 0.0

    def advance(self) -> None:
        """Simulate up to now (its clock's); a frozen twin stands still (exact comparisons in
        tests)."""
        now = self.clock.monotonic()
        if self.frozen:
            self._t = now
            return
        n = int(min(now - self._t, MAX_CATCH_UP_S) / self.model.opt.timestep)
        if n > 0:
            mujoco.mj_step(self.model, self.data, nstep=n)
            self._t += (
                n * self.model.opt.timestep if now - self._t <= MAX_CATCH_UP_S else now - self._t
            )

    # --- the task's scene --------------------------------------------------------------------
    def place(self, goal: np.ndarray, cube: np.ndarray | None = None) -> None:
        """Start an episode's scene: the goal marker (f64 [3], metres) and the cube, upright and at
        rest (f64 [3]), as a person sets up a table; the arm stays where it is."""
        with self._lock:
            self.advance()
            self.data.mocap_pos[0] = goal
            if cube is not None:
                joint = self.model.body("cube").jntadr[0]
                adr = self.model.jnt_qposadr[joint]
                self.data.qpos[adr : adr + 7] = [*cube, 1.0, 0.0, 0.0, 0.0]
                dof = self.model.jnt_dofadr[joint]
                self.data.qvel[dof : dof + 6] = 0.0
            mujoco.mj_forward(self.model, self.data)

    def readings(self, names) -> dict[str, np.ndarray]:
        """What the simulator knows now, by sensor name (f64 [D] each): the twin's privileged
        observation (tool point, goal, cube)."""
        with self._lock:
            self.advance()
            return {n: self.data.sensordata[self._sensors[n]].copy() for n in names}

    def success(self) -> bool:
        """Whether the task is done now, by the task's own success (simulators/mujoco/tasks.py)
        on the twin's sensors: the number sim-to-sim transfer is measured by."""
        names = ("tcp_pos", *self.task.privileged, *self.task.reads)
        readings = {
            n: torch.from_numpy(v.astype(np.float32))[None]  # f32 [1, D]
            for n, v in self.readings(names).items()
        }
        _, success = self.task.evaluate(readings)
        return bool(success[0])

    # --- ServoPhysics -------------------------------------------------------------------------
    def command(self, goals: dict[int, int], torque: dict[int, bool]) -> None:
        with self._lock:
            self.advance()
            for j in JOINTS:
                lo, hi = RANGES[j]
                self.data.ctrl[self._act[JOINTS.index(j)]] = np.clip(
                    ticks_to_rad(goals[SERVO_IDS[j]]), lo, hi
                )
                self.torque[j] = torque[SERVO_IDS[j]]
            self._set_gains()

    def positions(self) -> dict[int, int]:
        with self._lock:
            self.advance()
            return {
                SERVO_IDS[j]: rad_to_ticks(self.data.qpos[q]) for j, q in zip(JOINTS, self._qpos)
            }

    # --- what tests look at ---------------------------------------------------------------
    def joints(self) -> np.ndarray:
        """float64 [6] simulated joint angles (radians)."""
        with self._lock:
            self.advance()
            return np.array([self.data.qpos[q] for q in self._qpos])


def twin_calibration() -> dict[str, dict]:
    """LeRobot calibration of the twin, as ``lerobot-calibrate`` records an SO-101: each servo's
    range is its MuJoCo joint's range (the gripper from closed to open), except the wrist roll's,
    which LeRobot records as the full turn (0-4095); homing offset 0 (the simulated encoders read
    2048 at 0 rad). LeRobot reads degrees from the middle of each range, so the twin's joint zeros
    are LeRobot's (docs/so101.md)."""
    out = {}
    for j in JOINTS:
        lo, hi = RANGES[j]
        full_turn = j == "wrist_roll"
        out[j] = {
            "id": SERVO_IDS[j],
            "drive_mode": 0,
            "homing_offset": 0,
            "range_min": 0 if full_turn else rad_to_ticks(lo),
            "range_max": 4095 if full_turn else rad_to_ticks(hi),
        }
    return out


def twin_views(cfg: ArmConfig) -> dict[str, str]:
    """The twin camera each of the policy's cameras shows (``cfg.cameras``: NAME=SOURCE, SOURCE
    "front" or "wrist", or the twin camera called NAME when SOURCE is neither); a ValueError for
    what the twin cannot be (its cameras, its gripper's range), before anything is loaded."""
    views = {name: src if src in TWIN_CAMERAS else name for name, src in cfg.cameras.items()}
    unknown = sorted(v for v in views.values() if v not in TWIN_CAMERAS)
    if unknown:
        raise ValueError(
            f"camera: the twin has cameras {sorted(TWIN_CAMERAS)}, not {unknown} "
            "(give NAME=front or NAME=wrist)"
        )
    if tuple(cfg.gripper_range) != RANGES["gripper"]:
        raise ValueError(
            f"robot.gripper_range: the twin's gripper spans {RANGES['gripper']} rad, "
            f"got {cfg.gripper_range}"
        )
    return views


def _write_calibration(path: Path) -> None:
    """The twin's calibration at ``path``; another one there (a real arm's, of the same id) is
    refused, not replaced."""
    calibration = twin_calibration()
    if path.exists() and json.loads(path.read_text()) != calibration:
        raise ValueError(
            f"calibration_dir: {path} holds another calibration than the twin's; give the twin "
            "a directory or an id of its own"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(calibration, indent=2))


def make_twin_robot(
    cfg: ArmConfig, task: str = "push", start: dict[str, float] | None = None, clock=time
):
    """(LeRobot SOFollower wired to the twin, the twin, its serial port). ``cfg.cameras`` maps the
    policy's camera names to twin cameras ("front", "wrist"); the twin simulates on ``clock``."""
    views = twin_views(cfg)
    # LeRobot reads the calibration as the robot is made: a directory of its own is gone after
    with tempfile.TemporaryDirectory(prefix="embodied-twin-") as own:
        cal_dir = Path(cfg.calibration_dir or own)
        _write_calibration(cal_dir / f"{cfg.id}.json")
        real_cfg = replace(
            cfg,
            robot=cfg.robot.removesuffix("-sim"),
            port="twin",
            cameras={},
            calibration_dir=str(cal_dir),
        )
        robot = make_robot(real_cfg)
    twin = ArmTwin(task, start, clock)
    ranges = {SERVO_IDS[j]: (c["range_min"], c["range_max"]) for j, c in twin_calibration().items()}
    port = FeetechPort(ranges, physics=twin)
    attach(robot.bus, port)
    from embodied.twin_camera import TwinCamera

    # rendered at the policy's size: software rendering at 640x480 alone would take most of a
    # 30 Hz step
    robot.cameras = {
        name: TwinCamera(twin, TWIN_CAMERAS[view], cfg.image_size, cfg.image_size, cfg.camera_fps)
        for name, view in views.items()
    }
    return robot, twin, port
