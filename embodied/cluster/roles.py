"""The run's roles as Ray actors, behind the methods the embedded roles have (embodied/roles.py).

The runner's process (the driver) keeps the loop and sends each worker a few calls per iteration. A
round is collected where the environments are: each env worker runs the embedded loop over its rows
and acts through the rollout worker that serves it, directly (embodied/cluster/direct.py), or with a
policy copy of its own (``rollout.workers: 0``); the driver sends the plan and gets the batch.
``RemoteLearner`` sends the batch to the actor workers. An evaluation is collected where the
environments are too: each env worker evaluates its share of each task's episodes, acting as in its
rounds. Tensors travel as numpy arrays through Ray's object store (embodied/cluster/wire.py).

Each worker draws from a random stream of its own, derived from (seed, role, rank) as the
embedded run derives its one shard's (embodied/streams.py): a run with one worker per role draws
exactly what the embedded run draws, and a fixed worker count gives a reproducible run.

A worker that dies is restarted by Ray; its call raises ``WorkerLost`` here, the runner discards
the round and collects it again, and ``recover`` brings the restarted worker up to date (a
rollout worker gets the full weights and its stream as the last completed iteration left it).
"""

from __future__ import annotations

import functools
import time
from pathlib import Path

import torch

from embodied.cluster.calls import get, lost, wait_alive
from embodied.cluster.config import ROLES
from embodied.cluster.direct import NotConnected, members_of
from embodied.cluster.envs import RemoteEnvGroup, split_env
from embodied.cluster.evaluation import Evaluation
from embodied.cluster.inference import RemoteInference
from embodied.cluster.learner import RemoteLearner, RoundShards, join_ranks
from embodied.cluster.placement import place
from embodied.cluster.start import start_ray
from embodied.cluster.status import STATUS_FILE, write_status
from embodied.cluster.wire import from_wire, to_wire, wire_bytes
from embodied.cluster.workers import (
    ActorWorker,
    EnvRolloutWorker,
    EnvWorker,
    EvalWorker,
    RolloutWorker,
)
from embodied.evaluate import pooled_summary, split_episodes
from embodied.roles import WorkerLost
from embodied.rollout import CollectPlan, EpisodeStats
from embodied.run import Interrupted
from embodied.schema import Observation


class RayRoles:
    """The roles as Ray actors in one placement group (see the module docstring), behind the
    ``Roles`` protocol the runner drives."""

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
            facts = get([w.facts.remote() for w in env_workers], "env")
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
                join_ranks(actors, self.placed["actor"], device)
            role = "env" if self.in_env else "rollout"
            if resume is not None:
                checkpoint = ray.put(resume)  # (one copy for every rank; their streams in it)
                get([a.load.remote(checkpoint) for a in actors], "actor")
                # each inference copy takes its stream from the checkpoint, as the actors do
                iteration = resume["counters"]["iteration"]
                calls = [w.resume_stream.remote(resume["rng"], iteration) for w in inferring]
                get(calls, role)
            self.actor = actor
            sharded = cfg.trainer.backend == "megatron"
            self.learner = RemoteLearner(actors, cfg.algorithm.learning_rate, sharded)
            has_critic = get(inferring[0].has_critic.remote(), "rollout")
            self.inference = RemoteInference(inferring, has_critic, role)
            # which env workers each rollout worker serves, in lockstep (direct.py)
            self.members = members_of(len(rollouts), len(env_workers))
            if not self.in_env:
                self._connect()
            self.streams: dict[str, dict] = {}  # each worker's as the last round left it
            self._collected(get([w.stream_state.remote() for w in inferring], role))
            self.full_sync = True  # the rollout workers hold random weights until the first sync
            self.sync_epoch = 0  # weight-sync groups made so far (broadcast)
            if cluster.weight_sync == "broadcast":
                self.sync_address = get(actor.sync_address.remote(), "actor")
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
            get(
                [w.receive_weights.remote(self.full_sync, version, bucket_bytes) for w in workers],
                role,
            )
        else:
            weights, nbytes = self.actor.weights.options(num_returns=2).remote(self.full_sync)
            get([w.sync.remote(weights, version) for w in workers], role)
        self.inference.version = version
        self.full_sync = False
        return get(nbytes, "actor")

    def stage_candidates(self, chunk_size: int) -> list[int]:
        """The stage counts every env worker can split its own rows into."""
        calls = [w.stage_candidates.remote(chunk_size) for w in self.envs.workers]
        answers = get(calls, "env")
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
    ) -> RoundShards:
        """A round from the last ``envs.reset``, as ``rollout.collect``: each env worker collects
        its rows' round, acting through the rollout worker that serves it or (``rollout.workers:
        0``) with its own policy copy. This process sends the plan and gets references to the
        batches, which stay with the env workers until the actor workers fetch them."""
        envs = self.envs
        sent = [to_wire(plan.part(lo, hi)) for lo, hi in zip(envs.bounds, envs.bounds[1:])]
        env_calls = [
            worker.collect.remote(wired, stages, chunk_size, to_wire(index))
            for worker, wired, index in zip(envs.workers, sent, envs.task_index)
        ]
        serve_calls = [] if self.in_env else [w.serve.remote() for w in self.workers["rollout"]]
        answers, served = self._wait_round(env_calls, serve_calls, should_stop)
        envs.traffic.bytes += wire_bytes(sent) + wire_bytes(answers)
        envs.traffic.rows += envs.num_envs * plan.num_chunks
        shards = []
        for index, (shard, totals, stream) in zip(envs.task_index, answers):
            shards += shard  # (a reference: the batch stays with its env worker)
            stats.totals.index_add_(1, index.to(stats.totals.device), from_wire(totals))
            served += [stream] if self.in_env else []  # (the streams of the inference copies)
        # the round's streams are kept once the learner has the round (a round lost before
        # then is collected again from the streams before it, and draws what it drew)
        return RoundShards(shards, envs.instructions, functools.partial(self._collected, served))

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
        failed = []  # (role, error): a worker's own error, or a peer's broken link
        for role, calls in (("env", env_calls), ("rollout", serve_calls)):
            for call in calls:
                try:
                    ray.get(call)
                except ray.exceptions.RayActorError as error:
                    raise lost(role, error) from None
                except ray.exceptions.RayTaskError as error:
                    failed.append((role, error))
        for role, error in failed:  # (Ray restarted it between rounds)
            if isinstance(error.cause, NotConnected):
                raise WorkerLost(role, str(error.cause))
        if failed:  # the error that ended the round, before the links it broke
            broken = (ConnectionError, EOFError)
            raise min((e for _, e in failed), key=lambda e: isinstance(e.cause, broken))
        t0 = time.perf_counter()
        answers = ray.get(env_calls)
        self.envs.traffic.wait_s += time.perf_counter() - t0
        return answers, ray.get(serve_calls)

    def evaluate(
        self, *, episodes: int, seed: int, video_path=None, progress=None, should_stop=None
    ) -> dict[str, dict]:
        """``evaluate_by_task`` where the environments are: each env worker evaluates its share
        of each task's episodes, acting as its rounds do; a worker lost midway loses the
        evaluation, which starts again once the worker is back."""
        failures = 0
        while True:
            try:
                results = self._evaluate(episodes, seed, video_path, progress, should_stop)
                break
            except WorkerLost as lost:
                failures += 1
                self.recover(lost, failures)
        self.metrics()  # the next iteration's window starts here: evaluation is not in it
        return results

    def _evaluate(self, episodes, seed, video_path, progress, should_stop) -> dict[str, dict]:
        """One evaluation on the env workers (``RemoteEnvGroup.episode_shares``), pooled per
        task; the video is the first env worker's tasks'."""
        envs = self.envs
        shares = envs.episode_shares(episodes, seed)
        video = [video_path is not None and w == 0 for w in range(len(envs.workers))]
        env_calls = [w.evaluate.remote(*args) for w, args in zip(envs.workers, zip(shares, video))]
        serve_calls = [] if self.in_env else [w.serve.remote() for w in self.workers["rollout"]]
        answers, _ = self._wait_round(env_calls, serve_calls, should_stop)
        parts: dict[str, list[dict]] = {name: [] for name in envs.task_names}
        for results, _ in answers:
            for name, summary in results.items():
                parts[name].append(summary)
        pooled = {name: pooled_summary(theirs) for name, theirs in parts.items()}
        recorded = answers[0][1]
        for summary in pooled.values():
            summary.pop("eval/video", None)  # (the worker's own file)
            if recorded is not None:
                summary["eval/video"] = str(video_path)
        if recorded is not None:
            Path(video_path).parent.mkdir(parents=True, exist_ok=True)
            Path(video_path).write_bytes(recorded)
        if progress is not None:
            progress.update(episodes * len(pooled))
        return pooled

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
                wait_alive("eval", worker)
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
        return Evaluation(refs, self._eval_worker_lost)

    def metrics(self) -> tuple[dict[str, float], list[tuple]]:
        """Since the last call (an iteration): per role its workers' busy seconds (the busiest
        worker's) and idle share; per rollout step (B environment rows) the bytes that crossed to
        and from the env workers and the milliseconds this process waited for them. Also every
        worker call's span (name, role, worker, start, end) for a trace."""
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
        wait_s, nbytes, rows = self.envs.traffic.take()
        steps = max(rows / self.envs.num_envs, 1e-9)
        out["cluster/env_bytes_per_step"] = nbytes / steps
        out["cluster/env_wait_ms_per_step"] = 1000 * wait_s / steps
        return out, spans

    def _collected(self, states: list[dict]) -> None:
        """The inference workers' streams after a round the learner has: where the next round
        starts, so that a round collected again after a loss draws what the lost one drew."""
        self.streams.update({f"rollout/{i}": state for i, state in enumerate(states)})

    def rng_state(self) -> dict:
        """Every worker's stream (the actor ranks share actor/0), as a checkpoint stores them."""
        self.streams["actor/0"] = get(self.actor.stream_state.remote(), "actor")
        return {"streams": dict(self.streams)}

    def recover(self, error: WorkerLost, failures: int) -> None:
        """Wait for Ray to restart the lost role's workers and bring them up to date (a loss
        meanwhile is one more failure); over ``cluster.max_restarts`` in a row stop the run."""
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
                wait_alive(role, worker)
        # every inference copy continues its stream from the last completed iteration (a
        # restarted one's is fresh, the others' moved on in the lost round)
        calls = [
            worker.set_stream.remote(self.streams[f"rollout/{rank}"])
            for rank, worker in enumerate(self.inference.workers)
        ]
        get(calls, self.inference.role)
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
        addresses = get([w.listen.remote() for w in rollouts], "rollout")
        timeout_s = self.cfg.cluster.connect_timeout_s
        accepted = [w.accept.remote(len(m), timeout_s) for w, m in zip(rollouts, self.members)]
        calls = [
            self.envs.workers[env].connect.remote(address, key, member, self.inference.has_critic)
            for (address, key), served in zip(addresses, self.members)
            for member, env in enumerate(served)
        ]
        get(calls, "env")
        get(accepted, "rollout")

    def _join_sync(self) -> None:
        """The actor (rank 0) and the inference workers form a new weight-sync group."""
        self.sync_epoch += 1
        members = [self.actor, *self.inference.workers]
        calls = [
            w.join_sync.remote(self.sync_address, rank, len(members), self.sync_epoch)
            for rank, w in enumerate(members)
        ]
        get(calls[1:], self.inference.role)
        get(calls[0], "actor")

    def _ask(self, role: str, method: str) -> list | None:
        """Every worker of ``role`` answers ``method``. A lost evaluation worker answers None:
        it loses its evaluation only (the next one waits for Ray's restart)."""
        try:
            return get([getattr(w, method).remote() for w in self.workers[role]], role)
        except WorkerLost:
            if role != "eval":
                raise
            self.eval_lost = True
            return None

    def _eval_worker_lost(self, lost: WorkerLost) -> None:
        """An evaluation worker is lost: a fault; the next evaluation waits for Ray's restart."""
        self.events.append({"time": time.time(), "role": "eval", "detail": lost.detail})
        self.eval_lost = True

    def _write_status(self) -> None:
        """RUN/cluster.json (``status.write_status``): each worker's place and heartbeat, the
        faults so far."""
        rows = [
            {
                "role": slot.role,
                "index": slot.index,
                "resources": slot.resources,
                **self.placed[slot.role][slot.index],
                "heartbeat": self.heartbeat[slot.role],
            }
            for slot in self.slots
        ]
        write_status(self.run_dir, rows, self.cfg, self.events, self.ended)

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


def _device(cfg, num_gpus: float) -> str:
    """A worker's torch device: ``runner.device`` when given, else its GPU if it has one."""
    if cfg.runner.device != "auto":
        return cfg.runner.device
    return "cuda" if num_gpus > 0 else "cpu"
