"""What both MuJoCo backends share: the model, the spec, and how a world's episode starts.

An initial state is drawn in torch from the world's own random stream (simulators/mujoco/
streams.py): the arm's home pose with uniform noise, then the task's goal and objects. Both
backends write the very same numbers into their physics, so equal seeds give equal initial
states on ``mujoco.rollout`` and on MuJoCo Warp."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mujoco
import numpy as np
import torch

from embodied.schema import (
    ActionSpec,
    CameraSpec,
    EnvSpec,
    ObsSpec,
    UserError,
    host_to_device,
    reset_seeds,
)
from embodied.simulators.mujoco.arm import HOME, JOINTS, RANGES, scene
from embodied.simulators.mujoco.config import MuJoCoConfig
from embodied.simulators.mujoco.randomize import NUM_DRAWS, RandomizeConfig, WorldParams, draw
from embodied.simulators.mujoco.streams import Streams
from embodied.simulators.mujoco.tasks import Task

CONTROL_HZ = 20.0
MAX_DELTA = 0.1  # radians per control step (2 rad/s)
HOME_POSE = tuple(HOME[j] for j in JOINTS)
# Servo targets stay this far inside each joint's range, as the deploy's safety layer keeps a real
# arm's commands (robot.joint_margin): a policy learns the range it will be allowed.
TARGET_MARGIN = 0.05  # radians
LOW = tuple(RANGES[j][0] + TARGET_MARGIN for j in JOINTS)
HIGH = tuple(RANGES[j][1] - TARGET_MARGIN for j in JOINTS)


def check_action_shape(who: str, actions: torch.Tensor, num_envs: int) -> None:
    """A UserError where ``actions`` is not one row of 6 per world (a [1, 6] row would
    broadcast to every world)."""
    if tuple(actions.shape) != (num_envs, len(JOINTS)):
        raise UserError(
            f"{who}: actions of shape {tuple(actions.shape)}, expected ({num_envs}, {len(JOINTS)})"
        )


def build_model(cfg: MuJoCoConfig, task: Task) -> mujoco.MjModel:
    model = mujoco.MjModel.from_xml_string(scene(task.bodies, task.sensors))
    size = max(cfg.image_size, cfg.render_size)
    model.vis.global_.offwidth = size
    model.vis.global_.offheight = size
    return model


def substeps(model: mujoco.MjModel) -> int:
    """Physics steps per control step."""
    return round(1.0 / (CONTROL_HZ * model.opt.timestep))


def make_spec(cfg: MuJoCoConfig, task: Task) -> EnvSpec:
    size = cfg.image_size
    cams = tuple(CameraSpec(c, size, size) for c in cfg.cameras) if cfg.obs_mode == "rgb" else ()
    return EnvSpec(
        obs=ObsSpec(
            cameras=cams,
            state_names=tuple(f"{j}.pos" for j in JOINTS) + tuple(f"{j}.vel" for j in JOINTS),
            privileged={"tcp_pos": (3,), **{k: (n,) for k, n in task.privileged.items()}},
        ),
        action=ActionSpec(
            "joint_delta",
            JOINTS,
            (-MAX_DELTA,) * len(JOINTS),
            (MAX_DELTA,) * len(JOINTS),
            gripper=JOINTS.index("gripper"),
            control_hz=CONTROL_HZ,
        ),
        max_episode_steps=cfg.max_episode_steps or task.max_episode_steps,
        instructions=(task.instruction,),
    )


@dataclass
class InitialStates:
    """The start of N worlds' episodes, f32 on the env's device: servo targets and joint
    positions [N, 6], the goal (mocap) position [N, 3], the cube's position [N, 3] and orientation
    [N, 4] (w, x, y, z) or None, and each world's randomised parameters."""

    joints: torch.Tensor
    goal: torch.Tensor
    cube: torch.Tensor | None
    cube_quat: torch.Tensor | None
    params: WorldParams


def reseed(streams: Streams, seed: int | Sequence[int] | None, ids: Sequence[int]) -> None:
    """Apply ``VecEnv.reset``'s seeds to the worlds ``ids`` (unseeded ones continue)."""
    seeds = reset_seeds(seed, ids)
    given = [(i, s) for i, s in zip(ids, seeds) if s is not None]
    if given:
        device = streams.key.device
        rows = torch.tensor([i for i, _ in given], dtype=torch.int64)  # long [n], host
        values = torch.tensor([s for _, s in given], dtype=torch.int64)
        streams.reseed(host_to_device(rows, device), host_to_device(values, device))


def draw_initial(
    streams: Streams,
    task: Task,
    ids: torch.Tensor,
    home_noise: float,
    randomize: RandomizeConfig | None = None,
) -> InitialStates:
    """The next episode's start for worlds ``ids`` (int64 [N]) from their streams: the arm's
    pose, the task's goal and objects, then the randomisation (drawn even when it is off)."""
    n_task = len(JOINTS) + task.num_draws
    u = streams.uniform(ids, n_task + NUM_DRAWS)  # f32 [N, 6 + num_draws + NUM_DRAWS]
    noisy = [_near_home(j, u[:, j], home_noise) for j in range(len(JOINTS))]
    joints = torch.stack(noisy, 1)  # f32 [N, 6]; Python constants: no host-to-device copy
    params = draw(randomize or RandomizeConfig(), u[:, n_task:])
    sampled = task.sample(u[:, len(JOINTS) : n_task], params.cube_scale)
    cube = sampled.get("cube")  # (resting at its size)
    quat = None
    if cube is not None:
        half = 0.5 * params.cube_yaw
        zero = torch.zeros_like(half)
        quat = torch.stack([torch.cos(half), zero, zero, torch.sin(half)], 1)  # about z
    return InitialStates(joints, sampled["goal"], cube, quat, params)


def _near_home(j: int, u: torch.Tensor, noise: float) -> torch.Tensor:
    """Joint ``j`` uniform within ``noise`` of its home angle, over the part of that interval
    its target range holds (a clamp would pile the rest onto the bound: 40% of the wrist's
    draws at 0.1 rad, its home 0.018 rad inside its bound)."""
    low, high = HOME_POSE[j] - noise, HOME_POSE[j] + noise
    if LOW[j] <= low and high <= HIGH[j]:
        return HOME_POSE[j] + (2.0 * u - 1.0) * noise
    low, high = max(low, LOW[j]), min(high, HIGH[j])
    return low + u * (high - low)


def touching(model: mujoco.MjModel, geom: int) -> list[int]:
    """The other geoms that can collide with ``geom`` (MuJoCo's contype/conaffinity rule)."""
    can = (model.geom_contype & model.geom_conaffinity[geom]) | (
        model.geom_conaffinity & model.geom_contype[geom]
    )
    return [int(g) for g in np.flatnonzero(can) if g != geom]


@dataclass(frozen=True)
class Randomized:
    """Where the randomised quantities of a scene live in its model (ids; -1 where the scene has
    no cube), and their values as written (numpy, float64)."""

    cube_body: int
    cube_geom: int
    cube_dof: int  # the first of its free joint's 6 (3 translations, then 3 rotations)
    cube_bvh: int  # its body's bounding box, which MuJoCo's midphase tests before its geom's
    # the cube's and every geom it can touch (the arm's, the table): their sliding friction
    # scales, as a contact takes the larger of its two geoms' (the pads', the table's; without a
    # cube)
    friction_geoms: tuple[int, ...]
    camera: int  # the front camera
    half: float  # the cube's half-size, metres
    mass: float
    inertia: np.ndarray  # [3]
    # what MuJoCo derives from the cube's mass and inertia (mj_setConst), which the solver reads
    invweight: np.ndarray  # [2] body_invweight0: translation, rotation
    dof_invweight: np.ndarray  # [6] dof_invweight0 of its free joint
    world_mass: float  # body_subtreemass of the world body: every body's mass
    friction: np.ndarray  # [len(friction_geoms)]
    kp: np.ndarray  # [6] the servos' gains
    camera_pos: np.ndarray  # [3]
    light_pos: np.ndarray  # [3], light 0
    light_diffuse: np.ndarray  # [3]

    @classmethod
    def of(cls, model: mujoco.MjModel) -> Randomized:
        body = mujoco.mj_name2id(model, mujoco.mjtObj.mjOBJ_BODY, "cube")
        geom = int(model.body_geomadr[body]) if body >= 0 else -1
        if geom >= 0:
            geoms = (geom, *touching(model, geom))
        else:
            geoms = tuple(model.geom(n).id for n in ("fixed_jaw_pad", "moving_jaw_pad", "table"))
        camera = model.camera("base_camera").id
        dof = int(model.body_dofadr[body]) if body >= 0 else -1
        return cls(
            cube_body=body,
            cube_geom=geom,
            cube_dof=dof,
            cube_bvh=int(model.body_bvhadr[body]) if body >= 0 else -1,
            friction_geoms=geoms,
            camera=camera,
            half=float(model.geom_size[geom, 0]) if geom >= 0 else 0.0,
            mass=float(model.body_mass[body]) if body >= 0 else 0.0,
            inertia=model.body_inertia[body].copy() if body >= 0 else np.zeros(3),
            invweight=model.body_invweight0[body].copy() if body >= 0 else np.zeros(2),
            dof_invweight=model.dof_invweight0[dof : dof + 6].copy() if body >= 0 else np.zeros(6),
            world_mass=float(model.body_subtreemass[0]),
            friction=model.geom_friction[list(geoms), 0].copy(),
            kp=model.actuator_gainprm[:, 0].copy(),
            camera_pos=model.cam_pos[camera].copy(),
            light_pos=model.light_pos[0].copy(),
            light_diffuse=model.light_diffuse[0].copy(),
        )

    def apply(self, model: mujoco.MjModel, p: WorldParams, row: int) -> None:
        """Write world ``row`` of ``p`` into ``model`` (a world's own copy on the rollout backend;
        the shared model, briefly, to render a world)."""
        if self.cube_body >= 0:
            self._apply_cube(model, float(p.cube_scale[row]), float(p.mass_scale[row]))
        model.geom_friction[list(self.friction_geoms), 0] = self.friction * float(
            p.friction_scale[row]
        )
        kp = self.kp * p.gain_scale[row].double().cpu().numpy()  # f64 [6]
        model.actuator_gainprm[:, 0] = kp
        model.actuator_biasprm[:, 1] = -kp
        model.cam_pos[self.camera] = self.camera_pos + p.camera_offset[row].double().cpu().numpy()
        model.light_pos[0] = self.light_pos + p.light_offset[row].double().cpu().numpy()
        model.light_diffuse[0] = self.light_diffuse * float(p.light_scale[row])

    def _apply_cube(self, model: mujoco.MjModel, size: float, mass: float) -> None:
        """The cube ``size`` and ``mass`` times its own: a solid cube, so its inertia scales by
        mass x size^2; and what mj_setConst would derive from them (its inverse weights set the
        softness of its contacts; its subtree mass, its centre of mass)."""
        body = self.cube_body
        half = self.half * size
        model.geom_size[self.cube_geom] = half
        model.geom_rbound[self.cube_geom] = half * np.sqrt(3.0)
        model.geom_aabb[self.cube_geom, 3:] = half
        model.bvh_aabb[self.cube_bvh, 3:] = half  # (stale, arm links inside it touched nothing)
        rotation = mass * size**2  # (the inertia's scale)
        model.body_mass[body] = self.mass * mass
        model.body_inertia[body] = self.inertia * rotation
        model.body_invweight0[body] = self.invweight / (mass, rotation)
        dofs = slice(self.cube_dof, self.cube_dof + 6)
        model.dof_invweight0[dofs] = self.dof_invweight / np.repeat((mass, rotation), 3)
        model.body_subtreemass[body] = self.mass * mass
        model.body_subtreemass[0] = self.world_mass + self.mass * (mass - 1.0)
