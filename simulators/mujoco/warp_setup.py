"""Importing MuJoCo Warp for ``env.backend=warp``: the pinned Warp, the device, the kernel cache.

Nothing here imports Warp at module level: only a config that chooses the warp backend does."""

from __future__ import annotations

import time
from types import ModuleType

import torch

from embodied.schema import UserError

# mujoco-warp 3.8.1 asks warp-lang >= 1.12, but its sensor kernels fail to compile with 1.19.0
# ("Referencing undefined symbol: xmat"); 1.12.0 compiles them.
WARP_VERSION = "1.12.0"
MUJOCO_WARP_VERSION = "3.8.1"
_COMPILED: set[str] = set()  # the scenes whose first step was timed in this process


def require_warp() -> tuple[ModuleType, ModuleType]:
    """(warp, mujoco_warp), or a one-line UserError saying what to install."""
    try:
        import warp
    except ImportError:
        raise UserError(
            "env.backend=warp needs MuJoCo Warp: pip install 'embodied[warp]' "
            f"(mujoco-warp=={MUJOCO_WARP_VERSION} warp-lang=={WARP_VERSION})"
        ) from None
    if warp.__version__ != WARP_VERSION:
        raise UserError(
            f"env.backend=warp: warp-lang {warp.__version__} is installed, but mujoco-warp "
            f"{MUJOCO_WARP_VERSION}'s kernels compile with warp-lang {WARP_VERSION}: "
            f"pip install warp-lang=={WARP_VERSION}"
        )
    import mujoco_warp

    warp.config.quiet = True  # one line for the first compile (below), not one per module
    # the GPU's own machine code (cubin) in Warp's cache; where the driver is newer than Warp's
    # compiler Warp writes PTX, which the driver compiles again at each load on a fresh machine
    # (most likely pick's 18 s on an H100 with every module cached); warp_aot.py builds cubins
    warp.config.cuda_output = "cubin"
    warp.init()
    return warp, mujoco_warp


def torch_device(name: str) -> torch.device:
    """The torch device for ``env.device`` ("cpu" or "cuda[:N]"), or a one-line UserError."""
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(
            f"env.device={name} needs a CUDA GPU and this machine has none; "
            "use env.device=cpu (the same kernels on Warp's CPU device, for correctness)"
        )
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def timed_first_step(scene: str, step) -> None:
    """Run ``step()`` once; the first time a scene is stepped in this process, say how long it
    took when that was a compile rather than a load from Warp's kernel cache."""
    start = time.perf_counter()
    step()
    seconds = time.perf_counter() - start
    if scene not in _COMPILED and seconds > 10.0:
        import warp

        print(
            f"MuJoCo Warp: compiled the {scene} kernels in {seconds:.0f} s; they are kept in "
            f"{warp.config.kernel_cache_dir} for the next run",
            flush=True,
        )
    _COMPILED.add(scene)
