"""Importing MuJoCo Warp for ``env.backend=warp``: the pinned Warp, the device, the kernel cache.

Nothing here imports Warp at module level: only a config that chooses the warp backend does."""

from __future__ import annotations

import time
from pathlib import Path
from types import ModuleType

import torch

from embodied.schema import UserError, checked_device

# mujoco-warp 3.8.1 asks warp-lang >= 1.12, but its sensor kernels fail to compile with 1.19.0
# ("Referencing undefined symbol: xmat"); 1.12.0 compiles them.
WARP_VERSION = "1.12.0"
MUJOCO_WARP_VERSION = "3.8.1"


def require_warp() -> tuple[ModuleType, ModuleType]:
    """(warp, mujoco_warp), or a one-line UserError saying what to install."""
    missing = UserError(
        "env.backend=warp needs MuJoCo Warp: pip install 'embodied[warp]' "
        f"(mujoco-warp=={MUJOCO_WARP_VERSION} warp-lang=={WARP_VERSION})"
    )
    try:
        import warp
    except ImportError:
        raise missing from None
    if warp.__version__ != WARP_VERSION:
        raise UserError(
            f"env.backend=warp: warp-lang {warp.__version__} is installed, but mujoco-warp "
            f"{MUJOCO_WARP_VERSION}'s kernels compile with warp-lang {WARP_VERSION}: "
            f"pip install warp-lang=={WARP_VERSION}"
        )
    try:  # (warp-lang alone comes with other packages)
        import mujoco_warp
    except ModuleNotFoundError as error:
        if error.name != "mujoco_warp":  # (one of its own dependencies: its message says which)
            raise
        raise missing from None

    warp.config.quiet = True  # one line for the first compile (below), not one per module
    # the GPU's own machine code (cubin) in Warp's cache; where the driver is newer than Warp's
    # compiler Warp writes PTX, which the driver compiles again at each load on a fresh machine
    # (most likely pick's 18 s on an H100 with every module cached); warp_aot.py builds cubins
    warp.config.cuda_output = "cubin"
    warp.init()
    return warp, mujoco_warp


def torch_device(name: str) -> torch.device:
    """The torch device for ``env.device`` ("cpu" or "cuda[:N]"), or a one-line UserError."""
    instead = "env.device=cpu (the same kernels on Warp's CPU device, for correctness)"
    device = checked_device("env.device", name, instead)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def cache_entries(device_type: str) -> int:
    """The modules in Warp's kernel cache built for a ``device_type`` device ("cpu": an object
    file; "cuda": a binary, or PTX where Warp chose it): a compile adds one, a load none."""
    warp, _ = require_warp()  # (initialised: its cache folder is known)
    folder = Path(warp.config.kernel_cache_dir)
    patterns = ["wp_*/*.o"] if device_type == "cpu" else ["wp_*/*.cubin", "wp_*/*.ptx"]
    return sum(1 for pattern in patterns for _ in folder.glob(pattern))


def timed_first_step(scene: str, device_type: str, step) -> None:
    """Run ``step()`` (a scene's first step: Warp loads its modules, compiling those not in its
    kernel cache); when it compiled any, say how many and how long it took."""
    before = cache_entries(device_type)
    start = time.perf_counter()
    step()
    seconds = time.perf_counter() - start
    compiled = cache_entries(device_type) - before
    if compiled > 0:
        import warp

        modules = "module" if compiled == 1 else "modules"
        print(
            f"MuJoCo Warp: compiled {compiled} {modules} of the {scene} kernels in "
            f"{seconds:.0f} s; they are kept in {warp.config.kernel_cache_dir} for the next run",
            flush=True,
        )
