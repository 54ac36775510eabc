"""The actor workers seen from the driver: the learner's methods (``RemoteLearner``), an update
in flight (``Pending``), the ranks joined into one process group (``join_ranks``)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from embodied.checkpoint import staging_dir
from embodied.cluster.calls import get
from embodied.cluster.envs import ObservationShards
from embodied.cluster.group import WorkerGroup
from embodied.cluster.wire import from_wire
from embodied.config import ConfigError
from embodied.roles import WorkerLost
from embodied.rollout import RolloutBatch


@dataclass
class RoundShards:
    """A collected round as it lives in the env workers that collected it: one object per env
    worker, in row order, each owned by its worker (``refs``), and the tasks' instructions."""

    refs: list
    instructions: tuple[str, ...]
    added: Callable[[], None] | None = None  # called once the learner has the round
    name: Callable[[int], str] | None = None  # name(i): the env worker that holds refs[i]

    def fetch(self, device: torch.device | str = "cpu") -> RolloutBatch:
        """The whole round in this process, on ``device``: joined, so a copy that refers to none
        of the env workers' objects (an actor worker's; the driver's only in tests)."""
        import ray

        parts = [from_wire(part, device) for part in ray.get(self.refs)]
        batch = RolloutBatch.cat_envs(parts)
        batch.instructions = self.instructions
        return batch


class Pending:
    """An update running in the actor workers: ``result()`` is rank 0's metrics (every rank
    has the same), or ``WorkerLost`` as soon as any rank is lost (the others would wait for it
    in a collective, or fail in one)."""

    def __init__(self, workers: list, refs: list, name: Callable[[int], str] | None = None):
        self.workers = workers
        self.refs = refs
        self.name = name  # name(rank): the actor worker, for a loss's message

    def result(self) -> dict:
        import ray

        waiting = list(self.refs)
        while waiting:
            ready, waiting = ray.wait(waiting, num_returns=1)
            rank = self.refs.index(ready[0])
            try:
                get(ready[0], "actor", self._named(rank))
            except ray.exceptions.RayTaskError:
                self._raise_if_one_died()  # a rank's collective failed because a peer died
                raise
        return get(self.refs[0], "actor", self.name)

    def _named(self, rank: int) -> str | None:
        return None if self.name is None else self.name(rank)

    def _raise_if_one_died(self) -> None:
        import ray

        pings = [worker.ping.remote() for worker in self.workers]
        answered, _ = ray.wait(pings, num_returns=len(pings), timeout=30)  # busy ones: alive
        for ping in answered:
            # (a dead rank's ping answers at once, with the error)
            get(ping, "actor", self._named(pings.index(ping)))


@contextmanager
def held_by_env_workers(what: str, shards, on_loss: Callable[[], None] | None = None):
    """Calls that fetch ``shards`` (``RoundShards``, ``ObservationShards``: objects the env
    workers own, one each): one lost with its worker is that worker's loss
    (``WorkerLost("env")``, naming it and saying ``what`` was lost with it), after
    ``on_loss()``."""
    import ray

    try:
        yield
    except ray.exceptions.RayTaskError as error:
        if not isinstance(error.cause, ray.exceptions.ObjectLostError):
            raise
        if on_loss is not None:
            on_loss()
        detail = str(error.cause).strip().splitlines()[0]
        held = [ref.hex() for ref in shards.refs]
        lost_ref = getattr(error.cause, "object_ref_hex", None)
        worker = None
        if shards.name is not None and lost_ref in held:
            worker = shards.name(held.index(lost_ref))
        raise WorkerLost("env", f"{what} lost with it ({detail})", worker) from None


class RemoteLearner(WorkerGroup):
    """The actor workers as the ``Learner``: rank 0 saves and sends the weights; every rank
    fetches each round from the env workers and gets the calls that change its state. Ray
    never restarts one: the learner's state is lost with it, and the run can only resume."""

    def __init__(self, workers: list, lr: float, sharded: bool = False):
        super().__init__("actor", workers)
        self.sharded = sharded  # megatron's TP ranks: each saves its shard of a checkpoint
        self.rounds_added = 0  # (each round's key: a rank that added a lost round drops it)
        self.unsynced: list = []  # the ranks' calls of an update inference has no weights of
        self._lr = lr
        self.device = torch.device("cpu")

    def load(self, checkpoint: dict) -> None:
        """Every rank takes the checkpoint's state (one copy in the object store for all)."""
        import ray

        self.ask("load", ray.put(checkpoint))

    def stream_state(self) -> dict:
        """The stream every rank shares (actor/0)."""
        return get(self.workers[0].stream_state.remote(), "actor", self.describe)

    def init_normalizer(self, obs: ObservationShards) -> None:
        """Every rank fetches the observations from the env workers that hold them. Those lost
        with their env worker lose the round (``WorkerLost``); collected again, it starts from
        the same observations, and a rank that had them already keeps its statistics."""
        with held_by_env_workers("the first observations were", obs):
            get([w.init_normalizer.remote(obs.refs) for w in self.workers], "actor", self.describe)

    def add_round(self, shards: RoundShards) -> dict:
        """A collected round to every rank: each fetches its shards from the env workers and
        computes the advantages, as the update needs them; rank 0's metrics (every rank has the
        same). Queued behind an update in flight (cluster.max_staleness 1). A shard lost with
        its env worker loses the round (``WorkerLost``): the ranks that added it drop it."""
        key = self.rounds_added
        self.rounds_added += 1
        refs = shards.refs
        calls = [w.add_round.remote(key, refs, shards.instructions) for w in self.workers]

        def drop() -> None:
            get([w.drop_round.remote(key) for w in self.workers], "actor", self.describe)

        with held_by_env_workers("its round's data was", shards, on_loss=drop):
            answers = get(calls, "actor", self.describe)
        if shards.added is not None:
            shards.added()
        return from_wire(answers[0])

    def update(self) -> dict:
        return self.start_update().result()

    def start_update(self) -> Pending:
        """The update of the rounds added since the last one, running in the actor workers;
        the handle's ``result()`` waits for it."""
        refs = [w.update.remote() for w in self.workers]
        self.unsynced = refs
        return Pending(self.workers, refs, self.describe)

    def settle(self) -> bool:
        """Wait for the update started since inference last took the weights, if there is one
        (its result stays for the runner): whether there was. The weights rank 0 sends next are
        then that update's, and the actor is free for the next collective."""
        import ray

        refs, self.unsynced = self.unsynced, []
        if refs:
            ray.wait(refs, num_returns=len(refs))
        return bool(refs)

    def set_lr(self, lr: float) -> None:
        """Queued behind the update in flight (an actor runs its calls in order): it applies
        to the next one."""
        for worker in self.workers:
            worker.set_lr.remote(lr)
        self._lr = lr

    @property
    def lr(self) -> float:
        return self._lr

    def keep_record(self, run_dir: Path, iteration: int, reason, metrics: dict, counters):
        """Rank 0 writes or drops its oldest updated iteration's record (``Learner``); why it
        could not be written, or None."""
        call = self.workers[0].keep_record.remote(
            str(run_dir), iteration, reason, metrics, counters
        )
        return get(call, "actor", self.describe)

    def save(self, run_dir: Path, iteration: int, **kw) -> None:
        """Rank 0's state: data-parallel ranks hold the same weights and optimizer state. TP
        ranks write their shards where rank 0 stages the checkpoint (a file system they
        share)."""
        calls = [self.workers[0].save.remote(str(run_dir), iteration, kw)]
        if self.sharded:
            directory = str(staging_dir(run_dir, iteration))
            calls += [w.write_shards.remote(directory) for w in self.workers[1:]]
        get(calls, "actor", self.describe)


def join_ranks(actors: list, placed: list[dict], device: str) -> None:
    """Make the actor workers one process group (rank = index), rank 0's node the meeting
    place. NCCL wants a GPU per rank: actor workers that share one are refused."""
    if device.startswith("cuda"):
        ids = [tuple(p["gpu_ids"]) for p in placed]
        if len(set(ids)) < len(ids):
            raise ConfigError(
                f"cluster.actor: {len(actors)} actor workers share GPU(s) {ids}; data-parallel "
                "ranks and megatron's TP ranks need a GPU each (cluster.actor.num_gpus=1)"
            )
    address = get(actors[0].address.remote(), "actor")
    get([a.join.remote(rank, len(actors), address) for rank, a in enumerate(actors)], "actor")
