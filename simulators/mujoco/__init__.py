"""MuJoCo table-top tasks with a desktop arm written here (SO-100/SO-101 class), through the
contract. ``MuJoCoEnv`` imports mujoco on first use, so the config validates without it."""

from embodied.simulators.mujoco.config import MuJoCoConfig
from embodied.simulators.mujoco.tasks import TASKS


def __getattr__(name: str):
    if name == "MuJoCoEnv":
        from embodied.simulators.mujoco.env import MuJoCoEnv

        return MuJoCoEnv
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["MuJoCoConfig", "MuJoCoEnv", "TASKS"]
