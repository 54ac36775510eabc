"""Pure algorithm functions (torch only): advantages and losses."""

from embodied.algorithms.advantages import gae
from embodied.algorithms.losses import approx_kl, entropy, ppo_policy_loss, value_loss

__all__ = ["gae", "ppo_policy_loss", "value_loss", "entropy", "approx_kl"]
