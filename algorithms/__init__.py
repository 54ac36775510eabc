"""Pure algorithm functions (torch only): advantages and losses."""

from embodied.algorithms.advantages import chunk_returns, gae
from embodied.algorithms.grpo import grpo_advantages, informative_groups, kl_penalty
from embodied.algorithms.losses import (
    EXPLAINED_VARIANCE_MOMENTS,
    approx_kl,
    entropy,
    explained_variance,
    masked_mean,
    ppo_policy_loss,
    value_loss,
)

__all__ = [
    "EXPLAINED_VARIANCE_MOMENTS",
    "approx_kl",
    "chunk_returns",
    "entropy",
    "explained_variance",
    "gae",
    "grpo_advantages",
    "informative_groups",
    "kl_penalty",
    "masked_mean",
    "ppo_policy_loss",
    "value_loss",
]
