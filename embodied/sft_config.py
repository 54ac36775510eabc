"""``embodied sft``'s config: the datasets, the policy and its evaluation environment, the
steps and their learning-rate schedule, and the run's directory, evaluations and checkpoints."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

from embodied.cluster.config import ClusterConfig
from embodied.config import check_folder_name
from embodied.learner import TrainerConfig, check_grad_norm
from embodied.models import POLICY_CONFIGS, PolicyConfig, VLAConfig
from embodied.multitask import SIMULATOR_CONFIGS
from embodied.schema import SimulatorConfig, check_at_least, check_distinct_episodes
from embodied.seeds import check_seed
from embodied.simulators.maniskill import ManiSkillConfig
from embodied.train_config import check_cameras, check_megatron, check_minutes


@dataclass
class SFTRunnerConfig:
    # the bounds .inf turns off (config.py: any other float must be finite)
    INFINITE: ClassVar[tuple[str, ...]] = ("max_minutes",)
    name: str = "sft"  # run directory: output_dir/name
    output_dir: str = "runs"
    eval_every: int = 0  # steps between evaluations (0: only at the end)
    eval_episodes: int = 100  # per task
    max_minutes: float | None = None  # stop training after this long (then evaluate)
    save_every: int = 0  # steps between checkpoints (0: only at the end)
    keep_checkpoints: int = 3  # the newest N checkpoints stay
    resume: str | None = None  # a run directory (or checkpoint) to continue from
    resume_force: bool = False  # resume even though a key that changes the run differs
    overwrite: bool = False  # a new run in a directory that holds one: remove the earlier run
    torch_threads: int = 2
    progress: bool = True
    deterministic: bool = False  # the same floats on every x86 CPU (as runner.deterministic)
    report: bool = True  # RUN/report.html when the run ends or stops (embodied/report.py)

    def validate(self) -> None:
        check_folder_name("name", self.name)
        check_at_least(self, 1, "eval_episodes", "keep_checkpoints", "torch_threads")
        check_at_least(self, 0, "eval_every", "save_every")
        check_minutes(self.max_minutes)


SFT_POLICIES = ("vla", "smolvla")  # the policies with a demonstration loss (bc_loss)


@dataclass
class SFTConfig:
    # the bounds .inf turns off (config.py: any other float must be finite)
    INFINITE: ClassVar[tuple[str, ...]] = ("max_grad_norm",)
    # policy.name / env.simulator select the config schema of that section
    CHOICES: ClassVar[dict] = {"policy": POLICY_CONFIGS, "env": SIMULATOR_CONFIGS}
    CHOICE_KEYS: ClassVar[dict] = {"env": "simulator"}
    seed: int = 0
    datasets: list[str] = field(default_factory=list)  # LeRobot v3.0 dataset directories
    # > 0: train on each dataset's first N episodes only (few-shot SFT)
    episodes_per_dataset: int = 0
    # evaluation environment, any simulator; each dataset's task (info.json "embodied.task")
    # replaces its task
    env: SimulatorConfig = field(default_factory=lambda: ManiSkillConfig(obs_mode="rgb"))
    policy: PolicyConfig = field(default_factory=VLAConfig)
    steps: int = 2000
    batch_size: int = 32
    learning_rate: float = 3e-4
    weight_decay: float = 0.01
    warmup_steps: int = 100  # linear warm-up, then cosine decay to 10%
    max_grad_norm: float = 1.0
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    runner: SFTRunnerConfig = field(default_factory=SFTRunnerConfig)

    def validate(self) -> None:
        check_seed("seed", self.seed)
        if not self.datasets:
            raise ValueError("datasets: at least one dataset directory is required")
        if self.policy.name not in SFT_POLICIES:
            raise ValueError(
                f"policy.name: embodied sft trains {' or '.join(SFT_POLICIES)} (a chunk head "
                f"with a demonstration loss), got {self.policy.name!r}"
            )
        check_at_least(self, 1, "steps", "batch_size")
        check_at_least(self, 0, "warmup_steps", "episodes_per_dataset")
        if self.warmup_steps > self.steps:  # (steps=50 under the default 100: half the rate)
            raise ValueError(
                f"warmup_steps: {self.warmup_steps} of {self.steps} steps; the learning rate "
                "would never reach learning_rate (set warmup_steps at most steps)"
            )
        if self.learning_rate <= 0:
            raise ValueError(f"learning_rate: must be > 0, got {self.learning_rate}")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay: must be >= 0, got {self.weight_decay}")
        check_cameras(self.policy, self.env)
        check_distinct_episodes(self.env, {"runner.eval_episodes": self.runner.eval_episodes})
        check_grad_norm(self.max_grad_norm)
        if self.trainer.backend == "megatron":
            check_megatron(self.trainer, self.policy, ClusterConfig())


def lr_at(cfg: SFTConfig, s: int) -> float:
    """Linear warm-up, then cosine decay to 10% (``s`` from 0)."""
    warm = max(1, cfg.warmup_steps)
    progress = min(1.0, max(0, s - warm) / max(1, cfg.steps - warm))
    cosine = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))
    return cfg.learning_rate * min(1.0, (s + 1) / warm) * cosine
