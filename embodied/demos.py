"""``embodied demos``: record demonstrations offline into a LeRobot v3.0 dataset.

The demonstrator is a trained checkpoint (typically our state-based PPO expert acting on
privileged object/goal state) or, with ``expert: scripted``, the simulator's own scripted expert
(the MuJoCo tasks'), driving an environment whose cameras record what it does (ManiSkill's
obs_mode ``rgb+state``, MuJoCo's ``rgb``). Episodes run in rounds of B environments, each
environment's first episode per round counted, reset with seeds ``DEMO_SEED_OFFSET + seed + i``
(disjoint from the evaluation seeds, embodied/seeds.py; a demonstration may start where an RL
iteration does, which trains on both). Success is recorded per frame and per episode;
failed episodes are dropped unless ``keep_failed``.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch

from embodied.multitask import SIMULATOR_CONFIGS
from embodied.schema import SimulatorConfig, UserError, check_at_least
from embodied.seeds import MAX_SEED, check_seed
from embodied.simulators.maniskill import ManiSkillConfig

DEMO_SEED_OFFSET = 2_000_000  # (+ seed + attempts: below seeds.EVAL_SEED_OFFSET)
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
        check_seed("seed", self.seed)  # (below the evaluation seeds, whatever max_attempts)
        check_at_least(self, 1, "episodes")
        if self.max_attempts < self.episodes:
            raise ValueError(
                f"max_attempts: {self.max_attempts} is fewer than episodes ({self.episodes})"
            )
        if self.max_attempts > MAX_SEED:
            raise ValueError(f"max_attempts: at most {MAX_SEED:_}, got {self.max_attempts}")
        if not hasattr(self.env, "task"):  # (the dataset names its one task)
            raise ValueError(
                f"env.simulator: demonstrations are recorded from ManiSkill's or MuJoCo's tasks, "
                f"not {self.env.simulator}'s"
            )
        if getattr(self.env, "tasks", None):  # (it recorded all, each named the first one)
            raise ValueError(
                "env.tasks: a dataset holds one task's demonstrations; set env.task and record "
                "each task into its own dataset (embodied sft joins them)"
            )
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


def _kept(writer) -> str:
    """The dataset of the episodes recorded before an error, closed: its path, or why not."""
    try:
        return str(writer.close())
    except Exception as error:  # (the writer's own error: nothing to keep)
        return f"no dataset: it could not be closed ({error})"


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
    from embodied.checkpoint import load_policy_checkpoint, weights_misfit
    from embodied.models import build_policy
    from embodied.schema import EnvSpec

    ckpt = checkpoint if isinstance(checkpoint, dict) else load_policy_checkpoint(checkpoint)
    cfg = trained_config(ckpt["path"], ckpt["meta"])
    policy = build_policy(EnvSpec.from_dict(ckpt["meta"]["spec"]), cfg.policy).to(device)
    try:
        policy.load_state_dict(ckpt["model"])
    except RuntimeError as e:  # (a file its config names changed since: a vlm_path's model)
        raise weights_misfit(ckpt["path"], e) from None
    return policy.eval(), cfg


def trained_config(path, meta: dict):
    """The TrainConfig a checkpoint (at ``path``, its ``meta``) was trained with."""
    from embodied.config import compose
    from embodied.train_config import TrainConfig

    return compose(TrainConfig, [(str(path), meta["config"])])


@dataclass
class _Frame:
    """One step of every world, on the host (one copy per tensor, not one per world): what the
    expert saw, what it did, and what followed."""

    images: dict[str, np.ndarray]  # camera -> [B, ...] as the observation holds it
    state: np.ndarray  # f32 [B, S]
    privileged: dict[str, np.ndarray]  # key -> f32 [B, n], flattened per world
    actions: np.ndarray  # f32 [B, A] physical
    rewards: np.ndarray  # f32 [B]
    success: np.ndarray  # bool [B]
    done: np.ndarray  # bool [B]: the episode ended with this step

    @classmethod
    def of(cls, obs, actions: torch.Tensor, step, privileged_keys: list[str]) -> _Frame:
        B = actions.shape[0]
        return cls(
            images={c: v.cpu().numpy() for c, v in obs.images.items()},
            state=obs.state.cpu().numpy(),
            privileged={k: obs.privileged[k].reshape(B, -1).cpu().numpy() for k in privileged_keys},
            actions=actions.cpu().numpy(),
            rewards=step.reward.cpu().numpy(),
            success=step.success.cpu().numpy(),
            done=(step.terminated | step.truncated).cpu().numpy(),
        )


@dataclass
class _Episode:
    """One world's frames of an attempt, in order."""

    images: dict[str, list[np.ndarray]]
    privileged: dict[str, list[np.ndarray]]
    state: list[np.ndarray] = field(default_factory=list)
    actions: list[np.ndarray] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    success: list[bool] = field(default_factory=list)

    @classmethod
    def empty(cls, cameras, privileged_keys: list[str]) -> _Episode:
        return cls(images={c: [] for c in cameras}, privileged={k: [] for k in privileged_keys})

    @property
    def succeeded(self) -> bool:
        return any(self.success)

    def add(self, frame: _Frame, i: int) -> None:
        """World ``i``'s share of ``frame``."""
        for c, images in frame.images.items():
            self.images[c].append(images[i])
        for k, values in frame.privileged.items():
            self.privileged[k].append(values[i])
        self.state.append(frame.state[i])
        self.actions.append(frame.actions[i])
        self.rewards.append(float(frame.rewards[i]))
        self.success.append(bool(frame.success[i]))


def _attempt(env, expert, obs, n: int, deterministic: bool, privileged_keys) -> list[_Episode]:
    """The expert's episodes in worlds 0..n-1 from ``obs`` (their seeded reset), each recorded
    until it ends (offline recording: a loop over worlds is fine here)."""
    episodes = [_Episode.empty(obs.images, privileged_keys) for _ in range(n)]
    active = np.arange(env.num_envs) < n  # bool [B]
    while active.any():
        out = expert.act(obs, deterministic=deterministic)
        for k in range(out.actions.shape[1]):
            action = out.actions[:, k]  # f32 [B, A] physical
            step = env.step(action)
            frame = _Frame.of(obs, action, step, privileged_keys)
            for i in np.flatnonzero(active):
                episodes[i].add(frame, i)
            active &= ~frame.done
            obs = step.obs
            if not active.any():
                break
    return episodes


def _writer(cfg: DemosConfig, spec):
    """The LeRobot dataset the demonstrations go into."""
    from embodied.dataset import LeRobotWriter

    return LeRobotWriter(
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
            "action_space": spec.action.space,
            "expert": str(cfg.expert),
            "seed": cfg.seed,
        },
    )


def _write(writer, episode: _Episode, task: str, seed: int, world: dict | None) -> None:
    """One episode into the dataset, with its reset seed (and its world's randomised
    parameters, to re-simulate it)."""
    success = np.array(episode.success)
    writer.add_episode(
        images={c: np.stack(v) for c, v in episode.images.items()},
        state=np.stack(episode.state),
        actions=np.stack(episode.actions),
        rewards=np.array(episode.rewards, np.float32),
        success=success,
        task=task,
        privileged={k: np.stack(v) for k, v in episode.privileged.items()},
        extra={
            "seed": seed,
            "success_at_end": bool(success[-1]),
            **({} if world is None else {"world": world}),
        },
    )


def _expert_and_env(cfg: DemosConfig):
    """(expert, the task it was trained on, the environment it records in)."""
    from embodied.multitask import make_env

    if cfg.expert == SCRIPTED:
        env = make_env(cfg.env)
        return scripted_expert(cfg.env, env.device), cfg.env.task, env
    from embodied.checkpoint import load_policy_checkpoint
    from embodied.schema import EnvSpec

    try:
        ckpt = load_policy_checkpoint(cfg.expert)
        expert, expert_cfg = load_policy(ckpt)
    except (FileNotFoundError, UserError) as e:
        raise UserError(f"expert: {e}") from None
    trained = expert_cfg.env
    tasks = getattr(trained, "tasks", None) or [getattr(trained, "task", None)]
    if trained.simulator != cfg.env.simulator or cfg.env.task not in tasks:
        raise UserError(
            f"expert: trained on {trained.simulator}'s {', '.join(map(str, tasks))}, not "
            f"{cfg.env.simulator}'s {cfg.env.task}: its demonstrations would be of another task"
        )
    env = make_env(cfg.env)
    trained_spec = EnvSpec.from_dict(ckpt["meta"]["spec"])
    changes = expert_misfits(trained_spec, env.spec)
    unread = sorted(
        set(expert_cfg.policy.read_privileged(trained_spec)) - set(env.spec.obs.privileged)
    )
    if unread:  # (ManiSkill's rgb mode gives image agents' inputs only)
        changes.append(f"reads {', '.join(unread)}, which env.obs_mode={cfg.env.obs_mode} lacks")
    if changes:
        env.close()
        raise UserError(f"expert: trained with other inputs or actions ({'; '.join(changes)})")
    return expert.to(env.device), cfg.env.task, env  # (acts on the simulator's observations)


def expert_misfits(trained, given) -> list[str]:
    """How an expert trained on spec ``trained`` would not act in an environment of spec
    ``given``: other state or actions, or cameras it reads that ``given`` lacks at their size.
    Cameras it does not read may be there (a state expert drives an rgb environment: they are
    what the demonstrations record)."""
    changes = [c for c in trained.input_changes(given) if not c.startswith("cameras")]
    there = {(c.name, c.height, c.width) for c in given.obs.cameras}
    lacking = [
        f"{c.name} {c.height}x{c.width}"
        for c in trained.obs.cameras
        if (c.name, c.height, c.width) not in there
    ]
    if lacking:
        changes.append(f"cameras {lacking} not in the environment")
    return changes


@dataclass
class _Tally:
    """What a recording has done so far."""

    attempts: int = 0
    kept: int = 0
    wins: int = 0


@torch.no_grad()
def record_demos(cfg: DemosConfig, *, progress: bool = True) -> dict:
    """Record ``cfg.episodes`` of the expert's episodes (successful ones, unless
    ``keep_failed``) into a LeRobot dataset. Ctrl-C or SIGTERM stops after the episodes in
    progress and keeps those recorded (the summary's ``stopped`` names the signal)."""
    from tqdm import tqdm

    from embodied.run import StopSignals

    cfg.validate()
    expert, expert_task, env = _expert_and_env(cfg)
    spec = env.spec
    missing = sorted(set(cfg.privileged_keys) - set(spec.obs.privileged))
    if missing:
        env.close()
        raise UserError(
            f"privileged_keys: {missing} not among the environment's {sorted(spec.obs.privileged)}"
        )
    writer = _writer(cfg, spec)
    tally = _Tally()
    t0 = time.time()
    bar = tqdm(total=cfg.episodes, desc=f"demos {cfg.env.task}", disable=not progress, unit="ep")
    try:
        with StopSignals() as stop:
            while tally.kept < cfg.episodes and tally.attempts < cfg.max_attempts:
                if stop.requested:
                    break
                _record_round(env, expert, writer, cfg, tally, bar)
    except Exception as error:  # (a simulator's or the expert's: the episodes kept stand)
        if tally.kept:
            error.add_note(f"embodied demos: the {tally.kept} episodes kept are in {_kept(writer)}")
        raise
    finally:
        bar.close()
        env.close()
    stopped = None if stop.signum is None else signal.Signals(stop.signum).name
    if tally.kept == 0:
        when = f"stopped ({stopped}) before" if stopped else "the expert succeeded in none of"
        raise UserError(f"{when} {tally.attempts} episodes; nothing recorded")
    root = writer.close()
    return {
        "task": cfg.env.task,
        "episodes": tally.kept,
        "attempts": tally.attempts,
        "expert_success_rate": tally.wins / tally.attempts,
        "frames": writer.total_frames,
        "output": str(root),
        "minutes": (time.time() - t0) / 60,
        "expert": str(cfg.expert),
        "expert_task": expert_task,
        "stopped": stopped,
    }


def _record_round(env, expert, writer, cfg: DemosConfig, tally: _Tally, bar) -> None:
    """One seeded round of the expert in every environment; the episodes to keep written."""
    B = env.num_envs
    base = DEMO_SEED_OFFSET + cfg.seed + tally.attempts
    obs = env.reset(seed=[base + i for i in range(B)])
    # each world's randomised parameters (MuJoCo), kept with its episode to re-simulate it
    world = getattr(env, "world_params", None)
    worlds = None if world is None else world.to_dict()
    n = min(B, cfg.max_attempts - tally.attempts)
    episodes = _attempt(env, expert, obs, n, cfg.deterministic, cfg.privileged_keys)
    tally.attempts += n
    for i, episode in enumerate(episodes):
        if (episode.succeeded or cfg.keep_failed) and tally.kept < cfg.episodes:
            world_i = None if worlds is None else _row(worlds, i)
            _write(writer, episode, env.spec.instructions[0], base + i, world_i)
            tally.kept += 1
            bar.update(1)
    tally.wins += sum(episode.succeeded for episode in episodes)
    bar.set_postfix(attempts=tally.attempts, expert_success=f"{tally.wins}/{tally.attempts}")
