"""``ManiSkillEnv``: a VecEnv over ManiSkill3 with two backends.

- ``gpu``: physx_cuda batches all environments in this process; tensors stay on the GPU.
- ``cpu``: physx_cpu allows one environment per ManiSkill instance, so environments live in
  subprocess workers (several per worker), stepped in lockstep; arrays cross as numpy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import partial

import numpy as np
import torch

from embodied.schema import (
    Observation,
    SimulatorConfig,
    StepOutput,
    UserError,
    check_episode_limit,
    reset_seeds,
)
from embodied.simulators.maniskill.core import CoreOptions, ManiSkillCore
from embodied.simulators.maniskill.tasks import check_assets
from embodied.simulators.workers import WorkerVecEnv


@dataclass
class ManiSkillConfig(SimulatorConfig):
    """Which ManiSkill3 task to run and how."""

    simulator: str = "maniskill"
    task: str = "PushCube-v1"  # any ManiSkill3 task id whose assets are installed
    # several tasks at once (multi-task training): num_envs is split evenly between them, in order,
    # and `task` is ignored; the framework composes one env per task (embodied.multitask)
    tasks: list[str] = field(default_factory=list)
    num_envs: int = 8  # environments stepped in lockstep
    backend: str = "cpu"  # "cpu": physx_cpu in subprocess workers; "gpu": physx_cuda, batched
    num_workers: int = (
        2  # cpu backend: subprocesses sharing the environments; 0: all in this process
    )
    # cpu backend: a worker silent this long in a step is killed and the run fails (resets and
    # renders: 10x); a core in this process (num_workers=0) cannot time out
    step_timeout_s: float = 120.0
    # "state" (proprioception + privileged), "rgb" (cameras + proprioception; privileged holds only
    # what ManiSkill gives image-based agents, e.g. goal_pos), or "rgb+state" (cameras and the full
    # privileged state: a state-based expert can act while the cameras record, for demonstrations)
    obs_mode: str = "state"
    control_mode: str | None = None  # None: the task's default controller
    reward_mode: str = "normalized_dense"
    image_size: int = 128  # camera height = width for obs_mode=rgb
    max_episode_steps: int | None = None  # None: the task's registered limit
    render_size: int = 256  # evaluation video frame size
    # Success does not end the episode: it runs to the time limit and the dense reward keeps paying
    # for staying successful (as ManiSkill's PPO baseline trains). With terminations on, reaching
    # the goal ends the reward stream, and a policy can earn more by hovering just short of it.
    ignore_terminations: bool = False
    # which proprioceptive groups form the state: a policy to deploy on a real arm leaves out
    # tcp_pose (an arm measures joints; its tool pose would need the arm's exact kinematics)
    proprioception: list[str] = field(default_factory=lambda: ["qpos", "qvel", "tcp_pose"])

    def validate(self) -> None:
        if self.backend not in ("cpu", "gpu"):
            raise ValueError(f"backend: must be 'cpu' or 'gpu', got {self.backend!r}")
        if self.obs_mode not in ("state", "rgb", "rgb+state"):
            raise ValueError(
                f"obs_mode: must be 'state', 'rgb' or 'rgb+state', got {self.obs_mode!r}"
            )
        repeated = [t for i, t in enumerate(self.tasks) if t in self.tasks[:i]]
        if repeated:  # (its two copies would share one name: per-task statistics mix them)
            raise ValueError(f"tasks: {repeated[0]} is listed twice; list each task once")
        if self.tasks and self.num_envs % len(self.tasks):
            raise ValueError(
                f"num_envs: {self.num_envs} environments do not split evenly between "
                f"{len(self.tasks)} tasks"
            )
        if self.num_workers < 0:
            raise ValueError(
                f"num_workers: must be >= 0 (0: in this process), got {self.num_workers}"
            )
        if not self.step_timeout_s > 0:
            raise ValueError(f"step_timeout_s: must be > 0 (seconds), got {self.step_timeout_s}")
        unknown = sorted(set(self.proprioception) - {"qpos", "qvel", "tcp_pose"})
        if unknown or not self.proprioception:
            raise ValueError(
                "proprioception: a non-empty subset of ['qpos', 'qvel', 'tcp_pose'], "
                f"got {self.proprioception}"
            )
        for name in ("num_envs", "image_size", "render_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        check_episode_limit(self.max_episode_steps)

    def task_name(self) -> str | None:
        return None if self.tasks else self.task  # (with tasks, task is ignored)

    def with_task(self, name: str) -> ManiSkillConfig:
        """This config set up for the one task ``name`` (its tasks cleared: kept, every listed
        task was built)."""
        return SimulatorConfig.with_task(replace(self, tasks=[]), name)


def _core_options(cfg: ManiSkillConfig, num_envs: int, sim_backend: str) -> CoreOptions:
    return CoreOptions(
        task=cfg.task,
        num_envs=num_envs,
        obs_mode=cfg.obs_mode,
        control_mode=cfg.control_mode,
        reward_mode=cfg.reward_mode,
        image_size=cfg.image_size,
        max_episode_steps=cfg.max_episode_steps,
        sim_backend=sim_backend,
        render_size=cfg.render_size,
        ignore_terminations=cfg.ignore_terminations,
        proprioception=tuple(cfg.proprioception),
    )


# ---------------------------------------------------------------------------------------------
# CPU backend: each worker (embodied.simulators.workers) holds one ManiSkillCore over a SerialEnvs
# of single-environment instances, behind the workers' numpy protocol.
class _WorkerCore:
    """A ManiSkillCore of n physx_cpu environments speaking the workers' protocol."""

    def __init__(self, opts: CoreOptions, num_envs: int):
        self.core = ManiSkillCore(replace(opts, num_envs=num_envs))
        self.spec = self.core.spec
        self._everyone = list(range(num_envs))

    def _pack(self, obs: Observation) -> dict:
        return {
            "state": obs.state.numpy(),
            "images": {k: v.numpy() for k, v in obs.images.items()},
            "privileged": {k: v.numpy() for k, v in obs.privileged.items()},
            "instruction": [self.spec.instructions[0]] * obs.state.shape[0],
        }

    @torch.no_grad()  # no autograd bookkeeping for the simulator's many small tensor ops
    def reset(self, ids: list[int], seeds: list) -> dict:
        """ids: local env indices, one seed (or None) each; all None or all set."""
        env_ids = torch.tensor(ids, dtype=torch.long)
        seeded = bool(seeds) and None not in seeds
        obs = self.core.reset(seed=seeds if seeded else None, env_ids=env_ids)
        return self._pack(obs)

    @torch.no_grad()
    def step(self, ids: list[int], actions: np.ndarray):
        rows = None if ids == self._everyone else torch.tensor(ids)
        obs, reward, term, trunc, success, final, _ = self.core.step(
            torch.from_numpy(actions), rows
        )
        scalars = torch.stack(
            [reward, term.float(), trunc.float(), success.float()], 1
        ).numpy()  # f32 [n, 4]
        return self._pack(obs), scalars, None if final is None else self._pack(final)

    @torch.no_grad()
    def render(self, ids: list[int] | None = None) -> np.ndarray:
        """uint8 [n or len(ids), H, W, 3]; ids: local env indices."""
        return self.core.render(None if ids is None else torch.tensor(ids)).numpy()

    def close(self) -> None:
        self.core.close()


class ManiSkillEnv:
    """VecEnv over a ManiSkill3 task (see module docstring for the backends)."""

    def __init__(self, cfg: ManiSkillConfig):
        cfg.validate()
        if cfg.tasks:  # (it would run env.task, which tasks says is ignored)
            raise UserError(
                "env.tasks: one ManiSkillEnv runs one task (env.task); embodied.multitask."
                "make_env runs several"
            )
        check_assets(cfg.task)  # fail here, before any worker starts
        self.cfg = cfg
        self.num_envs = cfg.num_envs
        self.can_step_subsets = cfg.backend == "cpu"  # step_async/step_wait (pipelined collection)
        self._core = self._pool = None
        if cfg.backend == "gpu":
            if not torch.cuda.is_available():
                raise UserError(
                    "env.backend=gpu needs a CUDA GPU and this machine has none; use "
                    "env.backend=cpu"
                )
            self._core = ManiSkillCore(_core_options(cfg, cfg.num_envs, "physx_cuda"))
            self.device = torch.device(self._core.device)
            self.spec = self._core.spec
            return
        self._pool = WorkerVecEnv(
            partial(_WorkerCore, _core_options(cfg, cfg.num_envs, "physx_cpu")),
            cfg.num_envs,
            cfg.num_workers,
            name="ManiSkill",
            task=cfg.task,
            step_timeout_s=cfg.step_timeout_s,
        )
        self.device = self._pool.device
        self.spec = self._pool.spec

    def reset(
        self, *, seed: int | Sequence[int] | None = None, env_ids: torch.Tensor | None = None
    ) -> Observation:
        if self._pool is not None:
            return self._pool.reset(seed=seed, env_ids=env_ids)
        if seed is not None and not isinstance(
            seed, int
        ):  # an int seeds the whole batch in one call (see ManiSkillCore.reset)
            ids = (
                list(range(self.num_envs))
                if env_ids is None
                else [int(i) for i in env_ids.tolist()]
            )
            seed = reset_seeds(seed, ids)
        return self._core.reset(
            seed=seed, env_ids=None if env_ids is None else env_ids.to(self.device)
        )

    def step(self, actions: torch.Tensor) -> StepOutput:
        """actions: float32 [B, A] physical units."""
        if self._pool is not None:
            return self._pool.step(actions)
        obs, reward, term, trunc, success, final, ended = self._core.step(actions)
        return StepOutput(
            obs=obs,
            reward=reward,
            terminated=term,
            truncated=trunc,
            success=success,
            final_obs=final,
            ended=ended,
        )

    # --- pipelining (cpu backend): step a subset while the caller works on another ------------
    def step_async(self, actions: torch.Tensor, env_ids: torch.Tensor) -> None:
        if self._pool is None:
            raise NotImplementedError("the gpu backend steps all environments at once; use step()")
        self._pool.step_async(actions, env_ids)

    def step_wait(self, env_ids: torch.Tensor) -> StepOutput:
        return self._pool.step_wait(env_ids)

    def render(self, env_ids: torch.Tensor | None = None) -> torch.Tensor:
        """uint8 [B or N, H, W, 3] frames of the task's render camera."""
        return (self._pool or self._core).render(env_ids)

    def close(self) -> None:
        (self._pool or self._core).close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def make_env(cfg: ManiSkillConfig, **overrides) -> ManiSkillEnv:
    return ManiSkillEnv(replace(cfg, **overrides) if overrides else cfg)
