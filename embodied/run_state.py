"""What a training run has done (``RunState``, saved by every checkpoint as its counters), how
far collection has gone (``Progress``), an iteration collected (``Collected``) and its update
in flight (``UpdateInFlight``), and the completed iteration that a stop or a checkpoint saves
(``SavePoints``)."""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from embodied.run import EVALUATED_AT

if TYPE_CHECKING:
    from embodied.episode_stats import EpisodeStats

# left out of a checkpoint's counters while unset, as the runner always wrote them
_UNSET = {"evaluating": None, "pipeline_stages": None, "discarded_rounds": 0}


@dataclass
class RunState:
    """The run's progress at its last finished iteration; checkpoints save it as "counters"."""

    iteration: int = 0  # iterations finished
    env_steps: int = 0  # the finished iterations' env steps
    episodes: int = 0  # first episodes of their rounds ended in them (episode_stats.py)
    train_seconds: float = 0.0  # training's wall clock (runner.max_minutes counts it)
    policy_version: int = 0  # weight syncs to the rollout workers
    rounds: int = 0  # rounds collected (episode ids and random streams follow them)
    evals: list[dict] = field(default_factory=list)  # {iteration, env_steps, minutes, ...}
    before: dict | None = None  # the evaluation before RL, task -> summary
    best: dict | None = None  # {"iteration", "success_rate"} of the best evaluation so far
    pipeline_stages: int | None = None  # runner.pipeline_stages auto: the split it chose
    discarded_rounds: int = 0  # rounds lost with a worker and collected again
    evaluating: dict | None = None  # EVALUATED_AT of an evaluation in flight, until recorded

    @classmethod
    def from_counters(cls, counters: dict) -> RunState:
        """A checkpoint's counters (older checkpoints hold fewer keys: those keep defaults)."""
        known = {f.name for f in fields(cls)}
        return cls(**copy.deepcopy({k: v for k, v in counters.items() if k in known}))

    def counters(self) -> dict:
        """What a checkpoint saves (JSON types only)."""
        saved = asdict(self)
        return {k: v for k, v in saved.items() if not (k in _UNSET and v == _UNSET[k])}

    def copy(self) -> RunState:
        return copy.deepcopy(self)

    def at(self) -> dict:
        """The counters an evaluation of this iteration is recorded at."""
        return {key: getattr(self, key) for key in EVALUATED_AT}


@dataclass
class Progress:
    """How far collection has gone: ahead of ``RunState`` by the iteration whose update runs."""

    env_steps: int
    rounds: int

    @classmethod
    def of(cls, state: RunState) -> Progress:
        return cls(state.env_steps, state.rounds)


@dataclass
class Collected:
    """An iteration's collection: steps 1 and 2 (the learner holds its rounds' advantages)."""

    iteration: int
    metrics: dict[str, float]
    stats: EpisodeStats  # its rounds' first episodes
    start: float  # time.time() at its start
    seconds: float
    steps_before: int  # env steps before it
    progress: Progress  # after it


@dataclass
class UpdateInFlight:
    """An iteration whose update (step 3) runs: all that finishing it needs, so the next
    iteration can be collected meanwhile (cluster.max_staleness 1) with nothing swapped."""

    collected: Collected
    start: float  # time.time() as the update started
    lr: float
    update: Any  # the learner's handle: .result() -> the update's metrics


class SavePoints:
    """The completed iteration: its state and random streams, what a stop saves and what a
    checkpoint holds; the newest checkpoint's iteration."""

    def __init__(self, state: RunState, roles, run_dir: Path, meta: dict, keep: int):
        self.roles = roles
        self.run_dir = run_dir
        self.meta = meta
        self.keep = keep
        self.saved = state.iteration  # the newest checkpoint's iteration
        # the run's Clock once it runs: a checkpoint counts the time until it was saved (an
        # evaluation after the update included; a resume would train that much longer)
        self.clock = None
        self.complete(state)

    def complete(self, state: RunState) -> None:
        """Remember ``state`` (a finished iteration's) and the random streams as they are."""
        self.rng = self.roles.rng_state()
        self.state = state.copy()

    def save(self, evaluating: int | None = None) -> None:
        """A checkpoint of the completed iteration, unless it is saved already; ``evaluating``:
        the iteration of an evaluation in flight, whose checkpoint is kept (it may be the best)."""
        iteration = self.state.iteration
        if iteration == 0 or iteration == self.saved:
            return
        if self.clock is not None:
            self.state.train_seconds = self.clock.seconds
        protect = [] if self.state.best is None else [self.state.best["iteration"]]
        if evaluating is not None:
            protect.append(evaluating)
        self.roles.learner.save(
            self.run_dir,
            iteration,
            counters=self.state.counters(),
            meta=self.meta,
            rng=self.rng,
            keep=self.keep,
            protect=protect,
        )
        self.saved = iteration
