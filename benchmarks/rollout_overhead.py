"""Rollout overhead: env steps/s of the framework's rollout loop vs a raw ManiSkill loop.

Side by side in one run, same task, same number of environments and worker processes:
  raw        W processes, each stepping its share of plain ManiSkill envs with random actions
             (no IPC, no policy: the upper bound the simulator allows on this machine)
  vecenv     our ManiSkillEnv (subprocess workers, lockstep) with random actions
  rollout    our full rollout loop (`embodied.rollout.collect`) with the MLP actor-critic
  pipelined  the same loop with 2 pipeline stages (policy for one half while the other simulates)
With ``--workers 0`` everything runs in this one process: raw is the same plain envs stepped here,
ours is ``num_workers: 0`` (the simulator core in process, no pipes), and there is no pipelined
loop (nothing to overlap with).
The machine's speed drifts (shared VM), so the loops alternate and each repeat's ratio is taken to
the raw run of the same repeat; the median over repeats is the headline. CPU time per env step
(all processes: ours = main + workers) is printed too: it is far less sensitive to other tenants.

    python benchmarks/rollout_overhead.py [--task PushCube-v1] [--num-envs 16] [--workers 2]
        [--steps 150] [--repeats 10]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from turns import take_turns  # noqa: E402


def _raw_envs(task: str, count: int, control_mode: str) -> list:
    import logging

    import gymnasium as gym
    import mani_skill.envs  # noqa: F401

    logging.getLogger("mani_skill").setLevel(logging.ERROR)
    envs = [
        gym.make(
            task,
            num_envs=1,
            obs_mode="state_dict",
            control_mode=control_mode,
            reward_mode="normalized_dense",
            sim_backend="physx_cpu",
        ).unwrapped
        for _ in range(count)
    ]
    for i, e in enumerate(envs):
        e.reset(seed=i)
    return envs


def _raw_steps(envs: list, steps: int) -> tuple[float, float]:
    """Step plain ManiSkill envs with random actions -> (wall s, CPU s of this process)."""
    t0 = time.perf_counter()
    c0 = time.process_time()
    with torch.no_grad():  # as our workers run
        for t in range(steps):
            for e in envs:
                e.step(torch.rand(1, e.action_space.shape[-1]) * 2 - 1)
                if t % 50 == 49:
                    e.reset()
    return time.perf_counter() - t0, time.process_time() - c0


def _raw_worker(task: str, count: int, control_mode: str, commands, results) -> None:
    torch.set_num_threads(1)
    envs = _raw_envs(task, count, control_mode)
    results.put("ready")
    while (steps := commands.get()) is not None:
        results.put(_raw_steps(envs, steps))


def _cpu_seconds(pid: int) -> float:
    """user + system CPU time of a live process (Linux /proc)."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class RawLoop:
    """W plain ManiSkill processes, kept alive between measurements (so that raw and ours can
    alternate quickly), each stepping its share of the environments when told to."""

    def __init__(self, task: str, num_envs: int, workers: int, control_mode: str):
        ctx = mp.get_context("spawn")
        self.counts = [num_envs // workers + (i < num_envs % workers) for i in range(workers)]
        self.commands = [ctx.Queue() for _ in self.counts]
        self.results = [ctx.Queue() for _ in self.counts]
        self.procs = [
            ctx.Process(target=_raw_worker, args=(task, c, control_mode, cq, rq), daemon=True)
            for c, cq, rq in zip(self.counts, self.commands, self.results)
        ]
        for p in self.procs:
            p.start()
        for q in self.results:
            assert q.get() == "ready"

    def run(self, steps: int) -> tuple[float, float]:
        """-> (env steps/s, CPU ms per env step)."""
        for q in self.commands:
            q.put(steps)
        results = [q.get() for q in self.results]
        n = sum(self.counts) * steps
        return n / max(r[0] for r in results), sum(r[1] for r in results) / n * 1e3

    def close(self) -> None:
        for q in self.commands:
            q.put(None)
        for p in self.procs:
            p.join()


class InProcessRawLoop:
    """The same plain ManiSkill envs stepped in this process (the ceiling for
    ``num_workers: 0``)."""

    def __init__(self, task: str, num_envs: int, control_mode: str):
        self.envs = _raw_envs(task, num_envs, control_mode)

    def run(self, steps: int) -> tuple[float, float]:
        wall, cpu = _raw_steps(self.envs, steps)
        n = len(self.envs) * steps
        return n / wall, cpu / n * 1e3

    def close(self) -> None:
        for e in self.envs:
            e.close()


def _measured(env, steps: int, fn) -> tuple[float, float]:
    """Run ``fn`` -> (env steps/s, CPU ms per env step of this process and the env's workers)."""
    pids = [p.pid for p in env._pool._procs]
    w0 = [_cpu_seconds(p) for p in pids]
    c0 = time.process_time()
    t0 = time.perf_counter()
    fn()
    wall = time.perf_counter() - t0
    cpu = time.process_time() - c0 + sum(_cpu_seconds(p) - w for p, w in zip(pids, w0))
    return env.num_envs * steps / wall, cpu / (env.num_envs * steps) * 1e3


def bench_vecenv(env, steps: int) -> tuple[float, float]:
    low, high = env.spec.action.bounds()
    env.reset(seed=0)

    def run():
        for _ in range(steps):
            env.step(low + torch.rand(env.num_envs, env.spec.action.dim) * (high - low))

    return _measured(env, steps, run)


def bench_rollout(env, steps: int, stages: int = 1) -> tuple[float, float]:
    from embodied.env_group import EnvGroup
    from embodied.episode_stats import EpisodeStats
    from embodied.inference import InferencePolicy
    from embodied.models import ActorCritic, ActorCriticConfig
    from embodied.rollout import CollectPlan, collect

    envs = EnvGroup(env)
    policy = InferencePolicy(ActorCritic(env.spec, ActorCriticConfig()))
    obs = envs.reset(seed=0)
    stats = EpisodeStats(envs.task_names, env.device)
    plan = CollectPlan(
        seeds=0,
        group_of_env=torch.full((env.num_envs,), -1),
        num_chunks=steps,
        episode_base=0,
    )
    return _measured(env, steps, lambda: collect(envs, policy, obs, plan, stats, stages=stages))


def main() -> None:
    from embodied.simulators.maniskill import ManiSkillConfig, ManiSkillEnv

    args = _arguments()
    torch.set_num_threads(1)
    env = ManiSkillEnv(
        ManiSkillConfig(
            task=args.task,
            num_envs=args.num_envs,
            num_workers=args.workers,
            control_mode=args.control_mode,
        )
    )
    benches = {
        "raw": lambda: raw.run(args.steps),
        "vecenv": lambda: bench_vecenv(env, args.steps),
        "rollout": lambda: bench_rollout(env, args.steps),
        "pipelined": lambda: bench_rollout(env, args.steps, stages=2),
    }
    if args.workers == 0:
        del benches["pipelined"]  # in one process there is nothing to overlap
    loops = tuple(benches)
    raw = (
        InProcessRawLoop(args.task, args.num_envs, args.control_mode)
        if args.workers == 0
        else RawLoop(args.task, args.num_envs, args.workers, args.control_mode)
    )

    def progress(index: int, results: dict[str, list[tuple[float, float]]]) -> None:
        done = ", ".join(f"{k} {results[k][-1][0]:.0f}" for k in loops)
        print(f"repeat {index + 1}/{args.repeats}: {done}", flush=True)

    try:  # (steps/s, CPU ms a step) per loop and round
        results = take_turns(benches, args.repeats, after_round=progress)
    finally:
        env.close()
        raw.close()
    _print_table(args, results)


def _arguments() -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--task", default="PushCube-v1")
    ap.add_argument("--num-envs", type=int, default=16)
    ap.add_argument(
        "--workers", type=int, default=2, help="0: simulators in this process (num_workers: 0)"
    )
    ap.add_argument("--steps", type=int, default=150, help="steps per environment per measurement")
    ap.add_argument("--control-mode", default="pd_joint_delta_pos")
    ap.add_argument("--repeats", type=int, default=10, help="alternating repeats")
    return ap.parse_args()


def _print_table(args, results: dict[str, list[tuple[float, float]]]) -> None:
    """Each loop's median steps/s and CPU per step, as ratios to the same rounds' raw loop."""
    loops = tuple(results)
    sps = {k: [steps_per_s for steps_per_s, _ in results[k]] for k in loops}
    cpu = {k: [cpu_ms for _, cpu_ms in results[k]] for k in loops}
    print(
        f"\n{args.task} state, {args.num_envs} envs, {args.workers} workers, "
        f"{args.steps} steps/env x {args.repeats} repeats, {mp.cpu_count()} cores, "
        f"{platform.processor() or platform.machine()}, torch {torch.__version__}"
    )
    print(
        f"{'loop':<10}{'median steps/s':>15}{'median ratio':>14}{'CPU ms/step':>13}"
        f"{'CPU ratio':>11}   steps/s per repeat"
    )
    for k in loops:
        ratio = statistics.median(a / b for a, b in zip(sps[k], sps["raw"]))
        cpu_ratio = statistics.median(cpu[k]) / statistics.median(cpu["raw"])
        print(
            f"{k:<10}{statistics.median(sps[k]):>15.0f}{ratio:>14.3f}"
            f"{statistics.median(cpu[k]):>13.3f}{cpu_ratio:>11.3f}   "
            f"{[round(x) for x in sps[k]]}"
        )
    print(
        "ratio = steps/s over the same repeat's raw steps/s (goal >= 0.9); "
        "CPU ratio = CPU per env step over raw's"
    )


if __name__ == "__main__":
    main()
