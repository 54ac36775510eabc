"""Warp's CUDA kernels compiled on a machine without a GPU, into a kernel cache that a GPU machine
then loads instead of compiling (``python -m embodied.simulators.mujoco.warm --cuda-cache DIR``).

Warp compiles a module when a launch first needs it. Its cache folder is named by a hash of the
module's kernels at that moment and of the launch's block size, and Warp's CPU device runs every
block at size 1. So no list of modules says what a GPU run loads; the run does. This runs the
same scenes on Warp's CPU device and, after every launch, compiles the launched module for CUDA as
it stands then, with the block size the launch asked for.

A GPU loads what this writes where its driver is at least Warp's CUDA toolkit (12.9 for warp-lang
1.12.0): there Warp asks for PTX of its default PTX architecture (sm_75), which the driver turns
into the GPU's own code at load. An older driver asks for a binary of the GPU's architecture and
compiles as before."""

from __future__ import annotations

import contextlib
import inspect
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from embodied.simulators.mujoco.warp_setup import require_warp


@dataclass
class CudaCache:
    """What ``compiling_for_cuda`` wrote: one entry per module state and block size."""

    folder: Path
    arch: int  # the PTX architecture a GPU asks for (Warp's default: 75)
    compiled: list[str] = field(default_factory=list)  # "module folder @ block size"
    already_there: int = 0  # entries found in the folder from an earlier build
    seconds: float = 0.0  # spent compiling for CUDA


@contextlib.contextmanager
def compiling_for_cuda(folder: str | Path) -> Iterator[CudaCache]:
    """While open, every Warp launch (on any device) also compiles its module for CUDA into
    ``folder``. Launches are intercepted by wrapping ``warp.launch`` and ``warp.launch_tiled``,
    the two entry points MuJoCo Warp and this package call: Warp has no hook that names the
    modules a launch loads together with the block size it loads them for."""
    warp, _ = require_warp()
    from warp._src.context import runtime  # noqa: PLC0415 (pinned warp-lang: its default arch)

    cache = CudaCache(folder=Path(folder), arch=runtime.default_ptx_arch)
    cache.folder.mkdir(parents=True, exist_ok=True)
    seen: set[tuple[str, int]] = set()
    originals = {"launch": warp.launch, "launch_tiled": warp.launch_tiled}

    signature = inspect.signature(warp.launch)  # launch_tiled takes launch's arguments

    def intercepting(launch):
        def launch_and_compile(*args, **kwargs):
            result = launch(*args, **kwargs)
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            compile_module(bound.arguments["kernel"].module, bound.arguments["block_dim"])
            return result

        return launch_and_compile

    def compile_module(module, block_dim: int) -> None:
        launched_at = module.options["block_dim"]  # 1 on Warp's CPU device
        module.options["block_dim"] = block_dim
        try:
            name = module.get_module_identifier()
            if (name, block_dim) in seen:
                return
            seen.add((name, block_dim))
            if (cache.folder / name / f"{name}.sm{cache.arch}.ptx").exists():
                cache.already_there += 1
                return
            start = time.perf_counter()
            warp.compile_aot_module(
                module, arch=cache.arch, module_dir=cache.folder / name, use_ptx=True
            )
            cache.seconds += time.perf_counter() - start
            cache.compiled.append(f"{name} @ {block_dim}")
        finally:
            module.options["block_dim"] = launched_at

    warp.launch = intercepting(originals["launch"])
    warp.launch_tiled = intercepting(originals["launch_tiled"])
    try:
        yield cache
    finally:
        warp.launch = originals["launch"]
        warp.launch_tiled = originals["launch_tiled"]
