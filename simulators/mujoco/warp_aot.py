"""Warp's CUDA kernels compiled on a machine without a GPU, into a kernel cache that a GPU machine
then loads instead of compiling (``python -m embodied.simulators.mujoco.warm --cuda-cache DIR``).

Warp compiles a module when a launch first needs it. Its cache folder is named by a hash of the
module's kernels at that moment and of the launch's block size, and Warp's CPU device runs every
block at size 1. So no list of modules says what a GPU run loads; the run does. This runs the
same scenes on Warp's CPU device and, after every launch, compiles the launched module for CUDA as
it stands then, with the block size the launch asked for.

Which file a GPU looks for (warp-lang 1.12.0, ``Device.get_cuda_compile_arch``): with
``warp.config.cuda_output = "cubin"``, which ``require_warp`` sets, a binary for the GPU's own
architecture (sm_90 on an H100 or H200, sm_80 on an A100), loaded as it is. (Left to choose, Warp
would look for PTX where the driver is newer than its CUDA 12.9, for the lowest architecture among
the machine's GPUs, and the driver would compile that at every load on a fresh machine.)"""

from __future__ import annotations

import contextlib
import inspect
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from embodied.simulators.mujoco.warp_setup import require_warp

ARCHS = (90,)  # H100 and H200, the GPUs this project is measured on


@dataclass
class CudaCache:
    """What ``compiling_for_cuda`` wrote: one entry per module state, block size and arch."""

    folder: Path
    archs: tuple[int, ...]  # the GPU architectures built for
    compiled: list[str] = field(default_factory=list)  # "module folder @ block size for sm_N"
    already_there: int = 0  # entries found in the folder from an earlier build
    failed: list[str] = field(default_factory=list)  # entries whose compile raised (a GPU does it)
    seconds: float = 0.0  # spent compiling for CUDA


@contextlib.contextmanager
def compiling_for_cuda(folder: str | Path, archs: Sequence[int] = ARCHS) -> Iterator[CudaCache]:
    """While open, every Warp launch (on any device) also compiles its module for CUDA into
    ``folder``, as a binary (cubin) for each of ``archs``. Launches are intercepted by wrapping
    ``warp.launch`` and ``warp.launch_tiled``, the two entry points MuJoCo Warp and this package
    call: Warp has no hook that names the modules a launch loads with the block size it loads
    them for."""
    warp, _ = require_warp()
    cache = CudaCache(folder=Path(folder), archs=tuple(archs))
    cache.folder.mkdir(parents=True, exist_ok=True)
    builder = _CudaBuilder(warp, cache)
    originals = {"launch": warp.launch, "launch_tiled": warp.launch_tiled}
    warp.launch = builder.intercepting(originals["launch"])
    warp.launch_tiled = builder.intercepting(originals["launch_tiled"])
    try:
        yield cache
    finally:
        warp.launch = originals["launch"]
        warp.launch_tiled = originals["launch_tiled"]


class _CudaBuilder:
    """Compiles each module state a launch loads for CUDA, once per block size and arch, into
    ``cache.folder``, and notes each in ``cache``."""

    def __init__(self, warp, cache: CudaCache):
        from warp._src.context import launch as warp_launch  # noqa: PLC0415 (launch_tiled's too)

        self.warp = warp
        self.cache = cache
        self.signature = inspect.signature(warp_launch)
        self.seen: set[tuple[str, int, int]] = set()  # (module folder, block size, arch)

    def intercepting(self, launch):
        """``launch``, then the compile of the module it launched, for the block size it asked."""

        def launch_and_compile(*args, **kwargs):
            result = launch(*args, **kwargs)
            bound = self.signature.bind(*args, **kwargs)
            bound.apply_defaults()
            self.compile_module(bound.arguments["kernel"].module, bound.arguments["block_dim"])
            return result

        return launch_and_compile

    def compile_module(self, module, block_dim: int) -> None:
        launched_at = module.options["block_dim"]  # 1 on Warp's CPU device
        module.options["block_dim"] = block_dim
        try:
            name = module.get_module_identifier()
            for arch in self.cache.archs:
                if (name, block_dim, arch) not in self.seen:
                    self.seen.add((name, block_dim, arch))
                    self.compile_for(module, name, f"{name} @ {block_dim} for sm_{arch}", arch)
        finally:
            module.options["block_dim"] = launched_at

    def compile_for(self, module, name: str, entry: str, arch: int) -> None:
        cache = self.cache
        folder = cache.folder / name
        built = [folder / f"{name}.{suffix}" for suffix in (f"sm{arch}.cubin", "meta")]
        if all(path.exists() for path in built):
            cache.already_there += 1
            return
        start = time.perf_counter()
        try:
            self.warp.compile_aot_module(module, arch=arch, module_dir=folder, use_ptx=False)
        except Exception as error:  # (a miss costs the GPU the compile it would have done anyway)
            cache.failed.append(entry)
            print(f"warp_aot: {entry} not compiled: {error!r}", file=sys.stderr, flush=True)
            return
        finally:
            cache.seconds += time.perf_counter() - start
        cache.compiled.append(entry)
