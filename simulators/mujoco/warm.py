"""Compile MuJoCo Warp's kernels for every MuJoCo task and its renderer into Warp's kernel cache,
once, so that neither a test nor a run pays the compile (a minute or two on a 2-core CPU).
``python -m embodied.simulators.mujoco.warm [--device cpu|cuda] [--cuda-cache DIR]``;
scripts/setup.sh runs it. Each task's time is printed with the modules Warp compiled for it:
none once they are in the cache. ``--cuda-cache DIR`` also compiles the CUDA kernels, on a machine
without a GPU, into DIR: a kernel cache for a GPU machine (``WARP_CACHE_PATH=DIR`` there)."""

from __future__ import annotations

import argparse
import contextlib
import sys
import time

import torch

from embodied.simulators.mujoco import TASKS, MuJoCoConfig, make_env
from embodied.simulators.mujoco.warp_setup import cache_entries, require_warp


def warm(device: str) -> None:
    """Step every task once, and render both cameras of a scene, on ``device``."""
    common = {"num_envs": 2, "backend": "warp", "device": device}
    scenes = [MuJoCoConfig(task=task, **common) for task in sorted(TASKS)]
    cameras = ["base_camera", "wrist_camera"]  # the ray-cast renderer's kernels
    scenes.append(MuJoCoConfig(task="push", obs_mode="rgb", cameras=cameras, **common))
    for cfg in scenes:
        start = time.perf_counter()
        before = cache_entries(device)
        with make_env(cfg) as env:
            env.reset(seed=0)
            if cfg.obs_mode == "state":
                env.step(torch.zeros(2, len(env.spec.action.names)))
        what = cfg.task if cfg.obs_mode == "state" else "renderer"
        seconds = time.perf_counter() - start
        compiled = cache_entries(device) - before
        print(
            f"MuJoCo Warp {what} on {device}: ready in {seconds:.1f} s "
            f"({compiled} modules compiled for {device})",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu (Warp's CPU device) or cuda")
    parser.add_argument(
        "--cuda-cache", metavar="DIR", help="also compile the CUDA kernels into DIR (no GPU needed)"
    )
    parser.add_argument(
        "--cuda-arch",
        help="with --cuda-cache: the GPUs' architectures, comma-separated (H100, H200: 90)",
    )
    args = parser.parse_args()
    if args.cuda_arch is not None and not args.cuda_cache:
        parser.error("--cuda-arch: only with --cuda-cache DIR (it names the GPUs to build for)")
    if args.cuda_cache and args.device != "cpu":
        sys.exit("warm: --cuda-cache compiles on Warp's CPU device; leave out --device")
    building = contextlib.nullcontext(None)
    if args.cuda_cache:
        from embodied.simulators.mujoco.warp_aot import compiling_for_cuda

        building = compiling_for_cuda(args.cuda_cache, cuda_archs(parser, args.cuda_arch or "90"))
    with building as cuda:
        warm(args.device)
    if cuda is not None:
        archs = ", ".join(f"sm_{arch}" for arch in cuda.archs)
        print(
            f"CUDA kernels (binaries for {archs}) in {cuda.folder}: {len(cuda.compiled)} compiled "
            f"in {cuda.seconds:.0f} s, {cuda.already_there} already there, {len(cuda.failed)} "
            "failed",
            flush=True,
        )
        if cuda.failed:  # (a cache a GPU would compile anyway is no cache to carry)
            sys.exit(f"warm: {len(cuda.failed)} CUDA modules did not compile (above)")


def cuda_archs(parser: argparse.ArgumentParser, text: str) -> list[int]:
    """--cuda-arch's architectures, each one that the NVRTC in Warp's wheel compiles for."""
    require_warp()  # (initialised: NVRTC's list is known)
    from warp._src.context import runtime  # noqa: PLC0415 (pinned warp-lang)

    supported = sorted(runtime.nvrtc_supported_archs or [])
    try:
        archs = [int(arch) for arch in text.split(",")]
    except ValueError:
        parser.error(f"--cuda-arch: numbers such as 90 or 80,90, not {text!r}")
    unknown = [arch for arch in archs if arch not in supported]
    if unknown:
        parser.error(f"--cuda-arch: Warp's NVRTC compiles for {supported}, not {unknown}")
    return archs


if __name__ == "__main__":
    main()
