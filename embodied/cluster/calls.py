"""What every proxy of the cluster's workers shares: a call's answers with a dead worker as
``WorkerLost``, a wait for a restarted worker, the traffic counters."""

from __future__ import annotations

import time

from embodied.roles import WorkerLost

RESTART_TIMEOUT_S = 300.0  # how long a lost worker may take to come back


def get(refs, role: str):
    """``ray.get``, with a dead worker as ``WorkerLost``."""
    import ray

    try:
        return ray.get(refs)
    except ray.exceptions.RayActorError as e:
        raise lost(role, e) from None


def lost(role: str, error: Exception) -> WorkerLost:
    """``WorkerLost`` with the first line of Ray's message; a lost actor worker takes the
    learner's state (weights, optimizer) with it: the run can only resume."""
    text = str(error).strip()
    detail = text.splitlines()[0] if text else type(error).__name__
    if role == "actor":
        detail += "; the learner's state is lost: resume from the run's last checkpoint"
    return WorkerLost(role, detail)


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


def wait_alive(role: str, worker) -> None:
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
                    role, f"not back {RESTART_TIMEOUT_S:.0f} s after it was lost"
                ) from None
            time.sleep(0.5)
