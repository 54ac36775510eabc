"""``embodied bench SUITE``: evaluate one policy on a suite of tasks from several simulators.

A suite is a YAML file naming tasks (each a simulator config, as under ``env:`` in a training
config), episodes and a seed. Every task runs through the same contract and ``evaluate_by_task``
(deterministic actions, episode i on the held-out seed ``eval_seed(seed, held_out=True) + i`` as
in ``embodied eval``), so the same seed gives the same results on CPU. Each finished task is
written to ``OUT/tasks/<task>.json`` at once with a key of everything that determines it (env
config, episodes, seeds, policy); a rerun of a killed bench skips tasks whose file matches. After
every task the report is rewritten from the finished ones: ``results.json``, ``report.md``,
``success.png`` and one mp4 per task (``videos/``).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from embodied.bench_report import write_report
from embodied.checkpoint import META
from embodied.config import ConfigError, check_folder_name, compose, to_dict, validate_tree
from embodied.evaluate import evaluate_by_task
from embodied.logger import file_in_the_way, write_atomic
from embodied.multitask import SIMULATOR_CONFIGS, check_tasks, make_env
from embodied.schema import UserError, check_at_least, check_distinct_episodes
from embodied.seeds import check_seed, eval_seed

POLICIES = ("random", "zero")  # baselines; any other policy comes from --checkpoint


class SpecMismatch(ValueError):
    """The checkpoint's policy cannot act in this task (other actions, cameras or state)."""


@dataclass
class BenchTask:
    # a simulator config: `simulator:` and its keys
    env: dict[str, Any] = field(default_factory=dict)
    name: str = ""  # in the report; default <simulator>/<task>
    episodes: int = 0  # 0: the suite's `episodes`
    # one task per value, e.g. {task_id: [0, 1, 2]}
    sweep: dict[str, list[Any]] = field(default_factory=dict)


@dataclass
class BenchConfig:
    name: str = "bench"
    seed: int = 0  # (episodes overlap between seeds closer than ``episodes``)
    episodes: int = 10  # per task
    videos: bool = True  # an mp4 per task: its first round of episodes, up to 4 side by side
    output_dir: str = "runs/bench"  # the report goes to output_dir/name/<policy>
    torch_threads: int = 2
    tasks: list[BenchTask] = field(default_factory=list)

    def validate(self) -> None:
        check_folder_name("name", self.name)
        check_seed("seed", self.seed)
        if not self.tasks:
            raise ValueError("tasks: a suite needs at least one task")
        check_at_least(self, 1, "episodes", "torch_threads")
        for i, task in enumerate(self.tasks):
            if task.episodes < 0:
                raise ValueError(
                    f"tasks[{i}].episodes: must be >= 0 (0: the suite's), got {task.episodes}"
                )
            for key, values in task.sweep.items():  # (an empty list ran nothing, unsaid)
                if not values:
                    raise ValueError(f"tasks[{i}].sweep.{key}: an empty list runs no task")


@dataclass
class BenchItem:
    name: str
    env: Any  # the simulator's config dataclass
    episodes: int


def expand(cfg: BenchConfig, source: str) -> list[BenchItem]:
    """The suite's tasks, sweeps expanded, each env validated against its simulator's schema."""
    items = []
    for i, task in enumerate(cfg.tasks):
        where = f"tasks[{i}]"
        simulator = task.env.get("simulator")
        if simulator not in SIMULATOR_CONFIGS:
            what = "missing" if simulator is None else f"unknown simulator {simulator!r}"
            raise ConfigError(
                f"{where}.env.simulator: {what}; known: {sorted(SIMULATOR_CONFIGS)} (in {source})"
            )
        keys = list(task.sweep)
        values = list(task.sweep.values())
        combos = [dict(zip(keys, vs)) for vs in _product(values)] if keys else [{}]
        for combo in combos:
            env_dict = {**task.env, **combo}
            sources = [(source, env_dict)]
            try:
                env = compose(SIMULATOR_CONFIGS[simulator], sources)  # "key: ... (in source)"
            except ConfigError as e:
                raise ConfigError(f"{where}.env.{e}") from None
            validate_tree(env, f"{where}.env.", sources, files=False)
            label = task.name or f"{simulator}/{_task_label(env)}"
            if combo and task.name:
                label += "/" + "/".join(str(v) for v in combo.values())
            episodes = task.episodes or cfg.episodes
            try:
                check_distinct_episodes(env, {f"{where}: {label}: episodes": episodes})
            except ValueError as e:
                raise ConfigError(f"{e} (in {source})") from None
            try:
                check_tasks(env)  # a typo in the last task fails before the first one runs
            except UserError as e:
                raise type(e)(f"{where}: {e} (in {source})") from None
            items.append(BenchItem(label, env, episodes))
    names = [_file_name(it.name) for it in items]  # (pick/easy and pick_easy: one file)
    if len(set(names)) != len(names):
        shared = sorted({it.name for it in items if names.count(_file_name(it.name)) > 1})
        raise ConfigError(
            f"tasks: tasks share a name or the file name of one ({shared}); "
            f"give them other `name:`s (in {source})"
        )
    return items


def _product(values: list[list]) -> list[tuple]:
    out = [()]
    for vs in values:
        out = [o + (v,) for o in out for v in vs]
    return out


def _task_label(env) -> str:
    if getattr(env, "suite", None):
        return f"{env.suite}/{env.task_id}"
    if getattr(env, "tasks", None):
        return "+".join(env.tasks)
    return env.task


def _file_name(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def hardware() -> dict:
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "gpu": gpu,
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


class _PolicySource:
    """Builds the policy for each task: a baseline for its spec, or the checkpoint's policy after
    checking the task gives what it was trained on."""

    def __init__(self, policy: str | None, checkpoint: str | None, seed: int):
        self.seed = seed
        if checkpoint:
            from embodied.checkpoint import load_policy_checkpoint
            from embodied.demos import load_policy
            from embodied.schema import EnvSpec

            # loaded once: a run that saves meanwhile moves RUN/last (the weights, the spec and
            # the key are one checkpoint's)
            loaded = load_policy_checkpoint(checkpoint)
            self.loaded, trained = load_policy(loaded)
            self.acts_on = _acts_on(trained.runner)
            self.spec = EnvSpec.from_dict(loaded["meta"]["spec"])
            path = Path(loaded["path"]).resolve()  # RUN/last, RUN -> RUN/checkpoints/iter_N
            inside_run = path.parent.name == "checkpoints"
            self.label = _file_name(
                f"{path.parent.parent.name}_{path.name}" if inside_run else path.name
            )
            # its contents too: a run retrained into the same directory rewrites the same path
            self.key = f"checkpoint:{path}:{checkpoint_fingerprint(path)}"
        else:
            if policy not in POLICIES:
                raise UserError(
                    f"--policy: unknown baseline {policy!r}; known: {list(POLICIES)} "
                    "(or --checkpoint)"
                )
            self.loaded = None
            self.acts_on = None
            self.label = policy
            self.key = policy
        self.deterministic = (
            policy != "random" or checkpoint is not None
        )  # the random baseline samples (seeded)

    def device(self, env_device: torch.device) -> torch.device:
        """Where the policy acts: a checkpoint's as in ``embodied eval`` (its run's
        ``runner.device``), a baseline on the environment's device."""
        return env_device if self.acts_on is None else self.acts_on

    def for_env(self, spec):
        if self.loaded is None:
            from embodied.models.baselines import BASELINES

            cls = BASELINES[self.label]
            return cls(spec, seed=self.seed) if self.label == "random" else cls(spec)
        problems = self.spec.input_changes(spec)  # (the action space too: same names, other units)
        trained, given = (
            [(c.name, c.height, c.width) for c in s.obs.cameras] for s in (self.spec, spec)
        )
        if not problems and trained != given:
            problems.append(f"camera sizes {trained} -> {given}")
        # only the keys the policy reads: a task need not give the others it was trained beside
        read = getattr(self.loaded, "privileged_inputs", tuple(self.spec.obs.privileged))
        missing = {
            k: v
            for k, v in self.spec.obs.privileged.items()
            if k in read and tuple(spec.obs.privileged.get(k, ())) != tuple(v)
        }
        if missing:
            problems.append(f"privileged state {sorted(missing)} missing or of another shape")
        if problems:
            raise SpecMismatch("the checkpoint does not fit this task: " + "; ".join(problems))
        return self.loaded


def run_bench(
    cfg: BenchConfig,
    source: str,
    *,
    policy: str | None = "random",
    checkpoint: str | None = None,
    out: str | None = None,
    progress: bool = True,
) -> dict:
    """Evaluate the policy on every task of the suite (skipping tasks finished earlier) and write
    the report. Returns the results as written to results.json."""
    torch.set_num_threads(cfg.torch_threads)
    items = expand(cfg, source)
    policies = _PolicySource(policy, checkpoint, cfg.seed)
    out_dir = Path(out) if out else Path(cfg.output_dir) / cfg.name / policies.label
    if why := file_in_the_way(out_dir):
        setting = "--out" if out else "output_dir"
        raise UserError(f"{setting}: {out_dir} {why}; give a directory for the report")
    (out_dir / "tasks").mkdir(parents=True, exist_ok=True)
    meta = {
        "suite": cfg.name,
        "suite_file": source,
        "policy": policies.key,
        "seed": cfg.seed,
        "hardware": hardware(),
    }
    done: list[dict] = []
    meta["skipped"] = []  # tasks the checkpoint cannot act in, with the reason
    for n, item in enumerate(items, 1):
        counted = f"[{n}/{len(items)}] {item.name}"
        key = _task_key(item, cfg, policies)
        path = out_dir / "tasks" / f"{_file_name(item.name)}.json"
        kept = _kept_results(path, key, counted)
        if kept is not None and cfg.videos and not _have_videos(kept, out_dir):
            print(f"{counted}: its earlier results have no video; run again", flush=True)
            kept = None
        if kept is not None:
            for r in kept:  # (a file written before rows said so)
                r.setdefault("held_out", not item.env.no_held_out)
            done += kept
            continue
        try:
            results = _run_task(item, policies, cfg, out_dir, progress)
        except SpecMismatch as e:
            print(f"{counted}: skipped, {e}", flush=True)
            meta["skipped"].append({"task": item.name, "reason": str(e)})
            continue
        for r in results:
            r["key"] = key
            r["hardware"] = meta["hardware"]  # (its timings': a resumed bench may run elsewhere)
        write_atomic(path, json.dumps({"key": key, "results": results}, indent=2))
        done += results
        for r in results:
            print(f"[{n}/{len(items)}] {_result_line(r)}", flush=True)
        write_report(out_dir, meta, done)
    report = write_report(out_dir, meta, done)
    print(f"report: {out_dir}/report.md, results.json, success.png", flush=True)
    return report


def checkpoint_fingerprint(path: Path) -> str:
    """sha1 of a checkpoint directory's meta.json bytes and each other file's name, size and
    mtime_ns (weights can be GBs: not read); what ``embodied eval`` writes there is left out."""
    digest = hashlib.sha1()
    for file in sorted(f for f in path.rglob("*") if f.is_file()):
        name = file.relative_to(path).as_posix()
        if name == "eval.json" or (name.startswith("eval_") and name.endswith(".mp4")):
            continue
        if name == META:
            digest.update(file.read_bytes())
        else:
            stat = file.stat()
            digest.update(f"{name}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
    return digest.hexdigest()


def _acts_on(runner) -> torch.device | None:
    """Where a checkpoint acts, as in ``embodied eval``: its run's ``runner.device`` (None: the
    simulator's, for auto or, said once, on a machine without that device)."""
    if runner.device == "auto":
        return None
    acting = runner.acting_device(torch.device("cpu"))  # (the note where the machine lacks it)
    return acting if acting.type != "cpu" or runner.device == "cpu" else None


def _task_key(item: BenchItem, cfg: BenchConfig, policies: _PolicySource) -> str:
    """What a task's results were made from: its env, episodes, the suite's seed, the policy
    (and where it acted, where not on the simulator's device: other kernels, other numbers)."""
    made_from = {
        "env": to_dict(item.env),
        "episodes": item.episodes,
        "first_seed": eval_seed(cfg.seed, held_out=True),  # (results on older seeds run again)
        "policy": policies.key,
    }
    if policies.acts_on is not None:
        made_from["acts_on"] = str(policies.acts_on)
    return hashlib.sha1(json.dumps(made_from, sort_keys=True).encode()).hexdigest()


def _have_videos(rows: list[dict], out_dir: Path) -> bool:
    """Whether the kept rows' video is there (rows made with ``videos: false`` have none; of a
    multi-task item's rows only the first VIDEO_TILES tasks' name it)."""
    videos = [r["video"] for r in rows if r.get("video")]
    return bool(videos) and all((out_dir / v).is_file() for v in videos)


def _kept_results(path: Path, key: str, counted: str) -> list[dict] | None:
    """A task's results from an earlier run of the same key, said so; None to run it (again:
    a file that cannot be read, said so too)."""
    if not path.exists():
        return None
    try:
        kept = json.loads(path.read_text())
        if kept.get("key") != key:
            return None
        results = kept["results"]
        if not isinstance(results, list) or not all(isinstance(r, dict) for r in results):
            raise TypeError("'results' holds no list of result rows")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        print(f"{counted}: its results in {path} cannot be read ({e!r}): run again", flush=True)
        return None
    print(f"{counted}: finished in an earlier run, kept ({path})", flush=True)
    return results


def _result_line(r: dict) -> str:
    low, high = r["success_ci95"]
    return (
        f"{r['task']}: success {r['success_rate']:.2f} ({r['successes']}/{r['episodes']}, "
        f"95% CI {low:.2f}-{high:.2f}), {r['env_steps_per_s']:.0f} env steps/s, "
        f"policy {r['policy_ms']:.1f} ms, {r['minutes']:.1f} min"
    )


def _run_task(
    item: BenchItem, policies: _PolicySource, cfg: BenchConfig, out_dir: Path, progress: bool
) -> list[dict]:
    t0 = time.time()
    env = make_env(item.env)
    try:
        policy = policies.for_env(env.spec)
        names = getattr(env, "names", None)
        instructions = (
            dict(zip(names, env.spec.instructions)) if names else {"all": env.spec.instructions[0]}
        )
        if isinstance(policy, torch.nn.Module):
            policy = policy.to(policies.device(env.device)).eval()
        video = out_dir / "videos" / f"{_file_name(item.name)}.mp4" if cfg.videos else None
        with tqdm(
            total=item.episodes * len(names or [0]),
            desc=item.name,
            unit="ep",
            leave=False,
            disable=not progress,
            mininterval=0.1 if sys.stderr.isatty() else 30.0,
        ) as bar:
            summaries = evaluate_by_task(
                env,
                policy,
                episodes=item.episodes,
                seed=eval_seed(cfg.seed, held_out=True),
                video_path=video,
                progress=bar,
                deterministic=policies.deterministic,
            )
    finally:
        env.close()
    minutes = (time.time() - t0) / 60
    results = []
    for task, s in summaries.items():
        results.append(
            {
                "task": item.name if task == "all" else f"{item.name}/{task}",
                "simulator": item.env.simulator,
                "instruction": instructions.get(task, instructions.get("all")),
                "episodes": s["eval/episodes"],
                "successes": round(s["eval/success_rate"] * s["eval/episodes"]),
                "success_rate": s["eval/success_rate"],
                "success_ci95": s["eval/success_ci95"],
                "success_at_end": s["eval/success_at_end"],
                "mean_length": s["eval/length"],
                "mean_return": s["eval/return"],
                "env_steps_per_s": s["eval/env_steps_per_s"],
                "policy_ms": s["eval/policy_ms"],
                "video": os.path.relpath(s["eval/video"], out_dir) if "eval/video" in s else None,
                "minutes": minutes,
                "held_out": not item.env.no_held_out,  # (LIBERO: the selection's episodes)
                "env": to_dict(item.env),
            }
        )
    return results
