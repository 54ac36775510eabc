"""The base of every policy config: ``name`` selects the policy (and its config dataclass) in
``embodied.models.POLICIES``; a config file's ``policy.name`` picks which schema validates the
rest."""

from dataclasses import dataclass


@dataclass
class PolicyConfig:
    name: str = ""
