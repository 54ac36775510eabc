"""Seconds per GRPO round: a seeded group reset of every environment, then one episode each in
chunks, with the VLA of a GRPO config (weights as built: timing does not depend on them).

Runs against whichever embodied is importable, the current runner (embodied.runner) or the
trainer it replaced (embodied.grpo_trainer), so the same script measures before and after:

    python benchmarks/grpo_round.py --rounds 5                     # this tree
    PYTHONPATH=OLD_SITE python benchmarks/grpo_round.py --rounds 5 # an older install

Prints one JSON line: the code measured, the config, seconds per round (each, and the median of
all rounds but the first, which warms the encoders' caches).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import time

import torch


def rounds_new(cfg, rounds: int) -> list[float]:
    from embodied.env_group import EnvGroup
    from embodied.episode_stats import EpisodeStats
    from embodied.grpo import GRPO
    from embodied.inference import InferencePolicy
    from embodied.multitask import make_env
    from embodied.rollout import collect
    from embodied.runner import init_policy

    env = make_env(cfg.env)
    try:
        envs = EnvGroup(env)
        policy = InferencePolicy(init_policy(cfg, env.spec, env.device).eval())
        algorithm = GRPO(
            cfg.algorithm,
            seed=cfg.seed,
            task_of_env=envs.task_of_env,
            chunk_size=cfg.policy.chunk_size,
            max_episode_steps=env.spec.max_episode_steps,
        )
        times = []
        for r in range(rounds):
            t0 = time.perf_counter()
            plan = algorithm.plan(1 + r, 0, episode_base=0)
            stats = EpisodeStats(envs.task_names, env.device)
            batch, _ = collect(envs, policy, envs.reset(seed=plan.seeds), plan, stats)
            algorithm.advantages(batch)
            times.append(time.perf_counter() - t0)
        return times
    finally:
        env.close()


def rounds_old(cfg, rounds: int) -> list[float]:
    from embodied.grpo_trainer import _round
    from embodied.multitask import make_env
    from embodied.trainer import init_policy

    env = make_env(cfg.env)
    try:
        policy = init_policy(cfg, env, env.device).eval()
        M = cfg.algorithm.group_size
        G = env.num_envs // M
        T = math.ceil(env.spec.max_episode_steps / cfg.policy.chunk_size)
        times = []
        for r in range(rounds):
            t0 = time.perf_counter()
            seeds = [cfg.seed + r * G + g for g in range(G) for _ in range(M)]
            with torch.no_grad():
                _round(env, policy, seeds, T)
            times.append(time.perf_counter() - t0)
        return times
    finally:
        env.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/maniskill/multitask_vla_grpo.yaml")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("overrides", nargs="*", help="key.sub=value")
    args = p.parse_args()
    from embodied.config import load_config

    try:
        from embodied.train_config import TrainConfig

        measure = rounds_new
        code = "runner"
    except ImportError:
        from embodied.trainer import TrainConfig

        measure = rounds_old
        code = "grpo_trainer"
    overrides = ["runner.init_from=null", *args.overrides]
    cfg = load_config(TrainConfig, args.config, overrides)[0]
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.runner.torch_threads)
    times = measure(cfg, args.rounds)
    print(
        json.dumps(
            {
                "code": code,
                "config": args.config,
                "overrides": overrides,
                "num_envs": cfg.env.num_envs,
                "cpu": platform.processor() or platform.machine(),
                "round_s": [round(t, 2) for t in times],
                "median_s": round(statistics.median(times[1:] or times), 2),
            }
        )
    )


if __name__ == "__main__":
    main()
