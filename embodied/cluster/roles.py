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

The workers are made and grouped by role in embodied/cluster/wiring.py; each role group
(embodied/cluster/group.py) owns its workers, their health and how a restarted one catches up. A
worker that dies is restarted by Ray; its call raises ``WorkerLost`` here, the runner discards
the round and collects it again, and ``recover`` restores the env and inference groups (a
rollout worker gets the full weights and its stream as the last completed iteration left it).
"""

from __future__ import annotations

import functools
import time
from pathlib import Path

import torch
from tqdm import tqdm

from embodied.cluster.calls import RAY_GONE, USERS_ERRORS, control_plane_up, get, lost
from embodied.cluster.direct import NotConnected, members_of
from embodied.cluster.envs import split_env, untimed_note
from embodied.cluster.evaluation import Evaluation
from embodied.cluster.learner import RoundShards
from embodied.cluster.placement import place
from embodied.cluster.start import start_ray
from embodied.cluster.status import STATUS_FILE, write_status
from embodied.cluster.wire import from_wire, to_wire, wire_bytes
from embodied.cluster.wiring import start_groups
from embodied.episode_stats import EpisodeStats
from embodied.evaluate import pooled_summary, write_recorded_video
from embodied.events import EventLog
from embodied.roles import WorkerLost
from embodied.rollout import CollectPlan
from embodied.run import Interrupted
from embodied.schema import Observation


def pool_by_task(task_names: list[str], answers: list[dict[str, dict]]) -> dict[str, dict]:
    """Each env worker's ``{task: summary}`` pooled per task (its shares ran side by side). The
    timing is the whole evaluation's, in every task's summary: each worker's tasks share its
    own, so its steps/s count once in the sum and its policy's latency once in the mean (per
    task, workers holding other tasks were left out). No video: a worker's file is its own."""
    parts: dict[str, list[dict]] = {name: [] for name in task_names}
    for results in answers:
        for name, summary in results.items():
            parts[name].append(summary)
    pooled = {name: pooled_summary(theirs, side_by_side=True) for name, theirs in parts.items()}
    timed = [next(iter(results.values())) for results in answers if results]
    timed = [t for t in timed if "eval/env_steps_per_s" in t]
    for summary in pooled.values():
        summary.pop("eval/video", None)
        if timed:
            summary["eval/env_steps_per_s"] = sum(t["eval/env_steps_per_s"] for t in timed)
            summary["eval/policy_ms"] = sum(t["eval/policy_ms"] for t in timed) / len(timed)
    return pooled


class RayRoles:
    """The roles as Ray actors in one placement group (see the module docstring), behind the
    ``Roles`` protocol the runner drives."""

    def __init__(self, cfg, resume: dict | None, run_dir: Path, env_factory=None):
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        cluster = cfg.cluster
        self.started = start_ray(cluster)
        self.group = None
        self.groups = {}
        self.ended = None  # when close() took the workers down
        self.events: list[dict] = []
        self.event_log = EventLog(self.run_dir)
        try:
            env_cfgs = split_env(cfg.env, cluster.env.workers)
            if note := untimed_note(cfg.env, env_cfgs):
                print(note)
            self.group, self.slots = place(cluster, cfg.runner.device)
            made = start_groups(cfg, env_cfgs, self.group, self.slots, env_factory, self._fault)
            self.groups = made.by_role()
            self.envs, self.learner, self.inference = made.envs, made.learner, made.inference
            self.spec = self.envs.spec
            self.in_env = self.inference.role == "env"  # the env workers' copies act
            for group in self.groups.values():
                group.locate()
            if resume is not None:
                self.learner.load(resume)
                self.inference.resume_streams(resume["rng"], resume["counters"]["iteration"])
            # which env workers each rollout worker serves, in lockstep (direct.py)
            self.members = members_of(len(made.rollouts.workers), len(self.envs.workers))
            if not self.in_env:
                self._connect()
            self.inference.start_sync()
            self.since = time.time()  # the start of the window metrics() reports on
        except BaseException:
            self.close()
            raise

    # --- what the runner calls ----------------------------------------------------------------
    def sync(self, version: int) -> dict[str, float]:
        """The actor's weights to every inference copy (``RemoteInference.send_weights``). An
        inference worker lost on the way is replaced and the sync sent again."""
        t0 = time.perf_counter()
        self.learner.settle()  # (the update these weights come from has ended: its result is in)
        failures = 0
        while True:
            try:
                nbytes = self.inference.send_weights(version)
                break
            except WorkerLost as lost:
                failures += 1
                self._replace(lost, failures, "the weights sent again")
        for role in ("actor", self.inference.role):
            self.groups[role].heartbeat = time.time()
        self._write_status()
        return {
            "cluster/sync_ms": 1000 * (time.perf_counter() - t0),
            "cluster/sync_bytes": float(nbytes),
        }

    def stage_candidates(self, chunk_size: int) -> list[int]:
        """The stage counts every env worker can split its own rows into."""
        calls = [w.stage_candidates.remote(chunk_size) for w in self.envs.workers]
        answers = get(calls, "env", self.envs.describe)
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
        answers, served = self._wait_round(env_calls, self._serve_calls(), should_stop)
        envs.traffic.bytes += wire_bytes(sent) + wire_bytes(answers)
        envs.traffic.rows += envs.num_envs * plan.num_chunks
        shards = []
        for index, (shard, totals, stream) in zip(envs.task_index, answers):
            shards += shard  # (a reference: the batch stays with its env worker)
            stats.totals.index_add_(1, index.to(stats.totals.device), from_wire(totals))
            served += [stream] if self.in_env else []  # (the streams of the inference copies)
        # the round's streams are kept once the learner has the round (a round lost before
        # then is collected again from the streams before it, and draws what it drew)
        added = functools.partial(self.inference.collected, served)
        return RoundShards(shards, envs.instructions, added, envs.describe)

    def _serve_calls(self) -> list:
        """Each rollout worker serves its env workers for one round (none where they infer)."""
        return [] if self.in_env else [w.serve.remote() for w in self.groups["rollout"].workers]

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
        failed = []  # (role, worker, error): a worker's own error, or a peer's broken link
        for role, calls in (("env", env_calls), ("rollout", serve_calls)):
            for index, call in enumerate(calls):
                try:
                    ray.get(call)
                except ray.exceptions.RayActorError as error:
                    raise lost(role, error, self.groups[role].describe(index)) from None
                except ray.exceptions.RayTaskError as error:
                    failed.append((role, index, error))
        for role, index, error in failed:  # (Ray restarted it between rounds)
            if isinstance(error.cause, NotConnected):
                raise WorkerLost(role, str(error.cause), self.groups[role].describe(index))
        if failed:  # the error that ended the round, before the links it broke
            broken = (ConnectionError, EOFError)
            first = min((e for _, _, e in failed), key=lambda e: isinstance(e.cause, broken))
            if isinstance(first.cause, USERS_ERRORS):
                raise first.cause from None
            raise first
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
                self._replace(lost, failures, "the evaluation run again")
        self.metrics()  # the next iteration's window starts here: evaluation is not in it
        return results

    def _evaluate(self, episodes, seed, video_path, progress, should_stop) -> dict[str, dict]:
        """One evaluation on the env workers (``RemoteEnvGroup.episode_shares``), pooled per
        task; the video is the first env worker's tasks'."""
        envs = self.envs
        shares = envs.episode_shares(episodes, seed)
        video = [video_path is not None and w == 0 for w in range(len(envs.workers))]
        env_calls = [w.evaluate.remote(*args) for w, args in zip(envs.workers, zip(shares, video))]
        answers, _ = self._wait_round(env_calls, self._serve_calls(), should_stop)
        pooled = pool_by_task(envs.task_names, [results for results, _ in answers])
        recorded = answers[0][1]
        written = recorded is not None and write_recorded_video(Path(video_path), recorded)
        for name, summary in answers[0][0].items() if written else ():
            if "eval/video" in summary:  # (a task it shows)
                pooled[name]["eval/video"] = str(video_path)
        if progress is not None:
            progress.update(episodes * len(pooled))
        return pooled

    @property
    def evaluates_beside(self) -> bool:
        """Whether evaluation workers run evaluations beside training."""
        return "eval" in self.groups

    def start_evaluation(
        self, *, episodes: int, seed: int, weights: dict[str, torch.Tensor] | None = None
    ) -> Evaluation:
        """An evaluation of the current weights in the evaluation workers, beside training
        (``EvalGroup.start``): a handle whose ``result()`` is {task: summary} (``WorkerLost`` if a
        worker died; Ray restarts it). ``weights``: a checkpoint's (its whole state dict)
        instead of the actor's current ones."""
        import ray

        if weights is None:
            # all the weights every time: a worker Ray restarted between evaluations lost them
            weights, _ = self.learner.workers[0].weights.options(num_returns=2).remote(True)
        else:
            weights = ray.put(to_wire(weights))
        evaluators = self.groups["eval"]
        restored = evaluators.lost
        evaluation = evaluators.start(weights, self.inference.version, episodes, seed)
        if restored:
            self._write_status()
        return evaluation

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
        for role, group in self.groups.items():
            # (none: no workers in the role, or a lost evaluation worker)
            answers = self._timing(group) or [(0.0, [])]
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

    def _timing(self, group) -> list[tuple[float, list]] | None:
        """``group.timing()``; a worker lost meanwhile is replaced as in a weight sync (its
        busy time since the last call is lost with it)."""
        failures = 0
        while True:
            try:
                return group.timing()
            except WorkerLost as lost:
                failures += 1
                self._replace(lost, failures, "its busy time since the last iteration lost")

    def rng_state(self) -> dict:
        """Every worker's stream (the actor ranks share actor/0), as a checkpoint stores them."""
        streams = {**self.inference.streams, "actor/0": self.learner.stream_state()}
        return {"streams": streams}

    def recover(self, error: WorkerLost, failures: int) -> None:
        """Wait for Ray to restart the lost role's workers and bring them up to date (a loss
        meanwhile is one more failure); over ``cluster.max_restarts`` in a row stop the run."""
        limit = self.cfg.cluster.max_restarts
        while True:
            self._fault(error)
            if error.role == "actor":
                raise error  # (its message says to resume)
            if failures > limit:
                raise WorkerLost(
                    error.role,
                    f"{error.detail}; {failures} rounds in a row lost "
                    f"(cluster.max_restarts={limit})",
                    error.worker,
                )
            if not control_plane_up():
                raise WorkerLost(error.role, f"{error.detail}; {RAY_GONE}", error.worker)
            try:
                self._restore()
                return
            except WorkerLost as again:
                error = again
                failures += 1

    def _replace(self, lost: WorkerLost, failures: int, then: str) -> None:
        """``recover`` from a loss outside a round (whose loss the runner reports), said on
        the console as the runner says a round's."""
        self.recover(lost, failures)
        tqdm.write(f"{lost}; replaced, {then} (failure {failures} in a row)")

    def _restore(self) -> None:
        """The env and inference groups' restarted workers back in the run, connected afresh.
        An update in flight (cluster.max_staleness 1) is waited for first: the copies can only
        get its weights (the actor holds no others), one version on from the lost round's, and
        a weight-sync group's rendezvous would otherwise wait behind it (SYNC_TIMEOUT_S)."""
        if self.learner.settle():
            self.inference.version += 1
        self.envs.restore()
        self.inference.restore()
        if not self.in_env:
            self._connect()
        self._write_status()

    def _connect(self) -> None:
        """Each env worker connects to the rollout worker that serves it (``members``), all of
        them afresh (embodied/cluster/direct.py)."""
        rollouts = self.groups["rollout"]
        addresses = rollouts.ask("listen")
        timeout_s = self.cfg.cluster.connect_timeout_s
        accepted = [
            w.accept.remote(len(m), timeout_s) for w, m in zip(rollouts.workers, self.members)
        ]
        calls = [
            self.envs.workers[env].connect.remote(address, key, member, self.inference.has_critic)
            for (address, key), served in zip(addresses, self.members)
            for member, env in enumerate(served)
        ]
        order = [env for served in self.members for env in served]  # (of the calls)
        get(calls, "env", lambda i: self.envs.describe(order[i]))
        get(accepted, "rollout", rollouts.describe)

    def _fault(self, error: WorkerLost) -> None:
        """A worker lost: an event of the run's status, naming it where that is known."""
        worker = error.worker or f"{error.role} worker"
        event = {"time": time.time(), "role": error.role, "worker": worker, "detail": error.detail}
        self.events.append(event)
        # the run's event log too (it outlives this process's cluster.json); the runner logs the
        # iteration of a round it discards
        self.event_log.add("fault", None, None, f"{worker}: {error.detail}")

    def _write_status(self) -> None:
        """RUN/cluster.json (``status.write_status``): each worker's place and heartbeat, the
        faults so far."""
        rows = []
        for role, group in self.groups.items():
            rows += group.status_rows([slot for slot in self.slots if slot.role == role])
        write_status(self.run_dir, rows, self.cfg, self.events, self.ended)

    def close(self) -> None:
        import ray

        if not ray.is_initialized():
            return
        # (Ray's daemons stopped by a signal to every process: nothing to close through them)
        up = control_plane_up()
        try:
            for role in ("env", "eval"):  # (their environments closed first)
                if role in self.groups and up:
                    self.groups[role].close()
        finally:  # (an environment's close may raise: MuJoCo Warp's last overflow check)
            self._take_down(up)

    def _take_down(self, up: bool) -> None:
        """The status marked ended, every worker killed, the placement group removed, and a
        Ray this run started shut down."""
        import ray

        written = (self.run_dir / STATUS_FILE).exists()  # (at the run's first weight sync)
        if written and hasattr(self, "since"):
            self.ended = time.time()
            self._write_status()
        for group in self.groups.values() if up else ():
            group.kill()
        if self.group is not None and up:
            ray.util.remove_placement_group(self.group)
        if self.started:
            ray.shutdown()
