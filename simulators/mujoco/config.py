"""``MuJoCoConfig``: importable without mujoco installed (config validation, the CLI)."""

from __future__ import annotations

from dataclasses import dataclass, field

from embodied.schema import SimulatorConfig, check_device_name, check_episode_limit
from embodied.simulators.mujoco.randomize import RandomizeConfig
from embodied.simulators.mujoco.tasks import TASKS

BACKENDS = ("rollout", "warp")
CAMERAS = ("base_camera", "wrist_camera")  # the front camera on the table, the one on the gripper


@dataclass
class MuJoCoConfig(SimulatorConfig):
    """Which MuJoCo arm task to run and how."""

    simulator: str = "mujoco"
    task: str = "reach"  # reach | push | pick
    num_envs: int = 8
    obs_mode: str = "state"  # state (proprioception + privileged) | rgb (adds the cameras)
    cameras: list[str] = field(default_factory=lambda: ["base_camera"])  # rgb: and wrist_camera
    image_size: int = 64
    render_size: int = 128
    max_episode_steps: int | None = None  # None: the task's own
    ignore_terminations: bool = True  # success does not end the episode (see ManiSkillConfig)
    # radians: each joint uniform within this of its home angle at reset (where its range
    # allows)
    home_noise: float = 0.1
    backend: str = "rollout"  # rollout: mujoco.rollout on the CPU | warp: MuJoCo Warp
    device: str = "cpu"  # the warp backend's device: cpu (Warp's CPU device) | cuda | cuda:N
    nconmax: int | None = None  # warp: contacts per world (pooled over worlds); None: its default
    njmax: int | None = None  # warp: constraints per world; None: warp_env.NJMAX (measured)
    # warp: the step's reading of the new state (reward, success, truncation, the state
    # observation) through torch.compile: a few fused kernels a step, not some 35 operators
    compile: bool = False
    randomize: RandomizeConfig = field(default_factory=RandomizeConfig)  # per world, seeded

    def validate(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"task: unknown MuJoCo task {self.task!r}; available: {sorted(TASKS)}")
        if self.obs_mode not in ("state", "rgb"):
            raise ValueError(f"obs_mode: must be 'state' or 'rgb', got {self.obs_mode!r}")
        unknown = [c for c in self.cameras if c not in CAMERAS]
        if unknown or not self.cameras or len(set(self.cameras)) != len(self.cameras):
            raise ValueError(
                f"cameras: one or more of {list(CAMERAS)}, each once, got {list(self.cameras)}"
            )
        for name in ("num_envs", "image_size", "render_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        check_episode_limit(self.max_episode_steps)
        if self.home_noise < 0:
            raise ValueError(f"home_noise: must be >= 0, got {self.home_noise}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend: must be one of {list(BACKENDS)}, got {self.backend!r}")
        check_device_name("device", self.device)
        if self.device != "cpu" and self.backend != "warp":
            raise ValueError(
                f"device: the {self.backend} backend runs on the CPU; env.backend=warp runs on "
                f"{self.device}"
            )
        if self.compile and self.backend != "warp":
            raise ValueError("compile: only the warp backend compiles its step (env.backend=warp)")
        try:  # (a config file's section is validated on its own first, as env.randomize)
            self.randomize.validate()
        except ValueError as e:
            raise ValueError(f"randomize.{e}") from None
        for name in ("nconmax", "njmax"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name}: must be >= 1 or null, got {value}")
        unapplied = self._unapplied()
        if unapplied:
            raise ValueError(unapplied)

    def _unapplied(self) -> str | None:
        """Why a setting this backend or task would ignore is refused (None: each applies): a run
        that records a range it never applied would claim worlds it did not simulate."""
        r = self.randomize
        if self.backend == "warp" and r.light:
            return (
                "randomize.light: the warp backend cannot vary the light's brightness (MuJoCo "
                "Warp's renderer has no per-world light intensity); env.backend=rollout does"
            )
        seen = [name for name in ("camera_pos", "light_pos", "light") if getattr(r, name)]
        if seen and self.obs_mode == "state":  # (no image: only evaluation videos would show it)
            return f"randomize.{seen[0]}: varies the images, and obs_mode=state has none"
        cube = [name for name in ("cube_size", "cube_yaw", "mass") if getattr(r, name)]
        if cube and "cube_pos" not in TASKS[self.task].privileged:
            return f"randomize.{cube[0]}: the {self.task} task has no cube to vary"
        buffers = [name for name in ("nconmax", "njmax") if getattr(self, name) is not None]
        if buffers and self.backend != "warp":
            return (
                f"{buffers[0]}: sizes MuJoCo Warp's buffers (env.backend=warp); the "
                f"{self.backend} backend has none"
            )
        return None
