"""Domain randomisation per world: what differs between the simulator and a real SO-101 setup,
drawn for each world at every reset from the world's own random stream, so it is seeded and
equal seeds give equal worlds (GRPO's groups, re-simulating an episode).

The draws are taken whether randomisation is on or not (``NUM_DRAWS`` uniforms after the
initial state's), so turning a range on changes no initial state. Each range is relative (a
scale drawn in [1 - r, 1 + r]) or absolute (an offset in [-r, r]); 0 turns it off.

What each backend applies (``RandomizeConfig`` names the fields):
- both: the cube's size, yaw, mass (and a solid cube's inertia), the sliding friction of the
  cube and every geom that can touch it (the arm's, the table), each servo's gain, a command
  delay of whole control steps, the front camera's position, the light's position;
- the rollout backend only: the light's brightness (MuJoCo Warp's renderer has no per-world light
  intensity).
A range the run cannot apply (the light's brightness on warp, the cube's on reach, which has no
cube) is a config error (``MuJoCoConfig.validate``), not a draw recorded and ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

NUM_DRAWS = 18  # uniforms per world and reset (the fields of WorldParams, in order)


@dataclass
class RandomizeConfig:
    """Ranges of the per-world randomisation (0: off)."""

    cube_size: float = 0.0  # relative: the cube's half-size x U(1 - r, 1 + r) (push, pick)
    cube_yaw: float = 0.0  # radians: the cube starts turned by U(-r, r) about the vertical
    friction: float = 0.0  # relative: sliding friction of the cube and all that can touch it
    mass: float = 0.0  # relative: the cube's mass and inertia (push, pick)
    servo_gain: float = 0.0  # relative: each servo's position gain, apart
    action_delay: int = 0  # control steps: each world's commands act 0..r steps late
    camera_pos: float = 0.0  # metres: the front camera moves by U(-r, r) along each axis
    light_pos: float = 0.0  # metres: the light moves by U(-r, r) along each axis
    light: float = 0.0  # relative: the light's brightness (rollout backend only)

    def validate(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value < 0:
                raise ValueError(f"{f.name}: must be >= 0, got {value}")
        for name in ("cube_size", "friction", "mass", "servo_gain", "light"):
            if getattr(self, name) >= 1:
                raise ValueError(f"{name}: a relative range below 1, got {getattr(self, name)}")

    @property
    def active(self) -> bool:
        return any(getattr(self, f.name) for f in fields(self))


@dataclass
class WorldParams:
    """Each world's draw, f32 on the env's device ([N] or [N, k]); ``delay`` is int64 [N]."""

    cube_scale: torch.Tensor  # [N]
    cube_yaw: torch.Tensor  # [N] radians
    friction_scale: torch.Tensor  # [N]
    mass_scale: torch.Tensor  # [N]
    gain_scale: torch.Tensor  # [N, 6]
    delay: torch.Tensor  # int64 [N] control steps
    camera_offset: torch.Tensor  # [N, 3] metres
    light_offset: torch.Tensor  # [N, 3] metres
    light_scale: torch.Tensor  # [N]

    def rows(self, ids: torch.Tensor) -> WorldParams:
        return WorldParams(**{f.name: getattr(self, f.name)[ids] for f in fields(self)})

    def put(self, ids: torch.Tensor, part: WorldParams) -> None:
        """Write ``part`` (N worlds) into the rows ``ids`` of these."""
        for f in fields(self):
            getattr(self, f.name)[ids] = getattr(part, f.name)

    def to_dict(self) -> dict[str, list]:
        """Plain lists, world by world: what an episode's recording keeps."""
        return {f.name: getattr(self, f.name).tolist() for f in fields(self)}


def nominal(num_worlds: int, device: torch.device) -> WorldParams:
    """The model as written: no randomisation."""
    ones = torch.ones(num_worlds, device=device)
    return WorldParams(
        cube_scale=ones.clone(),
        cube_yaw=torch.zeros(num_worlds, device=device),
        friction_scale=ones.clone(),
        mass_scale=ones.clone(),
        gain_scale=torch.ones(num_worlds, 6, device=device),
        delay=torch.zeros(num_worlds, dtype=torch.int64, device=device),
        camera_offset=torch.zeros(num_worlds, 3, device=device),
        light_offset=torch.zeros(num_worlds, 3, device=device),
        light_scale=ones.clone(),
    )


def draw(cfg: RandomizeConfig, u: torch.Tensor) -> WorldParams:
    """Uniforms f32 [N, NUM_DRAWS] in [0, 1) -> the draw of N worlds."""
    signed = 2.0 * u - 1.0  # f32 [N, NUM_DRAWS] in [-1, 1)
    return WorldParams(
        cube_scale=1.0 + cfg.cube_size * signed[:, 0],
        cube_yaw=cfg.cube_yaw * signed[:, 1],
        friction_scale=1.0 + cfg.friction * signed[:, 2],
        mass_scale=1.0 + cfg.mass * signed[:, 3],
        gain_scale=1.0 + cfg.servo_gain * signed[:, 4:10],
        delay=(u[:, 10] * (cfg.action_delay + 1)).long().clamp(max=cfg.action_delay),
        camera_offset=cfg.camera_pos * signed[:, 11:14],
        light_offset=cfg.light_pos * signed[:, 14:17],
        light_scale=1.0 + cfg.light * signed[:, 17],
    )
