"""Orchestration scaling on Ray with a latency-bound simulator (``benchmarks/scaling.py
--latency``): env workers 1, 2, 4, ... of sleeping environments (benchmarks/latency_env.py), one
rollout worker serving them all in lockstep, against the ideal line (W times one worker's rate),
for each step time; and what passed through the driver per step, counted by this process's
system calls and by the run's own counters. On a machine with few cores the simulators' sleep
leaves the cores to the orchestration, which is what this measures.

    python benchmarks/scaling.py --latency [--step-ms 100 20] [--latency-workers 1 2 4 8 16]
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

from scaling import collect_round, driver_tcp_bytes, hardware, save


def latency_roles(workers: int, step_s: float, envs_per_worker: int, steps: int):
    """Ray roles over ``workers`` env workers of sleeping environments (benchmarks/
    latency_env.py) and one rollout worker serving them all, the PPO MLP; rounds of ``steps``
    steps (an episode each)."""
    from latency_env import SleepingEnvs

    from embodied.cluster import ray_roles
    from embodied.config import compose
    from embodied.train_config import TrainConfig

    source = {
        "seed": 0,
        "policy": {"name": "actor_critic", "hidden_sizes": [64, 64], "use_images": False},
        "algorithm": {"name": "ppo", "num_steps": steps},
        "env": {"num_envs": workers * envs_per_worker},
        "runner": {"progress": False, "torch_threads": 1},
        "cluster": {
            "enabled": True,
            "env": {"workers": workers, "num_cpus": 0.1},
            "rollout": {"num_cpus": 0.5},
            "actor": {"num_cpus": 0.5},
        },
    }
    cfg = compose(TrainConfig, [("latency", source)])
    out = Path("/tmp") / f"embodied-latency-{os.getpid()}-{time.monotonic_ns()}"
    out.mkdir(parents=True)
    return cfg, ray_roles(cfg, None, out, env_factory=SleepingEnvs(step_s, steps))


def latency(args) -> dict:
    """Env workers 1, 2, 4, ... of a latency-bound simulator against the ideal line (W times
    one worker's rate), per step time; and what passed through this process per step."""
    from embodied.cluster.config import ClusterConfig
    from embodied.cluster.start import start_ray

    start_ray(ClusterConfig(num_cpus=8))  # (logical CPUs: the sleeping workers need none)
    results = []
    for step_s in args.step_ms:
        step_s = step_s / 1000
        for workers in args.latency_workers:
            cfg, roles = latency_roles(workers, step_s, args.envs_per_worker, args.round_steps)
            try:
                roles.sync(0)
                collect_round(cfg, roles, 1)  # (warm-up)
                roles.metrics()
                rates = []
                io = []
                for _ in range(args.repeats):
                    before = driver_tcp_bytes()
                    steps, seconds = collect_round(cfg, roles, 1)
                    io.append((driver_tcp_bytes() - before) / args.round_steps)
                    rates.append(steps / seconds)
                counted = roles.metrics()[0]
            finally:
                roles.close()
            row = {
                "step_ms": 1000 * step_s,
                "env_workers": workers,
                "steps_per_s": statistics.median(rates),
                "driver_tcp_bytes_per_step": statistics.median(io),
                "counted_env_bytes_per_step": counted["cluster/env_bytes_per_step"],
            }
            first = next(r for r in results + [row] if r["step_ms"] == row["step_ms"])
            ideal = first["steps_per_s"] * workers / first["env_workers"]
            row["of_ideal"] = row["steps_per_s"] / ideal
            results.append(row)
            print(
                f"{1000 * step_s:.0f} ms steps, {workers} env workers: "
                f"{row['steps_per_s']:.1f} steps/s, {row['of_ideal']:.2f} of ideal; driver "
                f"TCP {row['driver_tcp_bytes_per_step']:.0f} B/step, counted "
                f"{row['counted_env_bytes_per_step']:.0f} B/step",
                flush=True,
            )
    print(f"\nSleeping simulator, {args.envs_per_worker} envs per env worker; {hardware()}")
    print(
        "| step | env workers | steps/s | of ideal | driver TCP bytes per step (process) | "
        "bytes per step counted (plan, batch) |"
    )
    print("|---|---|---|---|---|---|")
    for row in results:
        print(
            f"| {row['step_ms']:.0f} ms | {row['env_workers']} | {row['steps_per_s']:.1f} | "
            f"{row['of_ideal']:.2f} | {row['driver_tcp_bytes_per_step']:.0f} | "
            f"{row['counted_env_bytes_per_step']:.0f} |"
        )
    if args.png:
        plot_latency(results, Path(args.png))
    return {"rows": results, "hardware": hardware()}


def plot_latency(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    for step_ms in sorted({r["step_ms"] for r in rows}):
        mine = [r for r in rows if r["step_ms"] == step_ms]
        workers = [r["env_workers"] for r in mine]
        line = ax.plot(workers, [r["steps_per_s"] for r in mine], "o-", label=f"{step_ms:.0f} ms")
        ideal = [mine[0]["steps_per_s"] * w / workers[0] for w in workers]
        ax.plot(workers, ideal, "--", color=line[0].get_color(), label=f"ideal, {step_ms:.0f} ms")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("env workers")
    ax.set_ylabel("env steps/s")
    ax.set_title(f"Latency-bound simulator on Ray; {os.cpu_count()} cores")
    save(fig, ax, path)
