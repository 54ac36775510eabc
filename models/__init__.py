"""Policies behind the contract."""

from embodied.models.actor_critic import ActorCritic, ActorCriticConfig
from embodied.models.config import PolicyConfig
from embodied.models.normalization import RunningNorm
from embodied.models.vla import VLA, VLAConfig
from embodied.models.vla.smolvla import SmolVLA, SmolVLAConfig
from embodied.schema import EnvSpec

POLICIES = {
    "actor_critic": (ActorCriticConfig, ActorCritic),
    "vla": (VLAConfig, VLA),
    "smolvla": (SmolVLAConfig, SmolVLA),
}


def build_policy(spec: EnvSpec, cfg):
    """Instantiate the policy named by ``cfg.name`` for an environment ``spec``."""
    if cfg.name not in POLICIES:
        raise ValueError(f"unknown policy {cfg.name!r}; known: {sorted(POLICIES)}")
    return POLICIES[cfg.name][1](spec, cfg)


POLICY_CONFIGS = {name: config for name, (config, _) in POLICIES.items()}

__all__ = [
    "ActorCritic",
    "ActorCriticConfig",
    "POLICIES",
    "POLICY_CONFIGS",
    "PolicyConfig",
    "RunningNorm",
    "SmolVLA",
    "SmolVLAConfig",
    "VLA",
    "VLAConfig",
    "build_policy",
]
