"""The inference group: the policy copies that act (rollout workers, or env workers that infer),
the weights' version they hold, their random streams, and how the learner's weights reach them
(``cluster.weight_sync``: through the object store, a broadcast in buckets, or buffers on the
actor's node that the copies map: embodied/cluster/shared.py)."""

from __future__ import annotations

import torch

from embodied.cluster.calls import get
from embodied.cluster.direct import UNGROUPED, UNSYNCED
from embodied.cluster.group import WorkerGroup
from embodied.roles import WorkerLost


class RemoteInference(WorkerGroup):
    """The inference copies as one group. ``role``: "rollout", or "env" where the copies live in
    the env workers (``cluster.rollout.workers: 0``). ``actor``: the actor worker (rank 0) the
    weights come from. A restarted copy catches up with its stream as the last completed round
    left it and the full weights."""

    def __init__(self, role: str, workers: list, actor, cluster, has_critic: bool):
        super().__init__(role, workers)
        self.actor = actor
        self.cluster = cluster  # the run's ClusterConfig: how weights are sent
        self.has_critic = has_critic
        self.device = torch.device("cpu")  # (what the driver keeps of a round is on its host)
        self.version = 0  # the weights' version the copies hold
        self.full_sync = True  # the next sync sends every weight (the copies start random)
        self.streams: dict[str, dict] = {}  # each copy's stream as the last round left it
        self.sync_epoch = 0  # weight-sync groups made so far (broadcast)
        self.sync_address = None  # the actor's store for the broadcast group
        self.handles = None  # the actor's shared weight buffers (a reference to their handles)

    def start_sync(self) -> None:
        """Make the weight-sync group (``weight_sync: broadcast``); the copies' first streams."""
        if self.cluster.weight_sync == "broadcast":
            self.sync_address = get(self.actor.sync_address.remote(), "actor")
            self.join_sync()
        self.collected(self.ask("stream_state"))

    def send_weights(self, version: int) -> int:
        """One sync of the weights as ``version``: all of them the first time (and after a
        restart), then the trainable ones and the buffers that change; their bytes
        (``WorkerLost`` if a worker died)."""
        if self.cluster.weight_sync == "broadcast":
            self._check_members()  # (before the actor broadcasts: a missing one would stall it)
            bucket_bytes = int(self.cluster.sync_bucket_mb * 2**20)
            nbytes = self.actor.broadcast_weights.remote(self.full_sync, bucket_bytes)
            self.ask("receive_weights", self.full_sync, version, bucket_bytes)
        elif self.cluster.weight_sync == "shared":
            if self.handles is None:  # (once: one object-store copy every worker reads)
                self.handles = self.actor.share_weights.remote()
            nbytes = self.actor.publish_weights.remote(self.full_sync)
            get(nbytes, "actor")  # (written before anyone reads)
            self.ask("read_shared", self.handles, self.full_sync, version)
        else:
            weights, nbytes = self.actor.weights.options(num_returns=2).remote(self.full_sync)
            self.ask("sync", weights, version, self.full_sync)
        self.version = version
        self.full_sync = False
        return get(nbytes, "actor")

    def _check_members(self) -> None:
        """``WorkerLost`` where a copy is not in the current weight-sync group, or has none of
        the weights that a sync of only the ones that change assumes (Ray restarted it)."""
        for index, (epoch, version) in enumerate(self.ask("sync_state")):
            if epoch != self.sync_epoch:
                why = UNGROUPED
            elif version < 0 and not self.full_sync:
                why = UNSYNCED
            else:
                continue
            raise WorkerLost(self.role, why, self.describe(index))

    def join_sync(self) -> None:
        """The actor (rank 0) and the copies form a new weight-sync group."""
        self.sync_epoch += 1
        members = [self.actor, *self.workers]
        calls = [
            w.join_sync.remote(self.sync_address, rank, len(members), self.sync_epoch)
            for rank, w in enumerate(members)
        ]
        get(calls[1:], self.role)
        get(calls[0], "actor")

    def collected(self, states: list[dict]) -> None:
        """The copies' streams after a round the learner has: where the next round starts, so
        that a round collected again after a loss draws what the lost one drew."""
        self.streams.update({f"rollout/{i}": state for i, state in enumerate(states)})

    def resume_streams(self, rng: dict, iteration: int) -> None:
        """Each copy takes its stream from a checkpoint's ``rng``, as the actors do."""
        self.ask("resume_stream", rng, iteration)

    def catch_up(self) -> None:
        """Every copy continues its stream from the last completed round (a restarted one's is
        fresh, the others' moved on in the lost round), in a new sync group, with all the
        weights."""
        calls = [
            worker.set_stream.remote(self.streams[f"rollout/{rank}"])
            for rank, worker in enumerate(self.workers)
        ]
        get(calls, self.role)
        if self.cluster.weight_sync == "broadcast":
            self.join_sync()
        self.full_sync = True
        self.send_weights(self.version)
