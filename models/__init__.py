"""Policies behind the contract."""

from embodied.schema import EnvSpec
from embodied.models.actor_critic import ActorCritic, ActorCriticConfig
from embodied.models.normalization import RunningNorm

POLICIES = {"actor_critic": (ActorCriticConfig, ActorCritic)}


def build_policy(spec: EnvSpec, cfg) -> ActorCritic:
    """Instantiate the policy named by ``cfg.name`` for an environment ``spec``."""
    if cfg.name not in POLICIES:
        raise ValueError(f"unknown policy {cfg.name!r}; known: {sorted(POLICIES)}")
    return POLICIES[cfg.name][1](spec, cfg)


__all__ = ["ActorCritic", "ActorCriticConfig", "POLICIES", "RunningNorm", "build_policy"]
