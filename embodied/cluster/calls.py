"""What every proxy of the cluster's workers shares: a call's answers with a dead worker (or one
Ray restarted since it last took part) as ``WorkerLost`` naming the worker, a wait for a
restarted worker, the traffic counters."""

from __future__ import annotations

import time

from embodied.cluster.direct import NotConnected
from embodied.roles import WorkerLost

RESTART_TIMEOUT_S = 300.0  # how long a lost worker may take to come back


def get(refs, role: str, name=None):
    """``ray.get``, with a dead worker, or one that Ray restarted since it last took part
    (``NotConnected``), as ``WorkerLost``; ``name(i)`` describes the worker of ``refs[i]`` (of a
    single reference: ``name(0)``, or ``name`` itself, a string)."""
    import ray

    try:
        return ray.get(refs)
    except ray.exceptions.RayActorError as error:
        raise lost(role, error, _named(refs, name)) from None
    except ray.exceptions.RayTaskError as error:
        if not isinstance(error.cause, NotConnected):
            raise
        raise WorkerLost(role, str(error.cause), _named(refs, name)) from None


def _named(refs, name) -> str | None:
    """``name(i)`` of the first call in ``refs`` that failed (None without ``name``)."""
    import ray

    if name is None or isinstance(name, str):
        return name
    if not isinstance(refs, list):
        return name(0)
    for index, ref in enumerate(refs):
        if ray.wait([ref], timeout=0)[0]:
            try:
                ray.get(ref)
            except Exception:
                return name(index)
    return None


def lost(role: str, error: Exception, worker: str | None = None) -> WorkerLost:
    """``WorkerLost`` with the first line of Ray's message; a lost actor worker takes the
    learner's state (weights, optimizer) with it: the run can only resume."""
    text = str(error).strip()
    detail = text.splitlines()[0] if text else type(error).__name__
    if role == "actor":
        detail += "; the learner's state is lost: resume from the run's last checkpoint"
    return WorkerLost(role, detail, worker)


class Traffic:
    """What crossed between this process and a role's workers since the last ``take``."""

    def __init__(self):
        self.wait_s = 0.0  # seconds this process waited for answers
        self.bytes = 0  # bytes of the arrays sent and received
        self.rows = 0  # environment rows answered

    def take(self) -> tuple[float, int, int]:
        """(seconds waited, bytes, rows), then zeros."""
        out = (self.wait_s, self.bytes, self.rows)
        self.__init__()
        return out


def wait_alive(role: str, worker, name: str | None = None) -> None:
    """Wait until Ray has restarted ``worker`` (it answers a ping); ``WorkerLost`` after
    ``RESTART_TIMEOUT_S``."""
    import ray

    deadline = time.time() + RESTART_TIMEOUT_S
    while True:
        try:
            ray.get(worker.ping.remote(), timeout=30)
            return
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            if time.time() > deadline:
                raise WorkerLost(
                    role, f"not back {RESTART_TIMEOUT_S:.0f} s after it was lost", name
                ) from None
            time.sleep(0.5)
