"""Pure algorithm functions (torch only): advantages and losses."""

from embodied.algorithms.advantages import gae
from embodied.algorithms.grpo import grpo_advantages, informative_groups, kl_penalty
from embodied.algorithms.losses import approx_kl, entropy, ppo_policy_loss, value_loss

__all__ = [
    "gae",
    "grpo_advantages",
    "informative_groups",
    "kl_penalty",
    "ppo_policy_loss",
    "value_loss",
    "entropy",
    "approx_kl",
]
