"""Wall-clock to a success rate, from a training run's metrics.jsonl: the first evaluation at or
above ``--threshold``, the training minutes by then, and the lower bound a simulator sets
(environment steps by then / the raw simulator's world-steps per second, from
benchmarks/gpu_throughput.py). "not reached" is a result too. Writes the curve (env steps,
minutes, success) as JSON and, where matplotlib is installed, a PNG.

    python benchmarks/time_to_success.py RUN_DIR [--threshold 0.9] [--raw-rate 1.2e6]
        [--json OUT.json] [--png OUT.png]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def curve(run: Path) -> list[dict]:
    """[{env_steps, minutes, success}] per evaluation during training, in order; the final
    evaluation (its rows say ``final``) is left out: it scores held-out episodes after training,
    with more of them, so it is not a point on the training curve."""
    from embodied.logger import read_metrics

    minutes = {0: 0.0}  # iteration -> training minutes at its end (0: the evaluation before RL)
    points = []
    for row in read_metrics(run / "metrics.jsonl"):  # (a non-finite number as NaN)
        if "time/minutes" in row:
            minutes[row["iteration"]] = row["time/minutes"]
        if row.get("final"):
            continue
        if "eval/success_rate" in row and row.get("iteration") in minutes:
            points.append(
                {
                    "env_steps": row["env_steps"],
                    "minutes": minutes[row["iteration"]],
                    "success": row["eval/success_rate"],
                }
            )
    return points


def reached(points: list[dict], threshold: float, raw_rate: float | None) -> dict:
    """The first point at or above ``threshold`` (or where the curve ended) and its bound."""
    first = next((p for p in points if p["success"] >= threshold), None)
    last = points[-1] if points else {"env_steps": 0, "minutes": 0.0, "success": 0.0}
    at = first or last
    bound = None if raw_rate is None else at["env_steps"] / raw_rate / 60.0
    return {
        "threshold": threshold,
        "reached": first is not None,
        "env_steps": at["env_steps"],
        "minutes": at["minutes"],
        "success": at["success"],
        "lower_bound_minutes": bound,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run", type=Path)
    p.add_argument("--threshold", type=float, default=0.9)
    p.add_argument("--raw-rate", type=float, help="the raw simulator's world-steps per second")
    p.add_argument("--json", type=Path)
    p.add_argument("--png", type=Path)
    args = p.parse_args()
    points = curve(args.run)
    result = {"run": str(args.run), **reached(points, args.threshold, args.raw_rate)}
    word = "reached" if result["reached"] else "not reached; the run's last evaluation"
    print(
        f"{args.run.name}: {args.threshold:.2f} {word} at {result['env_steps']:,} env steps, "
        f"{result['minutes']:.2f} min (success {result['success']:.2f})"
        + (
            ""
            if result["lower_bound_minutes"] is None
            else f"; the simulator alone: {result['lower_bound_minutes']:.2f} min"
        )
    )
    if args.json:
        args.json.write_text(json.dumps({**result, "curve": points}, indent=2))
    if args.png:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return
        fig, ax = plt.subplots(figsize=(5, 3.5))
        ax.plot([q["minutes"] for q in points], [q["success"] for q in points], marker="o")
        ax.axhline(args.threshold, color="gray", linestyle="--")
        ax.set_xlabel("training minutes")
        ax.set_ylabel("evaluated success")
        ax.set_title(args.run.name)
        fig.tight_layout()
        fig.savefig(args.png, dpi=120)


if __name__ == "__main__":
    main()
