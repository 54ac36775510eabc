"""Asynchronous collection: the VLA GRPO config on Ray with ``cluster.max_staleness`` 0 and 1, side
by side. The same env-step budget, the same seed, the same evaluation; reports the wall-clock
time per iteration, the roles' busy shares and success before and after RL.

    python benchmarks/staleness.py [--steps 5000] [--episodes 20] [overrides ...]

Each run is a real ``embodied train`` process in ``runs/staleness/``; needs the SFT checkpoint
(``embodied sft configs/maniskill/multitask_vla_sft.yaml``, or ``runner.init_from=...``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(staleness: int, args) -> Path:
    name = f"staleness{staleness}"
    cmd = [
        sys.executable,
        "-m",
        "embodied.cli",
        "train",
        str(ROOT / "configs/maniskill/multitask_vla_grpo.yaml"),
        "cluster.enabled=true",
        f"cluster.max_staleness={staleness}",
        "cluster.rollout.num_cpus=0.5",
        "cluster.actor.num_cpus=0.5",
        f"runner.total_env_steps={args.steps}",
        f"runner.eval_episodes={args.episodes}",
        f"runner.final_eval_episodes={args.episodes}",
        "runner.max_minutes=null",
        "runner.video=false",
        "runner.progress=false",
        "runner.output_dir=runs/staleness",
        f"runner.name={name}",
        "runner.overwrite=true",
        *args.overrides,
    ]
    print(" ".join(cmd[2:]), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)
    return ROOT / "runs/staleness" / name


def summary(run_dir: Path) -> dict:
    from embodied.logger import read_metrics

    rows = read_metrics(run_dir / "metrics.jsonl")  # (a non-finite number as NaN)
    training = [r for r in rows if "iteration" in r and "time/rollout_s" in r]
    final = json.loads((run_dir / "metrics.json").read_text())
    minutes = final["minutes"]
    return {
        "iterations": len(training),
        "env_steps": final["env_steps"],
        "minutes": minutes,
        "s_per_iteration": 60 * minutes / max(1, len(training)),
        "rollout_s": statistics.median(r["time/rollout_s"] for r in training),
        "update_wait_s": statistics.median(r["time/update_s"] for r in training),
        "actor_idle": statistics.median(r["cluster/actor_idle"] for r in training),
        "env_idle": statistics.median(r["cluster/env_idle"] for r in training),
        "before": final["before"],
        "after": final["tasks"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--steps", type=int, default=5000, help="env steps per run")
    ap.add_argument("--episodes", type=int, default=20, help="evaluation episodes per task")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    results = {s: summary(run(s, args)) for s in (0, 1)}
    print(f"\n{os.cpu_count()} cores; {args.steps} env steps, {args.episodes} episodes per task")
    print("| max_staleness | iterations | s / iteration | actor idle | env idle | success |")
    print("|---|---|---|---|---|---|")
    for s, r in results.items():
        before = {t: v["eval/success_rate"] for t, v in r["before"].items()}
        after = {t: v["eval/success_rate"] for t, v in r["after"].items()}
        tasks = ", ".join(f"{t} {before[t]:.2f} -> {after[t]:.2f}" for t in after)
        print(
            f"| {s} | {r['iterations']} | {r['s_per_iteration']:.1f} | {r['actor_idle']:.0%} | "
            f"{r['env_idle']:.0%} | {tasks} |"
        )
    out = ROOT / "runs/staleness/results.json"
    out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
