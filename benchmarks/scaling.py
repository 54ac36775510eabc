"""Rollout scaling: env steps/s of the rollout loop by environment-worker count, embedded vs Ray,
and pipelined vs sequential collection on Ray.

Side by side in one run (every configuration is built once and the measurements alternate, so
the shared machine's drift hits them alike; the median over repeats is reported):
  embedded W   one process, the simulators in W subprocess workers (``env.num_workers: W``)
  ray W        the roles on a local Ray: W env workers (each simulating its share in its own
               process), a rollout worker, an actor worker (``cluster.env.workers: W``); each
               env worker collects its round and acts through the rollout worker directly
  in-env W     the same with the policy's inference copy in each env worker's process
               (``cluster.rollout.workers: 0``): each env worker collects its round itself
  ideal        W times the 1-worker rate of the same kind
Each measurement is one collection round of the PPO config (no update), from a seeded reset.

``--vla``: the multi-task VLA (EfficientNet-Lite0 + MiniLM, chunks of 4) on rgb, 2 tasks x 4
environments, on Ray with 2 env workers (one task each): rounds collected in lockstep and with 2
pipeline stages (a worker simulates its chunk while the rollout worker acts for the other)
alternate. With ``cluster.env.workers=1 env.num_workers=1`` one env worker simulates all 8
environments in its own process, and a stage is half of its rows. Each pair gives a speedup;
the rounds' busy seconds per role give the most that 2 stages could gain (``pipelining_bound``).
``--lockstep-workers N`` also times, in the same alternation, lockstep rounds of a second set of
roles with N env workers: the layout that pipelining inside one worker competes with.

    python benchmarks/scaling.py [--workers 1 2] [--repeats 5] [--png docs/scaling.png]
    python benchmarks/scaling.py --vla [--repeats 3] [config overrides]
    python benchmarks/scaling.py --vla [--lockstep-workers 2] cluster.env.workers=1 \
        env.num_workers=1 [overrides]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from turns import take_turns  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
STATE = [
    "env.num_envs=8",
    "algorithm.num_steps=50",
    "runner.progress=false",
    "cluster.rollout.num_cpus=0.5",
    "cluster.actor.num_cpus=0.5",
]
VLA = [
    "env.tasks=[PushCube-v1,PullCube-v1]",
    "env.num_envs=8",
    "env.num_workers=2",
    "algorithm.group_size=2",
    "runner.init_from=null",
    "policy.vision_pretrained=true",
    "cluster.env.workers=2",
    "cluster.env.num_cpus=0.5",
    "cluster.rollout.num_cpus=0.5",
    "cluster.actor.num_cpus=0.5",
]


def config(path: str, overrides: list[str]):
    from embodied.config import load_config
    from embodied.train_config import TrainConfig

    return load_config(TrainConfig, ROOT / path, overrides)[0]


def build(cfg, on_ray: bool):
    """The run's roles, as ``train`` builds them (no run directory needed)."""
    from embodied.multitask import make_env
    from embodied.roles import local_roles

    torch.manual_seed(cfg.seed)
    if not on_ray:
        return local_roles(cfg, make_env(cfg.env))
    from embodied.cluster import ray_roles

    out = Path("/tmp") / f"embodied-scaling-{os.getpid()}-{time.monotonic_ns()}"
    out.mkdir(parents=True)  # (cluster.json is written there at every weight sync)
    return ray_roles(cfg, None, out)


def round_rate(cfg, roles, stages: int = 1) -> float:
    """Env steps/s of one collection round (seeded reset excluded)."""
    steps, seconds = collect_round(cfg, roles, stages)
    return steps / seconds


def collect_round(cfg, roles, stages: int, after_reset=None) -> tuple[int, float]:
    """One collection round: its env steps and wall seconds (seeded reset excluded; then
    ``after_reset()`` is called where given)."""
    from embodied.episode_stats import EpisodeStats
    from embodied.roles import build_algorithm

    envs = roles.envs
    algorithm = build_algorithm(cfg, roles.spec, envs.task_of_env)
    plan = algorithm.plan(1, 0, 0)
    stats = EpisodeStats(envs.task_names, roles.inference.device)
    obs = envs.reset(seed=plan.seeds)
    if after_reset is not None:
        after_reset()
    K = cfg.policy.chunk_size
    t0 = time.perf_counter()
    roles.collect(obs, plan, stats, stages=stages, chunk_size=K)
    seconds = time.perf_counter() - t0
    return envs.num_envs * K * plan.num_chunks, seconds


def driver_tcp_bytes() -> int:
    """Bytes sent and received on this process's TCP sockets (``ss``'s counters for the sockets
    this pid holds): what passed through the driver at the process level, Ray's gRPC calls and
    the objects they carry inline included, whatever our own counters say. Objects that Ray
    hands over in shared memory on the node are not in it (the run's counters have those)."""
    import re
    import subprocess

    listing = subprocess.run(["ss", "-tinpH"], capture_output=True, text=True).stdout
    owner = f"pid={os.getpid()},"
    total = 0
    mine = False
    for line in listing.splitlines():
        if line and not line[0].isspace():  # a socket's line; its counters on the next
            mine = owner in line
        elif mine:
            total += sum(int(n) for n in re.findall(r"bytes_(?:sent|received):(\d+)", line))
    return total


def hardware() -> str:
    cpu = platform.processor() or platform.machine()
    return f"{os.cpu_count()} cores, {cpu}, torch {torch.__version__}"


def measure(cases: dict, repeats: int) -> dict[str, list[float]]:
    """The cases (name -> (cfg, roles, stages)) taking turns for ``repeats`` rounds each."""
    for cfg, roles, stages in cases.values():  # warm up: first resets, first weights
        roles.sync(0)
        round_rate(cfg, roles, stages)

    def progress(index: int, rates: dict[str, list[float]]) -> None:
        done = ", ".join(f"{k} {v[-1]:.0f}" for k, v in rates.items())
        print(f"repeat {index + 1}/{repeats}: {done}", flush=True)

    runs = {name: functools.partial(round_rate, *case) for name, case in cases.items()}
    return take_turns(runs, repeats, after_round=progress)


def scaling(args) -> dict:
    from embodied.cluster.config import ClusterConfig
    from embodied.cluster.start import start_ray

    start_ray(ClusterConfig(num_cpus=8))  # logical CPUs: every configuration is placed at once
    cases = {}
    built = []
    try:
        for w in args.workers:
            base = [*STATE, f"env.num_workers={w}"]
            cfg = config("configs/maniskill/pushcube_ppo.yaml", base)
            built.append(build(cfg, on_ray=False))
            cases[f"embedded {w}"] = (cfg, built[-1], 1)
            on_ray = [*base, "cluster.enabled=true", f"cluster.env.workers={w}"]
            for name, extra in (("ray", []), ("in-env", ["cluster.rollout.workers=0"])):
                cfg = config(
                    "configs/maniskill/pushcube_ppo.yaml",
                    [*on_ray, "cluster.env.num_cpus=0.5", *extra],
                )
                built.append(build(cfg, on_ray=True))
                cases[f"{name} {w}"] = (cfg, built[-1], 1)
        rates = measure(cases, args.repeats)
    finally:
        for roles in built:
            roles.close()
    median = {k: statistics.median(v) for k, v in rates.items()}
    first = args.workers[0]
    rows = []
    for w in args.workers:
        e = median[f"embedded {w}"]
        r = median[f"ray {w}"]
        n = median[f"in-env {w}"]
        rows.append(
            {
                "workers": w,
                "embedded": e,
                "ray": r,
                "in_env": n,
                "ideal_embedded": median[f"embedded {first}"] * w / first,
                "ideal_ray": median[f"ray {first}"] * w / first,
                "ray_overhead": 1 - r / e,
                "in_env_overhead": 1 - n / e,
            }
        )
    print("\nPushCube state, 8 envs, rounds of 50 steps, lockstep; " + hardware())
    print(
        "| env workers | embedded steps/s | Ray, direct | overhead | Ray, inference in the "
        "env workers | overhead | ideal (embedded) |"
    )
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['workers']} | {row['embedded']:.0f} | {row['ray']:.0f} | "
            f"{100 * row['ray_overhead']:.0f}% | {row['in_env']:.0f} | "
            f"{100 * row['in_env_overhead']:.0f}% | {row['ideal_embedded']:.0f} |"
        )
    if args.png:
        plot(rows, Path(args.png))
    return {"rows": rows, "rates": rates, "hardware": hardware()}


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workers = [r["workers"] for r in rows]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot(workers, [r["embedded"] for r in rows], "o-", label="embedded (subprocess workers)")
    ax.plot(workers, [r["ray"] for r in rows], "s-", label="Ray, acting through a rollout worker")
    ax.plot(workers, [r["in_env"] for r in rows], "^-", label="Ray, inference in env workers")
    ax.plot(workers, [r["ideal_embedded"] for r in rows], "k--", label="ideal")
    ax.set_xlabel("environment workers")
    ax.set_ylabel("env steps/s (rollout, lockstep)")
    ax.set_xticks(workers)
    ax.set_title(f"PushCube state, 8 envs; {os.cpu_count()} cores")
    save(fig, ax, path)


def save(fig, ax, path: Path) -> None:
    """The plot with its legend, as a PNG at ``path``."""
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def pipelining_bound(
    simulate_s: float,
    infer_s: float,
    round_s: float | None = None,
    *,
    stages_in_worker: bool = False,
) -> float:
    """The most that 2 stages can gain over a lockstep round: ``simulate_s``, each env worker's
    busy seconds, and ``infer_s``, the one rollout worker's, in the pipelined round (it acts
    for one stage at a time, one call at a time: I/2 per stage); ``round_s``, the lockstep
    round's wall time (default: S + I, no time lost between calls).

    A stage of whole env workers (2 workers, one stage each): a stage's chunk still waits for
    its own simulation and its half of the inference (S + I/2), and the one rollout worker
    still does all of it (I). So the gain is at most round_s / max(S + I/2, I); without time
    between calls, (S + I) / max(S + I/2, I) <= 1.5, reached at S = I / 2. On 2 cores for the
    2 simulators and the rollout worker, the cores give the same limit ((2 S + I) / 2).

    ``stages_in_worker`` (one env worker, each stage half of its rows): the worker simulates
    one stage while the rollout worker acts for the other, so a round takes at least the
    busier of the two, max(S, I): (S + I) / max(S, I) <= 2, reached at S = I. One process
    per core on 2 cores."""
    if round_s is None:
        round_s = simulate_s + infer_s
    if stages_in_worker:
        return round_s / max(simulate_s, infer_s)
    return round_s / max(simulate_s + infer_s / 2, infer_s)


def timed_round(cfg, roles, stages: int) -> tuple[float, dict[str, float]]:
    """One collection round's wall seconds and the roles' busy seconds in it (its reset
    excluded from both)."""
    _, seconds = collect_round(cfg, roles, stages, after_reset=roles.metrics)
    busy, _ = roles.metrics()
    return seconds, busy


def pipelining(args) -> dict:
    """Lockstep and pipelined rounds alternate; each pair gives a speedup, and the pipelined
    round's busy seconds give its bound. Each env worker splits its own rows into the stages."""
    from embodied.cluster.config import ClusterConfig
    from embodied.cluster.start import start_ray

    start_ray(ClusterConfig(num_cpus=8))
    overrides = [*VLA, "cluster.enabled=true", *args.overrides]
    cfg = config("configs/maniskill/multitask_vla_grpo.yaml", overrides)
    roles = build(cfg, on_ray=True)
    other = None  # (config, roles) of the other layout, timed in lockstep beside these
    pairs = []
    try:
        if 2 not in roles.stage_candidates(cfg.policy.chunk_size):
            raise SystemExit("these environments cannot step in 2 stages (they step all at once)")
        if args.lockstep_workers:
            n = args.lockstep_workers
            layout = [f"cluster.env.workers={n}", f"env.num_workers={n}"]
            other_cfg = config("configs/maniskill/multitask_vla_grpo.yaml", [*overrides, *layout])
            other = (other_cfg, build(other_cfg, on_ray=True))
        for stages in (1, 2):  # warm up: first resets, first weights
            roles.sync(0)
            round_rate(cfg, roles, stages)
        if other is not None:
            other[1].sync(0)
            round_rate(*other)
        cases = [1, 2] if other is None else [1, 2, "other"]  # stage counts, the other layout
        for r in range(args.repeats):
            order = cases if r % 2 == 0 else cases[::-1]  # (alternated: drift hits all alike)
            timed = {
                case: timed_round(*other, 1) if case == "other" else timed_round(cfg, roles, case)
                for case in order
            }
            pairs.append(_pair(timed))
            print(f"repeat {r + 1}/{args.repeats}: {_pair_line(pairs[-1], args)}", flush=True)
    finally:
        roles.close()
        if other is not None:
            other[1].close()
    median = {key: statistics.median(p[key] for p in pairs) for key in pairs[0]}
    _print_medians(median, cfg.cluster.env.workers, args.lockstep_workers)
    return {
        "median": median,
        "pairs": pairs,
        "env_workers": cfg.cluster.env.workers,
        "lockstep_workers": args.lockstep_workers,
        "stages_in_worker": True,
        "hardware": hardware(),
    }


def _pair(timed: dict) -> dict:
    """A lockstep round (``timed[1]``: seconds, busy seconds) beside a pipelined one
    (``timed[2]``), and the other layout's lockstep round where timed: the speedup, and its
    bound from the pipelined round's own busy seconds (what it had to do)."""
    sequential_s, busy = timed[1]
    pipelined_s, pipelined_busy = timed[2]
    simulate_s = busy["cluster/env_busy_s"]
    infer_s = busy["cluster/rollout_busy_s"]
    halves_s = pipelined_busy["cluster/rollout_busy_s"]
    simulate_pipelined_s = pipelined_busy["cluster/env_busy_s"]
    pair = {
        "sequential_s": sequential_s,
        "pipelined_s": pipelined_s,
        "simulate_s": simulate_s,
        "infer_s": infer_s,
        "infer_halves_s": halves_s,
        "simulate_pipelined_s": simulate_pipelined_s,
        "between_calls_s": sequential_s - simulate_s - infer_s,
        "speedup": sequential_s / pipelined_s,
        "bound": pipelining_bound(
            simulate_pipelined_s, halves_s, sequential_s, stages_in_worker=True
        ),
    }
    if "other" in timed:
        pair["other_lockstep_s"] = timed["other"][0]
        pair["speedup_over_other"] = pair["other_lockstep_s"] / pipelined_s
    return pair


def _pair_line(pair: dict, args) -> str:
    other = ""
    if "other_lockstep_s" in pair:
        other = (
            f"; lockstep on {args.lockstep_workers} env workers {pair['other_lockstep_s']:.2f} s: "
            f"{pair['speedup_over_other']:.2f}x"
        )
    return (
        f"lockstep {pair['sequential_s']:.2f} s (env workers {pair['simulate_s']:.2f} s busy, "
        f"the busier; rollout worker {pair['infer_s']:.2f} s), pipelined "
        f"{pair['pipelined_s']:.2f} s (rollout worker {pair['infer_halves_s']:.2f} s): "
        f"{pair['speedup']:.2f}x, bound {pair['bound']:.2f}x{other}"
    )


def _print_medians(median: dict, workers: int, lockstep_workers: int | None) -> None:
    print(
        f"\nVLA rgb 128 px, 2 tasks x 4 envs, chunks of 4, {workers} env worker(s) on Ray "
        f"(stages of rows in each); {hardware()}\n"
        f"medians: lockstep {median['sequential_s']:.2f} s, pipelined (2 stages) "
        f"{median['pipelined_s']:.2f} s a round: {median['speedup']:.2f}x (bound "
        f"{median['bound']:.2f}x; env workers {median['simulate_s']:.2f} s busy, rollout "
        f"worker {median['infer_s']:.2f} s in lockstep and {median['infer_halves_s']:.2f} s "
        f"pipelined, {median['between_calls_s']:.2f} s between calls)"
    )
    if lockstep_workers:
        print(
            f"lockstep on {lockstep_workers} env workers {median['other_lockstep_s']:.2f} s "
            f"a round: the pipelined round is {median['speedup_over_other']:.2f}x faster"
        )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--png", help="write the scaling plot here")
    ap.add_argument("--vla", action="store_true", help="pipelined vs sequential, VLA on rgb")
    ap.add_argument("--json", help="write the numbers here")
    ap.add_argument(
        "--lockstep-workers",
        type=int,
        help="--vla: also time lockstep rounds on this many env workers (a layout of its own)",
    )
    ap.add_argument("--latency", action="store_true", help="env workers of a sleeping simulator")
    ap.add_argument("--step-ms", type=float, nargs="+", default=[100.0, 20.0])
    ap.add_argument("--latency-workers", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--envs-per-worker", type=int, default=2)
    ap.add_argument("--round-steps", type=int, default=20, help="--latency: steps per round")
    ap.add_argument("overrides", nargs="*", help="config overrides for the --vla run")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(1)
    if args.latency:
        from latency_scaling import latency  # (benchmarks/latency_scaling.py)

        result = latency(args)
    else:
        result = pipelining(args) if args.vla else scaling(args)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    sys.exit(main())
