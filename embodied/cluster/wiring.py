"""The wiring of a cluster run: each role's workers made in their bundles of the run's placement
group, as role groups (embodied/cluster/group.py)."""

from __future__ import annotations

from dataclasses import dataclass

from embodied.cluster.actor import ActorWorker
from embodied.cluster.calls import get
from embodied.cluster.config import ROLES
from embodied.cluster.envs import RemoteEnvGroup
from embodied.cluster.evaluation import EvalGroup
from embodied.cluster.group import WorkerGroup
from embodied.cluster.inference import RemoteInference
from embodied.cluster.learner import RemoteLearner, join_ranks
from embodied.cluster.placement import Slot
from embodied.cluster.workers import (
    EnvRolloutWorker,
    EnvWorker,
    EvalWorker,
    RolloutWorker,
)


@dataclass
class Groups:
    """A run's role groups. ``inference`` is the rollout workers' group (``rollouts`` itself), or
    (``rollout.workers: 0``) a view of the env workers, whose processes hold the copies;
    ``rollouts`` is then empty."""

    envs: RemoteEnvGroup
    rollouts: WorkerGroup
    learner: RemoteLearner
    inference: RemoteInference
    evaluators: EvalGroup | None

    def by_role(self) -> dict[str, WorkerGroup]:
        """The groups by role, each worker in one of them."""
        groups = {"env": self.envs, "rollout": self.rollouts, "actor": self.learner}
        if self.evaluators is not None:
            groups["eval"] = self.evaluators
        return groups


def start_groups(
    cfg, env_cfgs: list, placement_group, slots: list[Slot], env_factory, fault
) -> Groups:
    """Every worker of the run in its slot (``env_cfgs``: each env worker's share of the env
    config); ``fault(error)`` records the evaluation workers' losses."""
    cluster = cfg.cluster
    by_role = {role: [s for s in slots if s.role == role] for role in ROLES}
    threads = cfg.runner.torch_threads

    def make(cls, slot: Slot, *args):
        return _remote(cls, slot, placement_group).remote(*args)

    in_env = cluster.rollout.workers == 0  # inference in each env worker's process
    rollout_device = device_of(cfg, (cluster.env if in_env else cluster.rollout).num_gpus)
    if in_env:
        args = (env_factory, cfg.policy, rollout_device, threads, cfg.seed)
        env_workers = [
            make(EnvRolloutWorker, slot, env_cfg, *args, rank)
            for rank, (slot, env_cfg) in enumerate(zip(by_role["env"], env_cfgs))
        ]
    else:
        env_workers = [
            make(EnvWorker, slot, env_cfg, env_factory, 1)
            for slot, env_cfg in zip(by_role["env"], env_cfgs)
        ]
    facts = get([w.facts.remote() for w in env_workers], "env", lambda i: f"env worker {i}")
    envs = RemoteEnvGroup(env_workers, facts)
    task_of_env = envs.task_of_env.tolist()
    actor_device = device_of(cfg, cluster.actor.num_gpus)
    # every actor worker derives the stream actor/0: the same policy, the same minibatch
    # permutations (data-parallel ranks)
    actors = [
        make(ActorWorker, slot, cfg, envs.spec, task_of_env, actor_device)
        for slot in by_role["actor"]
    ]
    sharded = cfg.trainer.backend == "megatron"
    learner = RemoteLearner(actors, cfg.algorithm.learning_rate, sharded)
    learner.locate()
    if len(actors) > 1:
        join_ranks(actors, learner.placed, actor_device)
    rollout_workers = [
        make(RolloutWorker, slot, cfg.policy, envs.spec, rollout_device, threads, cfg.seed, rank)
        for rank, slot in enumerate(by_role["rollout"])
    ]
    eval_args = (cfg.env, env_factory, cfg.policy, envs.spec)
    eval_device = device_of(cfg, cluster.eval.num_gpus)
    evaluators = [make(EvalWorker, s, *eval_args, eval_device, threads) for s in by_role["eval"]]
    role, inferring = ("env", env_workers) if in_env else ("rollout", rollout_workers)
    has_critic = get(inferring[0].has_critic.remote(), role)
    inference = RemoteInference(role, inferring, actors[0], cluster, has_critic)
    if in_env:  # (the env workers, named as the env group names them)
        inference.details = envs.details
    rollouts = WorkerGroup("rollout", []) if in_env else inference
    evaluation = EvalGroup(evaluators, fault) if evaluators else None
    return Groups(envs, rollouts, learner, inference, evaluation)


def _remote(cls, slot: Slot, placement_group):
    """``cls`` as a Ray actor class in ``slot``'s bundle, with its role's restart policy."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    custom = {k: v for k, v in slot.resources.items() if k not in ("CPU", "GPU")}
    return ray.remote(cls).options(
        num_cpus=slot.resources.get("CPU", 0.0),
        num_gpus=slot.resources.get("GPU", 0.0),
        resources=custom or None,
        # the runner counts failures in a row itself; the actor's optimizer state lives only
        # in its process: a lost actor stops the run
        max_restarts=0 if slot.role == "actor" else -1,
        max_task_retries=0,  # a lost call is lost: the round is collected again
        # the evaluation worker answers timing and pings while it evaluates
        max_concurrency=2 if slot.role == "eval" else 1,
        scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group, placement_group_bundle_index=slot.bundle
        ),
    )


def device_of(cfg, num_gpus: float) -> str:
    """A worker's torch device: ``runner.device`` when given, else its GPU if it has one."""
    if cfg.runner.device != "auto":
        return cfg.runner.device
    return "cuda" if num_gpus > 0 else "cpu"
