"""``embodied demos``: record demonstrations offline into a LeRobot v3.0 dataset.

The demonstrator is a trained checkpoint (typically our state-based PPO expert acting on
privileged object/goal state) or, with ``expert: scripted``, the simulator's own scripted expert
(the MuJoCo tasks'), driving an environment whose cameras record what it does (ManiSkill's
obs_mode ``rgb+state``, MuJoCo's ``rgb``). Episodes run in rounds of B environments, each
environment's first episode per round counted, reset with seeds ``DEMO_SEED_OFFSET + seed + i``
(disjoint from the training and evaluation seeds). Success is recorded per frame and per episode;
failed episodes are dropped unless ``keep_failed``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch

from embodied.multitask import SIMULATOR_CONFIGS
from embodied.schema import SimulatorConfig, UserError
from embodied.simulators.maniskill import ManiSkillConfig

DEMO_SEED_OFFSET = 2_000_000
SCRIPTED = "scripted"  # ``expert``: the simulator's own scripted expert for the task


@dataclass
class DemosConfig:
    """Which expert records which task, how many episodes, and where they go."""

    CHOICES: ClassVar[dict] = {"env": SIMULATOR_CONFIGS}
    CHOICE_KEYS: ClassVar[dict] = {"env": "simulator"}
    # the demonstrator: a checkpoint (a run directory, RUN/last or a checkpoint), or "scripted"
    expert: str = ""
    env: SimulatorConfig = field(default_factory=lambda: ManiSkillConfig(obs_mode="rgb+state"))
    episodes: int = 100  # successful episodes wanted (all episodes with keep_failed)
    max_attempts: int = 300  # stop after this many episodes even if fewer succeeded
    keep_failed: bool = False
    deterministic: bool = True  # the expert's mean action (its evaluated behaviour)
    privileged_keys: list[str] = field(
        default_factory=list
    )  # also store these (e.g. goal_pos) per frame
    output: str = "demos/run"  # the dataset directory (must not exist yet)
    seed: int = 0

    def validate(self) -> None:
        if not self.expert:
            raise ValueError("expert: a checkpoint path is required")
        if self.episodes < 1 or self.max_attempts < self.episodes:
            raise ValueError("episodes: need 1 <= episodes <= max_attempts")
        if "rgb" not in self.env.obs_mode:
            raise ValueError(
                "env.obs_mode: demonstrations need cameras (ManiSkill's 'rgb+state', MuJoCo's "
                f"'rgb'), got {self.env.obs_mode!r}"
            )
        if self.expert == SCRIPTED and self.env.simulator != "mujoco":
            raise ValueError(
                f"expert: scripted experts exist for the MuJoCo tasks, not for {self.env.simulator}"
                "; give a checkpoint"
            )


def scripted_expert(env_cfg, device):
    """The simulator's scripted expert for ``env_cfg``'s task (an ``act(obs)`` policy)."""
    from embodied.simulators.mujoco.experts import EXPERTS

    return EXPERTS[env_cfg.task](device)


def _row(columns: dict[str, list], i: int) -> dict:
    """World ``i`` of per-world lists."""
    return {k: v[i] for k, v in columns.items()}


def load_policy(checkpoint: str | Path | dict, device="cpu"):
    """A trained policy rebuilt on the spec it was trained with -> (policy in eval mode, train
    config). ``checkpoint``: a path, or what ``load_policy_checkpoint`` returned."""
    from embodied.checkpoint import load_policy_checkpoint
    from embodied.config import compose
    from embodied.models import build_policy
    from embodied.schema import EnvSpec
    from embodied.train_config import TrainConfig

    ckpt = checkpoint if isinstance(checkpoint, dict) else load_policy_checkpoint(checkpoint)
    cfg = compose(TrainConfig, [(str(ckpt["path"]), ckpt["meta"]["config"])])
    policy = build_policy(EnvSpec.from_dict(ckpt["meta"]["spec"]), cfg.policy).to(device)
    policy.load_state_dict(ckpt["model"])
    return policy.eval(), cfg


@torch.no_grad()
def record_demos(cfg: DemosConfig, *, progress: bool = True) -> dict:
    from tqdm import tqdm

    from embodied.dataset import LeRobotWriter
    from embodied.multitask import make_env

    cfg.validate()
    expert_task = cfg.env.task
    if cfg.expert != SCRIPTED:
        try:
            expert, expert_cfg = load_policy(cfg.expert)
        except (FileNotFoundError, UserError) as e:
            raise UserError(f"expert: {e}") from None
        expert_task = expert_cfg.env.task
    env = make_env(cfg.env)
    if cfg.expert == SCRIPTED:
        expert = scripted_expert(cfg.env, env.device)
    spec = env.spec
    missing = sorted(set(cfg.privileged_keys) - set(spec.obs.privileged))
    if missing:
        env.close()
        raise ValueError(
            f"privileged_keys: {missing} not among the environment's {sorted(spec.obs.privileged)}"
        )
    writer = LeRobotWriter(
        cfg.output,
        fps=spec.action.control_hz,
        cameras={c.name: (c.height, c.width) for c in spec.obs.cameras},
        state_names=list(spec.obs.state_names),
        action_names=list(spec.action.names),
        privileged={k: int(np.prod(spec.obs.privileged[k])) for k in cfg.privileged_keys},
        robot_type=None,  # the task decides the robot; see info.json["embodied"]
        source={
            "simulator": cfg.env.simulator,
            "task": cfg.env.task,
            "control_mode": getattr(cfg.env, "control_mode", spec.action.space),
            "expert": str(cfg.expert),
            "seed": cfg.seed,
        },
    )
    B = env.num_envs
    attempts = 0
    kept = 0
    wins_total = 0
    t0 = time.time()
    bar = tqdm(total=cfg.episodes, desc=f"demos {cfg.env.task}", disable=not progress, unit="ep")
    try:
        while kept < cfg.episodes and attempts < cfg.max_attempts:
            base = DEMO_SEED_OFFSET + cfg.seed + attempts
            obs = env.reset(seed=[base + i for i in range(B)])
            # each world's randomised parameters (MuJoCo), kept with its episode to re-simulate it
            world = getattr(env, "world_params", None)
            worlds = None if world is None else world.to_dict()
            n = min(B, cfg.max_attempts - attempts)
            frames = [
                {
                    "images": {c: [] for c in obs.images},
                    "state": [],
                    "actions": [],
                    "rewards": [],
                    "success": [],
                    "privileged": {k: [] for k in cfg.privileged_keys},
                }
                for _ in range(n)
            ]
            active = torch.zeros(B, dtype=torch.bool)
            active[:n] = True
            while bool(active.any()):
                out = expert.act(obs, deterministic=cfg.deterministic)
                for k in range(out.actions.shape[1]):
                    action = out.actions[:, k]  # f32 [B, A] physical
                    step = env.step(action)
                    done = step.terminated | step.truncated
                    for i in (
                        active.nonzero().squeeze(1).tolist()
                    ):  # offline recording: a loop is fine here
                        f = frames[i]
                        for c in obs.images:
                            f["images"][c].append(obs.images[c][i].cpu().numpy())
                        for key in cfg.privileged_keys:
                            f["privileged"][key].append(
                                obs.privileged[key][i].reshape(-1).cpu().numpy()
                            )
                        f["state"].append(obs.state[i].cpu().numpy())
                        f["actions"].append(action[i].cpu().numpy())
                        f["rewards"].append(float(step.reward[i]))
                        f["success"].append(bool(step.success[i]))
                    active &= ~done
                    obs = step.obs
                    if not bool(active.any()):
                        break
            attempts += n
            for i, f in enumerate(frames):
                success = np.array(f["success"])
                if (success.any() or cfg.keep_failed) and kept < cfg.episodes:
                    writer.add_episode(
                        images={c: np.stack(v) for c, v in f["images"].items()},
                        state=np.stack(f["state"]),
                        actions=np.stack(f["actions"]),
                        rewards=np.array(f["rewards"], np.float32),
                        success=success,
                        task=spec.instructions[0],
                        privileged={k: np.stack(v) for k, v in f["privileged"].items()},
                        extra={
                            "seed": base + i,
                            "success_at_end": bool(success[-1]),
                            **({} if worlds is None else {"world": _row(worlds, i)}),
                        },
                    )
                    kept += 1
                    bar.update(1)
            wins = sum(any(f["success"]) for f in frames)
            wins_total += wins
            bar.set_postfix(attempts=attempts, expert_success=f"{wins_total}/{attempts}")
    finally:
        bar.close()
        env.close()
    if kept == 0:
        raise RuntimeError(f"the expert succeeded in none of {attempts} episodes; nothing recorded")
    root = writer.close()
    return {
        "task": cfg.env.task,
        "episodes": kept,
        "attempts": attempts,
        "expert_success_rate": wins_total / attempts,
        "frames": writer.total_frames,
        "output": str(root),
        "minutes": (time.time() - t0) / 60,
        "expert": str(cfg.expert),
        "expert_task": expert_task,
    }
