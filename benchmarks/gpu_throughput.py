"""Simulation throughput: the raw simulator against our collect phase, side by side in one run.

``--sim mujoco_warp`` is the MuJoCo Warp backend on ``--device`` (cuda, or Warp's CPU device);
``--sim mujoco_rollout`` is ``mujoco.rollout`` on the CPU. For each number of worlds:

- raw: the simulator alone, random servo targets held for each control step (its substeps; on a
  GPU one captured CUDA graph), plus the cameras' rendering for ``--obs rgb``; no observation,
  reward, reset or policy (``env.simulate``);
- ours: the runner's collect phase (``embodied.rollout.collect``): env step (observations, reward,
  success, automatic resets), the MLP actor-critic's inference and the rollout buffers, over
  whole episodes;
- on CUDA, the host synchronisations per step of ours (``torch.cuda.set_sync_debug_mode``).

Throughput is world-steps per second (control steps x worlds). The goal (issue 32): ours/raw at
least 0.95 for state at 4096 worlds and more.

    python benchmarks/gpu_throughput.py --sim mujoco_warp --device cuda --worlds 1024,4096,16384
    python benchmarks/gpu_throughput.py --sim mujoco_warp --device cuda --obs rgb --worlds 256,1024
    python benchmarks/gpu_throughput.py --sim mujoco_warp --device cpu --worlds 32   # here
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from host_syncs import counted, sites_text  # noqa: E402


def make_env(sim: str, task: str, worlds: int, device: str, obs: str, size: int):
    from embodied.simulators.mujoco import MuJoCoConfig, make_env

    cfg = MuJoCoConfig(
        task=task,
        num_envs=worlds,
        backend="warp" if sim == "mujoco_warp" else "rollout",
        device=device if sim == "mujoco_warp" else "cpu",
        obs_mode=obs,
        image_size=size,
    )
    return make_env(cfg)


def wait(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def raw(env, steps: int) -> float:
    """World-steps/s of the simulator alone (and its cameras with rgb)."""
    from embodied.simulators.mujoco.worlds import HIGH, LOW

    low = torch.tensor(LOW, device=env.device)
    high = torch.tensor(HIGH, device=env.device)
    cameras = bool(env.spec.obs.cameras)
    env.reset(seed=0)

    def run(n: int) -> None:
        for _ in range(n):
            env.simulate(low + torch.rand(env.num_envs, len(low), device=env.device) * (high - low))
            if cameras:
                env._images()  # the rendering an rgb observation costs

    run(2)  # warm-up: kernels loaded, the CUDA graph captured
    wait(env.device)
    start = time.perf_counter()
    run(steps)
    wait(env.device)
    return steps * env.num_envs / (time.perf_counter() - start)


def ours(env, steps: int) -> tuple[float, Counter[str] | None]:
    """(world-steps/s of the collect phase, on CUDA its host syncs by line, else None)."""
    from embodied.env_group import EnvGroup
    from embodied.inference import InferencePolicy
    from embodied.models import ActorCritic, ActorCriticConfig
    from embodied.rollout import CollectPlan, EpisodeStats, collect

    envs = EnvGroup(env)
    policy = ActorCritic(env.spec, ActorCriticConfig()).to(env.device)
    inference = InferencePolicy(policy)
    plan = CollectPlan(
        seeds=0, group_of_env=torch.full((env.num_envs,), -1), num_chunks=steps, episode_base=0
    )
    stats = EpisodeStats(env.num_envs, envs.task_names, env.device)
    warm = CollectPlan(seeds=0, group_of_env=plan.group_of_env, num_chunks=2, episode_base=0)
    collect(envs, inference, envs.reset(seed=0), warm, stats)
    obs = envs.reset(seed=0)
    wait(env.device)
    start = time.perf_counter()
    collect(envs, inference, obs, plan, stats)
    wait(env.device)
    rate = steps * env.num_envs / (time.perf_counter() - start)
    if env.device.type != "cuda":
        return rate, None
    obs = envs.reset(seed=0)
    _, sites = counted(lambda: collect(envs, inference, obs, plan, stats))
    return rate, sites


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sim", choices=["mujoco_warp", "mujoco_rollout"], default="mujoco_warp")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--task", default="push")
    p.add_argument("--obs", choices=["state", "rgb"], default="state")
    p.add_argument("--image-size", type=int, default=128)
    p.add_argument("--worlds", default="1024,4096,16384", help="comma-separated world counts")
    p.add_argument("--steps", type=int, default=100, help="control steps timed per case")
    p.add_argument("--json", help="append each row here as it is measured (JSON lines)")
    args = p.parse_args()
    torch.set_grad_enabled(False)
    print(
        "| sim | device | obs | worlds | raw world-steps/s | ours world-steps/s | ours/raw | "
        "host syncs per step |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|")
    where = []  # the lines that synchronised, printed below the table
    for worlds in (int(w) for w in args.worlds.split(",")):
        env = make_env(args.sim, args.task, worlds, args.device, args.obs, args.image_size)
        try:
            raw_rate = raw(env, args.steps)
            ours_rate, sites = ours(env, args.steps)
        finally:
            env.close()
        syncs = None if sites is None else sum(sites.values()) / args.steps
        if sites is not None:
            where.append(f"- {worlds} worlds, host syncs of ours by line: {sites_text(sites)}")
        row = {
            "sim": args.sim,
            "device": str(env.device),
            "gpu": torch.cuda.get_device_name() if env.device.type == "cuda" else None,
            "task": args.task,
            "obs": args.obs,
            "image_size": args.image_size if args.obs == "rgb" else None,
            "worlds": worlds,
            "steps": args.steps,
            "raw_world_steps_per_s": raw_rate,
            "ours_world_steps_per_s": ours_rate,
            "ours_over_raw": ours_rate / raw_rate,
            "host_syncs_per_step": syncs,
            "sync_sites": None if sites is None else dict(sites),
        }
        syncs_text = "-" if syncs is None else f"{syncs:.2f}"
        print(
            f"| {args.sim} | {row['device']} | {args.obs} | {worlds} | {raw_rate:,.0f} | "
            f"{ours_rate:,.0f} | {ours_rate / raw_rate:.2f} | {syncs_text} |",
            flush=True,
        )
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(row) + "\n")
    if where:
        print("\n".join(["", *where]))


if __name__ == "__main__":
    main()
