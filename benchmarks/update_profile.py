"""Where a PPO update's time goes, at the GPU suite's learning size.

At the third visit (H100, push on the warp backend, 4096 worlds x 16 steps) an update took
0.28 s for 16 gradient steps of the MLP actor-critic, 70% of an iteration, while the rollout of
its 65,536 env steps took 0.12 s: the update bounds wall-clock to 0.9 more than the simulator.
This collects one round as the runner does (the warp config, ``--task``, ``--worlds``,
``--steps``) and updates on it ``--repeats`` times (the weights move on; the work is the same),
then prints:

- the update's seconds (median), its gradient steps and milliseconds per gradient step;
- on CUDA, the update's host syncs by line (``torch.cuda.set_sync_debug_mode``);
- torch's profile of one more update, per gradient step: top-level operators, kernels and
  their time, the costliest kernels (benchmarks/kernel_profile.py). Kernel time far below
  the milliseconds per step says the update waits on the host: launches, syncs, Python.

    python benchmarks/update_profile.py --device cuda --worlds 4096 --steps 16
    python benchmarks/update_profile.py --device cpu --worlds 16 --steps 16   # here
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_throughput import wait  # noqa: E402
from host_syncs import counted, sites_text  # noqa: E402
from kernel_profile import StepProfile, profile_text, profiled  # noqa: E402

CONFIG = "configs/mujoco_warp/so101_pick_ppo.yaml"


def build(args):
    """(config, roles) of a run of the warp config at the given size."""
    from embodied.config import load_config
    from embodied.multitask import make_env
    from embodied.roles import local_roles
    from embodied.train_config import TrainConfig

    overrides = [
        f"env.task={args.task}",
        f"env.device={args.device}",
        f"env.num_envs={args.worlds}",
        f"algorithm.num_steps={args.steps}",
        # every epoch runs: the per-step figures divide by them (the repeats update on one batch,
        # so its KL grows, and an early stop after one epoch read 4x too cheap)
        "algorithm.target_kl=null",
        *([f"algorithm.num_minibatches={args.minibatches}"] if args.minibatches else []),
    ]
    root = Path(__file__).resolve().parents[1]
    cfg, _ = load_config(TrainConfig, root / CONFIG, overrides)
    env = make_env(cfg.env)
    try:
        return cfg, local_roles(cfg, env)
    except BaseException:
        env.close()
        raise


def one_round(cfg, roles):
    """A round collected as the runner collects it (seeded reset, the whole round)."""
    from embodied.episode_stats import EpisodeStats
    from embodied.rollout import CollectPlan

    B = roles.envs.num_envs
    stats = EpisodeStats(roles.envs.task_names, roles.inference.device)  # (as the runner)
    plan = CollectPlan(
        seeds=cfg.seed,
        group_of_env=torch.full((B,), -1),
        num_chunks=cfg.algorithm.num_steps,
        episode_base=0,
    )
    return roles.collect(roles.envs.reset(seed=cfg.seed), plan, stats)


def timed_update(learner, batch, device: torch.device) -> float:
    """Seconds of one update on ``batch``, as the runner times it (advantages not included)."""
    learner.add_round(batch)
    wait(device)
    start = time.perf_counter()
    learner.update()
    wait(device)
    return time.perf_counter() - start


def measure(cfg, roles, repeats: int) -> dict:
    learner = roles.learner
    device = learner.device
    batch = one_round(cfg, roles)
    gradient_steps = cfg.algorithm.update_epochs * cfg.algorithm.num_minibatches
    timed_update(learner, batch, device)  # warm-up: cuBLAS handles, the allocator's pools
    seconds = [timed_update(learner, batch, device) for _ in range(repeats)]
    median = statistics.median(seconds)
    row = {
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "task": cfg.env.task,
        "worlds": cfg.env.num_envs,
        "steps": cfg.algorithm.num_steps,
        "samples": cfg.env.num_envs * cfg.algorithm.num_steps,
        "gradient_steps": gradient_steps,  # (all of them: target_kl is off)
        "update_s_per_repeat": seconds,
        "update_s": median,
        "ms_per_gradient_step": 1000 * median / gradient_steps,
        "sync_sites": None,
    }
    if device.type == "cuda":
        learner.add_round(batch)
        _, sites = counted(learner.update)
        row["sync_sites"] = dict(sites)
    learner.add_round(batch)
    row["profile"] = asdict(profiled(learner.update, gradient_steps, device))
    return row


def report(row: dict) -> str:
    lines = [
        f"update of {row['samples']:,} samples ({row['worlds']} worlds x {row['steps']} steps, "
        f"{row['task']}, {row['device']}): {row['update_s']:.3f} s, {row['gradient_steps']} "
        f"gradient steps, {row['ms_per_gradient_step']:.2f} ms each",
    ]
    if row["sync_sites"] is not None:
        lines.append(f"host syncs of an update by line: {sites_text(Counter(row['sync_sites']))}")
    lines.append(profile_text("per gradient step", StepProfile(**row["profile"])))
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--task", default="push")
    p.add_argument("--worlds", type=int, default=4096)
    p.add_argument("--steps", type=int, default=16, help="control steps a round")
    p.add_argument("--minibatches", type=int, default=0, help="0: the config's")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", help="append the row here (JSON lines)")
    args = p.parse_args()
    if args.repeats < 1:
        p.error(f"--repeats: at least 1, got {args.repeats}")
    cfg, roles = build(args)
    try:
        row = measure(cfg, roles, args.repeats)
    finally:
        roles.close()
    print(report(row), flush=True)
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
