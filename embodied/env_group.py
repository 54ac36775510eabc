"""The environment-group role: B environments of one or more tasks behind the contract, executing
a chunk of K actions per call.

The runner talks to it through ``reset``, ``send``/``receive`` and a few read-only facts
(``task_ids``, ``instructions``); a distributed runner puts it in a process of its own. Chunks
are executed here, so a remote group answers once per chunk, not once per environment step.

An episode that ends inside a chunk ends the chunk's credit there: ``ChunkStep.ended`` names the
environments whose episode (the one the chunk started in) ended, with that episode's last
observation. The chunk's remaining actions run on the freshly reset episode.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from embodied.schema import Observation


@dataclass
class ChunkStep:
    """What a chunk of K actions did to n environments (the rows it was sent for, in order).

    obs: the observation after the chunk (episodes that ended already reset), [n, ...].
    reward: f32 [n, K] per environment step; terminated, truncated, success: bool [n, K].
    ended: long [m] on the CPU: positions (in the n rows) whose chunk-start episode ended.
    final_obs: the last observation of each of those episodes, rows in the order of ``ended``;
        None when no episode ended.
    """

    obs: Observation
    reward: torch.Tensor
    terminated: torch.Tensor
    truncated: torch.Tensor
    success: torch.Tensor
    ended: torch.Tensor
    final_obs: Observation | None


class EnvGroup:
    """A VecEnv (a MultiTaskEnv for several tasks) seen as the runner's environment group.

    ``chunks_in_thread``: a stage's chunk of several actions runs in a thread of this process
    while the caller acts for another stage (a cluster env worker, whose policy answers from
    another process: the thread simulates while this one waits for it)."""

    def __init__(self, env, chunks_in_thread: bool = False):
        self.env = env
        self.num_envs = env.num_envs
        self.device = torch.device(env.device)
        self.spec = env.spec
        ranges = getattr(env, "task_ranges", [(0, env.num_envs)])
        self.task_names: list[str] = list(getattr(env, "names", ["all"]))
        task_of_env = torch.zeros(env.num_envs, dtype=torch.long)  # long [B] on the CPU
        for task, (lo, hi) in enumerate(ranges):
            task_of_env[lo:hi] = task
        self.task_of_env = task_of_env
        self.task_ids = task_of_env.to(self.device)  # long [B]
        self.instructions: tuple[str, ...] = ()  # one per task, read at the first reset
        self._ranges = ranges
        self._pending: deque[ChunkStep] = deque()
        # stepping subsets asynchronously (CPU workers) lets a rollout pipeline groups of envs
        self.can_pipeline = bool(getattr(env, "can_step_subsets", False))
        self.chunks_in_thread = chunks_in_thread
        self._executor = None  # (made at the first chunk run in a thread)
        self._running: dict[int, deque[Future]] = {}  # a stage's first row -> its chunks
        self._stepping: dict[int, deque[torch.Tensor]] = {}  # ... -> its rows stepping

    def reset(self, seed: int | Sequence[int] | None = None) -> Observation:
        """Reset every environment (an int seed gives env b the seed ``seed + b``, but on
        ManiSkill's GPU backend ManiSkill's own derivation from it; a list, one seed each) and
        check that each task's environments share one instruction. Whatever a round that
        failed left running is finished and dropped first (``drain``)."""
        self.drain()
        obs = self.env.reset(seed=seed)
        instructions = tuple(obs.instruction[lo] for lo, _ in self._ranges)
        for task, (lo, hi) in enumerate(self._ranges):
            if any(text != instructions[task] for text in obs.instruction[lo:hi]):
                raise ValueError(
                    f"task {self.task_names[task]}: its environments have different "
                    "instructions; the rollout stores one instruction per task"
                )
        self.instructions = instructions
        return obs

    def stage_split(self, stages: int, chunk_size: int) -> list[tuple[torch.Tensor | None, slice]]:
        """The rows of each pipeline stage, as (long [n] CPU index, the same rows as a slice);
        [(None, all)] for lockstep. Stage s holds envs s, s + S, ...: every worker holds some of
        each stage, so it always has the next stage's request queued when it finishes one. Only
        environments that step subsets asynchronously pipeline: one action at a time, or chunks
        of any length run in a thread (``chunks_in_thread``)."""
        if stages <= 1 or not self.can_pipeline or (chunk_size != 1 and not self.chunks_in_thread):
            return [(None, slice(None))]
        return strided_stages(self.num_envs, stages)

    # --- chunks ---------------------------------------------------------------------------------
    def send(self, actions: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """Start a chunk: actions f32 [n, K, A] for all environments or for ``rows`` (long [n],
        ascending, on the CPU). Subsets step asynchronously where the environment can (K = 1,
        CPU workers); otherwise the chunk runs now and ``receive`` hands it over."""
        if rows is not None and actions.shape[1] == 1:
            self.env.step_async(actions[:, 0], rows)
            self._stepping.setdefault(int(rows[0]), deque()).append(rows)
            return
        if rows is not None:
            if not self.chunks_in_thread:
                raise ValueError("pipelined collection executes chunks of one action (K = 1)")
            if self._executor is None:  # (one thread: the stages' chunks run in their order)
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="chunks")
            running = self._running.setdefault(int(rows[0]), deque())
            running.append(self._executor.submit(self.execute, actions, rows))
            return
        self._pending.append(self.execute(actions))

    def receive(self, rows: torch.Tensor | None = None) -> ChunkStep:
        """The result of the oldest ``send`` for the same rows."""
        if rows is None:
            return self._pending.popleft()
        running = self._running.get(int(rows[0]))
        if running:
            return running.popleft().result()
        self._stepping[int(rows[0])].popleft()
        step = self.env.step_wait(rows)
        return _chunk_of(step, n=len(rows))

    def drain(self) -> None:
        """Finish and drop every chunk still running or stepping (a round that failed midway,
        in a cluster env worker: its next round must not receive them)."""
        for running in self._running.values():
            for chunk in running:
                chunk.exception()  # (waits; a failed chunk's error is the failed round's)
        for stepping in self._stepping.values():
            for rows in stepping:
                try:
                    self.env.step_wait(rows)
                except Exception:  # (the failed round's error is raised elsewhere)
                    pass
        self._running.clear()
        self._stepping.clear()
        self._pending.clear()

    def execute(self, actions: torch.Tensor, rows: torch.Tensor | None = None) -> ChunkStep:
        """Run a chunk now: actions f32 [n, K, A] for all environments or for ``rows`` (long [n],
        ascending, on the CPU; environments that step subsets only), the others left as they
        are. A cluster env worker runs one pipeline stage's chunk so, while the rollout workers
        act for another stage."""
        if rows is not None and not self.can_pipeline:
            raise ValueError("these environments step all together; a chunk cannot run for rows")
        B, K = actions.shape[:2]
        if K == 1:  # the step's own tensors, as views: no buffers to fill
            return _chunk_of(self._step(actions[:, 0], rows), n=B)
        reward = torch.empty(B, K, device=self.device)
        terminated = torch.empty(B, K, dtype=torch.bool, device=self.device)
        truncated = torch.empty_like(terminated)
        success = torch.empty_like(terminated)
        alive = np.ones(B, dtype=bool)  # the chunk's episode still runs (host side: no sync)
        ended_parts: list[torch.Tensor] = []
        final_parts: list[Observation] = []
        obs = None
        for k in range(K):
            out = self._step(actions[:, k], rows)
            reward[:, k] = out.reward
            terminated[:, k] = out.terminated
            truncated[:, k] = out.truncated
            success[:, k] = out.success
            if out.ended is not None:
                ended_now = out.ended.numpy()  # positions in the n rows
                first = torch.from_numpy(ended_now[alive[ended_now]])  # the chunk's own episodes
                if len(first):
                    ended_parts.append(first)
                    final_parts.append(out.final_obs.index(first))
                alive[ended_now] = False
            obs = out.obs
        ended = torch.cat(ended_parts) if ended_parts else torch.zeros(0, dtype=torch.long)
        final_obs = Observation.cat(final_parts) if final_parts else None
        return ChunkStep(obs, reward, terminated, truncated, success, ended, final_obs)

    def _step(self, actions: torch.Tensor, rows: torch.Tensor | None):
        """One action (f32 [n, A]) for every environment or for ``rows``."""
        if rows is None:
            return self.env.step(actions)
        self.env.step_async(actions, rows)
        return self.env.step_wait(rows)

    def render(self, env_ids: torch.Tensor | None = None) -> torch.Tensor | None:
        return self.env.render(env_ids)

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(cancel_futures=True)
        self.env.close()


def strided_stages(num_envs: int, stages: int) -> list[tuple[torch.Tensor, slice]]:
    """Stage s holds environments s, s + S, ... (as a CPU index and as a strided slice)."""
    split = [(torch.arange(s, num_envs, stages), slice(s, None, stages)) for s in range(stages)]
    return [(rows, at) for rows, at in split if len(rows)]


def _chunk_of(step, n: int) -> ChunkStep:
    """A one-action chunk from a ``StepOutput`` of n rows."""
    ended = step.ended if step.ended is not None else torch.zeros(0, dtype=torch.long)
    final_obs = None if step.final_obs is None else step.final_obs.index(ended)
    return ChunkStep(
        obs=step.obs,
        reward=step.reward.reshape(n, 1),
        terminated=step.terminated.reshape(n, 1),
        truncated=step.truncated.reshape(n, 1),
        success=step.success.reshape(n, 1),
        ended=ended,
        final_obs=final_obs,
    )
