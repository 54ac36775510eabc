"""PPO with a critic: GAE over chunks, the clipped surrogate at a chosen log-probability level,
a (clipped) value loss and an entropy bonus.

Every iteration starts from a seeded reset of all environments (environment b of iteration i gets
seed ``seed + i * num_envs + b``), so an iteration depends only on the weights, the RNG state and
its index: a resumed run continues exactly as the uninterrupted one. Episodes still running at
the end of a rollout are truncated there and bootstrap from V(s_T).

A chunk of K actions is one decision step: its reward is sum_k gamma^k r_k over the actions that
ran in its episode, and what follows is discounted by gamma^n for those n actions (gamma^(k+1)
when the episode ended at action k).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from embodied.algorithm import (
    AlgorithmConfig,
    broadcast,
    check_behaviour_weight_cap,
    check_clipping,
    check_level,
    mean_over_rounds,
)
from embodied.algorithms import chunk_returns, entropy, gae, ppo_policy_loss, value_loss
from embodied.learner import TrainEngine
from embodied.rollout import CollectPlan, RolloutBatch, Samples


@dataclass
class PPOConfig(AlgorithmConfig):
    """PPO hyper-parameters (names as in CleanRL / ManiSkill's PPO baseline)."""

    # the bounds .inf turns off (config.py: any other float must be finite)
    INFINITE: ClassVar[tuple[str, ...]] = (
        "clip_coef",
        "clip_coef_high",
        "behaviour_weight_cap",
        "vf_clip",
        "max_grad_norm",
        "target_kl",
    )

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
    # decoupled PPO (cluster.max_staleness > 0): entries whose behaviour weight pi_prox / pi_old
    # exceeds this are left out of the loss (AReaL's filter; at logprob_level chunk the weight is
    # a product over K x A dimensions, so watch policy/behaviour_filtered); null: no cap
    behaviour_weight_cap: float | None = 5.0
    # where the ratio is taken: chunk (one ratio over the K x A dimensions of a chunk: clips at
    # the smallest change) | action | token; the same for K = 1 policies' chunk and action
    logprob_level: str = "action"
    vf_coef: float = 0.5
    vf_clip: float | None = None  # None: unclipped value loss
    ent_coef: float = 0.0
    max_grad_norm: float = 0.5
    # stop the epochs early once a minibatch's approx_kl exceeds it; approx_kl is per unit of
    # logprob_level (a chunk's sums its K x A dimensions: the same target stops sooner there)
    target_kl: float | None = 0.1
    norm_adv: bool = True
    reward_scale: float = 1.0

    def validate(self) -> None:
        for key in ("num_steps", "update_epochs", "num_minibatches"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key}: must be >= 1, got {getattr(self, key)}")
        if not 0 < self.gamma <= 1:
            raise ValueError(f"gamma: must be in (0, 1], got {self.gamma}")
        if not 0 <= self.gae_lambda <= 1:
            raise ValueError(f"gae_lambda: must be in [0, 1], got {self.gae_lambda}")
        if self.learning_rate <= 0:
            raise ValueError(f"learning_rate: must be > 0, got {self.learning_rate}")
        check_level(self.logprob_level)
        check_behaviour_weight_cap(self.behaviour_weight_cap)
        check_clipping(self.clip_coef, self.clip_coef_high, self.max_grad_norm)
        if self.vf_coef < 0:
            raise ValueError(f"vf_coef: must be >= 0, got {self.vf_coef}")
        for key in ("vf_clip", "target_kl"):
            if getattr(self, key) is not None and getattr(self, key) <= 0:
                raise ValueError(f"{key}: must be > 0 or null, got {getattr(self, key)}")
        if self.reward_scale <= 0:
            raise ValueError(f"reward_scale: must be > 0, got {self.reward_scale}")

    def check_with(self, policy, env) -> None:
        super().check_with(policy, env)
        if not policy.has_critic():
            fix = "set policy.value_head=true" if hasattr(policy, "value_head") else ""
            raise ValueError(
                f"algorithm.name: ppo needs a critic, and policy {policy.name!r} has none; "
                f"{fix + ' or ' if fix else ''}train with algorithm.name=grpo"
            )

    def fit_policy(self, policy: torch.nn.Module) -> None:
        if not getattr(policy, "has_critic", True):
            raise ValueError(
                "algorithm.name: ppo needs a critic; set policy.value_head=true "
                "(or train with algorithm.name=grpo)"
            )
        super().fit_policy(policy)

    def build(self, cfg, spec, task_of_env: torch.Tensor, policy=None) -> PPO:
        return PPO(
            self,
            seed=cfg.seed,
            num_envs=len(task_of_env),
            round_steps=self.num_steps * cfg.policy.chunk_size,
            episode_steps=spec.max_episode_steps,
        )


class PPO:
    has_critic = True
    max_rounds = 1
    evaluates_before = False  # (from scratch: evaluated before RL only with runner.init_from)

    def __init__(
        self,
        cfg: PPOConfig,
        *,
        seed: int,
        num_envs: int,
        round_steps: int | None = None,
        episode_steps: int | None = None,
    ):
        self.cfg = cfg
        self.seed = seed
        self.num_envs = num_envs
        self.num_chunks = cfg.num_steps
        self.round_steps = round_steps  # env steps per environment in a round
        self.episode_steps = episode_steps  # the env's max_episode_steps

    def notes(self) -> list[str]:
        if self.round_steps is None or self.episode_steps is None:
            return []
        if self.round_steps >= self.episode_steps:
            return []
        return [
            f"PPO: a round is {self.round_steps} env steps and an episode up to "
            f"{self.episode_steps}; every round starts from a seeded reset, so training sees "
            f"only each episode's first {self.round_steps} steps (if the task's reward comes "
            "later, raise algorithm.num_steps)"
        ]

    def plan(self, iteration: int, round_index: int, episode_base: int) -> CollectPlan:
        return CollectPlan(
            seeds=self.seed + iteration * self.num_envs,
            group_of_env=torch.full((self.num_envs,), -1, dtype=torch.long),
            num_chunks=self.cfg.num_steps,
            episode_base=episode_base,
        )

    def advantages(self, batch: RolloutBatch) -> dict[str, torch.Tensor]:
        cfg = self.cfg
        rewards, discount = chunk_returns(
            rewards=batch.rewards * cfg.reward_scale, valid=batch.valid, gamma=cfg.gamma
        )  # f32 [T, B] each
        terminated, truncated = batch.chunk_done
        batch.advantages, batch.returns = gae(
            rewards=rewards,
            values=batch.values,
            next_values=batch.next_values,
            terminated=terminated,
            truncated=truncated,
            gamma=discount,
            gae_lambda=cfg.gae_lambda,
        )
        batch.sample_mask = batch.valid[..., 0]  # every chunk starts in its episode
        return {}

    def enough(self, metrics: list[dict[str, torch.Tensor]]) -> bool:
        return True

    def collected(self, rounds: list[dict[str, torch.Tensor]]) -> dict[str, float]:
        return mean_over_rounds(rounds)

    def prepare(self, samples: Samples, learner: TrainEngine | None = None) -> None:
        pass

    def loss(self, learner: TrainEngine, minibatch: Samples):
        cfg = self.cfg
        level = cfg.logprob_level
        logprob, ent, value = learner.logprob(minibatch, level)
        adv = minibatch.advantages  # f32 [N]
        whole = minibatch.whole()  # a rank's share: the minibatch's statistics
        whole_adv = whole.advantages
        if cfg.norm_adv and len(whole_adv) > 1:
            adv = (adv - whole_adv.mean()) / (whole_adv.std() + 1e-8)
        pg_loss, pg_metrics = ppo_policy_loss(
            logprob=logprob,
            old_logprob=minibatch.behaviour_logprob(level),
            advantages=broadcast(adv, logprob),
            clip_low=cfg.clip_coef,
            clip_high=cfg.clip_coef_high,
            mask=minibatch.mask(level),
            prox_logprob=minibatch.prox_logprob,
            behaviour_weight_cap=cfg.behaviour_weight_cap,
            count=minibatch.mean_count(level),
        )
        per_row = minibatch.mean_count(None)
        v_loss, v_metrics = value_loss(
            values=value,
            returns=minibatch.returns,
            old_values=minibatch.values,
            clip=cfg.vf_clip,
            count=per_row,
            whole_returns=whole.returns,
            whole_old_values=whole.values,
        )
        ent_loss, ent_metrics = entropy(entropies=ent, count=per_row)
        loss = pg_loss - cfg.ent_coef * ent_loss + cfg.vf_coef * v_loss
        return loss, {**pg_metrics, **v_metrics, **ent_metrics, "loss/total": loss.detach()}

    def stop_early(self, last_minibatch: dict[str, float]) -> bool:
        target = self.cfg.target_kl
        return target is not None and last_minibatch["policy/approx_kl"] > target
