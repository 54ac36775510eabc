"""``LiberoConfig``: importable without LIBERO installed (config validation, the CLI)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from embodied.schema import SimulatorConfig, check_episode_limit

# suite -> (number of tasks, the published evaluation's step limit per episode)
SUITES: dict[str, tuple[int, int]] = {
    "libero_spatial": (10, 220),
    "libero_object": (10, 280),
    "libero_goal": (10, 300),
    "libero_10": (10, 520),
    "libero_90": (90, 400),
}


@dataclass
class LiberoConfig(SimulatorConfig):
    """One LIBERO task (a suite and a task index in it) with a Franka Panda under operational-space
    control. ``reset(seed=s)`` starts an episode from the suite's fixed initial state ``s % 50``
    (the published evaluation protocol: every task x its 50 initial states)."""

    simulator: str = "libero"
    no_held_out: ClassVar[str] = (
        "LIBERO evaluates each task on its 50 fixed initial states (episode i: state (seed + i) "
        "% 50), the states the selection evaluations ran: its episodes are not held out"
    )
    distinct_episodes: ClassVar[int] = 50  # (its initial states per task)
    suite: str = (
        "libero_spatial"  # libero_spatial | libero_object | libero_goal | libero_10 | libero_90
    )
    task_id: int = 0  # index of the task in the suite
    num_envs: int = 2
    num_workers: int = 2  # subprocesses sharing the environments; 0: all in this process
    # a worker silent this long in a step is killed and the run fails (resets and renders: 10x);
    # a core in this process (num_workers=0) cannot time out
    step_timeout_s: float = 120.0
    obs_mode: str = (
        "rgb"  # rgb: agent-view and wrist cameras + state; state: no cameras (~10x faster)
    )
    image_size: int = 128  # agent-view and wrist cameras, height = width
    max_episode_steps: int | None = None  # None: the published limit of the suite (SUITES)
    settle_steps: int = 10  # no-op steps after each reset while objects settle (not counted)
    ignore_terminations: bool = False  # True: success does not end the episode

    def validate(self) -> None:
        if self.suite not in SUITES:
            raise ValueError(
                f"suite: unknown LIBERO suite {self.suite!r}; available: {sorted(SUITES)}"
            )
        if self.obs_mode not in ("rgb", "state"):
            raise ValueError(f"obs_mode: must be 'rgb' or 'state', got {self.obs_mode!r}")
        n_tasks = SUITES[self.suite][0]
        if not 0 <= self.task_id < n_tasks:
            raise ValueError(
                f"task_id: {self.suite} has tasks 0..{n_tasks - 1}, got {self.task_id}"
            )
        if self.num_workers < 0:
            raise ValueError(
                f"num_workers: must be >= 0 (0: in this process), got {self.num_workers}"
            )
        if not self.step_timeout_s > 0:
            raise ValueError(f"step_timeout_s: must be > 0 (seconds), got {self.step_timeout_s}")
        for name in ("num_envs", "image_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.settle_steps < 0:
            raise ValueError(f"settle_steps: must be >= 0, got {self.settle_steps}")
        check_episode_limit(self.max_episode_steps)

    def task_name(self) -> str:
        """The suite and task index ("libero_goal/3"), as a dataset recorded on it names it."""
        return f"{self.suite}/{self.task_id}"

    def with_task(self, name: str) -> LiberoConfig:
        suite, _, task_id = name.partition("/")
        if not task_id.isdigit():
            raise ValueError(f"not a LIBERO task (suite/task_id): {name!r}")
        configured = replace(self, suite=suite, task_id=int(task_id))
        configured.validate()
        return configured

    @property
    def episode_steps(self) -> int:
        return self.max_episode_steps or SUITES[self.suite][1]
