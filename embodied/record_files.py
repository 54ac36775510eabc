"""Rollout records on disk (embodied/recording.py writes and reads them): where each iteration's
record is, which are there, why each was written, and their removal, whole or not at all (a
record is renamed out of the listing first), by pruning or when a resumed run abandons them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from embodied.checkpoint import fsync, iteration_dirs

RECORDS = "rollouts"
ABANDONED = "abandoned"  # RUN/rollouts/abandoned: the records a resume took out of the run


def record_dir(run_dir: Path, iteration: int) -> Path:
    return Path(run_dir) / RECORDS / f"iter_{iteration:06d}"


def recorded_iterations(run_dir: Path) -> list[int]:
    """The iterations with a record under RUN/rollouts, in order: folders named as
    ``record_dir`` names them and nothing else (not one still staged, nor a user's copy:
    ``iter_000005.bak``'s number stopped the run's next record, ``iter_000005_orig`` or
    ``iter_5`` counted 5 twice); a damaged one is ``read_record``'s to name."""
    folder = Path(run_dir) / RECORDS
    if not folder.is_dir():
        return []
    found = iteration_dirs(folder)  # (iter_5 beside iter_000005: a copy, not a record)
    return [i for i, path in found if path.is_dir() and path.name == record_dir(run_dir, i).name]


def prune_records(run_dir: Path, keep: int) -> list[int]:
    """Remove all but the newest ``keep`` records written every Nth iteration (the others stay);
    the iterations removed."""
    every = []
    for iteration in recorded_iterations(run_dir):
        path = record_dir(Path(run_dir), iteration)
        if record_reason(path) == "every":
            every.append(path)
    removed = every[: max(0, len(every) - keep)]
    for path in removed:
        remove_record(path)
    return [int(path.name.split("_")[1]) for path in removed]


def record_reason(path: Path) -> str | None:
    """Why the record at ``path`` was written ("every", "spike", "non-finite"); None where its
    record.json cannot be read."""
    try:
        meta = json.loads((path / "record.json").read_text())
    except (OSError, ValueError):
        return None
    return meta.get("reason") if isinstance(meta, dict) else None


def remove_record(path: Path) -> None:
    """Remove a record whole: renamed out of the listing first (a name starting with "."), so
    a crash meanwhile leaves no half record among them; earlier leftovers of such removals go
    too."""
    gone = path.with_name(f".{path.name}.removed")
    shutil.rmtree(gone, ignore_errors=True)
    path.rename(gone)
    fsync(path.parent)
    for leftover in path.parent.glob(".iter_*.removed"):
        shutil.rmtree(leftover, ignore_errors=True)


def drop_records_after(run_dir: Path, iteration: int) -> tuple[list[int], list[int]]:
    """Take the rollout records (``RUN/rollouts/iter_N``) of the iterations after ``iteration``
    out of the run, and any a write left staged: (the iterations removed, those moved to
    ``rollouts/abandoned/``). A run resumed from an earlier checkpoint abandons them: left,
    ``embodied episodes``, ``runner.replay_from`` and the report would read iterations the run
    no longer has, and the pruning, which keeps the newest, would remove the resumed run's own
    records first. The non-finite and spike ones, never pruned (and what the failure's line
    pointed at), are moved aside, not removed."""
    folder = Path(run_dir) / RECORDS
    if not folder.is_dir():
        return [], []
    for staged in folder.glob("iter_*.tmp"):  # (a write cut short; nothing writes here now)
        shutil.rmtree(staged)
    removed, kept = [], []
    for at in [at for at in recorded_iterations(run_dir) if at > iteration]:
        path = record_dir(Path(run_dir), at)
        if record_reason(path) not in ("non-finite", "spike"):
            remove_record(path)
            removed.append(at)
            continue
        abandoned = folder / ABANDONED
        abandoned.mkdir(exist_ok=True)
        earlier = len(list(abandoned.glob(f"{path.name}-*")))  # (one per resume that took it)
        path.rename(abandoned / f"{path.name}-{earlier + 1}")
        kept.append(at)
    return removed, kept
