"""ManiSkill3 through the embodied contract."""

from embodied.simulators.maniskill.env import ManiSkillConfig, ManiSkillEnv, make_env
from embodied.simulators.maniskill.tasks import (
    INSTRUCTIONS,
    MissingAssetError,
    check_assets,
    check_control_mode,
    check_reward_mode,
    instruction_for,
)

__all__ = [
    "INSTRUCTIONS",
    "ManiSkillConfig",
    "ManiSkillEnv",
    "MissingAssetError",
    "check_assets",
    "check_control_mode",
    "check_reward_mode",
    "instruction_for",
    "make_env",
]
