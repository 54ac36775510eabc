"""Rollout overhead: env steps/s of the framework's rollout loop vs a raw ManiSkill loop.

Side by side in one run, same task, same number of environments and worker processes:
  raw        W processes, each stepping its share of plain ManiSkill envs with random actions
             (no IPC, no policy: the upper bound the simulator allows on this machine)
  vecenv     our ManiSkillEnv (subprocess workers, lockstep) with random actions
  rollout    our full rollout loop (`embodied.rollout.collect`) with the MLP actor-critic
  pipelined  the same loop with 2 pipeline stages (policy for one half while the other simulates)
Prints a table and the ratios to raw.

    python benchmarks/rollout_overhead.py [--task PushCube-v1] [--num-envs 16] [--workers 2] [--steps 400]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import platform
import time

import torch


def _raw_worker(task: str, count: int, steps: int, control_mode: str, queue, go) -> None:
    import logging

    import gymnasium as gym
    import mani_skill.envs  # noqa: F401

    logging.getLogger("mani_skill").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    envs = [gym.make(task, num_envs=1, obs_mode="state_dict", control_mode=control_mode, reward_mode="normalized_dense",
                     sim_backend="physx_cpu").unwrapped for _ in range(count)]
    for i, e in enumerate(envs):
        e.reset(seed=i)
    queue.put("ready")
    go.wait()  # all workers start together
    t0 = time.perf_counter()
    for t in range(steps):
        for e in envs:
            e.step(torch.rand(1, e.action_space.shape[-1]) * 2 - 1)
            if t % 50 == 49:
                e.reset()
    queue.put(time.perf_counter() - t0)


def bench_raw(task: str, num_envs: int, workers: int, steps: int, control_mode: str) -> float:
    ctx = mp.get_context("spawn")
    counts = [num_envs // workers + (i < num_envs % workers) for i in range(workers)]
    queues, go = [ctx.Queue() for _ in counts], ctx.Event()
    procs = [ctx.Process(target=_raw_worker, args=(task, c, steps, control_mode, q, go)) for c, q in zip(counts, queues)]
    for p in procs:
        p.start()
    for q in queues:
        assert q.get() == "ready"
    go.set()
    elapsed = max(q.get() for q in queues)
    for p in procs:
        p.join()
    return num_envs * steps / elapsed


def bench_vecenv(env, steps: int) -> float:
    low, high = env.spec.action.bounds()
    env.reset(seed=0)
    t0 = time.perf_counter()
    for _ in range(steps):
        env.step(low + torch.rand(env.num_envs, env.spec.action.dim) * (high - low))
    return env.num_envs * steps / (time.perf_counter() - t0)


def bench_rollout(env, steps: int, stages: int = 1) -> float:
    from embodied.models import ActorCritic, ActorCriticConfig
    from embodied.rollout import EpisodeStats, collect

    policy = ActorCritic(env.spec, ActorCriticConfig())
    obs = env.reset(seed=0)
    stats = EpisodeStats.zeros(env.num_envs, env.device)
    t0 = time.perf_counter()
    collect(env, policy, obs, num_steps=steps, gamma=0.8, stats=stats, stages=stages)
    return env.num_envs * steps / (time.perf_counter() - t0)


def main() -> None:
    from embodied.simulators.maniskill import ManiSkillConfig, ManiSkillEnv

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", default="PushCube-v1")
    ap.add_argument("--num-envs", type=int, default=16)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=400, help="steps per environment per measurement")
    ap.add_argument("--control-mode", default="pd_joint_delta_pos")
    ap.add_argument("--repeats", type=int, default=2, help="alternating repeats; the best of each is reported")
    args = ap.parse_args()
    torch.set_num_threads(1)
    env = ManiSkillEnv(ManiSkillConfig(task=args.task, num_envs=args.num_envs, num_workers=args.workers,
                                       control_mode=args.control_mode))
    results = {"raw": [], "vecenv": [], "rollout": [], "pipelined": []}
    try:
        for _ in range(args.repeats):  # alternate so that machine noise hits all three alike
            results["raw"].append(bench_raw(args.task, args.num_envs, args.workers, args.steps, args.control_mode))
            results["vecenv"].append(bench_vecenv(env, args.steps))
            results["rollout"].append(bench_rollout(env, args.steps))
            results["pipelined"].append(bench_rollout(env, args.steps, stages=2))
    finally:
        env.close()
    best = {k: max(v) for k, v in results.items()}
    print(f"{args.task} state, {args.num_envs} envs, {args.workers} workers, {args.steps} steps/env, "
          f"{mp.cpu_count()} cores, {platform.processor() or platform.machine()}, torch {torch.__version__}")
    print(f"{'loop':<10}{'env steps/s':>14}{'runs':>40}")
    for k, v in results.items():
        print(f"{k:<10}{best[k]:>14.0f}{str([round(x) for x in v]):>40}")
    print(f"ratio vecenv/raw  = {best['vecenv'] / best['raw']:.3f}")
    print(f"ratio rollout/raw = {best['rollout'] / best['raw']:.3f}")
    print(f"ratio pipelined/raw = {best['pipelined'] / best['raw']:.3f}  (goal >= 0.9)")


if __name__ == "__main__":
    main()
