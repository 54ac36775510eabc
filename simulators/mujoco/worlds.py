"""What both MuJoCo backends share: the model, the spec, and how a world's episode starts.

An initial state is drawn in torch from the world's own random stream (simulators/mujoco/
streams.py): the arm's home pose with uniform noise, then the task's goal and objects. Both
backends write the very same numbers into their physics, so equal seeds give equal initial
states on ``mujoco.rollout`` and on MuJoCo Warp."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mujoco
import torch

from embodied.schema import ActionSpec, CameraSpec, EnvSpec, ObsSpec, reset_seeds
from embodied.simulators.mujoco.arm import HOME, JOINTS, RANGES, scene
from embodied.simulators.mujoco.config import MuJoCoConfig
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
    positions [N, 6], the goal (mocap) position [N, 3], the cube's position [N, 3] or None."""

    joints: torch.Tensor
    goal: torch.Tensor
    cube: torch.Tensor | None


def reseed(streams: Streams, seed: int | Sequence[int] | None, ids: Sequence[int]) -> None:
    """Apply ``VecEnv.reset``'s seeds to the worlds ``ids`` (unseeded ones continue)."""
    seeds = reset_seeds(seed, ids)
    given = [(i, s) for i, s in zip(ids, seeds) if s is not None]
    if given:
        device = streams.key.device
        rows = torch.tensor([i for i, _ in given], dtype=torch.int64, device=device)
        values = torch.tensor([s for _, s in given], dtype=torch.int64, device=device)
        streams.reseed(rows, values)


def draw_initial(
    streams: Streams, task: Task, ids: torch.Tensor, home_noise: float
) -> InitialStates:
    """The next episode's start for worlds ``ids`` (int64 [N]) from their streams."""
    u = streams.uniform(ids, len(JOINTS) + task.num_draws)  # f32 [N, 6 + num_draws]
    noisy = [
        torch.clamp(HOME_POSE[j] + (2.0 * u[:, j] - 1.0) * home_noise, LOW[j], HIGH[j])
        for j in range(len(JOINTS))
    ]
    joints = torch.stack(noisy, 1)  # f32 [N, 6]; Python constants: no host-to-device copy
    sampled = task.sample(u[:, len(JOINTS) :])
    return InitialStates(joints=joints, goal=sampled["goal"], cube=sampled.get("cube"))
