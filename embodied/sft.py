"""``embodied sft``: supervised fine-tuning (behaviour cloning) of a policy on LeRobot datasets.

Reads one or more demonstration datasets (one task each, or mixed), installs their
normalization statistics in the policy (state mean/std, action 1st/99th percentiles), trains the
policy's own ``bc_loss`` on random frames with the next K actions as the target chunk, evaluates
success per task in the simulator, and writes a checkpoint that ``embodied eval`` and RL
fine-tuning (``policy_init``) load. With a frozen image encoder the image features of every frame
are computed once and reused (the encoder is deterministic: BatchNorm in eval mode).

The update runs on the configured backend (``trainer.backend``, ``trainer.tensor_parallel``) as
RL's does: ``BCLearner`` holds the policy and its ``TrainEngine`` (AdamW with the config's weight
decay, clipping by the global norm); with TP ranks in processes, rank 0's follows the others in
lockstep (embodied/megatron/lockstep.py).
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import ClassVar

import torch
from tqdm import tqdm

from embodied import numerics
from embodied.cluster.config import ClusterConfig
from embodied.config import save_config, to_dict
from embodied.dataset import DemoDataset
from embodied.evaluate import evaluate_by_task, per_task
from embodied.learner import TorchEngine, TrainerConfig
from embodied.logger import RunLogger
from embodied.models import POLICY_CONFIGS, PolicyConfig, VLAConfig, build_policy
from embodied.multitask import make_env
from embodied.roles import save_engine
from embodied.run import Clock, Stopped, StopSignals, bar_interval
from embodied.schema import NormStats, Observation
from embodied.simulators.maniskill import ManiSkillConfig
from embodied.train_config import check_cameras, check_megatron


@dataclass
class SFTRunnerConfig:
    name: str = "sft"  # run directory: output_dir/name
    output_dir: str = "runs"
    eval_every: int = 0  # steps between evaluations (0: only at the end)
    eval_episodes: int = 100  # per task
    max_minutes: float | None = None  # stop training after this long (then evaluate)
    save_every: int = 0  # steps between checkpoints (0: only at the end)
    keep_checkpoints: int = 3  # the newest N checkpoints stay
    torch_threads: int = 2
    progress: bool = True
    deterministic: bool = False  # the same floats on every x86 CPU (as runner.deterministic)


@dataclass
class SFTConfig:
    CHOICES: ClassVar[dict] = {"policy": POLICY_CONFIGS}
    seed: int = 0
    datasets: list[str] = field(default_factory=list)  # LeRobot v3.0 dataset directories
    # > 0: train on each dataset's first N episodes only (few-shot SFT)
    episodes_per_dataset: int = 0
    # evaluation environment; each dataset's task (info.json "embodied.task") replaces its task
    env: ManiSkillConfig = field(default_factory=lambda: ManiSkillConfig(obs_mode="rgb"))
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
        if not self.datasets:
            raise ValueError("datasets: at least one dataset directory is required")
        for key in ("steps", "batch_size"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key}: must be >= 1, got {getattr(self, key)}")
        check_cameras(self.policy, self.env)
        if self.episodes_per_dataset < 0:
            raise ValueError(f"episodes_per_dataset: must be >= 0, got {self.episodes_per_dataset}")
        if self.trainer.backend == "megatron":
            check_megatron(self.trainer, self.policy, ClusterConfig())


@dataclass
class _Frames:
    """All datasets' frames as one set of tensors (N frames)."""

    data: DemoDataset
    instructions: list[str]  # per frame
    tasks: list[str]  # simulator task id per dataset, in order


def _load(paths: list[str], episodes: int = 0) -> _Frames:
    parts = [DemoDataset.load(p) for p in paths]
    parts = [p.head(episodes) for p in parts] if episodes > 0 else parts
    sets = [set(p.images) for p in parts]
    if any(s != sets[0] for s in sets):
        raise ValueError(f"datasets: cameras differ between datasets: {sets}")
    offset = 0
    starts = []
    ends = []
    instructions = []
    for p in parts:
        starts.append(p.starts + offset)  # long [E]
        ends.append(p.ends + offset)  # long [E]
        instructions += [p.tasks[t] for t in p.task.tolist()]
        offset += len(p)
    priv_keys = set.intersection(*[set(p.privileged) for p in parts])
    cat = DemoDataset(
        images={c: torch.cat([p.images[c] for p in parts]) for c in parts[0].images},
        privileged={k: torch.cat([p.privileged[k] for p in parts]) for k in priv_keys},
        state=torch.cat([p.state for p in parts]),
        actions=torch.cat([p.actions for p in parts]),
        episode=torch.cat([p.episode for p in parts]),
        frame=torch.cat([p.frame for p in parts]),
        task=torch.cat([p.task for p in parts]),
        tasks=[],
        starts=torch.cat(starts),
        ends=torch.cat(ends),
        info=parts[0].info,
        stats=parts[0].stats,
    )
    tasks = [p.info.get("embodied", {}).get("task") for p in parts]
    return _Frames(cat, instructions, tasks)


def _norm_data(frames: _Frames) -> dict[str, torch.Tensor]:
    """What the normalisation statistics are computed from (no images: it goes to every rank)."""
    d = frames.data
    return {"state": d.state, "privileged": d.privileged, "actions": d.actions}


def _norm_stats(policy, data: dict) -> None:
    obs = Observation(state=data["state"], instruction=[], privileged=data["privileged"])
    state = policy.state_vector(obs) if policy.state_dim else None
    actions = data["actions"]
    policy.set_norm_stats(
        state=NormStats(mean=state.mean(0), std=state.std(0)) if state is not None else None,
        action=NormStats(
            q01=torch.quantile(actions, 0.01, dim=0), q99=torch.quantile(actions, 0.99, dim=0)
        ),
    )


class BCLearner:
    """SFT's update: the policy with the datasets' normalisation statistics, and its
    ``TrainEngine`` on ``cfg.trainer.backend`` (AdamW, eps 1e-8, ``cfg.weight_decay`` on every
    trainable weight; clipping at ``cfg.max_grad_norm``). ``lockstep_calls``: what TP rank 0
    sends its helper ranks."""

    lockstep_calls = ("bc_step", "refresh")

    def __init__(self, cfg: SFTConfig, spec, norm_data: dict, device):
        self.policy = build_policy(spec, cfg.policy).to(device)
        _norm_stats(self.policy, norm_data)
        options = {
            "learning_rate": cfg.learning_rate,
            "max_grad_norm": cfg.max_grad_norm,
            "weight_decay": cfg.weight_decay,
            "adam_eps": 1e-8,
        }
        if cfg.trainer.backend == "megatron":
            from embodied.megatron.engine import MegatronEngine, join_ranks

            join_ranks(self.policy, cfg)
            self.engine = MegatronEngine(
                self.policy,
                with_value=False,
                recompute=cfg.trainer.recompute,
                dtype=cfg.trainer.dtype(device),
                **options,
            )
        else:
            self.engine = TorchEngine(self.policy, **options)

    def bc_step(self, obs, chunk, mask, features, lr: float) -> dict[str, torch.Tensor]:
        """One clipped AdamW step of ``policy.bc_loss`` at ``lr``: its metrics, the loss and
        the gradient norm (0-dim tensors)."""
        self.engine.set_lr(lr)
        self.policy.train()
        loss, metrics = self.policy.bc_loss(obs, chunk, mask, features=features)
        self.engine.backward(loss)
        grad_norm = self.engine.step()
        return {**metrics, "sft/loss": loss.detach(), "sft/grad_norm": grad_norm}

    def refresh(self) -> None:
        """The torch-layout policy (evaluation, checkpoints) gets the current weights."""
        self.engine.refresh()

    def save(self, run_dir: Path, step: int, **kw) -> Path:
        return save_engine(self.engine, run_dir, step, **kw)

    def close(self) -> None:
        self.engine.close()


def bc_learner_for(cfg: SFTConfig, spec, norm_data: dict) -> BCLearner:
    """SFT's learner in this process, its TP ranks 1.. in helper processes when
    ``trainer.tensor_parallel`` > 1."""
    device = torch.device("cpu")
    if cfg.trainer.tensor_parallel > 1:
        from embodied.megatron.lockstep import Lockstep, start_ranks

        helpers = start_ranks(cfg, device, BCLearner, spec, norm_data)
        return Lockstep(BCLearner(cfg, spec, norm_data, device), helpers)
    return BCLearner(cfg, spec, norm_data, device)


def _batch(frames: _Frames, idx: torch.Tensor) -> Observation:
    d = frames.data
    return Observation(
        state=d.state[idx],
        instruction=[frames.instructions[i] for i in idx.tolist()],
        images={c: v[idx] for c, v in d.images.items()},
        privileged={k: v[idx] for k, v in d.privileged.items()},
    )


@torch.no_grad()
def _cached_features(policy, frames: _Frames, batch: int = 64) -> torch.Tensor:
    """Frozen image encoder: every frame's features once, f32 [C, N, P, F]."""
    policy.eval()
    N = len(frames.data)
    out = []
    for lo in tqdm(
        range(0, N, batch),
        desc="image features",
        unit="batch",
        mininterval=0.1 if sys.stderr.isatty() else 30.0,
    ):
        idx = torch.arange(lo, min(N, lo + batch))
        f = policy.image_features(_batch(frames, idx))  # f32 [C*b, P, F]
        out.append(f.view(-1, len(idx), *f.shape[1:]))
    return torch.cat(out, dim=1)


def sft(cfg: SFTConfig) -> dict:
    if cfg.runner.deterministic:  # first: before a torch op chooses a code path or a worker starts
        numerics.pin()
    numerics.setup(cfg.runner.torch_threads)
    torch.manual_seed(cfg.seed)
    frames = _load(cfg.datasets, cfg.episodes_per_dataset)  # a bad dataset fails before the run
    run_dir = Path(cfg.runner.output_dir) / cfg.runner.name
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run_dir / "config.yaml")
    numerics.record(run_dir, iteration=0, deterministic=cfg.runner.deterministic)
    tasks = [t or cfg.env.task for t in frames.tasks]
    env_cfgs = {t: ManiSkillConfig(**{**to_dict(cfg.env), "task": t}) for t in dict.fromkeys(tasks)}
    with make_env(
        _eval_env_config(env_cfgs)
    ) as env:  # the spec all tasks share (privileged: common keys)
        spec = env.spec
    learner = bc_learner_for(cfg, spec, _norm_data(frames))
    policy = learner.engine.torch_policy  # (evaluation and the cached image features)
    K = cfg.policy.chunk_size
    warm = max(1, cfg.warmup_steps)

    def lr_at(s: int) -> float:
        """Linear warm-up, then cosine decay to 10% (``s`` from 0)."""
        progress = min(1.0, max(0, s - warm) / max(1, cfg.steps - warm))
        return cfg.learning_rate * (
            min(1.0, (s + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
        )

    try:  # (TP ranks in processes end with the learner)
        logger = RunLogger(run_dir)
        N = len(frames.data)
        trainable = sum(p.numel() for p in policy.parameters() if p.requires_grad)
        print(
            f"sft: {N} frames from {len(cfg.datasets)} dataset(s), tasks {sorted(set(tasks))}; "
            f"{trainable / 1e6:.1f}M trainable parameters"
        )
        meta = {
            "config": {
                "seed": cfg.seed,
                "env": to_dict(env_cfgs[tasks[0]]),
                "policy": to_dict(cfg.policy),
                # `embodied eval` acts with this many threads and pins, as this run's
                # evaluations did: another count or code path rounds otherwise
                "runner": {
                    "torch_threads": cfg.runner.torch_threads,
                    "deterministic": cfg.runner.deterministic,
                },
            },
            "sft": to_dict(cfg),
            "spec": spec.to_dict(),
            "format": "embodied-checkpoint-v1",
        }
        clock = Clock(0.0, cfg.runner.max_minutes)

        def save(step: int) -> Path:
            counters = {"iteration": step, "env_steps": 0, "train_seconds": clock.seconds}
            learner.refresh()
            return learner.save(
                run_dir, step, counters=counters, meta=meta, keep=cfg.runner.keep_checkpoints
            )

        bar = tqdm(
            total=cfg.steps,
            desc=cfg.runner.name,
            disable=not cfg.runner.progress,
            dynamic_ncols=True,
            mininterval=bar_interval(),
        )
        evals = []
        if getattr(policy, "caches_image_features", False):
            features = _cached_features(policy, frames)
        else:
            features = None
        policy.train()
        step = 0
        with StopSignals() as stop:
            for step in range(1, cfg.steps + 1):
                idx = torch.randint(N, (cfg.batch_size,))
                chunk, mask = frames.data.action_chunks(idx, K)
                # f32 [C*B, P, F], cameras outermost
                feats = None if features is None else features[:, idx].flatten(0, 1)
                lr = lr_at(step - 1)
                metrics = learner.bc_step(_batch(frames, idx), chunk, mask, feats, lr)
                bar.update(1)
                if step % 10 == 0 or step == cfg.steps:
                    metrics = {k: float(v) for k, v in metrics.items()}
                    metrics.update({"train/lr": lr, "time/minutes": clock.seconds / 60})
                    logger.log(metrics, step=step)
                    bar.set_postfix(loss=f"{metrics['sft/loss']:.4f}")
                if stop.requested:  # between steps the weights and optimizer are consistent
                    save(step)
                    bar.close()
                    logger.close()
                    raise Stopped(
                        stop.signum, f"stopped after step {step}; checkpoint: {run_dir}/last"
                    )
                if cfg.runner.save_every and step % cfg.runner.save_every == 0 and step < cfg.steps:
                    save(step)
                evaluate_now = cfg.runner.eval_every and step % cfg.runner.eval_every == 0
                if evaluate_now and step < cfg.steps and not clock.out_of_time:
                    learner.refresh()
                    evals.append(
                        evaluate_tasks(
                            policy, env_cfgs, cfg.runner.eval_episodes, cfg.seed, step, logger
                        )
                    )
                    policy.train()
                if clock.out_of_time:
                    bar.write(f"stopping after {step} steps ({cfg.runner.max_minutes} min)")
                    break
        bar.close()
        ckpt = save(step)
    finally:
        learner.close()
    final = evaluate_tasks(
        policy,
        env_cfgs,
        cfg.runner.eval_episodes,
        cfg.seed,
        step,
        logger,
        video_dir=run_dir / "videos",
    )
    summary = {
        "run_dir": str(run_dir),
        "checkpoint": str(ckpt),
        "steps": step,
        "minutes": clock.seconds / 60,
        "final": final,
        "evals": evals,
    }
    (run_dir / "metrics.json").write_text(json.dumps(summary, indent=2))
    logger.close()
    for task, r in final.items():
        ci = r["eval/success_ci95"]
        print(
            f"{task}: success {r['eval/success_rate']:.3f} over {r['eval/episodes']} episodes "
            f"(95% CI {ci[0]:.2f}-{ci[1]:.2f})"
        )
    return summary


@torch.no_grad()
def evaluate_tasks(
    policy,
    env_cfgs: dict[str, ManiSkillConfig],
    episodes: int,
    seed: int,
    step: int,
    logger,
    video_dir: Path | None = None,
) -> dict:
    """Deterministic evaluation of ``policy`` on each task, all tasks at once in one MultiTaskEnv
    (``env.num_envs`` environments per task) -> {task: evaluate() summary}."""
    policy.eval()
    env = make_env(_eval_env_config(env_cfgs))
    try:
        video = video_dir / "eval.mp4" if video_dir is not None else None
        with tqdm(
            total=episodes * len(env_cfgs),
            desc="evaluating",
            unit="ep",
            leave=False,
            mininterval=0.1 if sys.stderr.isatty() else 30.0,
        ) as progress:
            out = evaluate_by_task(
                env, policy, episodes=episodes, seed=seed, video_path=video, progress=progress
            )
    finally:
        env.close()
    if len(env_cfgs) == 1:
        out = {next(iter(env_cfgs)): out["all"]}
    for task, summary in out.items():
        logger.log(per_task(task, summary), step=step)
    return out


def _eval_env_config(env_cfgs: dict[str, ManiSkillConfig]) -> ManiSkillConfig:
    """One task's config, or a multi-task one with each task's ``num_envs`` and at least a worker
    per task."""
    first = next(iter(env_cfgs.values()))
    if len(env_cfgs) == 1:
        return first
    n = len(env_cfgs)
    return replace(
        first,
        tasks=list(env_cfgs),
        num_envs=n * first.num_envs,
        num_workers=max(n, first.num_workers) if first.num_workers else 0,
    )  # 0: in process
