"""What ``embodied report`` reads from a run directory, as typed data: the config, the logged
iterations and evaluations (``metrics.jsonl``: it is written as the run goes, so a run that
stopped or failed has a report too), the final summary, the host, the events and the records.
An ``embodied sft`` run has steps where a training run has iterations (its rows' ``iteration``
and ``env_steps`` are both the step), evaluations per task with no pooled row, a final
evaluation per task in metrics.json, and no events.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from embodied.evaluate import wilson_interval
from embodied.events import Event, read_events
from embodied.logger import read_metrics
from embodied.record_files import recorded_iterations
from embodied.recording import record_dir
from embodied.schema import UserError

PHASE_PREFIX = "time/"  # the logged seconds of each phase: time/<phase>_s
SFT_LOSS = "sft/loss"  # (in each logged step of an SFT run)


@dataclass
class Rate:
    """A success rate over ``episodes`` with its 95% Wilson interval."""

    rate: float
    episodes: int
    low: float
    high: float

    @classmethod
    def of(cls, rate: float, episodes: int) -> Rate:
        if math.isnan(rate):  # (not logged)
            return cls(rate, episodes, math.nan, math.nan)
        successes = round(rate * episodes)
        low, high = wilson_interval(successes, episodes)
        return cls(rate, episodes, low, high)


@dataclass
class TaskEval:
    success_once: Rate
    success_at_end: Rate
    ret: float  # the mean return
    length: float  # the mean episode length


@dataclass
class Evaluation:
    """One evaluation: all tasks pooled, and each task where there are several (an SFT run's
    each task, one or several: it logs no pooled row)."""

    iteration: int
    env_steps: int
    pooled: TaskEval | None  # (None only while its tasks are read: ``pooled_of`` them)
    tasks: dict[str, TaskEval] = field(default_factory=dict)


@dataclass
class RunData:
    run_dir: Path
    config_text: str  # config.yaml as the run wrote it
    iterations: list[dict]  # the training rows of metrics.jsonl, in order
    evaluations: list[Evaluation]
    final: Evaluation | None  # metrics.json's final evaluation (None: the run did not end)
    host_starts: list[dict]  # host.json: one entry per start of the run
    events: list[Event]
    records: list[dict]  # each record.json's iteration and reason, by iteration
    sft: bool = False  # an ``embodied sft`` run: steps, not iterations and env steps


def task_eval(row: dict, prefix: str = "eval/") -> TaskEval:
    """The ``prefix``success_rate, success_at_end, episodes, return and length of a row."""
    episodes = int(row[prefix + "episodes"])
    return TaskEval(
        success_once=Rate.of(row[prefix + "success_rate"], episodes),
        success_at_end=Rate.of(row.get(prefix + "success_at_end", math.nan), episodes),
        ret=row.get(prefix + "return", math.nan),
        length=row.get(prefix + "length", math.nan),
    )


def pooled_of(tasks: dict[str, TaskEval]) -> TaskEval:
    """The tasks' evaluations as one, each weighted by its episodes."""
    episodes = sum(t.success_once.episodes for t in tasks.values())

    def mean(value) -> float:
        total = sum(value(t) * t.success_once.episodes for t in tasks.values())
        return total / episodes if episodes else math.nan

    return TaskEval(
        success_once=Rate.of(mean(lambda t: t.success_once.rate), episodes),
        success_at_end=Rate.of(mean(lambda t: t.success_at_end.rate), episodes),
        ret=mean(lambda t: t.ret),
        length=mean(lambda t: t.length),
    )


def evaluations_of(rows: list[dict]) -> list[Evaluation]:
    """The evaluations among the rows: a pooled row (``eval/success_rate``), then the rows of
    its tasks (``eval/<task>/success_rate``) logged after it at the same iteration. Task rows
    with no pooled row before them (SFT logs none) are one evaluation, pooled here."""
    found: list[Evaluation] = []
    for row in rows:
        if "eval/success_rate" in row:
            found.append(Evaluation(row["iteration"], row["env_steps"], task_eval(row)))
            continue
        tasks = [
            key[len("eval/") : -len("/success_rate")]
            for key in row
            if key.startswith("eval/") and key.endswith("/success_rate")
        ]
        if not tasks:
            continue
        last = found[-1] if found else None
        if last is None or last.iteration != row["iteration"] or set(tasks) & set(last.tasks):
            last = Evaluation(row["iteration"], row["env_steps"], None)
            found.append(last)
        for task in tasks:
            last.tasks[task] = task_eval(row, f"eval/{task}/")
    for evaluation in found:
        evaluation.pooled = evaluation.pooled or pooled_of(evaluation.tasks)
    return found


def final_of(summary: dict) -> Evaluation:
    """metrics.json's final evaluation: a training run's, pooled with its tasks beside it, or
    an SFT run's, one per task (``final: {task: summary}``), at its last step."""
    final = summary["final"]
    if "steps" in summary:  # (SFT)
        tasks = {task: task_eval(row) for task, row in final.items()}
        step = summary["steps"]
        return Evaluation(step, step, pooled_of(tasks), tasks)
    tasks = summary.get("tasks", {})
    per_task = {t: task_eval(r) for t, r in tasks.items()} if len(tasks) > 1 else {}
    return Evaluation(final["iteration"], final["env_steps"], task_eval(final), per_task)


def records_of(run_dir: Path) -> list[dict]:
    """The iteration and reason of each record under RUN/rollouts."""
    found = []
    for iteration in recorded_iterations(run_dir):
        meta = record_dir(run_dir, iteration) / "record.json"
        try:
            reason = json.loads(meta.read_text())["reason"]
        except (OSError, json.JSONDecodeError, KeyError):
            reason = "damaged"
        found.append({"iteration": iteration, "reason": reason})
    return found


def read_run(run_dir: Path) -> RunData:
    """A run directory's data for its report (``UserError`` where it is not a run)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UserError(f"{run_dir}: no such run directory")
    config = run_dir / "config.yaml"
    jsonl = run_dir / "metrics.jsonl"
    if not jsonl.is_file():
        raise UserError(f"{run_dir}: not a training run (no metrics.jsonl)")
    rows = read_metrics(jsonl)  # (a non-finite number, logged as null, as NaN)
    summary_file = run_dir / "metrics.json"
    summary = json.loads(summary_file.read_text()) if summary_file.is_file() else None
    sft = "steps" in (summary or {}) or any(SFT_LOSS in r for r in rows)
    # (an iteration's row; replay_from's updates simulate nothing: their rows say "replayed")
    marks = (SFT_LOSS,) if sft else ("time/env_steps_per_s", "replayed")
    iterations = [r for r in rows if any(mark in r for mark in marks)]
    host = run_dir / "host.json"
    starts = json.loads(host.read_text()).get("starts", []) if host.is_file() else []
    return RunData(
        run_dir=run_dir,
        config_text=config.read_text() if config.is_file() else "(no config.yaml)",
        iterations=iterations,
        evaluations=evaluations_of(rows),
        final=final_of(summary) if summary else None,
        host_starts=starts,
        events=read_events(run_dir),
        records=records_of(run_dir),
        sft=sft,
    )


def run_status(events: list[Event], ended: bool) -> str:
    """How the run's last process ended: its ``end``, ``stop`` or ``failure`` event, one logged
    after its ``start`` or ``resume`` (an earlier process's stop says nothing of a resumed one).
    A run that logs no events (SFT) has ended where metrics.json holds its final evaluation."""
    starts = [i for i, e in enumerate(events) if e.kind in ("start", "resume")]
    if not starts:
        return "end" if ended else "running, stopped or cut off (no events logged)"
    outcomes = [e.kind for e in events[starts[-1] :] if e.kind in ("end", "stop", "failure")]
    return outcomes[-1] if outcomes else "running or cut off (no end event)"


def phase_seconds(iterations: list[dict]) -> dict[str, float]:
    """Each logged phase's seconds summed over the iterations (``time/<phase>_s``)."""
    totals: dict[str, float] = {}
    for row in iterations:
        for key, value in row.items():
            if key.startswith(PHASE_PREFIX) and key.endswith("_s") and "_per_" not in key:
                phase = key[len(PHASE_PREFIX) : -2]
                totals[phase] = totals.get(phase, 0.0) + value
    return totals
