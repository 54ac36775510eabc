"""Run logging: TensorBoard scalars and one JSON line per logged step (``metrics.jsonl``), and
the file helpers every writer of a run or a dataset uses.

``metrics.jsonl`` is strict JSON: a number that is not finite (a NaN loss) is written as null,
since JSON has no NaN (Python's ``NaN`` and ``Infinity`` tokens stop jq and ``JSON.parse``);
TensorBoard gets the float. ``read_metrics`` reads a null back as NaN.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from pathlib import Path


def after_the_last_event_file(tb_dir: Path) -> None:
    """Wait, if need be, for the second after the newest event file in ``tb_dir`` was made.
    TensorBoard reads a run's files in name order, and a name is the second it was made, then
    host, pid and a counter without padding ("...9" sorts after "...10"): a resumed process's
    file made in the same second could sort before the last process's, whose purge would then
    hide the new points (a test resuming twice within a second lost its third iteration)."""
    stamps = [p.name.split(".")[3] for p in tb_dir.glob("events.out.tfevents.*")]
    newest = max((int(s) for s in stamps if s.isdigit()), default=None)
    if newest is not None and time.time() < newest + 1:
        time.sleep(newest + 1 - time.time())


class RunLogger:
    """``resumed_at``: the step from which a resumed run logs anew (its checkpoint's, or an
    evaluation's it runs again: ``resume.logged_again_from``). TensorBoard hides what an earlier
    process logged from that step on, and the rows metrics.jsonl keeps from it (the runner
    trims the rest) are written to TensorBoard again."""

    def __init__(self, run_dir: Path, enabled_tb: bool = True, resumed_at: int | None = None):
        path = Path(run_dir) / "metrics.jsonl"
        end_cut_line(path)
        self.jsonl = open(path, "a")
        self.tb = None
        if enabled_tb:
            from torch.utils.tensorboard import SummaryWriter

            after_the_last_event_file(Path(run_dir) / "tb")
            self.tb = SummaryWriter(str(Path(run_dir) / "tb"), purge_step=resumed_at)
            if resumed_at is not None:
                self._scalars_again(read_metrics(path), resumed_at)

    def _scalars_again(self, rows: list[dict], step: int) -> None:
        for row in rows:
            if row.get("env_steps", -1) >= step:
                for k, v in _scalars(row).items():
                    if "/" in k:  # (a metric, not the row's env_steps or iteration)
                        self.tb.add_scalar(k, v, row["env_steps"])

    def log(self, metrics: dict, step: int, **extra) -> None:
        """Write the numeric ``group/name`` entries at ``step`` (env steps)."""
        scalars = _scalars(metrics)
        if self.tb is not None:
            for k, v in scalars.items():
                self.tb.add_scalar(k, v, step)
        self.jsonl.write(metrics_line({"env_steps": step, **extra, **scalars}))
        self.jsonl.flush()
        os.fsync(self.jsonl.fileno())  # (a checkpoint is synced: the rows it counts are too)

    def close(self) -> None:
        self.jsonl.close()
        if self.tb is not None:
            self.tb.close()


def _scalars(metrics: dict) -> dict[str, float]:
    return {
        k: float(v)
        for k, v in metrics.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool)
    }


def metrics_line(row: dict) -> str:
    """``row`` as one line of metrics.jsonl: strict JSON, a non-finite number as null."""
    finite = {
        k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in row.items()
    }
    return json.dumps(finite, allow_nan=False) + "\n"


def read_metrics(path: Path) -> list[dict]:
    """The rows of metrics.jsonl (``read_jsonl``), each null (a number that was not finite) as
    NaN: a reader sees a float that is not finite, as it did when the file held NaN tokens
    (an older run's file still may; they read as floats)."""
    return [{k: math.nan if v is None else v for k, v in row.items()} for row in read_jsonl(path)]


def end_cut_line(path: Path) -> None:
    """End the last line of a JSON-lines file where a crash cut it short, so that the next row
    appended is not glued to it (and lost with it). Nothing for a missing or whole file."""
    if not path.is_file() or path.stat().st_size == 0:
        return
    with open(path, "rb+") as f:
        f.seek(-1, os.SEEK_END)
        if f.read(1) != b"\n":
            f.write(b"\n")


def write_atomic(path: Path, text: str | bytes) -> None:
    """Write ``text`` (or bytes: a recorded video's) to ``path`` whole or not at all: a crash
    leaves the old file or the new, never part of one (a reader of metrics.json, config.yaml, a
    report). The temporary file is this writer's own: two processes writing one report do not
    rename each other's half."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(tmp, "wb" if isinstance(text, bytes) else "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read_jsonl(path: Path) -> list[dict]:
    """The rows of a JSON-lines file (metrics.jsonl, events.jsonl); a line cut by a crash is
    left out."""
    rows = []
    for line in Path(path).read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def file_in_the_way(path: str | Path) -> str | None:
    """Why ``path`` cannot be a directory to write in ("is a file", "is inside F, a file": it, or
    the nearest of its parents that exists, is a file or a broken link); None when it can be."""
    path = Path(path)
    try:
        # (a root, at worst)
        existing = next(p for p in (path, *path.parents) if p.exists() or p.is_symlink())
        if existing.is_dir():
            return None
    except OSError as e:
        return f"cannot be reached ({e.strerror or e})"
    what = "a file" if existing.exists() else "a broken link"
    return f"is {what}" if existing == path else f"is inside {existing}, {what}"
