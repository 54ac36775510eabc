"""Compile MuJoCo Warp's kernels for every MuJoCo task and its renderer into Warp's kernel cache,
once, so that neither a test nor a run pays the compile (a minute or two on a 2-core CPU).
``python -m embodied.simulators.mujoco.warm [--device cpu|cuda]``; scripts/setup.sh runs it.
Each task's time is printed: a compile the first time, a load from the cache after that."""

from __future__ import annotations

import argparse
import time

import torch

from embodied.simulators.mujoco import TASKS, MuJoCoConfig, make_env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu (Warp's CPU device) or cuda")
    args = parser.parse_args()
    for task in sorted(TASKS):
        start = time.perf_counter()
        cfg = MuJoCoConfig(task=task, num_envs=2, backend="warp", device=args.device)
        with make_env(cfg) as env:
            env.reset(seed=0)
            env.step(torch.zeros(2, len(env.spec.action.names)))
        print(f"MuJoCo Warp {task} on {args.device}: ready in {time.perf_counter() - start:.1f} s")
    start = time.perf_counter()  # the ray-cast renderer's kernels: both cameras of a scene
    cameras = ["base_camera", "wrist_camera"]
    cfg = MuJoCoConfig(
        task="push", num_envs=2, backend="warp", device=args.device, obs_mode="rgb", cameras=cameras
    )
    with make_env(cfg) as env:
        env.reset(seed=0)
    print(f"MuJoCo Warp renderer on {args.device}: ready in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
