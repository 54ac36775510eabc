"""The run's roles as Ray actors, behind the methods the embedded roles have (embodied/roles.py).

The runner's process (the driver) keeps the loop and sends each worker a few calls per
iteration. A round is collected where the environments are: each env worker runs the embedded
loop over its rows and acts through the rollout worker that serves it, directly
(embodied/cluster/direct.py), or with a policy copy of its own (``rollout.workers: 0``); the
driver sends the plan and gets the batch. ``RemoteLearner`` sends the batch to the actor
workers. Evaluations step through ``RemoteVecEnv`` and ``RemoteInference`` from here, one
action at a time. Tensors travel as numpy arrays through Ray's object store
(embodied/cluster/wire.py).

Each worker draws from a random stream of its own, derived from (seed, role, rank) as the
embedded run derives its one shard's (embodied/streams.py): a run with one worker per role draws
exactly what the embedded run draws, and a fixed worker count gives a reproducible run.

A worker that dies is restarted by Ray; its call raises ``WorkerLost`` here, the runner discards
the round and collects it again, and ``recover`` brings the restarted worker up to date (a
rollout worker gets the full weights and its stream as the last completed iteration left it).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import torch

from embodied.checkpoint import staging_dir
from embodied.cluster.config import ROLES, ClusterConfig
from embodied.cluster.direct import members_of
from embodied.cluster.placement import place
from embodied.cluster.status import STATUS_FILE
from embodied.cluster.wire import from_wire, to_wire, wire_bytes
from embodied.cluster.workers import (
    DRIVER_CWD,
    ActorWorker,
    EnvRolloutWorker,
    EnvWorker,
    EvalWorker,
    RolloutWorker,
)
from embodied.config import ConfigError, to_dict
from embodied.evaluate import evaluate_by_task, pooled_summary, split_episodes
from embodied.multitask import join_steps, joined_spec, shared_privileged
from embodied.numerics import PINNED_ENV
from embodied.roles import Roles, WorkerLost
from embodied.rollout import CollectPlan, EpisodeStats, RolloutBatch
from embodied.run import Interrupted
from embodied.schema import Observation, PolicyOutput, StepOutput

RESTART_TIMEOUT_S = 300.0  # how long a lost worker may take to come back
# environment variables the workers need as the driver has them (hub access, renderers)
# (and a pinned driver's numerics: every worker starts with MKL's and torch's code paths pinned)
PASSED_ENV = (
    "HF_HUB_OFFLINE",
    "MUJOCO_GL",
    "PYOPENGL_PLATFORM",
    "LIBERO_CONFIG_PATH",
    *PINNED_ENV,
)


def start_ray(cfg: ClusterConfig) -> bool:
    """Join ``cfg.address`` or start a local Ray (unless this process has one already); whether
    this call started it. Workers get the driver's module path (a simulator registered in the
    user's script imports there too) and the environment variables in ``PASSED_ENV``."""
    import ray

    if ray.is_initialized():
        return False
    env_vars = {k: os.environ[k] for k in PASSED_ENV if k in os.environ}
    env_vars["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))
    env_vars[DRIVER_CWD] = os.getcwd()  # (relative paths in the config: workers.py's _start)
    runtime_env = {"env_vars": env_vars}
    if cfg.address:
        try:
            ray.init(address=cfg.address, runtime_env=runtime_env, logging_level="WARNING")
        except ConnectionError as e:
            raise ConfigError(f"cluster.address: cannot join {cfg.address!r}: {e}") from None
    else:
        ray.init(
            # a Ray of this run's own, even where another runs on the machine (`ray.init()`
            # without an address would join one started by `ray start`)
            address="local",
            num_cpus=cfg.num_cpus,
            num_gpus=cfg.num_gpus,
            include_dashboard=False,
            runtime_env=runtime_env,
            logging_level="WARNING",
        )
    return True


def split_env(env_cfg, workers: int) -> list:
    """The env config of each env worker: its share of ``num_envs`` (and of the tasks, and of the
    simulator's own subprocess workers: none when the share is one, the env worker simulates
    itself), in row order."""
    n = env_cfg.num_envs
    tasks = list(getattr(env_cfg, "tasks", None) or [])
    share = {}
    if getattr(env_cfg, "num_workers", 0):
        each = max(1, env_cfg.num_workers // workers)
        # an env worker is a process of its own: a share of one simulator process runs in it
        # (a subprocess adds a hop to every chunk: 438 vs 515 steps/s, docs/benchmarks.md)
        share["num_workers"] = 0 if each == 1 else each
    if workers == 1:
        return [dataclasses.replace(env_cfg, **share)]
    if tasks:
        per_task = n // len(tasks)
        if len(tasks) % workers == 0:
            k = len(tasks) // workers
            return [
                dataclasses.replace(
                    env_cfg, tasks=tasks[i * k : (i + 1) * k], num_envs=per_task * k, **share
                )
                for i in range(workers)
            ]
        if workers % len(tasks) == 0 and per_task % (workers // len(tasks)) == 0:
            each = per_task // (workers // len(tasks))
            return [  # (a one-task list: the worker's environment is named by its task)
                dataclasses.replace(env_cfg, tasks=[task], num_envs=each, **share)
                for task in tasks
                for _ in range(workers // len(tasks))
            ]
        raise ConfigError(
            f"cluster.env.workers: {workers} env workers cannot share {len(tasks)} tasks of "
            f"{per_task} environments evenly; use a divisor or a multiple of the task count"
        )
    if n % workers:
        raise ConfigError(
            f"cluster.env.workers: {workers} env workers cannot share env.num_envs={n} evenly"
        )
    return [dataclasses.replace(env_cfg, num_envs=n // workers, **share) for _ in range(workers)]


def _get(refs, role: str):
    """``ray.get``, with a dead worker as ``WorkerLost``."""
    import ray

    try:
        return ray.get(refs)
    except ray.exceptions.RayActorError as e:
        raise _lost(role, e) from None


def _lost(role: str, error: Exception) -> WorkerLost:
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


class RemoteEnvGroup:
    """The env workers seen as one ``EnvGroup``: rows in worker order, tasks by name."""

    def __init__(self, workers: list, facts: list[dict]):
        self.workers = workers
        counts = [f["num_envs"] for f in facts]
        self.bounds = [sum(counts[:w]) for w in range(len(counts) + 1)]
        self.num_envs = self.bounds[-1]
        self.device = torch.device("cpu")  # what the workers send arrives on this host
        names: list[str] = []
        for f in facts:
            names += [name for name in f["task_names"] if name not in names]
        self.task_names = names
        # the privileged keys every task has, and each task's instructions, as one multi-task
        # environment of all of them would observe (each worker's is one of its tasks)
        specs = {name: f["spec"] for f in facts for name in f["task_names"]}
        keys = shared_privileged(list(specs.values()))
        self.spec = joined_spec([specs[name] for name in names], keys)
        extra = [w for w, f in zip(workers, facts) if sorted(f["spec"].obs.privileged) != keys]
        _get([w.keep_privileged.remote(keys) for w in extra], "env")
        of_env = [names.index(f["task_names"][t]) for f in facts for t in f["task_of_env"]]
        self.task_of_env = torch.tensor(of_env, dtype=torch.long)  # long [B] on the CPU
        self.task_ids = self.task_of_env
        self.task_ranges = [
            (int(r[0]), int(r[-1]) + 1)
            for r in (torch.nonzero(self.task_of_env == t).squeeze(1) for t in range(len(names)))
        ]
        # per worker: its task ids -> the run's (long [its tasks])
        self.task_index = [torch.tensor([names.index(n) for n in f["task_names"]]) for f in facts]
        self.instructions: tuple[str, ...] = ()
        self.traffic = Traffic()

    def reset(self, seed=None) -> Observation:
        B = self.num_envs
        seeds = [seed + b for b in range(B)] if isinstance(seed, int) else seed
        refs = [
            worker.reset.remote(None if seeds is None else list(seeds[lo:hi]))
            for worker, lo, hi in zip(self.workers, self.bounds, self.bounds[1:])
        ]
        answers = [from_wire(a) for a in self._wait(refs)]
        instructions: dict[str, str] = {}
        for w, (_, theirs) in enumerate(answers):
            local_names = self._local_names(w)
            for name, text in zip(local_names, theirs):
                if instructions.setdefault(name, text) != text:
                    raise ValueError(
                        f"task {name}: its environments have different instructions; the "
                        "rollout stores one instruction per task"
                    )
        self.instructions = tuple(instructions[name] for name in self.task_names)
        return Observation.cat([obs for obs, _ in answers])

    def _local_names(self, w: int) -> list[str]:
        lo, hi = self.bounds[w], self.bounds[w + 1]
        return list(dict.fromkeys(self.task_names[t] for t in self.task_of_env[lo:hi].tolist()))

    def _wait(self, refs: list):
        t0 = time.perf_counter()
        answers = _get(refs, "env")
        self.traffic.wait_s += time.perf_counter() - t0
        return answers

    def close(self) -> None:
        import ray

        try:
            ray.get([w.close.remote() for w in self.workers], timeout=30)
        except Exception:  # a dead or hung worker: it is killed with the rest
            pass


class RemoteVecEnv:
    """The env workers as one ``VecEnv`` (one action per call), for ``evaluate_by_task``."""

    def __init__(self, group: RemoteEnvGroup):
        self.group = group
        self.num_envs = group.num_envs
        self.device = group.device
        self.spec = group.spec
        self.names = group.task_names
        self.task_ranges = group.task_ranges

    def reset(self, *, seed=None, env_ids=None) -> Observation:
        if env_ids is not None:
            raise NotImplementedError("evaluation resets every environment")
        return self.group.reset(seed)

    def step(self, actions: torch.Tensor) -> StepOutput:
        bounds = self.group.bounds
        refs = [
            worker.step.remote(to_wire(actions[lo:hi]))
            for worker, lo, hi in zip(self.group.workers, bounds, bounds[1:])
        ]
        outs = [from_wire(o) for o in self.group._wait(refs)]
        return outs[0] if len(outs) == 1 else join_steps(outs, bounds[:-1])

    def render(self) -> torch.Tensor | None:
        frames = self.group._wait([w.render.remote() for w in self.group.workers])
        if any(f is None for f in frames):
            return None
        return torch.cat([from_wire(f) for f in frames])


class RemoteInference:
    """The rollout workers as one ``InferencePolicy``: a batch is split across them by rows."""

    def __init__(self, workers: list, has_critic: bool, role: str = "rollout"):
        self.workers = workers
        self.role = role  # "env": the inference copies live in the env workers
        self.version = 0
        self.device = torch.device("cpu")  # the rollout buffers live on the driver's host
        self.has_critic = has_critic
        self.traffic = Traffic()

    def _call(self, method: str, obs: Observation, **kw):
        t0 = time.perf_counter()
        n = len(self.workers)
        B = obs.batch_size
        cuts = [B * i // n for i in range(n + 1)]
        parts = [
            (worker, to_wire(obs.index(slice(lo, hi)) if n > 1 else obs))
            for worker, lo, hi in zip(self.workers, cuts, cuts[1:])
            if hi > lo
        ]
        refs = [getattr(worker, method).remote(wired, **kw) for worker, wired in parts]
        answers = _get(refs, self.role)
        self.traffic.wait_s += time.perf_counter() - t0
        self.traffic.bytes += wire_bytes([wired for _, wired in parts]) + wire_bytes(answers)
        self.traffic.rows += B
        return [from_wire(a) for a in answers]

    def act(self, obs: Observation, *, deterministic: bool = False) -> PolicyOutput:
        outs = self._call("act", obs, deterministic=deterministic)
        if len(outs) == 1:
            return outs[0]
        return PolicyOutput(
            actions=torch.cat([o.actions for o in outs]),
            logprob=torch.cat([o.logprob for o in outs]),
            value=torch.cat([o.value for o in outs]),
            extras={k: torch.cat([o.extras[k] for o in outs]) for k in outs[0].extras},
        )

    def value(self, obs: Observation) -> torch.Tensor:
        if not self.has_critic:
            return torch.zeros(obs.batch_size)
        return torch.cat(self._call("value", obs))


class Pending:
    """An update running in the actor workers: ``result()`` is rank 0's metrics (every rank
    has the same), or ``WorkerLost`` as soon as any rank is lost (the others would wait for it
    in a collective, or fail in one)."""

    def __init__(self, workers: list, refs: list):
        self.workers = workers
        self.refs = refs

    def result(self) -> dict:
        import ray

        waiting = list(self.refs)
        while waiting:
            ready, waiting = ray.wait(waiting, num_returns=1)
            try:
                _get(ready[0], "actor")
            except ray.exceptions.RayTaskError:
                self._raise_if_one_died()  # a rank's collective failed because a peer died
                raise
        return _get(self.refs[0], "actor")

    def _raise_if_one_died(self) -> None:
        import ray

        pings = [worker.ping.remote() for worker in self.workers]
        answered, _ = ray.wait(pings, num_returns=len(pings), timeout=30)  # busy ones: alive
        for ping in answered:
            _get(ping, "actor")  # a dead rank's ping answers at once, with the error


class RemoteLearner:
    """The actor workers as the ``Learner``: rank 0 saves and sends the weights; every rank
    gets the batch (one copy in the object store) and the calls that change its state."""

    def __init__(self, workers: list, lr: float, num_minibatches: int, sharded: bool = False):
        self.workers = workers
        self.sharded = sharded  # megatron's TP ranks: each saves its shard of a checkpoint
        self.num_minibatches = num_minibatches
        self._lr = lr
        self.device = torch.device("cpu")

    def init_normalizer(self, obs: Observation) -> None:
        wired = to_wire(obs)
        _get([w.init_normalizer.remote(wired) for w in self.workers], "actor")

    def update(self, samples, observations: list[Observation]) -> dict:
        return self.start_update(samples, observations).result()

    def start_update(self, samples, observations: list[Observation]) -> Pending:
        """The update, running in the actor workers; the handle's ``result()`` waits for it."""
        import ray

        ranks = 1 if self.sharded else len(self.workers)  # (TP ranks score the same rows)
        minibatch = max(1, len(samples) // self.num_minibatches) if samples is not None else 0
        if 0 < minibatch < ranks:  # (as update() cuts minibatches)
            raise ConfigError(
                f"cluster.actor.workers: a minibatch of {minibatch} samples cannot be shared by "
                f"{ranks} actor workers; use fewer actor workers or algorithm.num_minibatches"
            )
        batch = ray.put(to_wire(samples))
        seen = ray.put(to_wire(observations))
        return Pending(self.workers, [w.update.remote(batch, seen) for w in self.workers])

    def set_lr(self, lr: float) -> None:
        """Queued behind the update in flight (an actor runs its calls in order): it applies
        to the next one."""
        for worker in self.workers:
            worker.set_lr.remote(lr)
        self._lr = lr

    @property
    def lr(self) -> float:
        return self._lr

    def save(self, run_dir: Path, iteration: int, **kw) -> None:
        """Rank 0's state: data-parallel ranks hold the same weights and optimizer state. TP
        ranks write their shards where rank 0 stages the checkpoint (a file system they
        share)."""
        calls = [self.workers[0].save.remote(str(run_dir), iteration, kw)]
        if self.sharded:
            directory = str(staging_dir(run_dir, iteration))
            calls += [w.write_shards.remote(directory) for w in self.workers[1:]]
        _get(calls, "actor")


class Evaluation:
    """An evaluation running in the evaluation workers, each on its share of the episodes."""

    def __init__(self, roles: RayRoles, refs: list):
        self.roles = roles
        self.refs = refs

    def ready(self) -> bool:
        import ray

        done, _ = ray.wait(self.refs, num_returns=len(self.refs), timeout=0)
        return len(done) == len(self.refs)

    def result(self) -> dict[str, dict]:
        """{task: summary} over every worker's episodes, as one worker evaluating them all
        would give; ``WorkerLost`` if any worker was lost (the evaluation is lost)."""
        import ray

        try:
            parts = _get(self.refs, "eval")
        except WorkerLost as lost:
            # the others finish their shares first: the next evaluation must not find one
            # still running (it would share that worker's environments and policy)
            ray.wait(self.refs, num_returns=len(self.refs))
            self.roles.events.append({"time": time.time(), "role": "eval", "detail": lost.detail})
            self.roles.eval_lost = True
            raise
        return {task: pooled_summary([part[task] for part in parts]) for task in parts[0]}


class RayRoles(Roles):
    """The roles as Ray actors in one placement group; see the module docstring. Every method
    of ``Roles`` is implemented here (``collect`` relays through it)."""

    def __init__(self, cfg, resume: dict | None, run_dir: Path, env_factory=None):
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.cfg = cfg
        self.run_dir = Path(run_dir)
        cluster = cfg.cluster
        self.started = start_ray(cluster)
        self.group = None
        self.ended = None  # when close() took the workers down
        self.events: list[dict] = []
        try:
            env_cfgs = split_env(cfg.env, cluster.env.workers)
            self.group, self.slots = place(cluster)

            def make(cls, slot):
                custom = {k: v for k, v in slot.resources.items() if k not in ("CPU", "GPU")}
                actor = ray.remote(cls).options(
                    num_cpus=slot.resources.get("CPU", 0.0),
                    num_gpus=slot.resources.get("GPU", 0.0),
                    resources=custom or None,
                    # the runner counts failures in a row itself; the actor's optimizer state
                    # lives only in its process: a lost actor stops the run
                    max_restarts=0 if slot.role == "actor" else -1,
                    max_task_retries=0,  # a lost call is lost: the round is collected again
                    # the evaluation worker answers timing and pings while it evaluates
                    max_concurrency=2 if slot.role == "eval" else 1,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        self.group, placement_group_bundle_index=slot.bundle
                    ),
                )
                return actor

            slots = {role: [s for s in self.slots if s.role == role] for role in ROLES}
            threads = cfg.runner.torch_threads
            # rollout.workers 0: inference in each env worker's process, rounds collected there
            self.in_env = cluster.rollout.workers == 0
            if self.in_env:
                rollout_device = _device(cfg, cluster.env.num_gpus)
                env_workers = [
                    make(EnvRolloutWorker, slot).remote(
                        env_cfg, env_factory, cfg.policy, rollout_device, threads, cfg.seed, rank
                    )
                    for rank, (slot, env_cfg) in enumerate(zip(slots["env"], env_cfgs))
                ]
            else:
                rollout_device = _device(cfg, cluster.rollout.num_gpus)
                env_workers = [
                    make(EnvWorker, slot).remote(env_cfg, env_factory, 1)
                    for slot, env_cfg in zip(slots["env"], env_cfgs)
                ]
            facts = _get([w.facts.remote() for w in env_workers], "env")
            self.envs = RemoteEnvGroup(env_workers, facts)
            self.spec = self.envs.spec
            device = _device(cfg, cluster.actor.num_gpus)
            task_of_env = self.envs.task_of_env.tolist()
            # every actor worker derives the stream actor/0: the same policy, the same
            # minibatch permutations (data-parallel ranks)
            actors = [
                make(ActorWorker, slot).remote(cfg, self.spec, task_of_env, device)
                for slot in slots["actor"]
            ]
            actor = actors[0]
            eval_device = _device(cfg, cluster.eval.num_gpus)
            rollouts = [
                make(RolloutWorker, slot).remote(
                    cfg.policy, self.spec, rollout_device, threads, cfg.seed, rank
                )
                for rank, slot in enumerate(slots["rollout"])
            ]
            inferring = env_workers if self.in_env else rollouts  # the policy copies that act
            evaluators = [
                make(EvalWorker, slot).remote(
                    cfg.env, env_factory, cfg.policy, self.spec, eval_device, threads
                )
                for slot in slots.get("eval", [])
            ]
            self.eval_lost = False  # the evaluation worker died: wait for it before the next one
            self.workers = {"env": env_workers, "rollout": rollouts, "actor": actors}
            if evaluators:
                self.workers["eval"] = evaluators
            self.placed = {role: self._ask(role, "where") for role in self.workers}
            if len(actors) > 1:
                _join_ranks(actors, self.placed["actor"], device)
            role = "env" if self.in_env else "rollout"
            if resume is not None:
                checkpoint = ray.put(resume)  # (one copy for every rank; their streams in it)
                _get([a.load.remote(checkpoint) for a in actors], "actor")
                # each inference copy takes its stream from the checkpoint, as the actors do
                iteration = resume["counters"]["iteration"]
                calls = [w.resume_stream.remote(resume["rng"], iteration) for w in inferring]
                _get(calls, role)
            self.actor = actor
            self.learner = RemoteLearner(
                actors,
                cfg.algorithm.learning_rate,
                cfg.algorithm.num_minibatches,
                sharded=cfg.trainer.backend == "megatron",
            )
            has_critic = _get(inferring[0].has_critic.remote(), "rollout")
            self.inference = RemoteInference(inferring, has_critic, role)
            # which env workers each rollout worker serves, in lockstep (direct.py)
            self.members = members_of(len(rollouts), len(env_workers))
            if not self.in_env:
                self._connect()
            self.streams: dict[str, dict] = {}  # each worker's as the last round left it
            self._collected(_get([w.stream_state.remote() for w in inferring], role))
            self.full_sync = True  # the rollout workers hold random weights until the first sync
            self.sync_epoch = 0  # weight-sync groups made so far (broadcast)
            if cluster.weight_sync == "broadcast":
                self.sync_address = _get(actor.sync_address.remote(), "actor")
                self._join_sync()
            self.heartbeat = {role: time.time() for role in self.workers}
            self.since = time.time()  # the start of the window metrics() reports on
        except BaseException:
            self.close()
            raise

    # --- what the runner calls ----------------------------------------------------------------
    def sync(self, version: int) -> dict[str, float]:
        """The actor's weights to every inference copy, through the object store (one copy per
        node) or a broadcast (``cluster.weight_sync``): all of them the first time, then the
        trainable ones and the buffers that change. An inference worker lost on the way is
        replaced and the sync sent again."""
        t0 = time.perf_counter()
        failures = 0
        while True:
            try:
                nbytes = self._send_weights(version)
                break
            except WorkerLost as lost:
                failures += 1
                self.recover(lost, failures)
        now = time.time()
        self.heartbeat.update({role: now for role in ("actor", self.inference.role)})
        self._write_status()
        return {
            "cluster/sync_ms": 1000 * (time.perf_counter() - t0),
            "cluster/sync_bytes": float(nbytes),
        }

    def _send_weights(self, version: int) -> int:
        """One sync of the weights as ``version``; its bytes (``WorkerLost`` if a worker died)."""
        workers = self.inference.workers
        role = self.inference.role
        if self.cfg.cluster.weight_sync == "broadcast":
            bucket_bytes = int(self.cfg.cluster.sync_bucket_mb * 2**20)
            nbytes = self.actor.broadcast_weights.remote(self.full_sync, bucket_bytes)
            _get(
                [w.receive_weights.remote(self.full_sync, version, bucket_bytes) for w in workers],
                role,
            )
        else:
            weights, nbytes = self.actor.weights.options(num_returns=2).remote(self.full_sync)
            _get([w.sync.remote(weights, version) for w in workers], role)
        self.inference.version = version
        self.full_sync = False
        return _get(nbytes, "actor")

    def stage_candidates(self, chunk_size: int) -> list[int]:
        """Each env worker splits its own rows into stages: the counts that every worker's
        environments can split into."""
        calls = [w.stage_candidates.remote(chunk_size) for w in self.envs.workers]
        answers = _get(calls, "env")
        return [s for s in answers[0] if all(s in theirs for theirs in answers)]

    def collect(
        self,
        obs: Observation,
        plan: CollectPlan,
        stats: EpisodeStats,
        *,
        stages: int = 1,
        chunk_size: int = 1,
        should_stop=None,
    ) -> RolloutBatch:
        """A round from the last ``envs.reset``, as ``rollout.collect``: each env worker collects
        its rows' round, acting through the rollout worker that serves it or (``rollout.workers:
        0``) with its own policy copy; this process sends the plan and gets the batches."""
        envs = self.envs
        parts = [plan.part(lo, hi) for lo, hi in zip(envs.bounds, envs.bounds[1:])]
        sent = [to_wire(part) for part in parts]
        env_calls = [
            worker.collect.remote(wired, stages, chunk_size)
            for worker, wired in zip(envs.workers, sent)
        ]
        serve_calls = [] if self.in_env else [w.serve.remote() for w in self.workers["rollout"]]
        answers, served = self._wait_round(env_calls, serve_calls, should_stop)
        envs.traffic.bytes += wire_bytes(sent) + wire_bytes(answers)
        envs.traffic.rows += envs.num_envs * plan.num_chunks
        batches = []
        streams = served
        for index, (batch, totals, stream) in zip(envs.task_index, map(from_wire, answers)):
            batch.task_id = index[batch.task_id]  # the worker's task ids -> the run's
            stats.totals.index_add_(1, index.to(stats.totals.device), totals)
            batches.append(batch)
            if self.in_env:
                streams.append(stream)
        self._collected(streams)
        merged = RolloutBatch.cat_envs(batches)
        merged.instructions = envs.instructions
        return merged

    def _wait_round(self, env_calls: list, serve_calls: list, should_stop) -> tuple[list, list]:
        """The answers of a round's calls: (the env workers', the rollout workers'). When a
        worker dies its peers' calls end too (their connections close); the dead worker's role
        is the one lost (``WorkerLost``), not the peers' broken connections."""
        import ray

        waiting = env_calls + serve_calls
        while waiting:
            if should_stop is not None and should_stop():
                raise Interrupted  # (the workers finish their round; nothing of it is kept)
            _, waiting = ray.wait(waiting, num_returns=len(waiting), timeout=0.2)
        for role, calls in (("env", env_calls), ("rollout", serve_calls)):
            for call in calls:
                try:
                    ray.get(call)
                except ray.exceptions.RayActorError as error:
                    raise _lost(role, error) from None
                except ray.exceptions.RayTaskError:
                    pass  # (a broken connection to a lost peer, or the error raised below)
        t0 = time.perf_counter()
        answers = ray.get(env_calls)
        self.envs.traffic.wait_s += time.perf_counter() - t0
        return answers, ray.get(serve_calls)

    def evaluate(self, **kw) -> dict[str, dict]:
        """``evaluate_by_task`` through the env and rollout workers; a worker lost midway
        loses the evaluation, which starts again once the worker is back."""
        failures = 0
        while True:
            try:
                results = evaluate_by_task(RemoteVecEnv(self.envs), self.inference, **kw)
                break
            except WorkerLost as lost:
                failures += 1
                self.recover(lost, failures)
        self.metrics()  # the next iteration's window starts here: evaluation is not in it
        return results

    @property
    def evaluates_beside(self) -> bool:
        """Whether an evaluation worker runs evaluations beside training."""
        return "eval" in self.workers

    def start_evaluation(
        self, *, episodes: int, seed: int, weights: dict[str, torch.Tensor] | None = None
    ) -> Evaluation:
        """An evaluation of the current weights in the evaluation workers, beside training, the
        episodes split between them (``split_episodes``): a handle whose ``result()`` is {task:
        summary} (``WorkerLost`` if a worker died; Ray restarts it). ``weights``: a
        checkpoint's (its whole state dict) instead of the actor's current ones."""
        import ray

        evaluators = self.workers["eval"]
        if self.eval_lost:  # Ray restarts it: the next evaluation waits until it is back
            for worker in evaluators:
                self._wait_alive("eval", worker)
            self.eval_lost = False
            self.placed["eval"] = self._ask("eval", "where") or self.placed["eval"]
            self._write_status()
        if weights is None:
            # all the weights every time: a worker Ray restarted between evaluations lost them
            weights, _ = self.actor.weights.options(num_returns=2).remote(True)
        else:
            weights = ray.put(to_wire(weights))
        version = self.inference.version
        shares = split_episodes(episodes, seed, len(evaluators))
        refs = [
            worker.evaluate.remote(weights, version, share_episodes, share_seed)
            for worker, (share_episodes, share_seed) in zip(evaluators, shares)
        ]
        return Evaluation(self, refs)

    def metrics(self) -> tuple[dict[str, float], list[tuple]]:
        """Since the last call (an iteration): per role its workers' busy seconds (the busiest
        worker's) and idle share; per rollout step (B environment rows) the bytes that crossed
        to and from the env and rollout workers and the milliseconds this process waited for
        each. Also every worker call's span (name, role, worker, start, end) for a trace."""
        now = time.time()
        wall = max(now - self.since, 1e-9)
        self.since = now
        out: dict[str, float] = {}
        spans: list[tuple] = []
        for role in self.workers:
            answers = self._ask(role, "timing")
            if answers:
                self.heartbeat[role] = now
            else:  # (no workers in the role, or a lost evaluation worker: its heartbeat stays)
                answers = [(0.0, [])]
            busy = max(b for b, _ in answers)
            out[f"cluster/{role}_busy_s"] = busy
            out[f"cluster/{role}_idle"] = max(0.0, 1.0 - busy / wall)
            for index, (_, calls) in enumerate(answers):
                spans += [(name, role, index, start, end) for name, start, end in calls]
        B = self.envs.num_envs
        for role, proxy in (("env", self.envs), ("rollout", self.inference)):
            wait_s, nbytes, rows = proxy.traffic.take()
            steps = max(rows / B, 1e-9)
            out[f"cluster/{role}_bytes_per_step"] = nbytes / steps
            out[f"cluster/{role}_wait_ms_per_step"] = 1000 * wait_s / steps
        return out, spans

    def _collected(self, states: list[dict]) -> None:
        """The inference workers' streams after a round: where the next round starts, and so
        what a worker restarted before it ends continues from (the others too: the lost round
        moved theirs on), so the round collected again draws what the lost one drew."""
        self.streams.update({f"rollout/{i}": state for i, state in enumerate(states)})

    def rng_state(self) -> dict:
        """Every worker's stream (the actor ranks share actor/0: rank 0's), as a checkpoint
        stores them."""
        self.streams["actor/0"] = _get(self.actor.stream_state.remote(), "actor")
        return {"streams": dict(self.streams)}

    def recover(self, error: WorkerLost, failures: int) -> None:
        """Wait for Ray to restart the lost role's workers, then bring them up to date (a worker
        lost meanwhile counts as one more failure); a role lost more than
        ``cluster.max_restarts`` times in a row stops the run."""
        limit = self.cfg.cluster.max_restarts
        while True:
            self.events.append({"time": time.time(), "role": error.role, "detail": error.detail})
            if error.role == "actor":
                raise error  # (its message says to resume)
            if failures > limit:
                raise WorkerLost(
                    error.role,
                    f"{error.detail}; {failures} rounds in a row lost "
                    f"(cluster.max_restarts={limit})",
                )
            try:
                self._restore()
                return
            except WorkerLost as again:
                error = again
                failures += 1

    def _restore(self) -> None:
        """The restarted workers seeded, in the weight-sync group and holding the weights."""
        for role in ("env", "rollout"):
            for worker in self.workers[role]:
                self._wait_alive(role, worker)
        # every inference copy continues its stream from the last completed iteration (a
        # restarted one's is fresh, the others' moved on in the lost round)
        calls = [
            worker.set_stream.remote(self.streams[f"rollout/{rank}"])
            for rank, worker in enumerate(self.inference.workers)
        ]
        _get(calls, self.inference.role)
        if self.cfg.cluster.weight_sync == "broadcast":  # a new group, the new worker in it
            self._join_sync()
        self.full_sync = True
        self._send_weights(self.inference.version)
        if not self.in_env:
            self._connect()
        for role in self.workers:
            self.placed[role] = self._ask(role, "where") or self.placed[role]
        self._write_status()

    def _connect(self) -> None:
        """Each env worker connects to the rollout worker that serves it (``members``), all of
        them afresh (embodied/cluster/direct.py)."""
        rollouts = self.workers["rollout"]
        addresses = _get([w.listen.remote() for w in rollouts], "rollout")
        accepted = [w.accept.remote(len(m)) for w, m in zip(rollouts, self.members)]
        calls = [
            self.envs.workers[env].connect.remote(address, key, member, self.inference.has_critic)
            for (address, key), served in zip(addresses, self.members)
            for member, env in enumerate(served)
        ]
        _get(calls, "env")
        _get(accepted, "rollout")

    def _join_sync(self) -> None:
        """The actor (rank 0) and the inference workers form a new weight-sync group."""
        self.sync_epoch += 1
        members = [self.actor, *self.inference.workers]
        calls = [
            w.join_sync.remote(self.sync_address, rank, len(members), self.sync_epoch)
            for rank, w in enumerate(members)
        ]
        _get(calls[1:], self.inference.role)
        _get(calls[0], "actor")

    def _ask(self, role: str, method: str) -> list | None:
        """Every worker of ``role`` answers ``method``. A lost evaluation worker answers None:
        it loses its evaluation only (the next one waits for Ray's restart)."""
        try:
            return _get([getattr(w, method).remote() for w in self.workers[role]], role)
        except WorkerLost:
            if role != "eval":
                raise
            self.eval_lost = True
            return None

    def _wait_alive(self, role: str, worker) -> None:
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

    def _write_status(self) -> None:
        """RUN/cluster.json: each worker's role, node, process and resources, each role's last
        heartbeat (when its workers last answered a timing call or a weight sync), the faults so
        far (``embodied cluster status RUN`` reads it)."""
        rows = []
        for slot in self.slots:
            placed = self.placed[slot.role][slot.index]
            rows.append(
                {
                    "role": slot.role,
                    "index": slot.index,
                    "resources": slot.resources,
                    **placed,
                    "heartbeat": self.heartbeat[slot.role],
                }
            )
        status = {
            "ended": self.ended,
            "placement": self.cfg.cluster.placement,
            "cluster": to_dict(self.cfg.cluster),
            "workers": rows,
            "events": self.events,
            "updated": time.time(),
        }
        tmp = self.run_dir / (STATUS_FILE + ".tmp")
        tmp.write_text(json.dumps(status, indent=2))
        tmp.replace(self.run_dir / STATUS_FILE)

    def close(self) -> None:
        import ray

        if not ray.is_initialized():
            return
        envs = getattr(self, "envs", None)
        if envs is not None:
            envs.close()
        evaluators = getattr(self, "workers", {}).get("eval", [])
        try:  # (behind an evaluation in flight: it may not finish in time, and is killed)
            ray.get([w.close.remote() for w in evaluators], timeout=30)
        except Exception:
            pass
        written = (self.run_dir / STATUS_FILE).exists()  # (at the run's first weight sync)
        if written and hasattr(self, "heartbeat"):
            self.ended = time.time()
            self._write_status()
        for workers in getattr(self, "workers", {}).values():
            for worker in workers:
                ray.kill(worker)
        if self.group is not None:
            ray.util.remove_placement_group(self.group)
        if self.started:
            ray.shutdown()


def _join_ranks(actors: list, placed: list[dict], device: str) -> None:
    """Make the actor workers one process group (rank = index), rank 0's node the meeting
    place. NCCL wants a GPU per rank: actor workers that share one are refused."""
    if device.startswith("cuda"):
        ids = [tuple(p["gpu_ids"]) for p in placed]
        if len(set(ids)) < len(ids):
            raise ConfigError(
                f"cluster.actor: {len(actors)} actor workers share GPU(s) {ids}; data-parallel "
                "ranks and megatron's TP ranks need a GPU each (cluster.actor.num_gpus=1)"
            )
    address = _get(actors[0].address.remote(), "actor")
    _get([a.join.remote(rank, len(actors), address) for rank, a in enumerate(actors)], "actor")


def _device(cfg, num_gpus: float) -> str:
    """A worker's torch device: ``runner.device`` when given, else its GPU if it has one."""
    if cfg.runner.device != "auto":
        return cfg.runner.device
    return "cuda" if num_gpus > 0 else "cpu"
