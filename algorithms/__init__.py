"""Pure algorithm functions (torch only): advantages and losses."""

from embodied.algorithms.advantages import chunk_returns, gae
from embodied.algorithms.grpo import grpo_advantages, informative_groups, kl_penalty
from embodied.algorithms.losses import (
    approx_kl,
    entropy,
    masked_mean,
    ppo_policy_loss,
    value_loss,
)

__all__ = [
    "approx_kl",
    "chunk_returns",
    "entropy",
    "gae",
    "grpo_advantages",
    "informative_groups",
    "kl_penalty",
    "masked_mean",
    "ppo_policy_loss",
    "value_loss",
]
