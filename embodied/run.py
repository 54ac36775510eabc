"""What every training command shares around its loop: the run directory's lifecycle (a fresh
run, an overwrite, a rewind to the checkpoint a resume starts from), resuming (with a check
that the config still describes the same run), the metrics log without duplicate rows, the
checkpoints, the time limit, and stopping on Ctrl-C or SIGTERM at a consistent point.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from embodied import numerics
from embodied.checkpoint import (
    LAST,
    META,
    checkpoint_dir,
    drop_checkpoints_after,
    iteration_dirs,
    point_best,
)
from embodied.config import ConfigError, save_config
from embodied.logger import file_in_the_way, metrics_line, read_jsonl, write_atomic


class Interrupted(Exception):
    """Raised inside collection or evaluation when a stop was requested (nothing is half done:
    the weights are the last completed iteration's)."""


class Stopped(Exception):
    """Training stopped on a signal after saving the last completed iteration."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.signum = signum


class NonFiniteUpdate(Exception):
    """An update whose loss or gradient norm is not finite: the weights it stepped are not
    usable, so the run stops there, unsaved (its last checkpoint stays the newest); ``str()``
    is one line naming the iteration, the values, the update's record and that checkpoint."""

    def __init__(self, iteration: int, values: dict, record: Path | None, saved: Path | None):
        found = ", ".join(f"{key} {value}" for key, value in values.items())
        before = f"; its record {record} holds the weights before it" if record else ""
        kept = f"the last checkpoint is {saved}" if saved else "no checkpoint was saved before it"
        super().__init__(
            f"iteration {iteration}: the update is not finite ({found}), so the weights it "
            f"stepped are not usable and the run stopped{before}; {kept}"
        )
        self.iteration = iteration


class StopSignals:
    """Ctrl-C and SIGTERM ask the loop to stop at its next consistent point instead of killing it
    mid-update; a second Ctrl-C quits at once (KeyboardInterrupt, nothing saved)."""

    def __init__(self):
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        if _main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = signum
        name = signal.Signals(signum).name
        print(
            f"\n{name}: stopping at the next consistent point and saving "
            "(Ctrl-C again quits without saving)",
            file=sys.stderr,
            flush=True,
        )

    @property
    def requested(self) -> bool:
        return self.signum is not None


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def flatten(tree: dict, prefix: str = "") -> dict[str, object]:
    """{"a": {"b": 1}} -> {"a.b": 1}"""
    out: dict[str, object] = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, path + "."))
        else:
            out[path] = value
    return out


# keys a resumed run may change: where it writes, how it reports and how long it goes on
RESUME_FREE = (
    "runner.name",
    "runner.output_dir",
    "runner.resume",
    "runner.resume_force",
    "runner.overwrite",
    "runner.progress",
    "runner.max_minutes",
    "runner.eval_every",
    "runner.eval_episodes",
    "runner.final_eval_episodes",
    "runner.save_every",
    "runner.keep_checkpoints",
    "runner.video",
    "runner.trace",
    "runner.report",
    # what the run records (rollouts, spikes): records draw no random number
    "runner.record_rollouts",
    "runner.keep_rollouts",
    "runner.spike_factor",
    "env.num_workers",  # environments are seeded per episode: the worker layout changes nothing
    "env.step_timeout_s",
)
# where the roles run (embedded or on Ray, how many workers, which devices) changes no number,
# except how far collection may run ahead of the update
# where the roles run and which backend trains them: the same numbers (to float rounding);
# but for how far collection runs ahead and the precision (bf16 is not float32's rounding)
RESUME_FREE_PREFIX = ("cluster.", "trainer.")
RESUME_BOUND = ("cluster.max_staleness", "trainer.precision")


def check_resume(saved: dict, current: dict, checkpoint: Path, force: bool) -> None:
    """Refuse to resume when a key that changes the run's numbers differs from the checkpoint's
    config. ``runner.total_env_steps`` may grow unless the learning rate anneals over it. Keys
    newer than the checkpoint (not in its config) are not compared."""
    before = flatten(saved)
    now = flatten(current)
    free = set(RESUME_FREE)
    if not now.get("algorithm.anneal_lr", False):
        free.add("runner.total_env_steps")
    # (a key the checkpoint's config lacks is newer than the run: it takes its default)
    changed = [
        k
        for k in sorted(before)
        if k not in free
        and (not k.startswith(RESUME_FREE_PREFIX) or k in RESUME_BOUND)
        and before.get(k) != now.get(k)
    ]
    if not changed or force:
        return
    first = changed[0]
    more = f" (and {len(changed) - 1} more: {', '.join(changed[1:4])})" if len(changed) > 1 else ""
    raise ConfigError(
        f"runner.resume: {first} is {now.get(first)!r} here but {before.get(first)!r} in "
        f"{checkpoint}{more}; that changes the run: set runner.resume_force=true to resume anyway"
    )


def trim_metrics(run_dir: Path, iteration: int, evaluated: int | None = None) -> None:
    """Drop the metrics.jsonl rows logged after ``iteration`` (by a run that went on past its
    last checkpoint), so a resumed run logs each iteration once; also the evaluation rows of
    iteration ``evaluated`` (an evaluation beside training whose result no checkpoint holds:
    the resumed run evaluates it again) and the final evaluation's (the resumed run ends with
    its own)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return
    kept = []
    for row in read_jsonl(path):  # (without a line cut by the crash the run resumes from)
        at = row.get("iteration", 0)
        evaluation = any(key.startswith("eval/") for key in row)
        if at <= iteration and not (evaluation and at == evaluated) and not row.get("final"):
            kept.append(metrics_line(row))  # (an older file's NaN tokens as null)
    write_atomic(path, "".join(kept))


class Clock:
    """Training time across resumes, and the ``runner.max_minutes`` limit."""

    def __init__(self, seconds_before: float, max_minutes: float | None):
        self.start = time.time() - seconds_before
        self.max_minutes = max_minutes

    @property
    def seconds(self) -> float:
        return time.time() - self.start

    @property
    def out_of_time(self) -> bool:
        return self.max_minutes is not None and self.seconds >= self.max_minutes * 60

    def left(self) -> dict[str, str]:
        """Progress-bar field for runs stopped by max_minutes (the bar's own ETA assumes the step
        budget is reached)."""
        if self.max_minutes is None:
            return {}
        return {"min_left": f"{max(0.0, self.max_minutes - self.seconds / 60):.1f}"}


def bar_interval() -> float:
    """Progress-bar refresh: live on a terminal, a line every 30 s into a log file."""
    return 0.1 if sys.stderr.isatty() else 30.0


def bar_postfix(metrics: dict, steps: int, seconds: float, clock: Clock) -> dict[str, str]:
    """The progress bar's summary of an iteration: its speed, return, success, how busy the
    roles were (on Ray), and the time left."""
    postfix = {"sps": f"{steps / seconds:.0f}"}
    if "episode/return" in metrics:
        postfix["ret"] = f"{metrics['episode/return']:.2f}"
    if "episode/success_once" in metrics:
        postfix["succ"] = f"{metrics['episode/success_once']:.2f}"
    if "grpo/kept_groups" in metrics:
        postfix["kept"] = f"{metrics['grpo/kept_groups']:.0f}"
    if "cluster/env_idle" in metrics:  # how busy each role's busiest worker was
        busy = [1 - metrics[f"cluster/{role}_idle"] for role in ("env", "rollout", "actor")]
        postfix["busy"] = "env {:.0%} roll {:.0%} act {:.0%}".format(*busy)
    return {**postfix, **clock.left()}


def write_trace(path: Path, spans: list[tuple[str, str, int, float, float]]) -> None:
    """A Chrome/Perfetto trace (chrome://tracing, ui.perfetto.dev) of ``spans``: (what, role,
    worker index, start, end), times in seconds since the epoch; one process row per role, one
    thread row per worker."""
    roles = list(dict.fromkeys(role for _, role, _, _, _ in spans))
    origin = min(start for _, _, _, start, _ in spans)
    events = [
        {"name": "process_name", "ph": "M", "pid": pid, "args": {"name": role}}
        for pid, role in enumerate(roles)
    ]
    events += [
        {
            "name": name,
            "ph": "X",
            "pid": roles.index(role),
            "tid": worker,
            "ts": 1e6 * (start - origin),
            "dur": 1e6 * (end - start),
        }
        for name, role, worker, start, end in spans
    ]
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    tmp.replace(path)


# the counters an evaluation is recorded at (``Evaluations.record``)
EVALUATED_AT = ("iteration", "env_steps", "train_seconds")


LOCK = ".lock"  # RUN/.lock: held by the process that runs in RUN (its pid inside)

RUN_FILES = (
    "metrics.jsonl",
    "metrics.json",
    "checkpoints",
    "tb",
    "last",
    "best",
    "videos",
    "cluster.json",
    "trace.json",
    "events.jsonl",
    "rollouts",
    "report.html",
    "episodes",  # (`embodied episodes RUN`'s default output)
)


def rewind(run_dir: Path, resume: dict, cfg, evaluates_beside: bool) -> None:
    """Take the run back to the checkpoint ``resume`` (loaded) before it goes on from there:
    the metrics rows logged after it, those of the evaluation it will run again, the final
    evaluation's result, the later checkpoints and rollout records go; ``RUN/best`` is its
    best. An unfinished evaluation that cannot run again (``why_not_again``) keeps the rows it
    logged."""
    counters = resume["counters"]
    done = counters["iteration"]
    again = evaluation_again(cfg, evaluates_beside, run_dir, counters)
    trim_metrics(run_dir, done, None if again is None else again["iteration"])
    # the earlier process's result: the resumed run writes its own when it ends
    for result in ("metrics.json", "videos/final_eval.mp4", "videos/eval.mp4"):  # (sft's)
        (run_dir / result).unlink(missing_ok=True)
    abandoned = drop_checkpoints_after(run_dir, done)
    if abandoned:
        print(f"resuming from iteration {done}: removed the later checkpoints {abandoned}")
    records = drop_records_after(run_dir, done)
    if records:
        print(f"resuming from iteration {done}: removed the later rollout records {records}")
    best = counters.get("best")
    point_best(run_dir, None if best is None else best["iteration"])


def drop_records_after(run_dir: Path, iteration: int) -> list[int]:
    """Remove the rollout records (``RUN/rollouts/iter_N``, embodied/recording.py) of the
    iterations after ``iteration``, and any a write left staged; the iterations removed. A run
    resumed from an earlier checkpoint abandons them: left, ``embodied episodes``,
    ``runner.replay_from`` and the report would read iterations the run no longer has, and the
    pruning, which keeps the newest, would remove the resumed run's own records first."""
    folder = Path(run_dir) / "rollouts"
    if not folder.is_dir():
        return []
    for staged in folder.glob("iter_*.tmp"):  # (a write cut short; nothing writes here now)
        shutil.rmtree(staged)
    later = [(at, path) for at, path in iteration_dirs(folder) if at > iteration]
    for _, path in later:
        shutil.rmtree(path)
    return [at for at, _ in later]


def unsaved_evaluation(counters: dict) -> dict | None:
    """The counters of the evaluation beside training that was in flight when ``counters`` (a
    checkpoint's) were saved, where they lack its result: a resume from them runs it again."""
    at = counters.get("evaluating")
    recorded = [e["iteration"] for e in counters.get("evals", [])]
    return None if at is None or at["iteration"] in recorded else at


def evaluation_again(cfg, evaluates_beside: bool, run_dir: Path, counters: dict) -> dict | None:
    """The counters (``EVALUATED_AT``) of the unsaved evaluation that a run resumed from a
    checkpoint's ``counters`` runs again beside training; None where there is none."""
    unsaved = unsaved_evaluation(counters)
    if unsaved is None or why_not_again(cfg, evaluates_beside, run_dir, counters, unsaved):
        return None
    return unsaved


def logged_again_from(cfg, evaluates_beside: bool, run_dir: Path, counters: dict) -> int:
    """The env step from which a run resumed from ``counters`` logs anew: its checkpoint's, or
    that of the evaluation it runs again where earlier (TensorBoard hides the earlier processes'
    points from there on, and gets the rows metrics.jsonl keeps from there again)."""
    again = evaluation_again(cfg, evaluates_beside, run_dir, counters)
    steps = counters["env_steps"]
    return steps if again is None else min(steps, again["env_steps"])


def why_not_again(
    cfg, evaluates_beside: bool, run_dir: Path, counters: dict, at: dict
) -> str | None:
    """Why the unfinished evaluation ``at`` of a resumed checkpoint (``counters``) cannot run
    again beside training; None where it can. Decided from the checkpoint alone, so that
    ``rewind`` and the resumed run agree."""
    run = cfg.runner
    out_of_time = run.max_minutes is not None and counters["train_seconds"] >= run.max_minutes * 60
    path = checkpoint_dir(run_dir, at["iteration"])
    if not evaluates_beside:
        return "it runs again only with cluster.eval.workers"
    if counters["env_steps"] >= run.total_env_steps or out_of_time:
        return "no iteration is left to run it beside"
    if not (path / META).is_file():
        return f"its checkpoint {path} is gone"
    return None


def run_dir_of(checkpoint: Path, given: str) -> Path:
    """A checkpoint lives in RUN/checkpoints/iter_N: a resumed run keeps writing to RUN."""
    if checkpoint.parent.name != "checkpoints":
        raise ConfigError(
            f"runner.resume: {given} is not inside a run directory (RUN/checkpoints/iter_N); "
            "resume from the run directory or one of its checkpoints"
        )
    return checkpoint.parent.parent


def run_dir_for(runner, resume: dict | None) -> Path:
    """A run's directory (``runner``: its config's runner section): the resumed checkpoint's,
    or ``output_dir/name``, which must not hold an earlier run unless ``overwrite``."""
    if resume is not None:
        run_dir = run_dir_of(resume["path"], runner.resume)
        check_writable(run_dir, "runner.resume")
        return run_dir
    run_dir = Path(runner.output_dir) / runner.name
    check_fresh(run_dir, runner.overwrite)
    check_writable(run_dir, "runner.output_dir, runner.name")
    return run_dir


def check_writable(run_dir: Path, keys: str) -> None:
    """Before anything is built: the run directory, or the folder it will be made in, can be
    written (a read-only disk, another user's folder); ``keys`` name where it came from."""
    if why := file_in_the_way(run_dir):
        raise ConfigError(f"{keys}: {run_dir} {why}")
    existing = next(p for p in (run_dir, *run_dir.parents) if p.exists())
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{keys}: cannot write in {existing} (read-only, or not yours)")


@contextmanager
def run_dir_held(run_dir: Path):
    """The run directory for this process alone until the block ends: a second process on it (a
    double submit, a job requeued while the first still drains) is refused here, before it
    builds anything or touches a file. What this made is removed again if the block leaves the
    directory holding nothing but the lock (a run whose simulator failed to build)."""
    made = [p for p in (run_dir, *run_dir.parents) if not p.exists()]
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        lock_made = not (run_dir / LOCK).exists()
        lock = open(run_dir / LOCK, "a+")
    except OSError as e:
        raise _unwritable(run_dir, e) from None
    try:
        _lock(lock, run_dir)
        yield
    finally:
        lock.close()  # (the lock goes with it, and with the process however it ends)
        if lock_made and [p.name for p in run_dir.iterdir()] == [LOCK]:
            (run_dir / LOCK).unlink()
            for folder in made:  # (deepest first)
                folder.rmdir()


def _lock(lock, run_dir: Path) -> None:
    """Hold ``lock`` (RUN/.lock, open) for this process, its pid written in it; a ConfigError
    naming the process that holds it. A filesystem without locks (some network ones) runs
    unlocked, saying so."""
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "?"
        raise ConfigError(
            f"runner.name: {run_dir} is in use by another run (process {holder}); wait for it "
            "to end, or choose another runner.name"
        ) from None
    except OSError as e:  # ENOLCK, EOPNOTSUPP, ENOSYS: no flock there
        print(f"{run_dir}: not locked ({e.strerror}): a second run into it would not be refused")
        return
    lock.seek(0)
    lock.truncate()
    lock.write(f"{os.getpid()}\n")
    lock.flush()


def _unwritable(run_dir: Path, error: OSError) -> ConfigError:
    """The one line for a run directory that could not be made or written in."""
    reason = error.strerror or error
    return ConfigError(f"runner.output_dir, runner.name: cannot write in {run_dir} ({reason})")


def enter_run_dir(run_dir: Path, cfg, resume: dict | None, evaluates_beside: bool) -> None:
    """The run directory made ready for the run: taken back to the resumed checkpoint
    (``rewind``) or emptied (``runner.overwrite``), with the run's config.yaml and its numeric
    settings (``numerics.record``)."""
    if resume is not None:
        rewind(run_dir, resume, cfg, evaluates_beside)
    elif cfg.runner.overwrite:
        clear_run(run_dir)
    start = 0 if resume is None else resume["counters"]["iteration"]
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run_dir / "config.yaml")
        numerics.record(run_dir, iteration=start, deterministic=cfg.runner.deterministic)
    except OSError as e:
        raise _unwritable(run_dir, e) from None


def check_fresh(run_dir: Path, overwrite: bool) -> None:
    """A new run never mixes into an earlier one's metrics, checkpoints or best link."""
    found = [
        name for name in RUN_FILES if (run_dir / name).exists() or (run_dir / name).is_symlink()
    ]
    if found and not overwrite:
        has_checkpoint = (run_dir / LAST / META).is_file()  # (one stopped before any has none)
        resume = f"continue it with runner.resume={run_dir}, " if has_checkpoint else ""
        raise ConfigError(
            f"runner.name: {run_dir} already holds a run ({', '.join(found)}); {resume}start "
            "over with runner.overwrite=true, or choose another runner.name"
        )
    if found and not (run_dir / "config.yaml").is_file():  # (every run writes it first)
        raise ConfigError(
            f"runner.overwrite: {run_dir} holds {', '.join(found)} but no config.yaml, so it is "
            "not a run's directory and nothing there is removed; choose another runner.name"
        )


def clear_run(run_dir: Path) -> None:
    for name in RUN_FILES:
        path = run_dir / name
        if path.is_symlink() or path.is_file():
            path.unlink()
        elif path.is_dir():
            shutil.rmtree(path)
