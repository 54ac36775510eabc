"""The run's events (``RUN/events.jsonl``): what happened to it besides its iterations, one JSON
line each, appended as it happens and kept across resumes; ``embodied report`` lists them.

Kinds: ``start``, ``resume``, ``fault`` (a worker lost), ``discarded_round`` (its round is
collected again), ``record`` (an update recorded for a non-finite loss or a spike),
``record_failed`` (a record that could not be written: a full disk), ``stop`` (a signal),
``out_of_time`` (``runner.max_minutes``), ``failure`` (the run raised), ``end``.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from embodied.logger import end_cut_line, read_jsonl

EVENTS_FILE = "events.jsonl"
KINDS = (
    "start",
    "resume",
    "fault",
    "discarded_round",
    "record",
    "record_failed",
    "stop",
    "out_of_time",
    "failure",
    "end",
)


@dataclass
class Event:
    time: float  # seconds since the epoch
    kind: str  # one of KINDS
    iteration: int | None  # the last completed iteration when it happened (None: not known)
    env_steps: int | None
    detail: str = ""


class EventLog:
    """Appends to ``RUN/events.jsonl``; a file opened per event (events are rare), so a run's
    parts can each hold one."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / EVENTS_FILE

    def add(self, kind: str, iteration: int | None, env_steps: int | None, detail="") -> Event:
        if kind not in KINDS:
            raise ValueError(f"event kind {kind!r}: not one of {', '.join(KINDS)}")
        event = Event(time.time(), kind, iteration, env_steps, detail)
        if self.path.parent.is_dir():  # (a fault while the run is set up, before its directory)
            end_cut_line(self.path)
            with open(self.path, "a") as f:
                f.write(json.dumps(asdict(event)) + "\n")
                f.flush()
                os.fsync(f.fileno())  # as metrics rows are: the report's status reads both
        return event


def read_events(run_dir: Path) -> list[Event]:
    """The run's events in order; none for a run without the file. A line cut by a crash (the
    last) is left out."""
    path = Path(run_dir) / EVENTS_FILE
    if not path.is_file():
        return []
    events = []
    for row in read_jsonl(path):
        try:
            events.append(Event(**row))
        except TypeError:  # (a row of other fields)
            continue
    return events
