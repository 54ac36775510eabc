"""The train config: every section of ``embodied train``'s YAML as one dataclass, and what the
sections ask of each other, checked before anything is built."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch

from embodied.algorithm import AlgorithmConfig
from embodied.cluster.config import ClusterConfig
from embodied.config import check_folder_name, to_dict
from embodied.grpo import GRPOConfig
from embodied.learner import TrainerConfig
from embodied.models import POLICY_CONFIGS, ActorCriticConfig, PolicyConfig
from embodied.multitask import SIMULATOR_CONFIGS
from embodied.ppo import PPOConfig
from embodied.schema import (
    SimulatorConfig,
    UserError,
    check_at_least,
    check_device_name,
    check_distinct_episodes,
    checked_device,
)
from embodied.seeds import check_seed
from embodied.simulators.maniskill import ManiSkillConfig

ALGORITHMS = {"ppo": PPOConfig, "grpo": GRPOConfig}


def check_minutes(max_minutes: float | None) -> None:
    if max_minutes is not None and max_minutes <= 0:
        raise ValueError(f"max_minutes: must be > 0, got {max_minutes}")


@dataclass
class RunnerConfig:
    """Where the run goes, how long it lasts, what it keeps."""

    # the bounds .inf turns off (config.py: any other float must be finite)
    INFINITE: ClassVar[tuple[str, ...]] = ("max_minutes", "spike_factor")

    name: str = "run"  # run directory: output_dir/name
    output_dir: str = "runs"
    total_env_steps: int = 1_000_000  # environment steps over all environments
    max_minutes: float | None = None  # stop training after this wall-clock time (then evaluate)
    eval_every: int = 10  # iterations between evaluations (0: only at the end)
    eval_episodes: int = 50  # episodes per task per evaluation during training
    final_eval_episodes: int = 100  # episodes per task of the final evaluation
    save_every: int = 10  # iterations between checkpoints (always at the end)
    keep_checkpoints: int = 3  # the newest N checkpoints stay, plus the best by evaluation
    # write every Nth iteration's rollout and the learner's state before its update to
    # RUN/rollouts (0: off), and any iteration whose update is not finite or spikes
    record_rollouts: int = 0
    keep_rollouts: int = 5  # the newest N records of every Nth iteration stay (spikes: all)
    # a gradient norm over this x the median of the positive norms of the last 20 iterations (at
    # least 2 of them) is a spike, recorded; 0: never
    spike_factor: float = 10.0
    # train on a recorded run's rounds (RUN/rollouts), in their order, without simulators
    replay_from: str | None = None
    video: bool = True  # record the final evaluation as mp4
    report: bool = True  # write RUN/report.html at the run's end (embodied/report.py)
    resume: str | None = None  # a run directory (or checkpoint) to continue from
    resume_force: bool = False  # resume even though a key that changes the run differs
    overwrite: bool = False  # a new run in a directory that holds one: remove the earlier run
    # start from these policy weights (e.g. an SFT checkpoint) with a fresh optimizer
    init_from: str | None = None
    device: str = "auto"  # "auto": the environment's device
    torch_threads: int = 1  # intra-op threads for the policy (the simulators use the other cores)
    # > 1: the policy acts for one group of envs while others simulate; "auto": try the stage
    # counts the envs can split into in the first iterations and keep the fastest
    pipeline_stages: int | str = 1
    progress: bool = True  # show a progress bar
    trace: bool = False  # RUN/trace.json: a Chrome/Perfetto trace of an iteration (the second)
    # the same floats on every x86 CPU: MKL, torch's kernels and convolutions on portable code
    # paths (embodied/numerics.py); off by default: the README run trains 27% slower so
    deterministic: bool = False

    def validate(self) -> None:
        check_folder_name("name", self.name)
        check_at_least(self, 1, "total_env_steps", "eval_episodes", "final_eval_episodes")
        check_at_least(self, 1, "keep_rollouts", "keep_checkpoints", "torch_threads")
        check_at_least(self, 0, "eval_every", "save_every")
        stages = self.pipeline_stages
        if stages != "auto" and (not isinstance(stages, int) or stages < 1):
            raise ValueError(f"pipeline_stages: must be >= 1 or auto, got {stages!r}")
        if self.record_rollouts < 0:
            raise ValueError(
                f"record_rollouts: every N >= 1 iterations, or 0 (off); got {self.record_rollouts}"
            )
        if self.replay_from and self.resume:
            raise ValueError("replay_from: starts a run from records; it cannot resume one")
        if self.spike_factor < 0 or 0 < self.spike_factor <= 1:  # (<= 1: half the updates)
            raise ValueError(
                f"spike_factor: 0 (no spikes) or a multiple > 1 of the median gradient norm, "
                f"got {self.spike_factor}"
            )
        check_minutes(self.max_minutes)
        check_device_name("device", self.device, auto=True)

    def torch_device(self, auto: torch.device | str) -> torch.device:
        """The learner's device: ``auto`` for device=auto (the environment's); CUDA on a
        machine without it is a one-line UserError (validation alone accepts it: a GPU's
        command line validates on a CPU)."""
        if self.device == "auto":
            return torch.device(auto)
        instead = "runner.device=auto (the environment's device) or cpu"
        return checked_device("runner.device", self.device, instead)

    def acting_device(self, env_device: torch.device) -> torch.device:
        """Where a checkpoint of this run acts in ``embodied eval`` and ``bench``: where its
        evaluations acted (a CPU simulator's run may act on CUDA; other kernels round otherwise),
        or the environment's device, said so, on a machine without that one."""
        try:
            return self.torch_device(env_device)
        except UserError:
            print(
                f"note: the run acted on runner.device={self.device}, which this machine "
                f"lacks; acting on {env_device} (its numbers may differ in the last bits)",
                file=sys.stderr,
            )
            return torch.device(env_device)


@dataclass
class TrainConfig:
    # policy.name / algorithm.name / env.simulator select the config schema of that section
    CHOICES: ClassVar[dict] = {
        "policy": POLICY_CONFIGS,
        "algorithm": ALGORITHMS,
        "env": SIMULATOR_CONFIGS,
    }
    CHOICE_KEYS: ClassVar[dict] = {"env": "simulator"}
    seed: int = 0
    env: SimulatorConfig = field(default_factory=ManiSkillConfig)  # env.simulator picks the schema
    policy: PolicyConfig = field(default_factory=ActorCriticConfig)  # policy.name picks it
    algorithm: AlgorithmConfig = field(default_factory=PPOConfig)
    runner: RunnerConfig = field(default_factory=RunnerConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)  # enabled: the roles on Ray
    trainer: TrainerConfig = field(default_factory=TrainerConfig)  # backend: torch | megatron

    def validate(self) -> None:
        """What the sections ask of each other, before anything is built."""
        check_seed("seed", self.seed)
        check_cameras(self.policy, self.env)
        counts = {
            "runner.eval_episodes": self.runner.eval_episodes,
            "runner.final_eval_episodes": self.runner.final_eval_episodes,
        }
        check_distinct_episodes(self.env, counts)
        if self.runner.replay_from and self.cluster.enabled:
            raise ValueError(
                "runner.replay_from: trains in this process from records, without simulators "
                "or workers; set cluster.enabled=false"
            )
        self.algorithm.check_with(self.policy, self.env)
        if self.policy.compile_act and self.runner.pipeline_stages == "auto":
            raise ValueError(
                "policy.compile_act compiles the act once per batch size, and "
                "runner.pipeline_stages=auto would time each split with its compile: choose a "
                "number of stages (1 on a GPU)"
            )
        if self.trainer.backend == "megatron":
            check_megatron(self.trainer, self.policy, self.cluster)
            if self.runner.replay_from:
                raise ValueError(
                    "runner.replay_from: trains on trainer.backend=torch (records hold the "
                    "torch layout, a megatron run's too)"
                )
            if self.runner.record_rollouts and self.cluster.enabled:
                raise ValueError(
                    "runner.record_rollouts: records of the megatron backend on a cluster are "
                    "not built yet (in one process, at any trainer.tensor_parallel, they are)"
                )


def check_megatron(trainer: TrainerConfig, policy: PolicyConfig, cluster: ClusterConfig) -> None:
    """What the megatron backend trains today (ValueError naming the key otherwise)."""
    if policy.name != "vla":
        raise ValueError(
            f"trainer.backend: megatron trains a VLA's transformer; policy {policy.name!r} has "
            "none (use policy.name=vla or trainer.backend=torch)"
        )
    tp = trainer.tensor_parallel
    if policy.heads % tp:
        raise ValueError(
            f"trainer.tensor_parallel: {policy.heads} attention heads (policy.heads) do not "
            f"split over {tp} ranks"
        )
    if policy.head == "discrete" and policy.bins % tp:
        raise ValueError(
            f"trainer.tensor_parallel: the discrete head's {policy.bins} bins (policy.bins) do "
            f"not split over {tp} ranks"
        )
    if policy.vlm_path:
        _check_vlm_split(Path(policy.vlm_path), tp)
    if cluster.offload_optimizer:
        raise ValueError(
            "cluster.offload_optimizer: not built for trainer.backend=megatron yet (torch only)"
        )
    if cluster.enabled and cluster.actor.workers != tp:
        raise ValueError(
            f"cluster.actor.workers: on a cluster each megatron TP rank is an actor worker; set "
            f"it to {tp} (trainer.tensor_parallel): data-parallel megatron ranks are not built yet"
        )


def _check_vlm_split(path: Path, tp: int) -> None:
    """A VLM language model megatron shards (embodied/megatron/shards.py) splits over ``tp``
    ranks; another family's stays whole."""
    from transformers import AutoConfig

    from embodied.megatron.shards import TEXT_FAMILIES

    if not (path / "config.json").is_file():
        return  # (the policy's build names the missing directory)
    try:
        text = AutoConfig.from_pretrained(path, local_files_only=True).get_text_config()
    except (OSError, ValueError) as error:
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ValueError(f"policy.vlm_path: {path}/config.json does not load ({reason})") from None
    if text.model_type not in TEXT_FAMILIES:
        return
    sizes = (text.num_key_value_heads, text.vocab_size, text.intermediate_size)
    if any(size % tp for size in sizes):
        raise ValueError(
            f"trainer.tensor_parallel: the language model of policy.vlm_path has "
            f"{sizes[0]} key-value groups, a vocabulary of {sizes[1]} and an MLP of {sizes[2]}: "
            f"each must split evenly over {tp} ranks"
        )


def check_cameras(policy: PolicyConfig, env: SimulatorConfig) -> None:
    """A policy that reads cameras needs an observation with them (ValueError "env.obs_mode: ...",
    as a ``validate()`` raises it)."""
    obs_mode = getattr(env, "obs_mode", "rgb")
    if policy.needs_cameras and "rgb" not in obs_mode:
        raise ValueError(
            f"env.obs_mode: policy {policy.name!r} reads camera images and obs_mode "
            f"{obs_mode!r} has none; use env.obs_mode=rgb"
        )


def run_meta(cfg: TrainConfig, spec) -> dict:
    return {"config": to_dict(cfg), "spec": spec.to_dict(), "format": "embodied-checkpoint-v1"}
