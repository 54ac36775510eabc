"""MuJoCo table-top tasks with a desktop arm written here (SO-100/SO-101 class), through the contract."""

from embodied.simulators.mujoco.env import MuJoCoConfig, MuJoCoEnv
from embodied.simulators.mujoco.tasks import TASKS

__all__ = ["MuJoCoConfig", "MuJoCoEnv", "TASKS"]
