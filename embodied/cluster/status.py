"""``embodied cluster status RUN``: which role runs where, its resources, its last heartbeat,
read from ``RUN/cluster.json`` (written by the run at its start and after every weight sync).
No Ray import: it reads the file, so it works after the run (and its cluster) have gone."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from embodied.config import to_dict
from embodied.schema import UserError

STATUS_FILE = "cluster.json"


def write_status(run_dir: Path, workers: list[dict], cfg, events: list, ended: float | None):
    """RUN/cluster.json, atomically: each worker's role, node, process and resources, each role's
    last heartbeat (when its workers last answered a timing call or a weight sync), the faults so
    far, when the run ended (None: it runs); ``embodied cluster status RUN`` reads it."""
    status = {
        "ended": ended,
        "placement": cfg.cluster.placement,
        "cluster": to_dict(cfg.cluster),
        "workers": workers,
        "events": events,
        "updated": time.time(),
    }
    tmp = run_dir / (STATUS_FILE + ".tmp")
    tmp.write_text(json.dumps(status, indent=2))
    tmp.replace(run_dir / STATUS_FILE)


def read_status(run_dir: str | Path) -> dict:
    path = Path(run_dir) / STATUS_FILE
    if not Path(run_dir).is_dir():
        raise UserError(f"{run_dir}: no such run directory")
    if not path.is_file():
        raise UserError(f"{run_dir}: no {STATUS_FILE}; it is not a cluster run (cluster.enabled)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: not readable ({e})") from None


def _ago(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min ago"
    return f"{seconds / 3600:.1f} h ago"


def format_status(status: dict, now: float | None = None) -> str:
    """A table: one line per worker (role, index, node, host, pid, GPUs, resources, heartbeat),
    then the faults."""
    now = time.time() if now is None else now
    state = (
        f"run ended {_ago(now - status['ended'])}"
        if status.get("ended")
        else f"updated {_ago(now - status['updated'])}"
    )
    lines = [f"placement {status['placement']}, {state}"]
    header = ("role", "#", "node", "host", "pid", "gpus", "resources", "heartbeat")
    table = [header]
    for w in status["workers"]:
        resources = " ".join(f"{k}={v:g}" for k, v in sorted(w["resources"].items()))
        table.append(
            (
                w["role"],
                str(w["index"]),
                w["node_id"][:12],
                w["host"],
                str(w["pid"]),
                ",".join(w["gpu_ids"]) or "-",
                resources,
                _ago(now - w["heartbeat"]),
            )
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines += [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in table
    ]
    events = status.get("events", [])
    lines.append(f"faults: {len(events)}")
    for e in events:
        worker = e.get("worker", f"{e['role']} worker")  # (a run before workers were named)
        lines.append(f"  {_ago(now - e['time'])}: {worker} lost ({e['detail']})")
    return "\n".join(lines)


def where() -> dict:
    """This worker's node id, process id and accelerator ids (``cluster status`` shows them),
    and its Ray actor id (Ray's own messages name a worker by it)."""
    import ray

    context = ray.get_runtime_context()
    return {
        "node_id": context.get_node_id(),
        "actor_id": context.get_actor_id(),
        "pid": os.getpid(),
        "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
        "host": os.uname().nodename,
    }
