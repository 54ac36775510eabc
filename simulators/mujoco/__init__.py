"""MuJoCo table-top tasks with a desktop arm written here (SO-100/SO-101 class), through the
contract, on two backends: ``mujoco.rollout`` (CPU) and MuJoCo Warp (``env.backend=warp``, Warp's
CPU device or a GPU). The envs import mujoco (and Warp) on first use, so the config validates
without them."""

from embodied.simulators.mujoco.config import MuJoCoConfig
from embodied.simulators.mujoco.tasks import TASKS


def make_env(cfg: MuJoCoConfig):
    """The env of ``cfg.backend``."""
    cfg.validate()
    if cfg.backend == "warp":
        from embodied.simulators.mujoco.warp_env import MuJoCoWarpEnv

        return MuJoCoWarpEnv(cfg)
    from embodied.simulators.mujoco.env import MuJoCoEnv

    return MuJoCoEnv(cfg)


def __getattr__(name: str):
    if name == "MuJoCoEnv":
        from embodied.simulators.mujoco.env import MuJoCoEnv

        return MuJoCoEnv
    if name == "MuJoCoWarpEnv":
        from embodied.simulators.mujoco.warp_env import MuJoCoWarpEnv

        return MuJoCoWarpEnv
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["MuJoCoConfig", "MuJoCoEnv", "MuJoCoWarpEnv", "TASKS", "make_env"]
