"""The bench report: results.json, report.md (a markdown table) and success.png (success per task
with its 95% Wilson interval, and the simulator's speed), rewritten after every finished task."""

from __future__ import annotations

import json
import time
from pathlib import Path

from embodied.logger import write_atomic

COLUMNS = (
    "task",
    "episodes",
    "success",
    "95% CI",
    "mean length",
    "env steps/s",
    "policy ms",
    "video",
)


def write_report(out_dir: Path, meta: dict, results: list[dict]) -> dict:
    report = {**meta, "written": time.strftime("%Y-%m-%d %H:%M:%S"), "tasks": results}
    if results:  # tasks weighted equally, as LIBERO's published protocol averages its 10 tasks
        report["mean_task_success"] = sum(r["success_rate"] for r in results) / len(results)
    write_atomic(out_dir / "results.json", json.dumps(report, indent=2))
    write_atomic(out_dir / "report.md", markdown(report))
    if results:
        plot(out_dir / "success.png", results, title=f"{meta['suite']}: {meta['policy']}")
    return report


def markdown(report: dict) -> str:
    hw = report["hardware"]
    lines = [
        f"# Bench `{report['suite']}`: policy `{report['policy']}`",
        "",
        f"Seed {report['seed']}; {hw['cpus']} CPUs ({hw['processor']}), "
        f"GPU: {hw['gpu'] or 'none'}; "
        f"torch {hw['torch']}, Python {hw['python']}; written {report['written']}.",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    for r in report["tasks"]:
        lo, hi = r["success_ci95"]
        video = f"[mp4]({r['video']})" if r.get("video") else ""
        lines.append(
            f"| {r['task']} | {r['episodes']} | "
            f"{r['success_rate']:.2f} ({r['successes']}/{r['episodes']}) | "
            f"{lo:.2f}-{hi:.2f} | {r['mean_length']:.1f} | {r['env_steps_per_s']:.1f} | "
            f"{r['policy_ms']:.2f} | {video} |"
        )
    if "mean_task_success" in report:
        n = len(report["tasks"])
        episodes = sum(r["episodes"] for r in report["tasks"])
        lines.append(
            f"| mean of task success rates ({n} tasks weighted equally) | {episodes} | "
            f"{report['mean_task_success']:.2f} | | | | | |"
        )
    elsewhere = [r["task"] for r in report["tasks"] if r.get("hardware") != hw]
    if elsewhere:  # (kept from an earlier process: its timings are that process's)
        lines.append(
            f"\nThe timings (env steps/s, policy ms) of {', '.join(elsewhere)} were measured by "
            "an earlier process on other or unrecorded hardware (each task's `hardware` in "
            "results.json)."
        )
    repeated = [r for r in report["tasks"] if r.get("held_out") is False]
    if repeated:
        lines.append(
            f"\nNot held out: {', '.join(r['task'] for r in repeated)}. Their episodes are the "
            "ones a training run's evaluations ran (LIBERO's 50 initial states per task), so a "
            "checkpoint chosen on them (`best`) scores its selection's episodes."
        )
    for skipped in report.get("skipped", []):
        lines.append(f"\nSkipped `{skipped['task']}`: {skipped['reason']}.")
    return "\n".join(lines) + "\n"


def plot(path: Path, results: list[dict], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    names = [r["task"] for r in results]
    rate = [r["success_rate"] for r in results]
    err = [  # (rows kept from before the interval held its rate: -1e-16 is refused)
        [max(0.0, r["success_rate"] - r["success_ci95"][0]) for r in results],
        [max(0.0, r["success_ci95"][1] - r["success_rate"]) for r in results],
    ]
    fig, (ax, speed) = plt.subplots(1, 2, figsize=(11, 0.5 * len(names) + 1.8), sharey=True)
    y = list(range(len(names)))
    ax.barh(y, rate, xerr=err, color="tab:blue", capsize=3)
    ax.set_xlim(0, 1)
    ax.set_xlabel("success rate (95% Wilson interval)")
    ax.set_yticks(y, names)
    ax.invert_yaxis()
    speed.barh(y, [r["env_steps_per_s"] for r in results], color="tab:gray")
    speed.set_xscale("log")
    speed.set_xlabel("env steps/s (all environments)")
    fig.suptitle(title)
    fig.tight_layout()
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(path)
