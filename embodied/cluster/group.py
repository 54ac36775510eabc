"""What every role group of a cluster run shares: its workers, where they run, when they last
answered, and their health. A group's workers are Ray actors of one role; Ray restarts one that
dies (the actor workers excepted), and ``restore`` brings it back into the run: it waits until
every worker answers, lets the group catch up (``catch_up``: what its role needs to go on), and
asks where they run now."""

from __future__ import annotations

import time

from embodied.cluster.calls import get, wait_alive


class WorkerGroup:
    """The workers of one role (``role``: "env", "rollout", "actor" or "eval")."""

    def __init__(self, role: str, workers: list):
        self.role = role
        self.workers = workers
        self.placed: list[dict] = [{} for _ in workers]  # each worker's node, pid, GPUs
        self.heartbeat = time.time()  # when every worker last answered

    def ask(self, method: str, *args) -> list:
        """Every worker's answer to ``method(*args)``, in worker order (``WorkerLost`` naming the
        worker if one died)."""
        calls = [getattr(w, method).remote(*args) for w in self.workers]
        answers = get(calls, self.role, self.describe)
        self.heartbeat = time.time()
        return answers

    def describe(self, index: int) -> str:
        """Worker ``index`` for a message: "env worker 1 (pid 4242 on node-a; ...)"."""
        details = "; ".join(self.details(index))
        return f"{self.role} worker {index}" + (f" ({details})" if details else "")

    def details(self, index: int) -> list[str]:
        """What names worker ``index`` beside its role and index: where it ran when last asked
        (the process a loss took)."""
        place = self.placed[index] if index < len(self.placed) else {}
        return [f"pid {place['pid']} on {place['host']}"] if "pid" in place else []

    def locate(self) -> None:
        """Ask every worker where it runs (for the run's status file)."""
        self.placed = self.ask("where")

    def restore(self) -> None:
        """Bring workers Ray restarted back into the run: wait until they all answer, then
        ``catch_up`` and ``locate``."""
        for index, worker in enumerate(self.workers):
            wait_alive(self.role, worker, self.describe(index))
        self.catch_up()
        self.locate()

    def catch_up(self) -> None:
        """What a restarted worker of this role needs before it takes part again (nothing)."""

    def timing(self) -> list[tuple[float, list]] | None:
        """Each worker's (busy seconds, call spans) since the last call; None without
        workers."""
        return self.ask("timing") if self.workers else None

    def status_rows(self, slots: list) -> list[dict]:
        """One row per worker for the status file: its placement slot, place and heartbeat."""
        return [
            {
                "role": self.role,
                "index": slot.index,
                "resources": slot.resources,
                **self.placed[slot.index],
                "heartbeat": self.heartbeat,
            }
            for slot in slots
        ]

    def kill(self) -> None:
        import ray

        for worker in self.workers:
            ray.kill(worker)
