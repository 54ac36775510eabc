"""The PPO trainer: collect -> advantages -> epochs of minibatch updates -> log -> evaluate -> checkpoint.

Every iteration starts from a seeded reset of all environments (environment b of iteration i gets
seed ``seed + i * num_envs + b``), so an iteration depends only on the weights, the RNG state and
its index: a run resumed from a checkpoint continues exactly as the uninterrupted run would.
Episodes still running at the end of a rollout are truncated there and bootstrap from V(s_T).
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch
from tqdm import tqdm

from embodied.algorithms import entropy, gae, ppo_policy_loss, value_loss
from embodied.checkpoint import load_checkpoint, save_checkpoint, set_rng_state
from embodied.config import save_config, to_dict
from embodied.evaluate import evaluate
from embodied.logger import RunLogger
from embodied.models import POLICY_CONFIGS, ActorCriticConfig, PolicyConfig, build_policy
from embodied.multitask import SIMULATOR_CONFIGS, make_env
from embodied.rollout import EpisodeStats, collect
from embodied.schema import SimulatorConfig
from embodied.simulators.maniskill import ManiSkillConfig


@dataclass
class AlgorithmConfig:
    name: str = ""  # selects the schema: ppo | grpo


@dataclass
class PPOConfig(AlgorithmConfig):
    """PPO hyper-parameters (names as in CleanRL / ManiSkill's PPO baseline)."""

    name: str = "ppo"
    num_steps: int = 50  # T: policy calls per environment per rollout
    gamma: float = 0.8  # per environment step
    gae_lambda: float = 0.9
    learning_rate: float = 3e-4
    anneal_lr: bool = False  # linearly to 0 over total_env_steps
    update_epochs: int = 4
    num_minibatches: int = 4
    clip_coef: float = 0.2  # ratio clipped to [1 - clip_coef, 1 + clip_coef_high]
    clip_coef_high: float | None = None  # None: symmetric
    vf_coef: float = 0.5
    vf_clip: float | None = None  # None: unclipped value loss
    ent_coef: float = 0.0
    max_grad_norm: float = 0.5
    target_kl: float | None = 0.1  # stop the epochs early once approx_kl exceeds it
    norm_adv: bool = True
    reward_scale: float = 1.0

    def validate(self) -> None:
        for key in ("num_steps", "update_epochs", "num_minibatches"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key}: must be >= 1, got {getattr(self, key)}")
        if not 0 < self.gamma <= 1 or not 0 <= self.gae_lambda <= 1:
            raise ValueError("gamma: gamma must be in (0, 1] and gae_lambda in [0, 1]")
        if self.learning_rate <= 0:
            raise ValueError(f"learning_rate: must be > 0, got {self.learning_rate}")


@dataclass
class GRPOConfig(AlgorithmConfig):
    """GRPO with outcome rewards (episode success) for chunked policies, DAPO-style dynamic
    sampling and clip-higher, optional KL to the initial policy. No critic."""

    name: str = "grpo"
    group_size: int = 8  # M episodes per group, all reset with the same seed
    groups_per_batch: int = 2  # informative groups wanted per update
    max_rounds: int = 4  # collection rounds per update while too few groups are informative
    dynamic_sampling: bool = True  # drop groups whose members all succeeded or all failed
    scale_by_std: bool = True  # False: Dr. GRPO (no division by the group's std)
    # where the PPO ratio is taken: chunk (one ratio over K*A dimensions: clips at the smallest
    # change) | action | token
    logprob_level: str = "action"
    # the Gaussian head's log std after runner.init_from: SFT fits only the mean, and sampling at
    # the SFT's untrained std can fail most episodes the deterministic policy solves
    exploration_log_std: float | None = None
    learning_rate: float = 2e-5
    update_epochs: int = 2
    num_minibatches: int = 2
    clip_coef: float = 0.2
    clip_coef_high: float | None = 0.28  # DAPO clip-higher
    kl_coef: float = 0.0  # > 0: penalty KL(pi || initial policy), k3 estimator
    max_grad_norm: float = 1.0

    def validate(self) -> None:
        if self.group_size < 2:
            raise ValueError(f"group_size: must be >= 2, got {self.group_size}")
        if self.logprob_level not in ("chunk", "action", "token"):
            raise ValueError(
                f"logprob_level: must be chunk, action or token, got {self.logprob_level!r}"
            )
        for key in ("groups_per_batch", "max_rounds", "update_epochs", "num_minibatches"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key}: must be >= 1, got {getattr(self, key)}")


ALGORITHMS = {"ppo": PPOConfig, "grpo": GRPOConfig}


@dataclass
class RunnerConfig:
    """Where the run goes and how long it lasts."""

    name: str = "run"  # run directory: output_dir/name
    output_dir: str = "runs"
    total_env_steps: int = 1_000_000  # environment steps over all environments
    max_minutes: float | None = None  # stop training after this wall-clock time (then evaluate)
    eval_every: int = 10  # iterations between evaluations (0: only at the end)
    eval_episodes: int = 50  # episodes per evaluation during training
    final_eval_episodes: int = 100  # episodes of the final evaluation
    save_every: int = 10  # iterations between checkpoints (always at the end)
    video: bool = True  # record the final evaluation as mp4
    resume: str | None = None  # a run directory (or checkpoint) to continue from
    init_from: str | None = (
        None  # start from these policy weights (e.g. an SFT checkpoint), fresh optimizer
    )
    device: str = "auto"  # "auto": the environment's device
    torch_threads: int = 1  # intra-op threads for the policy (the simulators use the other cores)
    pipeline_stages: int = 1  # > 1: the policy acts for one group of envs while the others simulate
    progress: bool = True  # show a progress bar

    def validate(self) -> None:
        if self.total_env_steps < 1:
            raise ValueError(f"total_env_steps: must be >= 1, got {self.total_env_steps}")
        if self.pipeline_stages < 1:
            raise ValueError(f"pipeline_stages: must be >= 1, got {self.pipeline_stages}")
        if self.eval_episodes < 1 or self.final_eval_episodes < 1:
            raise ValueError("eval_episodes: eval_episodes and final_eval_episodes must be >= 1")


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
    policy: PolicyConfig = field(default_factory=ActorCriticConfig)  # policy.name picks the schema
    algorithm: AlgorithmConfig = field(default_factory=PPOConfig)
    runner: RunnerConfig = field(default_factory=RunnerConfig)


def ppo_update(policy, optimizer, rollout, advantages, returns, cfg: PPOConfig) -> dict[str, float]:
    """Epochs of minibatch PPO updates over the flattened [T*B] rollout; returns mean metrics."""
    b_adv, b_ret, b_values = advantages.reshape(-1), returns.reshape(-1), rollout.values.reshape(-1)
    n = b_adv.shape[0]
    mb_size = max(1, n // cfg.num_minibatches)
    sums: dict[str, float] = {}
    count = 0
    for epoch in range(cfg.update_epochs):
        perm = torch.randperm(n, device=b_adv.device)
        for start in range(0, n - mb_size + 1, mb_size):
            mb_inds = perm[start : start + mb_size]
            mb_obs, mb_out = rollout.flat(mb_inds)
            newlogprob, ent, newvalue = policy.evaluate(mb_obs, mb_out)
            mb_adv = b_adv[mb_inds]
            if cfg.norm_adv and mb_adv.numel() > 1:
                mb_adv = (mb_adv - mb_adv.mean()) / (mb_adv.std() + 1e-8)
            pg_loss, m_pg = ppo_policy_loss(
                logprob=newlogprob,
                old_logprob=mb_out.logprob,
                advantages=mb_adv,
                clip_low=cfg.clip_coef,
                clip_high=cfg.clip_coef_high,
            )
            v_loss, m_v = value_loss(
                values=newvalue,
                returns=b_ret[mb_inds],
                old_values=b_values[mb_inds],
                clip=cfg.vf_clip,
            )
            ent_loss, m_ent = entropy(entropies=ent)
            loss = pg_loss - cfg.ent_coef * ent_loss + cfg.vf_coef * v_loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.max_grad_norm)
            optimizer.step()
            for k, v in {
                **m_pg,
                **m_v,
                **m_ent,
                "loss/total": loss.item(),
                "policy/grad_norm": grad_norm.item(),
            }.items():
                sums[k] = sums.get(k, 0.0) + v
            count += 1
        if cfg.target_kl is not None and m_pg["policy/approx_kl"] > cfg.target_kl:
            break
    metrics = {k: v / count for k, v in sums.items()}
    metrics["policy/epochs"] = epoch + 1
    return metrics


def run_meta(cfg: TrainConfig, spec) -> dict:
    return {"config": to_dict(cfg), "spec": spec.to_dict(), "format": "embodied-checkpoint-v1"}


def time_left(run, counters: dict) -> dict:
    """Progress-bar field for runs stopped by runner.max_minutes (the bar's own ETA assumes the
    step budget is reached)."""
    if run.max_minutes is None:
        return {}
    return {"min_left": f"{max(0.0, run.max_minutes - counters['train_seconds'] / 60):.1f}"}


def train(cfg: TrainConfig) -> dict:
    torch.set_num_threads(cfg.runner.torch_threads)
    resume = load_checkpoint(cfg.runner.resume) if cfg.runner.resume else None
    # a checkpoint lives in RUN/checkpoints/iter_N: a resumed run keeps writing to RUN
    run_dir = (
        resume["path"].parent.parent if resume else Path(cfg.runner.output_dir) / cfg.runner.name
    )
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run_dir / "config.yaml")
    torch.manual_seed(cfg.seed)

    env = make_env(cfg.env)
    try:
        if cfg.algorithm.name == "grpo":
            from embodied.grpo_trainer import train_grpo

            return train_grpo(cfg, env, run_dir, resume)
        return _train(cfg, env, run_dir, resume)
    finally:
        env.close()


def init_policy(cfg: TrainConfig, env, device):
    """The policy for ``env``, with weights (and normalization) from ``runner.init_from`` if set."""
    policy = build_policy(env.spec, cfg.policy).to(device)
    if cfg.runner.init_from:
        state = load_checkpoint(cfg.runner.init_from, with_trainer_state=False)["model"]
        missing, unexpected = policy.load_state_dict(state, strict=False)
        # a critic may be added (PPO after SFT: fresh value head) or dropped (GRPO); nothing else may differ
        bad = [k for k in missing + unexpected if not k.startswith("value_mlp.")]
        if bad:
            raise ValueError(
                f"runner.init_from: {cfg.runner.init_from} does not fit policy {cfg.policy.name!r} "
                f"(mismatched weights: {bad[:5]})"
            )
    return policy


def _train(cfg: TrainConfig, env, run_dir: Path, resume: dict | None) -> dict:
    alg, run = cfg.algorithm, cfg.runner
    device = env.device if run.device == "auto" else torch.device(run.device)
    policy = init_policy(cfg, env, device)
    optimizer = torch.optim.Adam(policy.parameters(), lr=alg.learning_rate, eps=1e-5)
    B, K, T = env.num_envs, cfg.policy.chunk_size, alg.num_steps
    steps_per_iter = B * K * T
    num_iterations = math.ceil(run.total_env_steps / steps_per_iter)
    counters = {"iteration": 0, "env_steps": 0, "train_seconds": 0.0, "evals": []}
    if resume is not None:
        policy.load_state_dict(resume["model"])
        optimizer.load_state_dict(resume["optimizer"])
        set_rng_state(resume["rng"])
        counters = resume["counters"]
        print(
            f"resuming {run_dir} from iteration {counters['iteration']} ({counters['env_steps']} env steps)"
        )
    logger = RunLogger(run_dir, enabled_tb=True)
    meta = run_meta(cfg, env.spec)
    bar = tqdm(
        total=num_iterations * steps_per_iter,
        initial=counters["env_steps"],
        unit="step",
        unit_scale=True,
        dynamic_ncols=True,
        disable=not run.progress,
        desc=run.name,
        mininterval=0.1 if sys.stderr.isatty() else 30.0,
    )  # a log file gets a line every 30 s
    start_wall = time.time() - counters["train_seconds"]
    ckpt_iteration = counters["iteration"]
    try:
        for iteration in range(counters["iteration"] + 1, num_iterations + 1):
            if alg.anneal_lr:
                optimizer.param_groups[0]["lr"] = alg.learning_rate * (
                    1 - (iteration - 1) / num_iterations
                )
            # 1. collect
            t0 = time.time()
            stats = EpisodeStats.zeros(B, env.device)
            obs = env.reset(seed=cfg.seed + iteration * B).map(lambda x: x.to(device))
            rollout, _ = collect(
                env,
                policy,
                obs,
                num_steps=T,
                gamma=alg.gamma,
                stats=stats,
                stages=run.pipeline_stages if K == 1 else 1,
            )
            rollout_time = time.time() - t0
            # 2. advantages (chunk-level: one GAE step spans K environment steps)
            advantages, returns = gae(
                rewards=rollout.rewards * alg.reward_scale,
                values=rollout.values,
                next_values=rollout.next_values,
                terminated=rollout.terminated,
                truncated=rollout.truncated,
                gamma=alg.gamma**K,
                gae_lambda=alg.gae_lambda,
            )
            # 3. update, then fold this rollout into the observation normalizer for the next one
            t1 = time.time()
            metrics = ppo_update(policy, optimizer, rollout, advantages, returns, alg)
            policy.update_normalizer(rollout.obs)
            update_time = time.time() - t1
            # 4. log
            counters["iteration"], counters["env_steps"] = (
                iteration,
                counters["env_steps"] + steps_per_iter,
            )
            counters["train_seconds"] = time.time() - start_wall
            metrics.update(stats.summary())
            metrics.update(
                {
                    "time/rollout_s": rollout_time,
                    "time/update_s": update_time,
                    "time/env_steps_per_s": steps_per_iter / rollout_time,
                    "time/minutes": counters["train_seconds"] / 60,
                    "train/lr": optimizer.param_groups[0]["lr"],
                }
            )
            logger.log(metrics, step=counters["env_steps"], iteration=iteration)
            bar.update(steps_per_iter)
            bar.set_postfix(
                {
                    "sps": f"{steps_per_iter / (rollout_time + update_time):.0f}",
                    "ret": f"{metrics.get('episode/return', float('nan')):.2f}",
                    "succ": f"{metrics.get('episode/success_once', float('nan')):.2f}",
                    **time_left(run, counters),
                }
            )
            out_of_time = (
                run.max_minutes is not None and counters["train_seconds"] >= run.max_minutes * 60
            )
            last = iteration == num_iterations or out_of_time
            # 5. evaluate
            if run.eval_every and iteration % run.eval_every == 0 and not last:
                result = evaluate(env, policy, episodes=run.eval_episodes, seed=cfg.seed)
                counters["evals"].append(
                    {
                        "iteration": iteration,
                        "env_steps": counters["env_steps"],
                        "minutes": counters["train_seconds"] / 60,
                        **result,
                    }
                )
                logger.log(result, step=counters["env_steps"])
                bar.write(
                    f"iter {iteration} env_steps {counters['env_steps']}: success "
                    f"{result['eval/success_rate']:.2f} over {result['eval/episodes']} episodes"
                )
            # 6. checkpoint
            if last or (run.save_every and iteration % run.save_every == 0):
                save_checkpoint(
                    run_dir,
                    iteration,
                    model=policy,
                    optimizer=optimizer,
                    counters=counters,
                    meta=meta,
                )
                ckpt_iteration = iteration
            if out_of_time:
                bar.write(
                    f"stopping after {counters['train_seconds'] / 60:.1f} min (runner.max_minutes={run.max_minutes})"
                )
                break
    except KeyboardInterrupt:
        if counters["iteration"] > ckpt_iteration:
            save_checkpoint(
                run_dir,
                counters["iteration"],
                model=policy,
                optimizer=optimizer,
                counters=counters,
                meta=meta,
            )
        bar.close()
        logger.close()
        raise
    bar.close()
    # final evaluation with video
    final = evaluate(
        env,
        policy,
        episodes=run.final_eval_episodes,
        seed=cfg.seed,
        video_path=run_dir / "videos" / "final_eval.mp4" if run.video else None,
    )
    final.update(
        {
            "env_steps": counters["env_steps"],
            "minutes": counters["train_seconds"] / 60,
            "iteration": counters["iteration"],
        }
    )
    logger.log(final, step=counters["env_steps"])
    summary = {"run_dir": str(run_dir), "final": final, "evals": counters["evals"]}
    (run_dir / "metrics.json").write_text(json.dumps(summary, indent=2))
    logger.close()
    print(
        f"final evaluation: success {final['eval/success_rate']:.3f} over {final['eval/episodes']} episodes "
        f"(95% CI {final['eval/success_ci95'][0]:.2f}-{final['eval/success_ci95'][1]:.2f}); run in {run_dir}"
    )
    return summary
