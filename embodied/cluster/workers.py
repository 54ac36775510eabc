"""The worker processes of a cluster run: thin wrappers, as Ray actors, around the same objects the
embedded run calls (``EnvGroup``, ``InferencePolicy``, ``Learner``). What they return crosses the
process boundary as numpy arrays (embodied/cluster/wire.py).

A worker that dies is restarted by Ray with the arguments it was made with: an env worker builds
its environments again (the runner's next reset seeds them), a rollout worker builds its policy
again and receives the learner's full weights before it acts. What the driver set after the
constructor (connections, the weight-sync group, the weights, the stream, the privileged keys) is
gone: the worker says so (``NotConnected``) until the driver has set it again (``catch_up``).
"""

from __future__ import annotations

import contextlib
import functools
import os
import tempfile
import threading
import time
from pathlib import Path

import torch

from embodied import numerics
from embodied.cluster import direct
from embodied.cluster.shared import SharedWeights
from embodied.cluster.status import where
from embodied.cluster.wire import from_wire, to_wire
from embodied.env_group import EnvGroup
from embodied.episode_stats import EpisodeStats
from embodied.evaluate import evaluate_by_task, evaluate_shares
from embodied.frozen_weights import frozen_keys
from embodied.inference import InferencePolicy
from embodied.models import build_policy
from embodied.rollout import collect
from embodied.stages import stage_candidates
from embodied.streams import Stream, resumed

DRIVER_CWD = "EMBODIED_DRIVER_CWD"  # the driver's working directory (start_ray passes it)


def _start(torch_threads: int) -> None:
    """What every worker does first: torch's threads (and the run's numeric pins), and the
    driver's working directory where this node has it, so that the paths a config gives
    relative to it (``runner.init_from``, ``policy.vlm_path``, the run directory) name the same
    files here as in the driver, also in a cluster started elsewhere."""
    numerics.setup(torch_threads)
    cwd = os.environ.get(DRIVER_CWD)
    if cwd and os.path.isdir(cwd):
        os.chdir(cwd)


def timed(method):
    """Count a call's seconds as the worker's busy time, and keep its span (wall clock, for
    ``runner.trace``)."""

    @functools.wraps(method)
    def call(self, *args, **kw):
        start = time.time()
        try:
            return method(self, *args, **kw)
        finally:
            end = time.time()
            self.busy_s += end - start
            self.spans.append((method.__name__, start, end))

    return call


class _Worker:
    """What every worker answers: where it runs, a liveness ping, its random stream, its
    timing."""

    busy_s = 0.0  # seconds spent in calls since the last ``timing()``
    spans: list  # (method, start, end) since the last ``timing()``

    def where(self) -> dict:
        return where()

    def ping(self) -> int:
        return os.getpid()

    stream: Stream  # what this worker's role draws from (embodied/streams.py)
    sync_epoch = 0  # the weight-sync group it is in (0: none; broadcast.py)

    def stream_state(self) -> dict:
        return self.stream.state()

    def set_stream(self, state: dict) -> None:
        """Continue from ``state`` (a restarted worker: the last completed iteration's)."""
        self.stream.load(state)

    def resume_stream(self, rng: dict, iteration: int) -> None:
        """The stream as a resumed run continues it from a checkpoint's ``rng`` saved at
        ``iteration`` (``streams.resumed``)."""
        resumed(self.stream, rng, self.seed, iteration)

    def join_sync(self, address: str, rank: int, size: int, epoch: int) -> None:
        """Join the weight-sync group (``cluster.weight_sync: broadcast``) at the actor's store
        ``address`` as ``rank`` of ``size``; ``epoch`` counts the groups made so far."""
        from embodied.cluster.broadcast import SyncGroup, connect

        if getattr(self, "sync_store", None) is None:
            self.sync_store = connect(address)
        self.sync_group = SyncGroup(self.sync_store, rank, size, epoch)
        self.sync_epoch = epoch

    def timing(self) -> tuple[float, list]:
        """(busy seconds, the calls' spans) since the last call."""
        busy, spans = self.busy_s, self.spans
        self.busy_s = 0.0
        self.spans = []
        return busy, spans


class EnvWorker(_Worker):
    """Environments ``[lo, hi)`` of the run: ``factory(env_cfg)`` (default ``make_env``) behind an
    ``EnvGroup``. Chunks are executed here: one call per chunk, not per environment step."""

    # chunks of several actions step in a thread while the next stage's request comes
    CHUNKS_IN_THREAD = True

    def __init__(self, env_cfg, factory, torch_threads: int = 1):
        self.spans = []
        _start(torch_threads)
        if factory is None:
            from embodied.multitask import make_env

            factory = make_env
        self.env = factory(env_cfg)
        self.group = EnvGroup(self.env, chunks_in_thread=self.CHUNKS_IN_THREAD)

    def facts(self) -> dict:
        group = self.group
        return {
            "num_envs": group.num_envs,
            "spec": group.spec,
            "task_names": group.task_names,
            "task_of_env": group.task_of_env.tolist(),
            "device": str(group.device),
            "can_pipeline": group.can_pipeline,
            **where(),
        }

    def keep_privileged(self, keys: list[str]) -> None:
        """Observe only the privileged ``keys``: those every env worker's tasks have, as one
        multi-task environment of all of them would (this worker's is one of its tasks). A
        restarted worker observes all of its own again until the driver says this again."""
        self.env.keep_privileged(keys)
        self.group.drain()  # (recovery: a failed round's step may still be in flight)
        self.group = EnvGroup(self.env, chunks_in_thread=self.CHUNKS_IN_THREAD)

    @timed
    def reset(self, seeds: int | list[int] | None):
        """Reset every environment: ([the observations in the object store, owned by this
        worker], the tasks' instructions). The observations stay here (a round starts from them,
        ``collect``) unless the driver's caller fetches them (an evaluation)."""
        import ray

        obs = self.group.reset(seed=seeds)
        self.obs = obs
        return [ray.put(to_wire(obs))], self.group.instructions

    @timed
    def evaluate(self, shares: list[tuple[int, int]], video: bool) -> tuple[dict, bytes | None]:
        """Its part of an evaluation, acting as its rounds do (``evaluate_shares``; ``shares``:
        (episodes, seed) per task of this worker): ({task: summary} of the tasks it has episodes
        of, the video's mp4 bytes when ``video``)."""
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / "eval.mp4" if video else None
            with self._acting() as inference:
                results = evaluate_shares(self.env, inference, shares=shares, video_path=path)
            return results, path.read_bytes() if video and path.exists() else None

    # --- rounds collected here (the embedded loop), acting through the rollout worker -------
    def connect(self, address, key: bytes, member: int, has_critic: bool) -> None:
        """Act through the rollout worker listening at ``address``, as its ``member``-th env
        worker (embodied/cluster/direct.py)."""
        old = getattr(self, "inference", None)
        if old is not None:
            old.close()
        connection = direct.connect(address, key, member)
        self.inference = direct.DirectInference(connection, self.group.device, has_critic)

    def stage_candidates(self, chunk_size: int) -> list[int]:
        return stage_candidates(self.group, chunk_size)

    @timed
    def collect(self, plan, stages: int, chunk_size: int, task_index):
        """A round from the last reset: ([its RolloutBatch in the object store, owned by this
        worker], its first episodes' totals f32 [5, this worker's tasks], the inference
        copy's stream after it where it lives here). The batch stays here until the actor
        workers fetch it; ``task_index`` (long [this worker's tasks]) maps its task ids to the
        run's."""
        import ray

        with self._acting() as inference:
            stats = EpisodeStats(self.group.task_names, inference.device)
            batch, _ = collect(
                self.group,
                inference,
                self.obs,
                from_wire(plan),
                stats,
                stages=stages,
                chunk_size=chunk_size,
            )
        batch.task_id = from_wire(task_index, batch.task_id.device)[batch.task_id]
        shard = ray.put(to_wire(batch))  # (put here: this worker owns it, not the driver)
        return [shard], to_wire(stats.totals), self.stream_after()

    @contextlib.contextmanager
    def _acting(self):
        """The policy a round or an evaluation acts with: the link to its rollout worker, whose
        round ends with this one (an error here closes the link, and ends it there too)."""
        why = self.unready()
        if why is not None:
            raise direct.NotConnected(why)
        inference = self.inference
        linked = isinstance(inference, direct.DirectInference)
        try:
            yield inference
        except BaseException:
            if linked:
                inference.close()
            raise
        if linked:
            inference.end_round()
            self.busy_s -= inference.waited_s  # (waiting for the rollout worker: not busy)
            inference.waited_s = 0.0

    def unready(self) -> str | None:
        """Why this worker cannot act in a round (Ray restarted it since the last one), or
        None."""
        if getattr(self, "inference", None) is None:
            return direct.UNLINKED
        return None

    def stream_after(self) -> dict | None:
        """The stream of the inference copy in this process (none: it is a rollout worker's)."""
        return None

    def close(self) -> None:
        self.group.close()


class RolloutWorker(_Worker):
    """An inference copy of the policy at a known weight version, acting on observation batches.
    It is built from the spec with random weights and acts only after a full sync: a sync of
    some of the weights to a copy that has none (Ray restarted it) is ``NotConnected``."""

    def __init__(self, policy_cfg, spec, device: str, torch_threads: int, seed: int, rank: int):
        self.spans = []
        _start(torch_threads)
        self.device = torch.device(device)
        self.seed = seed
        self.stream = Stream.derived(seed, "rollout", rank)
        self.policy_cfg = policy_cfg
        self._build_copy(spec)

    def _build_copy(self, spec) -> None:
        """A policy copy for ``spec``, with none of the learner's weights yet."""
        policy = build_policy(spec, self.policy_cfg).to(self.device).eval()
        compile_act = self.policy_cfg.compile_act
        self.inference = InferencePolicy(policy, stream=self.stream, compile_act=compile_act)
        self.sync_keys = sync_keys_of(self.inference.policy)
        self.version = -1  # no weights from the learner yet

    def _can_load(self, full: bool) -> None:
        """``NotConnected`` where a sync of only the weights that change would leave this copy
        with random ones (the frozen part, or all of them): Ray restarted it since the last
        sync."""
        if not full and self.version < 0:
            raise direct.NotConnected(direct.UNSYNCED)

    def sync_state(self) -> tuple[int, int]:
        """(the weight-sync group it is in, the weights' version it holds; -1: none)."""
        return self.sync_epoch, self.version

    @timed
    def sync(self, weights, version: int, full: bool) -> float:
        """Load the learner's weights (all of them, or the trainable ones and the buffers that
        change); returns the seconds it took here."""
        t0 = time.perf_counter()
        self._can_load(full)
        self.inference.sync(from_wire(weights, self.device), version)
        self.version = version
        return time.perf_counter() - t0

    @timed
    def receive_weights(self, full: bool, version: int, bucket_bytes: int) -> float:
        """``sync`` through the weight-sync group's broadcast; returns the seconds here."""
        t0 = time.perf_counter()
        self._can_load(full)
        if getattr(self, "sync_group", None) is None:
            raise direct.NotConnected(direct.UNGROUPED)
        named = sync_entries(self.inference.policy, self.sync_keys, full)
        self.inference.sync(self.sync_group.receive(list(named.items()), bucket_bytes), version)
        self.version = version
        return time.perf_counter() - t0

    @timed
    def read_shared(self, handles: bytes, full: bool, version: int) -> float:
        """``sync`` from the actor's shared buffers (``weight_sync: shared``), mapped at the
        first call (``handles``); returns the seconds here."""
        t0 = time.perf_counter()
        self._can_load(full)
        if getattr(self, "shared", None) is None:
            try:
                self.shared = SharedWeights.open(handles)
            except (RuntimeError, OSError) as error:
                raise RuntimeError(
                    "weight_sync shared: this worker cannot map the actor's weights (it needs "
                    f"the actor's node and, on a GPU, its device): {error}"
                ) from None
        state = self.shared.views(None if full else self.sync_keys)
        self.inference.sync(state, version)
        self.version = version
        return time.perf_counter() - t0

    def get_version(self) -> int:
        return self.version

    # --- serving env workers directly (embodied/cluster/direct.py) ----------------------------
    def listen(self) -> tuple:
        """Listen for this worker's env workers afresh (those of a lost round are dropped):
        (address, key)."""
        import ray

        for connection in getattr(self, "members", []):
            connection.close()
        self.members = []
        if getattr(self, "listener", None) is not None:
            self.listener.close()
        self.listener, address, self.key = direct.listen(ray.util.get_node_ip_address())
        return address, self.key

    def accept(self, members: int, timeout_s: float) -> None:
        self.members = direct.accept(self.listener, self.key, members, timeout_s)

    @timed
    def serve(self) -> dict:
        """One round of the env workers connected to this one; the stream's state after it."""
        if not getattr(self, "members", None):
            raise direct.NotConnected("restarted since the last round: not connected")
        try:
            _, waited_s = direct.serve(self.members, self.inference)
        except BaseException:
            for connection in self.members:  # (the members' rounds end too)
                connection.close()
            raise
        self.busy_s -= waited_s  # (waiting for the env workers' requests: not busy)
        return self.stream.state()

    def has_critic(self) -> bool:
        return self.inference.has_critic


class EnvRolloutWorker(EnvWorker, RolloutWorker):
    """An env worker with the rollout role's inference copy in its own process
    (``cluster.rollout.workers: 0``, as RLlib's env runners): it collects whole rounds of its
    environments (``collect``, the embedded loop), so no call crosses a process boundary per
    chunk. For policies that infer quickly on the env worker's device; a large VLA wants rollout
    workers of its own, on a GPU, batching the observations of several env workers."""

    # its policy samples in this process from the run's stream, which swaps torch's global
    # generator: a simulator drawing from it in a chunk thread at the same time (ManiSkill's
    # automatic resets) would take the stream's numbers. Chunks run in the acting thread, as in
    # the embedded run
    CHUNKS_IN_THREAD = False

    def __init__(
        self, env_cfg, factory, policy_cfg, device: str, torch_threads: int, seed: int, rank: int
    ):
        EnvWorker.__init__(self, env_cfg, factory, torch_threads)
        spec = self.group.spec
        RolloutWorker.__init__(self, policy_cfg, spec, device, torch_threads, seed, rank)

    def keep_privileged(self, keys: list[str]) -> None:
        """As an env worker's, and the policy copy built again for what is observed now (the
        run's policy reads the keys every worker has: a copy that reads all of this worker's
        would have other weights than the learner's); it waits for all the weights again."""
        EnvWorker.keep_privileged(self, keys)
        self._build_copy(self.group.spec)

    def unready(self) -> str | None:
        if self.version < 0:
            return direct.UNSYNCED
        return None

    def stream_after(self):
        return self.stream.state()


class EvalWorker(_Worker):
    """Evaluations beside training: environments of its own (the run's env config) and a policy
    copy that gets the weights of the iteration it evaluates."""

    def __init__(self, env_cfg, factory, policy_cfg, spec, device: str, torch_threads: int = 1):
        self.spans = []
        _start(torch_threads)
        if factory is None:
            from embodied.multitask import make_env

            factory = make_env
        self.env = factory(env_cfg)
        self.device = torch.device(device)
        self.inference = InferencePolicy(build_policy(spec, policy_cfg).to(self.device).eval())
        # one evaluation at a time: the second concurrent call slot is for timing calls
        self.evaluating = threading.Lock()

    @timed
    def evaluate(self, weights, version: int, episodes: int, seed: int) -> dict[str, dict]:
        """``evaluate_by_task`` at the weights ``weights`` (all of them the first time, then
        the ones that change): {task: summary}."""
        with self.evaluating:
            self.inference.sync(from_wire(weights, self.device), version)
            policy = self.inference.policy
            return evaluate_by_task(self.env, policy, episodes=episodes, seed=seed)

    def close(self) -> None:
        self.env.close()


def sync_entries(policy: torch.nn.Module, sync_keys: set[str], full: bool) -> dict:
    """The state-dict entries a weight sync carries, in state-dict order (the same order on
    every side): all of them, or those in ``sync_keys``."""
    state = policy.state_dict()
    return {k: v for k, v in state.items() if full or k in sync_keys}


def sync_keys_of(policy: torch.nn.Module) -> set[str]:
    """State-dict keys that an update can change: every key but the frozen ones (the same split
    checkpoints make)."""
    return set(policy.state_dict()) - frozen_keys(policy)
