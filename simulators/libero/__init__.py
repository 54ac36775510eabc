"""LIBERO (hf-libero on robosuite/MuJoCo) through the contract: every task of the spatial, object,
goal, 10 and 90 suites, evaluated from the suites' fixed initial states. ``LiberoCore`` imports
LIBERO on first use, so the config validates without it."""

from embodied.simulators.libero.config import SUITES, LiberoConfig


def __getattr__(name: str):
    if name == "LiberoCore":
        from embodied.simulators.libero.core import LiberoCore

        return LiberoCore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["LiberoConfig", "LiberoCore", "SUITES"]
