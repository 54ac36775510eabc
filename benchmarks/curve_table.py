"""Print a run's evaluation curve (success vs env steps and vs minutes) as a markdown table.

python benchmarks/curve_table.py runs/pushcube_ppo
"""

import sys
from pathlib import Path


def main(run_dir: str) -> None:
    from embodied.logger import read_metrics

    rows = read_metrics(Path(run_dir) / "metrics.jsonl")  # (a non-finite number as NaN)
    minutes = {}
    print(
        "| env steps | minutes | success (once) | success at end | episodes |\n"
        "|---:|---:|---:|---:|---:|"
    )
    for r in rows:
        if "time/minutes" in r:
            minutes[r["env_steps"]] = r["time/minutes"]
        if "eval/success_rate" in r:
            m = r.get("minutes", minutes.get(r["env_steps"], float("nan")))
            at_end = r.get("eval/success_at_end", float("nan"))
            print(
                f"| {int(r['env_steps'])} | {m:.1f} | {r['eval/success_rate']:.2f} | "
                f"{at_end:.2f} | {int(r['eval/episodes'])} |"
            )


if __name__ == "__main__":
    main(sys.argv[1])
