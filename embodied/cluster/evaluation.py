"""The evaluation group: workers that evaluate beside training (``cluster.eval.workers``), and an
evaluation running in them, seen from the driver."""

from __future__ import annotations

from collections.abc import Callable

from embodied.cluster.calls import get
from embodied.cluster.group import WorkerGroup
from embodied.evaluate import pooled_summary, split_episodes
from embodied.roles import WorkerLost


class Evaluation:
    """An evaluation running in the evaluation workers, each on its share of the episodes;
    ``worker_lost(error)`` is told when one of them is lost."""

    def __init__(self, refs: list, worker_lost: Callable[[WorkerLost], None], name=None):
        self.refs = refs
        self.worker_lost = worker_lost
        self.name = name  # name(i): worker i, for a loss's message

    def ready(self) -> bool:
        import ray

        done, _ = ray.wait(self.refs, num_returns=len(self.refs), timeout=0)
        return len(done) == len(self.refs)

    def result(self) -> dict[str, dict]:
        """{task: summary} over every worker's episodes, as one worker evaluating them all
        would give; ``WorkerLost`` if any worker was lost (the evaluation is lost)."""
        import ray

        try:
            parts = get(self.refs, "eval", self.name)
        except WorkerLost as lost:
            # the others finish their shares first: the next evaluation must not find one
            # still running (it would share that worker's environments and policy)
            ray.wait(self.refs, num_returns=len(self.refs))
            self.worker_lost(lost)
            raise
        return {
            task: pooled_summary([part[task] for part in parts], side_by_side=True)
            for task in parts[0]
        }


class EvalGroup(WorkerGroup):
    """The evaluation workers. A lost one loses its evaluation only: the run's other calls go
    on (``timing`` and ``locate`` answer without it), and the next evaluation waits until Ray
    has restarted it (``restore``). ``fault(error)`` records each loss."""

    def __init__(self, workers: list, fault: Callable[[WorkerLost], None]):
        super().__init__("eval", workers)
        self.fault = fault
        self.lost = False  # a worker died: the next evaluation waits for it

    def start(self, weights, version: int, episodes: int, seed: int) -> Evaluation:
        """An evaluation at ``weights`` (an object-store reference to all of them: a worker Ray
        restarted lost its own), the episodes split between the workers."""
        if self.lost:
            self.restore()
            self.lost = False
        shares = split_episodes(episodes, seed, len(self.workers))
        refs = [
            worker.evaluate.remote(weights, version, share_episodes, share_seed)
            for worker, (share_episodes, share_seed) in zip(self.workers, shares)
        ]
        return Evaluation(refs, self._worker_lost, self.describe)

    def _worker_lost(self, lost: WorkerLost) -> None:
        self.fault(lost)
        self.lost = True

    def timing(self) -> list[tuple[float, list]] | None:
        try:
            return super().timing()
        except WorkerLost:
            self.lost = True
            return None  # (its heartbeat stays when it last answered)

    def locate(self) -> None:
        try:
            super().locate()
        except WorkerLost:
            self.lost = True

    def close(self) -> None:
        """Ask each worker to close its environments; one behind an evaluation in flight may
        not answer in time, and is killed with the rest."""
        import ray

        try:
            ray.get([w.close.remote() for w in self.workers], timeout=30)
        except Exception:
            pass
