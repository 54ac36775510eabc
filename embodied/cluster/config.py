"""The ``cluster:`` config block: where the run's roles live on Ray. No Ray import here.

    cluster:
      enabled: true            # or give an address: a local Ray starts when none is given
      address: auto            # join a running cluster (``ray start --head`` / a Ray cluster)
      placement: collocated    # collocated | disaggregated | hybrid
      env:     {workers: 2, num_cpus: 1}
      rollout: {workers: 1, num_cpus: 1, num_gpus: 0.5}   # workers 0: in the env workers
      actor:   {workers: 1, num_cpus: 1, num_gpus: 0.5}
      eval:    {workers: 2, num_cpus: 1}   # evaluations beside training (default 0: in line)

Each worker of a role asks for ``num_cpus``/``num_gpus`` (fractions allowed; ``num_cpus`` left
unset: one CPU, or an equal share of the CPUs where the cluster has fewer) and any custom
resources (``resources: {sim_node: 1}`` pins it to the nodes that offer them). ``collocated``
packs every worker on one node (fractional GPUs of a rollout and an actor worker share one
device); ``disaggregated`` gives every worker a bundle of its own, spread over nodes where it
can be; ``hybrid`` keeps the rollout and actor workers together on one node (one bundle for
them all) and lets the env workers go anywhere. Several actor workers are data-parallel ranks
(torch DDP; with NCCL each needs a GPU of its own). ``rollout.workers: 0`` puts the policy's
inference copy in each env worker's process instead: it collects whole rounds of its
environments there, with no call per chunk between processes (policies that infer quickly on
the env workers' CPUs; a VLA wants rollout workers of its own on a GPU).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, is_dataclass

PLACEMENTS = ("collocated", "disaggregated", "hybrid")
ROLES = ("env", "rollout", "actor", "eval")
WEIGHT_SYNCS = ("object_store", "broadcast", "shared")


@dataclass
class RoleConfig:
    """One role's workers and what each asks for."""

    workers: int = 1
    # None: one CPU per worker, or an equal share where the cluster has fewer (placement.py)
    num_cpus: float | None = None
    num_gpus: float = 0.0
    resources: dict[str, float] = field(default_factory=dict)  # custom Ray resources per worker

    def validate(self) -> None:
        if self.workers < 0:
            raise ValueError(f"workers: must be >= 0, got {self.workers}")
        if self.num_cpus is not None and self.num_cpus < 0:
            raise ValueError(f"num_cpus: must be >= 0, got {self.num_cpus}")
        if self.num_gpus < 0:
            raise ValueError(f"num_gpus: must be >= 0, got {self.num_gpus}")
        if self.num_gpus > 1 and self.num_gpus != int(self.num_gpus):
            raise ValueError(f"num_gpus: above 1 it must be whole, got {self.num_gpus}")
        for name, amount in self.resources.items():
            if amount < 0:
                raise ValueError(f"resources: {name} must be >= 0, got {amount}")


@dataclass
class ClusterConfig:
    """Where the roles run. ``enabled: false`` (the default): one process, Ray never imported."""

    enabled: bool = False
    address: str | None = None  # an existing cluster ("auto", "ray://host:10001"); None: start one
    placement: str = "collocated"
    env: RoleConfig = field(default_factory=RoleConfig)
    rollout: RoleConfig = field(default_factory=RoleConfig)
    actor: RoleConfig = field(default_factory=RoleConfig)
    # >= 1: evaluations during training run in workers of their own (environments and a policy
    # copy each, the episodes split between them), beside training instead of stopping it;
    # 0: the env and rollout workers run them
    eval: RoleConfig = field(default_factory=lambda: RoleConfig(workers=0))
    # 0: every chunk comes from the weights of the last update; 1: the next iteration is
    # collected while the update runs (its chunks are one update old; decoupled PPO corrects)
    max_staleness: int = 0
    max_restarts: int = 3  # a role whose worker fails this many times in a row stops the run
    # the actor's optimizer state in host memory between updates, leaving its device to the
    # rollout (collocated placement on a shared GPU; it also works in one process)
    offload_optimizer: bool = False
    # how weights reach the inference copies: "object_store" (one copy per node, each worker
    # reads it), "broadcast" (a collective of the actor and those workers, in buckets) or
    # "shared" (buffers on the actor's node that they map: CUDA IPC on a GPU, shared memory on
    # the host; collocated placement)
    weight_sync: str = "object_store"
    sync_bucket_mb: float = 64.0  # broadcast: tensors flattened together up to this size
    num_cpus: int | None = None  # a local Ray's CPUs (None: the machine's)
    num_gpus: int | None = None  # a local Ray's GPUs (None: the machine's)
    # how long a rollout worker waits for its env workers to connect (a lost one: recovery)
    connect_timeout_s: float = 120.0

    def validate(self) -> None:
        if self.address:
            self.enabled = True  # an address means a cluster run
        if self.placement not in PLACEMENTS:
            raise ValueError(
                f"placement: must be one of {', '.join(PLACEMENTS)}, got {self.placement!r}"
            )
        if self.connect_timeout_s <= 0:
            raise ValueError(f"connect_timeout_s: must be > 0, got {self.connect_timeout_s}")
        if self.max_staleness not in (0, 1):
            raise ValueError(
                f"max_staleness: 0 (on-policy) or 1 (collect while the update runs), got "
                f"{self.max_staleness}"
            )
        if self.max_staleness and not self.enabled:
            raise ValueError(
                "max_staleness: 1 overlaps collection with the update in another process; it "
                "needs the roles on Ray (cluster.enabled=true)"
            )
        for role in ("env", "actor"):
            if getattr(self, role).workers < 1:
                raise ValueError(f"{role}.workers: must be >= 1, got {getattr(self, role).workers}")
        if self.rollout.workers > self.env.workers:
            raise ValueError(
                f"rollout.workers: each rollout worker serves env workers of its own; "
                f"{self.rollout.workers} rollout workers for {self.env.workers} env worker(s) "
                "leave some idle (at most env.workers)"
            )
        if self.rollout.workers == 0 and self.rollout.num_gpus:
            raise ValueError(
                "rollout.num_gpus: with rollout.workers 0 the policy infers in the env workers' "
                "processes, on their devices; give the GPU to env.num_gpus"
            )
        if self.eval.workers and not self.enabled:
            raise ValueError(
                "eval.workers: an evaluation worker runs beside training in a process of its "
                "own; it needs the roles on Ray (cluster.enabled=true)"
            )
        if self.weight_sync not in WEIGHT_SYNCS:
            raise ValueError(
                f"weight_sync: must be one of {', '.join(WEIGHT_SYNCS)}, got {self.weight_sync!r}"
            )
        if self.weight_sync == "shared" and self.placement != "collocated":
            raise ValueError(
                f"weight_sync: shared maps the actor's memory, so the inference copies must be "
                f"on its node: placement collocated, not {self.placement}"
            )
        if self.sync_bucket_mb <= 0:
            raise ValueError(f"sync_bucket_mb: must be > 0, got {self.sync_bucket_mb}")
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts: must be >= 0, got {self.max_restarts}")
        self._check_local_size()

    def _check_local_size(self) -> None:
        """``num_cpus``/``num_gpus`` size a Ray this run starts: in range, and not beside an
        ``address`` (a cluster joined has its own; they were ignored)."""
        for key, least in (("num_cpus", 1), ("num_gpus", 0)):
            value = getattr(self, key)
            if value is not None and value < least:
                raise ValueError(f"{key}: must be >= {least} (or null: the machine's), got {value}")
            if value is not None and self.address:
                raise ValueError(
                    f"{key}: sizes a Ray this run starts; the cluster at address "
                    f"{self.address} has its own (set the roles' num_cpus/num_gpus instead)"
                )


ONE_PROCESS = ("enabled", "address", "offload_optimizer")  # (what a run without Ray reads)


def ignored_in_one_process(cfg: ClusterConfig) -> str | None:
    """A note naming the settings of ``cfg`` that only Ray reads, where they differ from their
    defaults and ``cluster.enabled`` is false: a run in one process ignores them (a cluster
    line copied without ``enabled`` trained alone, unsaid). A note, not an error: a cluster
    config run with ``cluster.enabled=false`` (a replay, a try on one machine) is meant."""
    if cfg.enabled:
        return None
    default = ClusterConfig()
    keys = []
    for f in fields(cfg):
        mine, theirs = getattr(cfg, f.name), getattr(default, f.name)
        if f.name in ONE_PROCESS or mine == theirs:
            continue
        if is_dataclass(mine):  # (a role's: name its fields)
            keys += [
                f"cluster.{f.name}.{g.name}"
                for g in fields(mine)
                if getattr(mine, g.name) != getattr(theirs, g.name)
            ]
        else:
            keys.append(f"cluster.{f.name}")
    if not keys:
        return None
    return (
        f"note: {', '.join(keys)} apply to the roles on Ray; cluster.enabled is false, so this "
        "run, in one process, ignores them"
    )
