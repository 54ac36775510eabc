"""GRPO with outcome rewards (episode success) for chunked policies: DAPO-style dynamic sampling
and clip-higher, an optional KL penalty to the initial policy, no critic.

Each round resets the environments in groups of M that share a reset seed (the same initial
state). Groups never span tasks: each task's environments form floor(n / M) groups, and the
leftover environments of a task run unseen by the update (group -1). Every environment runs one
counted episode (chunks of K actions, T = ceil(max_episode_steps / K) chunks). An episode's
outcome is whether it succeeded at some step. Groups whose members all succeeded or all failed
are dropped (dynamic sampling) and more rounds are collected until ``groups_per_batch``
informative groups are in hand or ``max_rounds`` is reached. Every chunk of a kept episode shares
the episode's group-normalised advantage. Outcomes, groups and masks come from the rollout's
``episode_id``, ``group_id``, ``success`` and ``valid`` fields.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from embodied.algorithm import (
    AlgorithmConfig,
    broadcast,
    check_behaviour_weight_cap,
    check_clipping,
    check_level,
    in_pieces,
    mean_over_rounds,
)
from embodied.algorithms import (
    grpo_advantages,
    informative_groups,
    kl_penalty,
    masked_mean,
    ppo_policy_loss,
)
from embodied.learner import TrainEngine
from embodied.rollout import CollectPlan, RolloutBatch, Samples, logprob_at


@dataclass
class GRPOConfig(AlgorithmConfig):
    """GRPO hyper-parameters. No critic."""

    # the bounds .inf turns off (config.py: any other float must be finite)
    INFINITE: ClassVar[tuple[str, ...]] = (
        "clip_coef",
        "clip_coef_high",
        "behaviour_weight_cap",
        "max_grad_norm",
    )

    name: str = "grpo"
    group_size: int = 8  # M episodes per group, all reset with the same seed
    groups_per_batch: int = 2  # informative groups wanted per update
    max_rounds: int = 4  # collection rounds per update while too few groups are informative
    dynamic_sampling: bool = True  # drop groups whose members all succeeded or all failed
    scale_by_std: bool = True  # False: Dr. GRPO (no division by the group's std)
    # where the PPO ratio is taken: chunk (one ratio over K*A dimensions: clips at the smallest
    # change) | action | token
    logprob_level: str = "action"
    learning_rate: float = 2e-5
    anneal_lr: bool = False  # linearly to 0 over total_env_steps
    update_epochs: int = 2
    num_minibatches: int = 2
    clip_coef: float = 0.2
    clip_coef_high: float | None = 0.28  # DAPO clip-higher
    # decoupled PPO (cluster.max_staleness > 0): entries whose behaviour weight pi_prox / pi_old
    # exceeds this are left out of the loss (AReaL's filter; at logprob_level chunk the weight is
    # a product over K x A dimensions, so watch policy/behaviour_filtered); null: no cap
    behaviour_weight_cap: float | None = 5.0
    kl_coef: float = 0.0  # > 0: penalty KL(pi || initial policy), k3 estimator
    max_grad_norm: float = 1.0

    def validate(self) -> None:
        if self.group_size < 2:
            raise ValueError(f"group_size: must be >= 2, got {self.group_size}")
        check_level(self.logprob_level)
        check_behaviour_weight_cap(self.behaviour_weight_cap)
        check_clipping(self.clip_coef, self.clip_coef_high, self.max_grad_norm)
        for key in ("groups_per_batch", "max_rounds", "update_epochs", "num_minibatches"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key}: must be >= 1, got {getattr(self, key)}")
        if self.learning_rate <= 0:
            raise ValueError(f"learning_rate: must be > 0, got {self.learning_rate}")
        if self.kl_coef < 0:
            raise ValueError(f"kl_coef: must be >= 0, got {self.kl_coef}")

    def check_with(self, policy, env) -> None:
        super().check_with(policy, env)
        tasks = len(getattr(env, "tasks", None) or []) or 1
        per_task = env.num_envs // tasks
        if per_task < self.group_size:
            raise ValueError(
                f"algorithm.group_size: groups of {self.group_size} need that many environments "
                f"per task, and each task has {per_task} (env.num_envs={env.num_envs} over "
                f"{tasks} task(s))"
            )
        most = tasks * (per_task // self.group_size) * self.max_rounds
        if self.groups_per_batch > most:  # (every update ran max_rounds, on fewer, unsaid)
            raise ValueError(
                f"algorithm.groups_per_batch: {self.groups_per_batch} groups, but an update's "
                f"{self.max_rounds} rounds (algorithm.max_rounds) give at most {most}"
            )

    def keeps_reference(self) -> bool:
        return self.kl_coef > 0

    def build(self, cfg, spec, task_of_env: torch.Tensor, policy=None) -> GRPO:
        return GRPO(
            self,
            seed=cfg.seed,
            task_of_env=task_of_env,
            chunk_size=cfg.policy.chunk_size,
            max_episode_steps=spec.max_episode_steps,
            policy=policy,
        )


def groups_by_task(task_of_env: torch.Tensor, group_size: int) -> torch.Tensor:
    """Group of each environment, long [B]: each task's environments (in order) in groups of
    ``group_size``, numbered across tasks; -1 for a task's leftover environments."""
    group_of_env = torch.full_like(task_of_env, -1)
    next_group = 0
    for task in task_of_env.unique().tolist():
        envs = (task_of_env == task).nonzero().squeeze(1)  # long [n]
        whole = len(envs) // group_size * group_size
        groups = torch.arange(whole // group_size).repeat_interleave(group_size)
        group_of_env[envs[:whole]] = groups + next_group
        next_group += whole // group_size
    return group_of_env


class GRPO:
    has_critic = False
    evaluates_before = True  # (it fine-tunes a trained policy: success before RL is the baseline)

    def __init__(
        self,
        cfg: GRPOConfig,
        *,
        seed: int,
        task_of_env: torch.Tensor,
        chunk_size: int,
        max_episode_steps: int,
        policy: torch.nn.Module | None = None,
    ):
        self.cfg = cfg
        self.seed = seed
        self.max_rounds = cfg.max_rounds
        self.group_of_env = groups_by_task(task_of_env, cfg.group_size)  # long [B], CPU
        self.num_groups = int(self.group_of_env.max()) + 1
        if self.num_groups < 1:
            raise ValueError(
                f"algorithm.group_size={cfg.group_size}: no task has that many environments "
                f"(env.num_envs={len(task_of_env)} over {len(task_of_env.unique())} task(s))"
            )
        self.idle_envs = int((self.group_of_env < 0).sum())  # leftovers: run, never trained on
        self.num_chunks = math.ceil(max_episode_steps / chunk_size)  # one episode per env
        # the KL penalty's reference: the policy's weights as they start
        self.policy = policy
        self.reference = None
        if cfg.kl_coef > 0 and policy is not None:
            self.reference = copy.deepcopy(policy).eval().requires_grad_(False)

    def plan(self, iteration: int, round_index: int, episode_base: int) -> CollectPlan:
        """Fresh initial states every round: group g of round r of iteration i gets seed
        seed + ((i - 1) * max_rounds + r) * S + g, where S = groups + idle environments are the
        seeds a round uses (idle environments get seeds of their own). Consecutive rounds take
        consecutive seeds, so a simulator with a finite set of initial states (LIBERO's 50, seed
        % 50) meets them all; steps of B met 10 of 50 at env.num_envs=10 in groups of 5."""
        seeds_per_round = self.num_groups + self.idle_envs
        base = self.seed + ((iteration - 1) * self.max_rounds + round_index) * seeds_per_round
        idle = (self.group_of_env < 0).cumsum(0) + self.num_groups - 1  # long [B]
        seeds = base + torch.where(self.group_of_env >= 0, self.group_of_env, idle)
        # group ids stay distinct across the rounds of one update
        offset = round_index * self.num_groups
        group_of_env = torch.where(self.group_of_env >= 0, self.group_of_env + offset, -1)
        return CollectPlan(
            seeds=seeds.tolist(),
            group_of_env=group_of_env,
            num_chunks=self.num_chunks,
            episode_base=episode_base,
        )

    def advantages(self, batch: RolloutBatch) -> dict[str, torch.Tensor]:
        """Outcome per episode from its chunks (success within the valid actions), advantages
        per group, mapped back to every chunk of the episode through ``episode_id``."""
        member = batch.group_id >= 0  # bool [T, B]: chunks of counted episodes
        chunk_success = (batch.success & batch.valid).any(-1)  # bool [T, B]
        chunk_ended = ((batch.terminated | batch.truncated) & batch.valid).any(-1)
        # a few host syncs per round (not per step): which episodes are present
        episodes, chunk_episode = torch.unique(batch.episode_id[member], return_inverse=True)
        E = len(episodes)
        outcome = torch.zeros(E, device=member.device)
        outcome = outcome.scatter_reduce(0, chunk_episode, chunk_success[member].float(), "amax")
        ended = torch.zeros(E, device=member.device)
        ended = ended.scatter_reduce(0, chunk_episode, chunk_ended[member].float(), "amax")
        group_min = batch.group_id[member].min()
        group = torch.zeros(E, dtype=torch.long, device=member.device)
        group = group.scatter(0, chunk_episode, batch.group_id[member] - group_min)
        unfinished = int(E - ended.sum())
        if unfinished:
            raise RuntimeError(
                f"{unfinished} environments did not finish an episode in {batch.valid.shape[0]} "
                "chunks; GRPO needs episodes that end (set env.max_episode_steps)"
            )
        adv, metrics = grpo_advantages(
            rewards=outcome,
            group_ids=group,
            num_groups=self.num_groups,
            scale_by_std=self.cfg.scale_by_std,
        )
        if self.cfg.dynamic_sampling:
            keep = informative_groups(rewards=outcome, group_ids=group, num_groups=self.num_groups)
        else:
            keep = torch.ones(self.num_groups, dtype=torch.bool, device=member.device)
        batch.advantages = torch.zeros(member.shape, device=member.device)
        batch.advantages[member] = adv[chunk_episode]
        batch.sample_mask = torch.zeros_like(member)
        batch.sample_mask[member] = keep[group][chunk_episode]
        metrics["grpo/kept_groups"] = keep.sum()
        metrics["grpo/episode_success"] = outcome.mean()
        return metrics

    def enough(self, metrics: list[dict[str, torch.Tensor]]) -> bool:
        kept = int(sum(m["grpo/kept_groups"] for m in metrics))  # one sync per round
        return kept >= self.cfg.groups_per_batch

    def collected(self, rounds: list[dict[str, torch.Tensor]]) -> dict[str, float]:
        metrics = mean_over_rounds(rounds, summed=("grpo/kept_groups",))
        metrics["grpo/rounds"] = len(rounds)
        return metrics

    def notes(self) -> list[str]:
        if not self.idle_envs:
            return []
        return [
            f"GRPO: {self.idle_envs} environment(s) fill no group of {self.cfg.group_size} "
            "within their task and are not trained on"
        ]

    @torch.no_grad()
    def prepare(self, samples: Samples, learner: TrainEngine | None = None) -> None:
        """Reference log-probabilities (KL penalty), once per batch, in minibatch-sized pieces."""
        if self.reference is None:
            return
        # the reference keeps its weights but sees observations as the policy does now: the
        # normalisation statistics (buffers) are the observation pipeline's, not the weights'
        live = dict(self.policy.named_buffers())
        for name, buffer in self.reference.named_buffers():
            buffer.copy_(live[name])
        level = self.cfg.logprob_level

        def reference_logprob(piece: Samples) -> torch.Tensor:
            token, _, _ = self.reference.evaluate(piece.obs, piece.output, level="token")
            return logprob_at(token, level, piece.valid)

        num_minibatches = self.cfg.num_minibatches
        samples.ref_logprob = in_pieces(samples, num_minibatches, reference_logprob, learner)

    def loss(self, learner: TrainEngine, minibatch: Samples):
        cfg = self.cfg
        level = cfg.logprob_level
        logprob, ent, _ = learner.logprob(minibatch, level)
        old_logprob = minibatch.behaviour_logprob(level)
        mask = minibatch.mask(level)
        count = minibatch.mean_count(level)  # None unless a data-parallel rank's share
        loss, metrics = ppo_policy_loss(
            logprob=logprob,
            old_logprob=old_logprob,
            advantages=broadcast(minibatch.advantages, logprob),
            clip_low=cfg.clip_coef,
            clip_high=cfg.clip_coef_high,
            mask=mask,
            prox_logprob=minibatch.prox_logprob,
            behaviour_weight_cap=cfg.behaviour_weight_cap,
            count=count,
        )
        if minibatch.ref_logprob is not None:
            kl, kl_metrics = kl_penalty(
                logprob=logprob,
                ref_logprob=minibatch.ref_logprob,
                old_logprob=old_logprob,
                mask=mask,
                count=count,
                prox_logprob=minibatch.prox_logprob,
                behaviour_weight_cap=cfg.behaviour_weight_cap,
            )
            loss = loss + cfg.kl_coef * kl
            metrics.update(kl_metrics)
        metrics["policy/entropy"] = masked_mean(ent.detach(), None, minibatch.mean_count(None))
        return loss, metrics

    def stop_early(self, last_minibatch: dict[str, float]) -> bool:
        return False
