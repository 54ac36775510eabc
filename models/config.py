"""The base of every policy config: ``name`` selects the policy (and its config dataclass) in
``embodied.models.POLICIES``; a config file's ``policy.name`` picks which schema validates the
rest."""

from dataclasses import dataclass
from typing import ClassVar


@dataclass
class PolicyConfig:
    # the policy reads camera images: the environment needs an obs_mode with cameras (checked
    # with the config, before anything is built)
    needs_cameras: ClassVar[bool] = False

    name: str = ""
    # rollouts call the policy's act through torch.compile (embodied/inference.py): its
    # operators fused into fewer kernels, fewer launches a step on a GPU; the first call of each
    # batch size compiles (11 s for the MLP on the 2-core VM, from a cold cache)
    compile_act: bool = False

    def read_privileged(self, spec) -> tuple[str, ...]:
        """The privileged keys of ``spec`` (an EnvSpec) the policy built from this config reads:
        those it names (a VLA's ``privileged_keys``); the actor-critic's rule is its own."""
        return tuple(getattr(self, "privileged_keys", None) or ())

    def has_critic(self) -> bool:
        """Whether the policy built from this config has a value head (PPO needs one)."""
        return True

    def has_gaussian(self) -> bool:
        """Whether its actions are sampled from a Gaussian with a log std (what
        ``algorithm.exploration_log_std`` sets)."""
        return True
