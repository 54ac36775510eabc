"""``MuJoCoConfig``: importable without mujoco installed (config validation, the CLI)."""

from __future__ import annotations

from dataclasses import dataclass

from embodied.schema import SimulatorConfig
from embodied.simulators.mujoco.tasks import TASKS


@dataclass
class MuJoCoConfig(SimulatorConfig):
    """Which MuJoCo arm task to run and how."""

    simulator: str = "mujoco"
    task: str = "reach"  # reach | push
    num_envs: int = 8
    obs_mode: str = "state"  # state (proprioception + privileged) | rgb (adds base_camera)
    image_size: int = 64
    render_size: int = 128
    max_episode_steps: int | None = None  # None: the task's own
    ignore_terminations: bool = True  # success does not end the episode (see ManiSkillConfig)
    home_noise: float = 0.1  # radians of uniform noise on the home pose at reset

    def validate(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"task: unknown MuJoCo task {self.task!r}; available: {sorted(TASKS)}")
        if self.obs_mode not in ("state", "rgb"):
            raise ValueError(f"obs_mode: must be 'state' or 'rgb', got {self.obs_mode!r}")
        for name in ("num_envs", "image_size", "render_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
