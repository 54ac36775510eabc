"""Policies behind the contract."""

from embodied.schema import EnvSpec
from embodied.models.actor_critic import ActorCritic, ActorCriticConfig
from embodied.models.normalization import RunningNorm
from embodied.models.vla import VLA, VLAConfig

POLICIES = {"actor_critic": (ActorCriticConfig, ActorCritic), "vla": (VLAConfig, VLA)}


def build_policy(spec: EnvSpec, cfg):
    """Instantiate the policy named by ``cfg.name`` for an environment ``spec``."""
    if cfg.name not in POLICIES:
        raise ValueError(f"unknown policy {cfg.name!r}; known: {sorted(POLICIES)}")
    return POLICIES[cfg.name][1](spec, cfg)


__all__ = ["ActorCritic", "ActorCriticConfig", "POLICIES", "RunningNorm", "VLA", "VLAConfig", "build_policy"]
