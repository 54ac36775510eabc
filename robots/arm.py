"""LeRobot arms behind the contract.

``make_robot`` builds LeRobot's own driver class (SO-100/SO-101 follower on Feetech servos, Koch
follower on Dynamixels) with OpenCV cameras; ``connect`` uses the calibration LeRobot saved for
that arm (``lerobot-calibrate``) and refuses to run without one rather than prompting.
``RobotEnv`` is a ``VecEnv`` with B = 1 over a connected robot: LeRobot's joint readings
(degrees, gripper 0-100) become radians in ``Observation.state``, camera frames become
``images``, and every command passes the safety layer before it reaches the driver.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import numpy as np
import torch

from embodied.robots.safety import SafetyConfig, SafetyLayer
from embodied.schema import ActionSpec, CameraSpec, EnvSpec, Observation, ObsSpec, StepOutput

JOINTS = ("shoulder_pan", "shoulder_lift", "elbow_flex", "wrist_flex", "wrist_roll", "gripper")
GRIPPER = JOINTS.index("gripper")
STATE_NAMES = tuple(f"{j}.pos" for j in JOINTS) + tuple(f"{j}.vel" for j in JOINTS)  # RobotEnv's
ROBOTS = ("so100", "so101", "koch")  # "-sim" of an SO arm: the digital twin (embodied/twin.py)
# rad/s: the STS3215's no-load speed at 12 V (0.22 s per 60 degrees), the most robot.max_speed
# may be: above it the rate limit no longer limits, the moves to the start and safe poses included
MAX_SPEED = 4.7


class RobotError(RuntimeError):
    pass


@dataclass
class ArmConfig:
    """Which arm, how to reach it, and what the policy sees of it."""

    robot: str = "so101"  # so100 | so101 | koch, or so100-sim | so101-sim (the MuJoCo twin)
    port: str = ""  # the motor bus, e.g. /dev/ttyACM0 (unused by the twin)
    id: str = "embodied"  # LeRobot's calibration id (lerobot-calibrate --robot.id=...)
    calibration_dir: str | None = (
        None  # None: LeRobot's default (~/.cache/huggingface/lerobot/calibration)
    )
    cameras: dict[str, str] = field(default_factory=dict)  # name -> OpenCV index or device path
    camera_width: int = 640
    camera_height: int = 480
    camera_fps: int = 30
    image_size: int = 128  # frames are resized to image_size x image_size for the policy
    # radians that LeRobot's gripper 0..100 maps to (the SO-101 description's gripper range)
    gripper_range: tuple[float, float] = (-0.17453, 1.74533)
    control_hz: float = 30.0
    max_episode_steps: int = 900  # 30 s at 30 Hz
    instruction: str = ""
    joint_margin: float = 0.05  # radians kept clear of each calibrated end of travel
    # radians per second per joint (the safety layer's rate limit, per step at control_hz): the
    # speed the MuJoCo tasks allow (0.1 rad a step at 20 Hz), under the STS3215's (MAX_SPEED)
    max_speed: float = 2.0
    # the watchdog: without a fresh action for this long an episode stops (the arm holds its last
    # command from a quarter of it); a policy slower than its chunks last needs more
    watchdog_s: float = 1.0
    # The policy's joint frame, where it differs from the arm's (another simulator's conventions):
    # policy = sign * arm + offset, per joint. Safety works in the arm's frame.
    joint_signs: tuple[float, ...] = (1.0,) * 6
    joint_offsets: tuple[float, ...] = (0.0,) * 6

    def validate(self) -> None:
        base = self.robot.removesuffix("-sim")
        if base not in ROBOTS or (self.robot.endswith("-sim") and base == "koch"):
            raise ValueError(
                f"robot: one of {', '.join(ROBOTS)}, so100-sim, so101-sim; got {self.robot!r}"
            )
        if not self.robot.endswith("-sim") and not self.port:
            raise ValueError(
                "robot.port: the arm's serial port is needed "
                "(e.g. /dev/ttyACM0; `lerobot-find-port` finds it)"
            )
        if self.control_hz <= 0 or self.image_size < 1 or self.max_episode_steps < 1:
            raise ValueError("robot: control_hz, image_size and max_episode_steps must be positive")
        if not 0 < self.watchdog_s < math.inf:
            raise ValueError(f"robot.watchdog: seconds, > 0 and finite, got {self.watchdog_s:g}")
        if not 0 < self.max_speed <= MAX_SPEED:
            raise ValueError(
                f"robot.max_speed: rad/s, > 0 and at most {MAX_SPEED} (the STS3215 servos' "
                f"no-load speed: a faster limit limits nothing), got {self.max_speed:g}"
            )
        closed, opened = self.gripper_range
        if not (math.isfinite(closed) and math.isfinite(opened) and closed < opened):
            raise ValueError(
                f"robot.gripper_range: radians at LeRobot's 0 and 100, finite and the first "
                f"smaller, got {tuple(self.gripper_range)}"
            )
        if (
            len(self.joint_signs) != len(JOINTS)
            or any(v not in (1, -1) for v in self.joint_signs)
            or len(self.joint_offsets) != len(JOINTS)
        ):
            raise ValueError(
                f"robot.joint_signs / joint_offsets: {len(JOINTS)} values each, signs +1 or -1"
            )


def lerobot_config(cfg: ArmConfig):
    """LeRobot's config object for the arm (torque stays on at disconnect: our shutdown decides)."""
    from lerobot.cameras.opencv import OpenCVCameraConfig

    cams = {
        name: OpenCVCameraConfig(
            index_or_path=int(src) if str(src).isdigit() else src,
            fps=cfg.camera_fps,
            width=cfg.camera_width,
            height=cfg.camera_height,
        )
        for name, src in cfg.cameras.items()
    }
    common = dict(
        port=cfg.port or "twin",
        id=cfg.id,
        cameras=cams,
        disable_torque_on_disconnect=False,
        calibration_dir=None if cfg.calibration_dir is None else Path(cfg.calibration_dir),
    )
    if cfg.robot.startswith("koch"):
        from lerobot.robots.koch_follower import KochFollowerConfig

        return KochFollowerConfig(
            **common, use_degrees=True
        )  # its default is -100..100, not degrees
    from lerobot.robots.so_follower import SOFollowerRobotConfig

    return SOFollowerRobotConfig(**common, use_degrees=True)


def make_robot(cfg: ArmConfig):
    """LeRobot's driver object for the arm, not connected yet."""
    cfg.validate()
    if cfg.robot.startswith("koch"):
        from lerobot.robots.koch_follower import KochFollower

        return KochFollower(lerobot_config(cfg))
    from lerobot.robots.so_follower import SOFollower

    return SOFollower(lerobot_config(cfg))


def connect(robot, cfg: ArmConfig) -> None:
    """Connect with the calibration LeRobot stored for this arm; never start an interactive one.
    What fails to connect (a camera that cannot open at its settings, a port that is not the
    arm's, a Ctrl-C) is a RobotError (the Ctrl-C itself), what did connect closed. LeRobot opens
    the cameras, then configures the servos, which ends with their torque on: a failure before
    that leaves the torque as the servos had it, one after switches it off (``release``)."""
    try:
        with _watching_configure(robot) as configuring:
            robot.connect(calibrate=False)
        calibrated = robot.is_calibrated
    except BaseException as e:
        error = e
        if isinstance(e, Exception):
            error = cannot_connect(cfg, e)
        release(robot, error, torque_off=bool(configuring))
        if error is e:
            raise
        raise error from e
    if not calibrated:
        error = uncalibrated(robot, cfg)
        release(robot, error)  # (torque off, as lerobot-calibrate, the next step, has it)
        raise error


@contextlib.contextmanager
def _watching_configure(robot):
    """A list that holds True once LeRobot's connect began configuring the servos (their torque
    goes off there): the only sign of it, since a failed handshake leaves the bus connected too."""
    began: list[bool] = []
    own = vars(robot).get("configure")  # (an instance's own, as a test's fault sets one)
    inner = robot.configure

    def configure():
        began.append(True)
        return inner()

    robot.configure = configure
    try:
        yield began
    finally:
        if own is None:
            del robot.configure
        else:
            robot.configure = own


def cannot_connect(cfg: ArmConfig, cause: Exception) -> RobotError:
    return RobotError(f"{cfg.robot} on {cfg.port or 'the twin'}: cannot connect: {cause}")


def uncalibrated(robot, cfg: ArmConfig) -> RobotError:
    """The error for an arm whose calibration LeRobot does not have, with the command that makes
    it."""
    kind = (
        "koch_follower"
        if cfg.robot.startswith("koch")
        else f"{cfg.robot.removesuffix('-sim')}_follower"
    )
    return RobotError(
        f"{cfg.robot} on {cfg.port}: no matching calibration for id {cfg.id!r} (looked in "
        f"{robot.calibration_fpath}). Calibrate it once with LeRobot: `lerobot-calibrate "
        f"--robot.type={kind} --robot.port={cfg.port} --robot.id={cfg.id}`"
    )


def release(robot, cause: BaseException, *, torque_off: bool = True) -> None:
    """Disconnect what of an arm was connected but never moved, where the run ends before it
    began (``cause``); first switch torque off if ``torque_off``, where LeRobot's connect switched
    it on: its connect assumes the arm at rest (calibration switches torque off there too). A
    failure here is noted on ``cause``, which stays the error."""
    bus = robot.bus
    undo = []  # (what, how)
    if bus.is_connected:
        if torque_off:
            undo.append(("torque off", bus.disable_torque))
        undo.append(("disconnect", partial(bus.disconnect, disable_torque=False)))
    for name, camera in robot.cameras.items():
        if camera.is_connected:
            undo.append((f"camera {name}: disconnect", camera.disconnect))
    for what, how in undo:
        try:
            how()
        except Exception as e:
            cause.add_note(f"releasing the arm: {what} failed: {e!r}")


def read_joints(robot, cfg: ArmConfig) -> np.ndarray:
    """A connected arm's joints (radians [6], the arm's frame) from its bus alone, as LeRobot's
    ``get_observation`` reads them, without the cameras."""
    raw = robot.bus.sync_read("Present_Position")
    return to_radians({f"{m}.pos": v for m, v in raw.items()}, cfg.gripper_range)


def to_radians(values: dict[str, float], gripper_range: tuple[float, float]) -> np.ndarray:
    """LeRobot joint values {"<joint>.pos": degrees, gripper 0..100} -> float64 [6] radians."""
    q = np.array([values[f"{j}.pos"] for j in JOINTS], dtype=np.float64)
    q[:GRIPPER] = np.deg2rad(q[:GRIPPER])
    lo, hi = gripper_range
    q[GRIPPER] = lo + q[GRIPPER] / 100.0 * (hi - lo)
    return q


def from_radians(q: np.ndarray, gripper_range: tuple[float, float]) -> dict[str, float]:
    lo, hi = gripper_range
    out = {f"{j}.pos": float(math.degrees(v)) for j, v in zip(JOINTS[:GRIPPER], q[:GRIPPER])}
    out["gripper.pos"] = float((q[GRIPPER] - lo) / (hi - lo) * 100.0)
    return out


def calibrated_limits(robot, cfg: ArmConfig) -> tuple[np.ndarray, np.ndarray]:
    """Joint limits in radians from the arm's own calibration (its recorded range of motion), each
    end moved in by ``joint_margin``."""
    bus = robot.bus
    lo = {}
    hi = {}
    for j in JOINTS:
        cal = bus.calibration[j]
        ends = (
            bus._normalize({bus.motors[j].id: cal.range_min}),
            bus._normalize({bus.motors[j].id: cal.range_max}),
        )
        lo[f"{j}.pos"], hi[f"{j}.pos"] = (next(iter(e.values())) for e in ends)
    at_min = to_radians(lo, cfg.gripper_range)  # f64 [6]: the calibration's range_min
    at_max = to_radians(hi, cfg.gripper_range)  # f64 [6]: its range_max (not always the larger)
    low = np.minimum(at_min, at_max) + cfg.joint_margin
    high = np.maximum(at_min, at_max) - cfg.joint_margin
    return low, high


def default_safety(robot, cfg: ArmConfig, **overrides) -> SafetyConfig:
    low, high = calibrated_limits(robot, cfg)
    # the SO-101's rest pose: the upper arm laid back, the forearm folded over it, the gripper
    # tilted down in front (tool point 7 cm above the table), shut
    rest = np.array([0.0, -1.6, 1.6, 0.6, 0.0, cfg.gripper_range[0]])
    safe = np.clip(rest, low, high)
    return SafetyConfig(
        **{
            "joint_low": tuple(low),
            "joint_high": tuple(high),
            "max_step": cfg.max_speed / cfg.control_hz,
            "safe_pose": tuple(safe),
            "hold_after_s": cfg.watchdog_s / 4,
            "stop_after_s": cfg.watchdog_s,
            **overrides,
        }
    )


def _centre_square(frame: torch.Tensor) -> torch.Tensor:
    """The centred square of a frame [H, W, 3] (a 640x480 camera's middle 480x480)."""
    height, width = frame.shape[:2]
    side = min(height, width)
    top, left = (height - side) // 2, (width - side) // 2
    return frame[top : top + side, left : left + side]


class RobotEnv:
    """A connected arm as a VecEnv with B = 1. Actions: float32 [1, 6] joint positions (radians,
    gripper included). A real scene cannot be reset by software: ``reset`` starts a new episode
    from wherever the arm is (the deploy loop first drives it to a start pose).

    ``privileged`` names what the observation carries besides the arm's joints (key -> shape),
    read each step by ``read_privileged``: on a real arm the goal its user gives
    (``goal_pos``), on the twin whatever its simulator knows. ``judge`` (if given) says whether
    the task is done (a simulated scene can: the twin's), filling ``success``; a real scene has
    none and reports no success."""

    num_envs = 1
    device = torch.device("cpu")

    def __init__(
        self,
        robot,
        cfg: ArmConfig,
        safety: SafetyLayer,
        clock=time,
        *,
        privileged: dict[str, tuple[int, ...]] | None = None,
        read_privileged: Callable[[], dict[str, np.ndarray]] | None = None,
        judge: Callable[[], bool] | None = None,
    ):
        self.robot = robot
        self.clock = clock  # what joint velocities are measured against (``control.Clock``)
        self.cfg = cfg
        self.safety = safety
        self.read_privileged = read_privileged
        self.judge = judge
        self.signs = np.asarray(cfg.joint_signs, float)  # f64 [6]
        self.offsets = np.asarray(cfg.joint_offsets, float)  # f64 [6]
        cams = tuple(CameraSpec(name, cfg.image_size, cfg.image_size) for name in robot.cameras)
        ends = np.stack([self.to_policy(safety.low), self.to_policy(safety.high)])
        low = ends.min(0)  # f64 [6]
        high = ends.max(0)  # f64 [6]
        self.spec = EnvSpec(
            obs=ObsSpec(
                cameras=cams,
                state_names=STATE_NAMES,
                privileged=dict(privileged or {}),
            ),
            action=ActionSpec(
                "joint_pos",
                JOINTS,
                tuple(low),
                tuple(high),
                gripper=GRIPPER,
                control_hz=cfg.control_hz,
            ),
            max_episode_steps=cfg.max_episode_steps,
            instructions=(cfg.instruction,),
        )
        self.elapsed = 0
        self.present = None  # arm-frame radians
        self._last_t = None  # when self.present was read
        self.interventions: list[str] = []  # this step's

    def to_policy(self, q: np.ndarray) -> np.ndarray:
        """Arm-frame joint radians -> the policy's frame."""
        return self.signs * np.asarray(q, float) + self.offsets

    def to_arm(self, q: np.ndarray) -> np.ndarray:
        return (np.asarray(q, float) - self.offsets) * self.signs

    def observe(self) -> Observation:
        """Read the arm and cameras (present joint positions in ``self.present``, radians). What
        LeRobot's drivers raise there (a camera without frames: RuntimeError, TimeoutError) is a
        RobotError naming the robot."""
        try:
            raw = self.robot.get_observation()
        except (RuntimeError, OSError) as e:
            if isinstance(e, RobotError):
                raise
            raise RobotError(f"{self.cfg.robot}: reading the arm and cameras failed: {e}") from e
        t = self.clock.monotonic()
        q = to_radians(raw, self.cfg.gripper_range)
        vel = (
            np.zeros_like(q)
            if self.present is None
            else (q - self.present) / max(t - self._last_t, 1e-3)
        )
        self._last_t = t
        self.present = q
        state = torch.from_numpy(
            np.concatenate([self.to_policy(q), self.signs * vel]).astype(np.float32)
        )[None]  # f32 [1, 12]
        images = {}
        for name in self.robot.cameras:
            frame = torch.from_numpy(np.ascontiguousarray(raw[name]))  # uint8 [H, W, 3]
            frame = _centre_square(frame)  # (the simulators' cameras are square: not squashed)
            if frame.shape[:2] != (self.cfg.image_size, self.cfg.image_size):
                frame = (
                    torch.nn.functional.interpolate(
                        frame.permute(2, 0, 1)[None].float(),
                        size=(self.cfg.image_size,) * 2,
                        mode="bilinear",
                        antialias=True,
                    )[0]
                    .permute(1, 2, 0)
                    .round()
                    .clamp(0, 255)
                    .to(torch.uint8)
                )
            images[name] = frame[None]  # uint8 [1, S, S, 3]
        privileged = {}
        if self.spec.obs.privileged:
            values = self.read_privileged()
            for key in self.spec.obs.privileged:
                privileged[key] = torch.tensor(values[key], dtype=torch.float32)[None]  # [1, D]
        return Observation(
            state=state, instruction=[self.cfg.instruction], images=images, privileged=privileged
        )

    def read_joints(self) -> np.ndarray:
        """The joints alone (radians [6], the arm's frame; also in ``self.present``), read from
        the bus without the cameras: a camera that fails cannot stop a move to a pose."""
        self.present = read_joints(self.robot, self.cfg)
        self._last_t = self.clock.monotonic()
        return self.present

    def reset(self, *, seed=None, env_ids=None) -> Observation:
        # at rest, as a simulator's reset gives: the start move's last reading, milliseconds
        # ago, made one encoder tick 0.77 rad/s
        self.present = None
        obs = self.observe()
        self.safety.start(self.present)
        self.elapsed = 0
        return obs

    def send(self, command: np.ndarray) -> np.ndarray:
        """Pass one joint command (radians [6]) through the safety layer to the driver; returns
        what was sent."""
        before = self.safety.last.copy()
        safe, self.interventions = self.safety.filter(command)
        self._write(safe, before)
        return safe

    def hold(self, pose: np.ndarray | None = None) -> np.ndarray:
        """Hold the last command, or take one rate-limited step toward ``pose``."""
        before = self.safety.last.copy()
        safe = before.copy() if pose is None else self.safety.toward(pose)
        self._write(safe, before)
        return safe

    def _write(self, safe: np.ndarray, before: np.ndarray) -> None:
        """``safe`` to the driver. Where the write fails, the safety layer's last command is
        ``before`` again: the next one is rate-limited from what the arm was last sent."""
        try:
            self.robot.send_action(from_radians(safe, self.cfg.gripper_range))
        except Exception:
            self.safety.last = before
            raise

    def step(self, actions: torch.Tensor, settle: Callable[[], None] | None = None) -> StepOutput:
        """actions: float [1, 6] joint positions, radians, in the policy's frame. ``settle``
        (the control loop's wait for its next tick) runs between the command and the reading, so
        the observation is the arm a period after the command, as a simulator's step returns it."""
        sent = self.send(self.to_arm(actions.detach().to("cpu", torch.float64).numpy().reshape(-1)))
        if settle is not None:
            settle()
        obs = self.observe()
        self.elapsed += 1
        truncated = self.elapsed >= self.cfg.max_episode_steps
        false = torch.zeros(1, dtype=torch.bool)
        done = self.judge is not None and self.judge()
        out = StepOutput(
            obs=obs,
            reward=torch.zeros(1),
            terminated=false,
            truncated=torch.tensor([truncated]),
            success=torch.tensor([done]),
            final_obs=obs if truncated else None,
            ended=torch.zeros(1, dtype=torch.long) if truncated else None,
            info={"sent": self.to_policy(sent), "interventions": list(self.interventions)},
        )  # policy frame
        if truncated:
            self.elapsed = 0
        return out

    def render(self, env_ids: torch.Tensor | None = None) -> torch.Tensor | None:
        return None

    def close(self) -> None:
        if self.robot.is_connected:
            self.robot.disconnect()
