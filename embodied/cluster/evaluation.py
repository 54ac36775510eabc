"""The evaluation group: workers that evaluate beside training (``cluster.eval.workers``), and an
evaluation running in them, seen from the driver."""

from __future__ import annotations

from collections.abc import Callable

from embodied.cluster.calls import get
from embodied.cluster.group import WorkerGroup
from embodied.config import ConfigError
from embodied.evaluate import pooled_summary, split_episodes
from embodied.roles import WorkerLost, WorkerNotStarted
from embodied.schema import UserError

# what a worker that Ray restarted gives where its constructor raised (``calls.not_started``)
NOT_STARTED = (WorkerNotStarted, ConfigError, UserError)


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
        except (WorkerLost, WorkerNotStarted) as error:  # (a restart whose constructor raised)
            # the others finish their shares first: the next evaluation must not find one
            # still running (it would share that worker's environments and policy)
            ray.wait(self.refs, num_returns=len(self.refs))
            lost = error if isinstance(error, WorkerLost) else WorkerLost("eval", str(error))
            self.worker_lost(lost)
            raise lost from None
        return {
            task: pooled_summary([part[task] for part in parts], side_by_side=True)
            for task in parts[0]
        }


class LostEvaluation:
    """An evaluation that cannot start: its workers cannot come back (``error``)."""

    def __init__(self, error: WorkerLost):
        self.error = error

    def ready(self) -> bool:
        return True

    def result(self) -> dict[str, dict]:
        raise self.error


class EvalGroup(WorkerGroup):
    """The evaluation workers. A lost one loses its evaluation only: the run's other calls go
    on (``timing`` and ``locate`` answer without it), and the next evaluation waits until Ray
    has restarted it (``restore``). One that cannot come back (its constructor raised again, or
    it is not back in time) loses every later evaluation, said each time; training goes on.
    ``fault(error)`` records each loss."""

    def __init__(self, workers: list, fault: Callable[[WorkerLost], None]):
        super().__init__("eval", workers)
        self.fault = fault
        self.lost = False  # a worker died: the next evaluation waits for it
        self.gone: WorkerLost | None = None  # why the workers cannot evaluate any more

    def start(self, weights, version: int, episodes: int, seed: int):
        """An evaluation at ``weights`` (an object-store reference to all of them: a worker Ray
        restarted lost its own), the episodes split between the workers; a ``LostEvaluation``
        where they cannot come back."""
        if self.lost and self.gone is None:
            try:
                self.restore()
                self.lost = False
            except (WorkerLost, *NOT_STARTED) as error:
                detail = f"{error}; no evaluation runs beside training from here"
                self.gone = WorkerLost("eval", detail)
                self.fault(self.gone)
        if self.gone is not None:
            return LostEvaluation(self.gone)
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
        """The workers' timing; None while one is lost (a restarting one would hold the call
        for as long as its constructor runs)."""
        if self.lost:
            return None  # (its heartbeat stays when it last answered)
        try:
            return super().timing()
        except (WorkerLost, *NOT_STARTED):
            self.lost = True
            return None

    def locate(self) -> None:
        """Where each worker runs; one lost meanwhile is left (``lost``). At the run's start a
        worker that cannot start stops the run, as any role's does: every evaluation beside
        training (and the best checkpoint) was lost without a word."""
        at_start = not any(self.placed)
        try:
            super().locate()
        except (WorkerLost, *NOT_STARTED):
            if at_start:
                raise
            self.lost = True

    def close(self) -> None:
        """Ask each worker to close its environments; one behind an evaluation in flight may
        not answer in time, and is killed with the rest."""
        import ray

        try:
            ray.get([w.close.remote() for w in self.workers], timeout=30)
        except Exception:
            pass
