"""What every training command shares around its loop: the run directory's lifecycle (a fresh
run, an overwrite, its lock; a resume's rewind to its checkpoint is resume.py's), the time
limit, the progress bar, and stopping on Ctrl-C or SIGTERM at a consistent point.
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
)
from embodied.config import ConfigError, save_config
from embodied.logger import file_in_the_way
from embodied.resume import rewind


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
    is one line naming the iteration (SFT's: ``unit="step"``), the values, the update's record
    and that checkpoint."""

    def __init__(
        self,
        iteration: int,
        values: dict,
        record: Path | None,
        saved: Path | None,
        unit: str = "iteration",
    ):
        found = ", ".join(f"{key} {value}" for key, value in values.items())
        before = f"; its record {record} holds the weights before it" if record else ""
        kept = f"the last checkpoint is {saved}" if saved else "no checkpoint was saved before it"
        super().__init__(
            f"{unit} {iteration}: the update is not finite ({found}), so the weights it "
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


def run_dir_of(checkpoint: Path, given: str) -> Path:
    """A checkpoint lives in RUN/checkpoints/iter_N: a resumed run keeps writing to RUN, whose
    ``last`` and ``best`` must be links (it moves them)."""
    in_run = checkpoint.parent
    if in_run.name == "checkpoints":
        in_run = in_run.parent
    for link in (in_run / "last", in_run / "best"):
        if link.exists() and not link.is_symlink():
            raise ConfigError(
                f"runner.resume: {link} is a directory, not a link: the run was copied "
                "following its links; copy it keeping them (cp -a, rsync -a), or remove "
                f"{in_run / 'last'} and {in_run / 'best'} and resume from one of "
                f"{in_run / 'checkpoints'}"
            )
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
        check_writable(run_dir, run_dir_keys(resume))
        return run_dir
    run_dir = Path(runner.output_dir) / runner.name
    check_fresh(run_dir, runner.overwrite)
    check_writable(run_dir, run_dir_keys(resume))
    return run_dir


def run_dir_keys(resume: dict | None) -> str:
    """The settings that chose a run's directory, as its errors name them."""
    return "runner.output_dir, runner.name" if resume is None else "runner.resume"


def check_writable(run_dir: Path, keys: str) -> None:
    """Before anything is built: the run directory, or the folder it will be made in, can be
    written (a read-only disk, another user's folder); ``keys`` name where it came from."""
    if why := file_in_the_way(run_dir):
        raise ConfigError(f"{keys}: {run_dir} {why}")
    existing = next(p for p in (run_dir, *run_dir.parents) if p.exists())
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{keys}: cannot write in {existing} (read-only, or not yours)")


@contextmanager
def run_dir_held(run_dir: Path, keys: str = run_dir_keys(None)):
    """The run directory for this process alone until the block ends: a second process on it (a
    double submit, a job requeued while the first still drains) is refused here, before it
    builds anything or touches a file. What this made is removed again if the block leaves the
    directory holding nothing but the lock (a run whose simulator failed to build). ``keys``:
    the settings that chose the directory (``run_dir_keys``), as its errors name them."""
    made = [p for p in (run_dir, *run_dir.parents) if not p.exists()]
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        lock_made = not (run_dir / LOCK).exists()
        lock = open(run_dir / LOCK, "a+")
    except OSError as e:
        raise _unwritable(run_dir, e, keys) from None
    try:
        _lock(lock, run_dir, keys)
        yield
    finally:
        lock.close()  # (the lock goes with it, and with the process however it ends)
        if lock_made and [p.name for p in run_dir.iterdir()] == [LOCK]:
            (run_dir / LOCK).unlink()
            for folder in made:  # (deepest first)
                folder.rmdir()


def _lock(lock, run_dir: Path, keys: str) -> None:
    """Hold ``lock`` (RUN/.lock, open) for this process, its pid written in it; a ConfigError
    naming the process that holds it. A filesystem without locks (some network ones) runs
    unlocked, saying so."""
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "?"
        resumed = keys == run_dir_keys({})  # (another name would not resume this run)
        raise ConfigError(
            f"{'runner.resume' if resumed else 'runner.name'}: {run_dir} is in use by another "
            f"run (process {holder}); wait for it to end"
            + ("" if resumed else ", or choose another runner.name")
        ) from None
    except OSError as e:  # ENOLCK, EOPNOTSUPP, ENOSYS: no flock there
        print(f"{run_dir}: not locked ({e.strerror}): a second run into it would not be refused")
        return
    lock.seek(0)
    lock.truncate()
    lock.write(f"{os.getpid()}\n")
    lock.flush()


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
        raise _unwritable(run_dir, e, run_dir_keys(resume)) from None


def _unwritable(run_dir: Path, error: OSError, keys: str) -> ConfigError:
    """The one line for a run directory that could not be made or written in (``keys``: the
    settings that chose it)."""
    return ConfigError(f"{keys}: cannot write in {run_dir} ({error.strerror or error})")


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
