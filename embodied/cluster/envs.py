"""The env workers seen from the driver: the env config each one gets (``split_env``), and the
group as one environment group for resets, facts and evaluation shares (``RemoteEnvGroup``).
Rounds of training and evaluations run in the env workers themselves
(embodied/cluster/direct.py)."""

from __future__ import annotations

import dataclasses
import numbers
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from embodied.cluster.calls import USERS_ERRORS, Traffic, get
from embodied.cluster.group import WorkerGroup
from embodied.cluster.wire import from_wire
from embodied.config import ConfigError
from embodied.evaluate import split_episodes
from embodied.multitask import joined_spec, shared_privileged
from embodied.schema import Observation, reset_seeds


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


def untimed_note(env_cfg, shares: list) -> str | None:
    """A note where ``split_env`` ran each env worker's one simulator process in the worker
    itself: ``env.step_timeout_s`` bounds a simulator subprocess's answer, and none is left."""
    asked = getattr(env_cfg, "num_workers", 0)
    if not asked or getattr(shares[0], "num_workers", 0) or not hasattr(env_cfg, "step_timeout_s"):
        return None
    return (
        f"note: env.num_workers={asked} over {len(shares)} env workers is one simulator process "
        "each, run in the env worker itself (no hop between processes), where "
        "env.step_timeout_s does not apply: a simulator that hangs stops the run only when "
        f"stopped; env.num_workers={2 * len(shares)} keeps two subprocesses each, and the timeout"
    )


def episode_shares(
    held: list[list[int]], tasks: int, episodes: int, seed: int
) -> list[list[tuple[int, int]]]:
    """Per worker, (episodes, seed) for each task it holds (``held``: per worker, the run's
    task ids in its own order): each of the ``tasks`` tasks' ``episodes`` at ``seed`` split
    among the workers that hold it, in worker order (``split_episodes``; a worker beyond the
    episodes gets none)."""
    shares = [[(0, seed)] * len(theirs) for theirs in held]
    for task in range(tasks):
        holders = [w for w, theirs in enumerate(held) if task in theirs]
        for w, share in zip(holders, split_episodes(episodes, seed, len(holders))):
            shares[w][held[w].index(task)] = share
    return shares


@dataclass
class ObservationShards:
    """Observations as they live in the env workers: one object per worker, in row order, each
    owned by its worker. A round starts from them there; the learner's normaliser fetches the
    first ones itself."""

    refs: list
    name: Callable[[int], str] | None = None  # name(i): the env worker that holds refs[i]

    def fetch(self, device: torch.device | str = "cpu") -> Observation:
        """All of them in this process, on ``device`` (an evaluation acts on them in the driver,
        the normaliser starts from them in the actor workers)."""
        import ray

        return Observation.cat([from_wire(part, device) for part in ray.get(self.refs)])


class RemoteEnvGroup(WorkerGroup):
    """The env workers seen as one ``EnvGroup``: rows in worker order, tasks by name. A
    restarted worker builds its environments again; the next round's reset seeds them, and it is
    told again which privileged keys it keeps (``catch_up``)."""

    def __init__(self, workers: list, facts: list[dict]):
        super().__init__("env", workers)
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
        self.kept = keys
        # (the workers whose tasks observe more: told to keep these, again after a restart)
        self.extra = [w for w, f in enumerate(facts) if sorted(f["spec"].obs.privileged) != keys]
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
        self.seeds: list[list | None] = [None] * len(workers)  # each worker's last reset seeds
        self.catch_up()

    def catch_up(self) -> None:
        """Every worker whose tasks observe more privileged keys than all share keeps those
        (a restarted one observes all of its own again)."""
        calls = [self.workers[w].keep_privileged.remote(self.kept) for w in self.extra]
        get(calls, "env", lambda i: self.describe(self.extra[i]))

    def details(self, index: int) -> list[str]:
        """As every worker's, and its tasks, its rows and its last reset's seeds."""
        lo, hi = self.bounds[index], self.bounds[index + 1]
        names = self._local_names(index)
        held = [f"task{'s' * (len(names) > 1)} {', '.join(names)}", f"envs {lo}-{hi - 1}"]
        distinct = list(dict.fromkeys(self.seeds[index] or []))  # (a GRPO group shares one)
        if len(distinct) == 1:
            held.append(f"seed {distinct[0]}")
        elif distinct:
            shown = ", ".join(map(str, distinct)) if len(distinct) <= 3 else ""
            held.append(f"seeds {shown or f'{distinct[0]}..{distinct[-1]}'}")
        return super().details(index) + held

    def reset(self, seed=None) -> ObservationShards:
        """Reset every environment (seeds by row, as ``EnvGroup.reset``): the observations stay
        with the env workers (``ObservationShards``); the tasks' instructions come here."""
        B = self.num_envs
        seeds = None if seed is None else reset_seeds(seed, range(B))  # (numpy ints too)
        self.seeds = [
            None if seeds is None else list(seeds[lo:hi])
            for lo, hi in zip(self.bounds, self.bounds[1:])
        ]
        sent = self.seeds
        if isinstance(seed, numbers.Integral):  # one int a worker, from its first row, as
            # ``MultiTaskEnv`` gives each task: ManiSkill's GPU batch then resets in one call
            sent = [int(seed) + lo for lo in self.bounds[:-1]]
        refs = [worker.reset.remote(mine) for worker, mine in zip(self.workers, sent)]
        answers = self._wait(refs)
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
        return ObservationShards([ref for refs, _ in answers for ref in refs], self.describe)

    def episode_shares(self, episodes: int, seed: int) -> list[list[tuple[int, int]]]:
        """Per worker, (episodes, seed) for each of its own tasks (``episode_shares``); each
        worker's seeds are its episodes' (for a message naming it)."""
        held = [index.tolist() for index in self.task_index]
        shares = episode_shares(held, len(self.task_names), episodes, seed)
        self.seeds = [[first + i for n, first in theirs for i in range(n)] for theirs in shares]
        return shares

    def _local_names(self, w: int) -> list[str]:
        lo, hi = self.bounds[w], self.bounds[w + 1]
        return list(dict.fromkeys(self.task_names[t] for t in self.task_of_env[lo:hi].tolist()))

    def _wait(self, refs: list):
        t0 = time.perf_counter()
        answers = get(refs, "env", self.describe)
        self.traffic.wait_s += time.perf_counter() - t0
        return answers

    def close(self) -> None:
        import ray

        try:
            ray.get([w.close.remote() for w in self.workers], timeout=30)
        except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError):
            pass  # a dead or hung worker: it is killed with the rest
        except ray.exceptions.RayTaskError as error:  # (its simulator's own close raised)
            if isinstance(error.cause, USERS_ERRORS):
                raise error.cause from None
            raise
