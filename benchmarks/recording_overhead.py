"""What recording every iteration costs (``runner.record_rollouts: 1``), side by side in one run:
the same short training run with recording off and on, alternated ``--repeats`` times; the
seconds per iteration (rollout plus update plus what follows it, from the runs' own clocks: the
wall time between consecutive metric rows), and the records' disk per 1,000 env steps.

    python benchmarks/recording_overhead.py configs/maniskill/pushcube_ppo.yaml --iterations 6
    python benchmarks/recording_overhead.py configs/maniskill/multitask_vla_grpo.yaml \
        runner.init_from=null env.max_episode_steps=50 runner.max_minutes=5 --iterations 3

(overrides right after the config; they come after the script's own, so they win). A GRPO
iteration is one round here (``algorithm.max_rounds=1``: an episode per environment), so its
size is known before the run; that needs ``env.max_episode_steps``.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def iteration_steps(cfg) -> tuple[int, list[str]]:
    """The env steps of one iteration and the overrides that fix them: PPO's ``num_steps``
    chunks; GRPO's one round of an episode per environment."""
    chunk = cfg.policy.chunk_size
    if cfg.algorithm.name != "grpo":
        return cfg.env.num_envs * chunk * cfg.algorithm.num_steps, []
    limit = getattr(cfg.env, "max_episode_steps", None)
    if limit is None:
        raise SystemExit("recording_overhead: a GRPO config needs env.max_episode_steps")
    return cfg.env.num_envs * chunk * math.ceil(limit / chunk), ["algorithm.max_rounds=1"]


def run(config: str, out: Path, name: str, record: int, iterations: int, extra: list[str]):
    """One training run; (seconds per iteration after the first, env steps, (bytes of the
    recorded rounds, bytes of the rest: the learner's state and the metadata))."""
    from embodied.config import load_config
    from embodied.logger import read_metrics
    from embodied.train_config import TrainConfig

    cfg = load_config(TrainConfig, ROOT / config, extra)[0]
    steps, sizing = iteration_steps(cfg)
    overrides = [
        *sizing,
        f"runner.total_env_steps={steps * iterations}",
        f"runner.record_rollouts={record}",
        f"runner.keep_rollouts={iterations}",
        "runner.eval_every=0",
        "runner.final_eval_episodes=1",
        "runner.save_every=0",
        "runner.video=false",
        "runner.progress=false",
        f"runner.output_dir={out}",
        f"runner.name={name}",
        *extra,
    ]
    cmd = [sys.executable, "-m", "embodied.cli", "train", str(ROOT / config), *overrides]
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    rows = read_metrics(out / name / "metrics.jsonl")  # (a non-finite number as NaN)
    training = [r for r in rows if "time/rollout_s" in r]
    if len(training) < 2:
        raise SystemExit(f"recording_overhead: {name} ran {len(training)} iteration(s), not 2+")
    seconds = [60 * (b["time/minutes"] - a["time/minutes"]) for a, b in zip(training, training[1:])]
    files = [f for f in (out / name / "rollouts").rglob("*") if f.is_file()] if record else []
    rounds = sum(f.stat().st_size for f in files if f.name == "rounds.safetensors.zst")
    rest = sum(f.stat().st_size for f in files) - rounds
    return statistics.median(seconds), training[-1]["env_steps"], (rounds, rest)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config")
    ap.add_argument("--iterations", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("overrides", nargs="*", default=[])
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder)
        times = {0: [], 1: []}
        disk = []
        for repeat in range(args.repeats):
            for record in (0, 1):
                name = f"r{repeat}_record{record}"
                seconds, steps, nbytes = run(
                    args.config, out, name, record, args.iterations, args.overrides
                )
                times[record].append(seconds)
                if record:
                    disk.append((nbytes[0] / steps * 1000, nbytes[1] / args.iterations))
                print(f"{name}: {seconds:.2f} s per iteration", flush=True)
    off, on = statistics.median(times[0]), statistics.median(times[1])
    rounds = statistics.median(d[0] for d in disk) / 1e6
    state = statistics.median(d[1] for d in disk) / 1e6
    print(
        f"\n{args.config}: {off:.2f} s per iteration without recording, {on:.2f} s recording "
        f"every iteration ({100 * (on / off - 1):+.1f}%); the rounds {rounds:.3f} MB per 1,000 "
        f"env steps, the learner's state {state:.2f} MB per record"
    )
    machine = platform.processor() or platform.machine()
    print(f"{os.cpu_count()} cores, {machine}, {time.strftime('%Y-%m-%d')}")


if __name__ == "__main__":
    main()
