"""The actor worker: the learner in a process of its own (see embodied/cluster/workers.py for what
every worker shares). It sends the weights to the inference copies through the object store, a
broadcast, or buffers they map (embodied/cluster/shared.py)."""

from __future__ import annotations

import datetime
from pathlib import Path

import torch

from embodied.cluster.envs import ObservationShards
from embodied.cluster.learner import RoundShards
from embodied.cluster.shared import SharedWeights
from embodied.cluster.wire import to_wire, wire_bytes
from embodied.cluster.workers import _start, _Worker, sync_entries, sync_keys_of, timed
from embodied.roles import Learner

COLLECTIVE_TIMEOUT_S = 600  # how long an actor worker waits for the others in a collective


class ActorWorker(_Worker):
    """The learner: the algorithm's update, the normaliser, the optimizer, checkpoints. Several
    actor workers are one process group (``join``). On the torch backend they are data-parallel
    ranks: each gets the whole batch, takes its share of every minibatch, and the gradients are
    averaged (torch DDP). On the megatron backend they are its tensor-parallel ranks: each holds
    its shard of the learner, built once the group exists."""

    def __init__(self, cfg, spec, task_of_env: list[int], device: str):
        self.spans = []
        _start(cfg.runner.torch_threads)
        self.device = torch.device(device)
        self.learner_args = (cfg, spec, torch.tensor(task_of_env, dtype=torch.long))
        self.learner = None
        self.round_keys: list[int] = []  # the rounds added since the last update
        # (megatron's ranks shard the learner over their group: built in ``join``)
        if not (cfg.trainer.backend == "megatron" and cfg.cluster.actor.workers > 1):
            self._build()

    def _build(self) -> None:
        cfg, spec, task_ids = self.learner_args
        self.learner = Learner(cfg, spec, task_ids, self.device)  # (every rank: stream actor/0)
        self.stream = self.learner.stream
        self.sync_keys = sync_keys_of(self.learner.engine.torch_policy)

    def address(self) -> str:
        """A free TCP address on this worker's node: the process group meets there (rank 0)."""
        import socket

        import ray

        with socket.socket() as probe:
            probe.bind(("", 0))
            port = probe.getsockname()[1]
        return f"tcp://{ray.util.get_node_ip_address()}:{port}"

    def join(self, rank: int, world_size: int, address: str) -> None:
        """Join the actor workers' process group (gloo on the CPU, NCCL on GPUs) as ``rank``;
        from here on every update is shared with the other ranks."""
        import torch.distributed as dist

        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend,
            init_method=address,
            rank=rank,
            world_size=world_size,
            # a rank that died leaves the others waiting in a collective; the driver sees the
            # death at once and stops the run, this only bounds a worker left behind
            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        )
        if self.learner is None:  # megatron: this rank's shard of the learner, over the group
            self._build()
        else:
            self.learner.distribute(dist.group.WORLD)

    def data_parallel(self) -> tuple[int, int]:
        """(this worker's rank, the number of ranks)."""
        return self.learner.engine.rank, self.learner.engine.world_size

    def load(self, checkpoint: dict) -> None:
        self.learner.load(checkpoint)

    @timed
    def init_normalizer(self, shards: list) -> None:
        """The normaliser's first statistics, from the observations the env workers hold; once
        (a first round collected again brings the same observations)."""
        if not getattr(self, "normalized", False):
            self.learner.init_normalizer(ObservationShards(shards).fetch(self.learner.device))
        self.normalized = True

    @timed
    def add_round(self, key: int, shards: list, instructions: tuple[str, ...]):
        """A round for the next update, fetched from the env workers that hold its shards (in
        row order) and joined here (a copy: nothing refers to their objects afterwards); its
        advantages' metrics. ``key``: the round's, for ``drop_round``."""
        batch = RoundShards(shards, instructions).fetch(self.learner.device)
        metrics = self.learner.add_round(batch)
        self.round_keys.append(key)
        return to_wire(metrics)

    def drop_round(self, key: int) -> None:
        """Forget round ``key`` if it was added here (another rank could not fetch it)."""
        if self.round_keys and self.round_keys[-1] == key:
            self.round_keys.pop()
            self.learner.drop_last_round()

    @timed
    def update(self) -> dict:
        self.round_keys = []
        return self.learner.update()

    def set_lr(self, lr: float) -> None:
        self.learner.set_lr(lr)

    def lr(self) -> float:
        return self.learner.lr

    @timed
    def weights(self, full: bool) -> tuple:
        """(the weights inference needs, their bytes): all of them, or only the trainable
        parameters and the buffers that change (a frozen backbone is never sent again)."""
        wired = to_wire(sync_entries(self.learner.engine.torch_policy, self.sync_keys, full))
        return wired, wire_bytes(wired)

    def sync_address(self) -> str:
        """Start the weight-sync group's store here (this worker outlives the others: Ray never
        restarts it); its host:port."""
        from embodied.cluster.broadcast import host_store

        self.sync_store, address = host_store()
        return address

    @timed
    def broadcast_weights(self, full: bool, bucket_bytes: int) -> int:
        """``weights`` through the weight-sync group's broadcast; returns the bytes sent."""
        named = sync_entries(self.learner.engine.torch_policy, self.sync_keys, full)
        return self.sync_group.send(list(named.items()), bucket_bytes)

    @timed
    def keep_record(self, run_dir: str, iteration: int, reason, metrics: dict, counters):
        return self.learner.keep_record(Path(run_dir), iteration, reason, metrics, counters)

    @timed
    def save(self, run_dir, iteration: int, kw: dict) -> None:
        self.learner.save(run_dir, iteration, **kw)

    @timed
    def write_shards(self, directory: str) -> None:
        """A megatron TP rank past the first: its shard of the checkpoint rank 0 stages in
        ``directory`` (rank 0 writes its own and the rest in ``save``)."""
        self.learner.engine.write_shards(Path(directory))

    def share_weights(self) -> bytes:
        """Handles to buffers holding every weight (``weight_sync: shared``), made at the first
        call; an inference copy on this node maps them (``SharedWeights.open``)."""
        if getattr(self, "shared", None) is None:
            policy = self.learner.engine.torch_policy
            self.shared = SharedWeights.allocate(sync_entries(policy, self.sync_keys, True))
        return self.shared.handles()

    @timed
    def publish_weights(self, full: bool) -> int:
        """``weights`` into the shared buffers (all of them, or the ones that change); the
        bytes copied. It returns once they are written."""
        named = sync_entries(self.learner.engine.torch_policy, self.sync_keys, full)
        return self.shared.write(named)
