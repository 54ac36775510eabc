"""ManiSkill3 through the embodied contract."""

from embodied.simulators.maniskill.core import (
    INSTRUCTIONS,
    MissingAssetError,
    check_assets,
    instruction_for,
)
from embodied.simulators.maniskill.env import (
    ManiSkillConfig,
    ManiSkillEnv,
    check_control_mode,
    check_reward_mode,
    make_env,
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
