"""An evaluation running in the evaluation workers beside training, seen from the driver."""

from __future__ import annotations

from collections.abc import Callable

from embodied.cluster.calls import get
from embodied.evaluate import pooled_summary
from embodied.roles import WorkerLost


class Evaluation:
    """An evaluation running in the evaluation workers, each on its share of the episodes;
    ``worker_lost(error)`` is told when one of them is lost."""

    def __init__(self, refs: list, worker_lost: Callable[[WorkerLost], None]):
        self.refs = refs
        self.worker_lost = worker_lost

    def ready(self) -> bool:
        import ray

        done, _ = ray.wait(self.refs, num_returns=len(self.refs), timeout=0)
        return len(done) == len(self.refs)

    def result(self) -> dict[str, dict]:
        """{task: summary} over every worker's episodes, as one worker evaluating them all
        would give; ``WorkerLost`` if any worker was lost (the evaluation is lost)."""
        import ray

        try:
            parts = get(self.refs, "eval")
        except WorkerLost as lost:
            # the others finish their shares first: the next evaluation must not find one
            # still running (it would share that worker's environments and policy)
            ray.wait(self.refs, num_returns=len(self.refs))
            self.worker_lost(lost)
            raise
        return {task: pooled_summary([part[task] for part in parts]) for task in parts[0]}
