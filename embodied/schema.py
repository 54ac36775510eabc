"""The observation/action contract shared by every simulator, robot and policy.

Every tensor is batched, batch first, on the environment's device. Time-major buffers are
``[T, B, ...]``. Actions are in physical units (``ActionSpec.low``/``high``). The validators
``check_env`` and ``check_policy`` live in ``embodied.contract``.
"""

from __future__ import annotations

import numbers
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any, ClassVar, Protocol, runtime_checkable

import numpy as np
import torch

ACTION_SPACES = ("ee_delta_pose", "ee_pose", "joint_pos", "joint_delta")
# what a delta space's action adds to: the last target (MuJoCo; ManiSkill's *_target_delta_*
# modes) or the pose as measured at the step (ManiSkill's pd_joint_delta_pos, LIBERO's OSC)
DELTAS_FROM = ("target", "measured")


def check_device_name(key: str, name: str, auto: bool = False) -> None:
    """A ValueError unless ``name`` (the value of ``key``) is cpu, cuda or cuda:N (or, with
    ``auto``, auto): the form of a device setting, on any machine."""
    if auto and name == "auto":
        return
    if not re.fullmatch(r"cpu|cuda(:\d+)?", name):
        choices = "auto, cpu, cuda or cuda:N" if auto else "cpu, cuda or cuda:N"
        raise ValueError(f"{key}: must be {choices}, got {name!r}")


def checked_device(setting: str, name: str, instead: str) -> torch.device:
    """``name`` ("cpu", "cuda" or "cuda:N": the value of ``setting``) as a torch device; a
    one-line UserError for another form, for CUDA on a machine without it, or for a GPU it
    lacks. ``instead``: what to set on a machine without CUDA."""
    try:
        check_device_name(setting, name)
    except ValueError as e:
        raise UserError(str(e)) from None
    device = torch.device(name)
    if device.type != "cuda":
        return device
    if not torch.cuda.is_available():
        raise UserError(
            f"{setting}={name} needs a CUDA GPU and this machine has none; use {instead}"
        )
    if (device.index or 0) >= torch.cuda.device_count():
        raise UserError(
            f"{setting}={name}: this machine has {torch.cuda.device_count()} CUDA GPU(s), "
            "numbered from 0"
        )
    return device


def host_to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` (on the host) on ``device`` without the host waiting: to a GPU through pinned
    memory, non-blocking (a copy from pageable memory waits for the device's queue to drain). A
    tensor already pinned is read by the copy later: the caller must not change it meanwhile."""
    if t.device == device or device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class UserError(ValueError):
    """Bad input the user can fix (a task, a path, a checkpoint, a command-line value), raised
    where it is first used. ``str()`` is one line naming the culprit; the CLI prints it and exits
    with code 2. Any other exception is a bug and keeps its traceback."""


def refuse_non_finite(who: str, actions: np.ndarray, rows: Sequence[int]) -> None:
    """A UserError naming the environments (``rows``: each action row's) whose actions ([n, A],
    on the host) hold a NaN or an infinity: a simulator would take a NaN as its target."""
    finite = np.isfinite(actions).all(axis=1)  # bool [n]
    if not finite.all():
        bad = np.flatnonzero(~finite)
        raise UserError(
            f"{who}: the actions of environments {[int(rows[i]) for i in bad]} are not finite "
            f"(first: {actions[bad[0]].tolist()})"
        )


@dataclass
class Observation:
    """One batched observation.

    images: camera name -> uint8 [B, H, W, 3] RGB, channel-last.
    state: float32 [B, S] proprioception; columns named by ``ObsSpec.state_names``.
    instruction: list[str] of length B, the task in natural language.
    privileged: key -> float32 [B, ...] simulator-only ground truth (object/goal state).
    """

    state: torch.Tensor
    instruction: list[str]
    images: dict[str, torch.Tensor] = field(default_factory=dict)
    privileged: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def batch_size(self) -> int:
        return self.state.shape[0]

    @property
    def device(self) -> torch.device:
        return self.state.device

    def tensors(self) -> dict[str, torch.Tensor]:
        """Flat ``group/key`` view of every tensor (state, images/*, privileged/*)."""
        out = {"state": self.state}
        out.update({f"images/{k}": v for k, v in self.images.items()})
        out.update({f"privileged/{k}": v for k, v in self.privileged.items()})
        return out

    def map(self, fn) -> Observation:
        """Apply ``fn`` to every tensor (e.g. ``.to(device)``, indexing); instructions follow
        indexing only when ``fn`` keeps the batch dimension aligned, so they are re-derived."""
        return Observation(
            state=fn(self.state),
            instruction=list(self.instruction),
            images={k: fn(v) for k, v in self.images.items()},
            privileged={k: fn(v) for k, v in self.privileged.items()},
        )

    def to(self, device: torch.device) -> Observation:
        """The observation on ``device``: itself when it is there already."""
        return self if self.device == device else self.map(lambda t: t.to(device))

    def index(self, idx: torch.Tensor | slice) -> Observation:
        """Rows ``idx`` of the batch (instructions included): a slice, or long indices or a bool
        mask, best on the host (one copy to the device, and the instructions read there)."""
        if isinstance(idx, slice):
            rows = range(self.batch_size)[idx]
        else:
            rows = (idx.nonzero().flatten() if idx.dtype == torch.bool else idx).tolist()
            idx = host_to_device(idx, self.device)  # (host rows: one copy, and no wait)
        obs = self.map(lambda t: t[idx])
        obs.instruction = [self.instruction[i] for i in rows]
        return obs

    def where(self, mask: torch.Tensor, other: Observation) -> Observation:
        """Rows of ``self`` where ``mask`` (bool [B]) is true, else rows of ``other``."""

        def pick(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            m = mask.view(-1, *([1] * (a.dim() - 1)))
            return torch.where(m, a, b)

        instruction = list(self.instruction)
        if instruction != other.instruction:  # (only then is the mask read on the host)
            instruction = [
                a if m else b for a, b, m in zip(self.instruction, other.instruction, mask.tolist())
            ]
        return Observation(
            state=pick(self.state, other.state),
            instruction=instruction,
            images={k: pick(v, other.images[k]) for k, v in self.images.items()},
            privileged={k: pick(v, other.privileged[k]) for k, v in self.privileged.items()},
        )

    @staticmethod
    def cat(obs: Sequence[Observation]) -> Observation:
        """Concatenate along the batch dimension."""
        first = obs[0]
        return Observation(
            state=torch.cat([o.state for o in obs]),
            instruction=[s for o in obs for s in o.instruction],
            images={k: torch.cat([o.images[k] for o in obs]) for k in first.images},
            privileged={k: torch.cat([o.privileged[k] for o in obs]) for k in first.privileged},
        )


@dataclass(frozen=True)
class CameraSpec:
    name: str
    height: int
    width: int


@dataclass(frozen=True)
class ObsSpec:
    """What an environment observes: cameras, named state columns, privileged keys and shapes."""

    cameras: tuple[CameraSpec, ...] = ()
    state_names: tuple[str, ...] = ()
    privileged: dict[str, tuple[int, ...]] = field(default_factory=dict)  # key -> per-env shape

    @property
    def state_dim(self) -> int:
        return len(self.state_names)


@dataclass(frozen=True)
class ActionSpec:
    """Per-step action in physical units: float32 [B, A] within [low, high]."""

    space: str  # one of ACTION_SPACES
    names: tuple[str, ...]
    low: tuple[float, ...]
    high: tuple[float, ...]
    gripper: int | None = None  # index of the gripper dimension, if any
    control_hz: float = 20.0
    # one of DELTAS_FROM (a delta space's; "target" for the others); None: not said (a spec
    # saved before specs said it)
    deltas_from: str | None = "target"

    def __post_init__(self):
        if self.space not in ACTION_SPACES:
            raise ValueError(f"ActionSpec.space must be one of {ACTION_SPACES}, got {self.space!r}")
        if self.deltas_from not in (*DELTAS_FROM, None):
            raise ValueError(
                f"ActionSpec.deltas_from must be one of {DELTAS_FROM}, got {self.deltas_from!r}"
            )
        if not (len(self.names) == len(self.low) == len(self.high)):
            raise ValueError("ActionSpec names, low and high must have the same length")
        if any(lo >= hi for lo, hi in zip(self.low, self.high)):
            raise ValueError("ActionSpec requires low < high in every dimension")

    @property
    def dim(self) -> int:
        return len(self.names)

    def bounds(self, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """(low, high), each float32 [A] on ``device``."""
        low = torch.tensor(self.low, dtype=torch.float32, device=device)
        high = torch.tensor(self.high, dtype=torch.float32, device=device)
        return low, high


@dataclass(frozen=True)
class EnvSpec:
    obs: ObsSpec
    action: ActionSpec
    max_episode_steps: int
    instructions: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        return {
            "obs": {
                "cameras": [vars(c) for c in self.obs.cameras],
                "state_names": list(self.obs.state_names),
                "privileged": {k: list(v) for k, v in self.obs.privileged.items()},
            },
            "action": {f.name: getattr(self.action, f.name) for f in fields(self.action)},
            "max_episode_steps": self.max_episode_steps,
            "instructions": list(self.instructions),
        }

    def input_changes(self, other: EnvSpec) -> list[str]:
        """How a policy made for this spec would see or act otherwise in ``other``'s: "state
        [..] -> [..]", and so on for the cameras, the action space and the actions. Privileged
        keys are left out (they may differ between tasks: a policy names any it reads)."""
        return [
            f"{what} {old} -> {new}"
            for what, old, new in [
                ("state", list(self.obs.state_names), list(other.obs.state_names)),
                (
                    "cameras",
                    [c.name for c in self.obs.cameras],
                    [c.name for c in other.obs.cameras],
                ),
                ("action space", self.action.space, other.action.space),
                ("deltas from", self.action.deltas_from, other.action.deltas_from),
                ("actions", list(self.action.names), list(other.action.names)),
            ]
            if old != new and None not in (old, new)  # (a spec that does not say: unknown)
        ]

    @staticmethod
    def from_dict(d: dict) -> EnvSpec:
        a = d["action"]
        return EnvSpec(
            obs=ObsSpec(
                cameras=tuple(CameraSpec(**c) for c in d["obs"]["cameras"]),
                state_names=tuple(d["obs"]["state_names"]),
                privileged={k: tuple(v) for k, v in d["obs"]["privileged"].items()},
            ),
            action=replace(
                ActionSpec(
                    space=a["space"],
                    names=tuple(a["names"]),
                    low=tuple(a["low"]),
                    high=tuple(a["high"]),
                ),
                gripper=a["gripper"],
                control_hz=a["control_hz"],
                # (None in a spec saved before it was said; deploy reads it from the config)
                deltas_from=a.get("deltas_from"),
            ),
            max_episode_steps=d["max_episode_steps"],
            instructions=tuple(d["instructions"]),
        )


@dataclass
class SimulatorConfig:
    """Base of every simulator's config dataclass; ``simulator`` names which one (and so which
    schema validates an ``env:`` section)."""

    simulator: str = ""
    # why an evaluation on the held-out seeds (embodied/seeds.py) runs the episodes that the
    # selection evaluations ran (a simulator whose seed picks one of a few fixed scenes); empty
    # where a seed draws its own episode, so held-out seeds hold others out
    no_held_out: ClassVar[str] = ""
    # how many distinct episodes a task has (a seed picks one of them), None: unbounded; a
    # count beyond it repeats episodes, which are no more evidence
    distinct_episodes: ClassVar[int | None] = None

    def task_name(self) -> str | None:
        """The one task this config sets up, as a dataset names it (``embodied.task`` in its
        info.json); None where the simulator has no choice of task."""
        return getattr(self, "task", None)

    def with_task(self, name: str) -> SimulatorConfig:
        """This config set up for the task ``task_name`` names (ValueError: not one of its)."""
        if not hasattr(self, "task"):
            return self
        configured = replace(self, task=name)
        configured.validate()
        return configured


def check_distinct_episodes(env: SimulatorConfig, counts: dict[str, int]) -> None:
    """A ValueError naming the first of ``counts`` (what says it -> episodes per task) beyond the
    distinct episodes of ``env``'s tasks (LIBERO's 50 initial states): those beyond would repeat
    them, counted as evidence that narrows the interval with nothing new."""
    limit = env.distinct_episodes
    for key, episodes in counts.items():
        if limit is not None and episodes > limit:
            raise ValueError(
                f"{key}: {episodes}, but {env.simulator} has {limit} distinct episodes per task "
                f"(those beyond repeat them); set it to {limit} or fewer"
            )


def check_at_least(section: Any, minimum: int, *keys: str) -> None:
    """A config's check: a ValueError naming the first of ``keys`` (fields of ``section``) below
    ``minimum``."""
    for key in keys:
        value = getattr(section, key)
        if value < minimum:
            raise ValueError(f"{key}: must be >= {minimum}, got {value}")


def check_episode_limit(max_episode_steps: int | None) -> None:
    """A simulator config's ``max_episode_steps``: None (the task's own) or at least one step."""
    if max_episode_steps is not None and max_episode_steps < 1:
        raise ValueError(
            f"max_episode_steps: must be >= 1 or null (the task's), got {max_episode_steps}"
        )


@dataclass
class StepOutput:
    """What ``VecEnv.step`` returns.

    obs: the next observation (already reset for environments whose episode ended).
    reward: float32 [B]; terminated, truncated, success: bool [B].
    final_obs: full-batch Observation whose rows for ended episodes hold the last observation
        before the automatic reset (other rows equal ``obs``); None when no episode ended.
    ended: long [n] on the CPU, ascending: the environments whose episode ended this step (the
        rows of ``terminated | truncated``); None when none did. The environment knows them on
        the host anyway (it had to reset them), so a GPU rollout reads them here instead of
        synchronising with the device to find them.
    """

    obs: Observation
    reward: torch.Tensor
    terminated: torch.Tensor
    truncated: torch.Tensor
    success: torch.Tensor
    final_obs: Observation | None = None
    ended: torch.Tensor | None = None
    info: dict[str, Any] = field(default_factory=dict)


def ended_rows(done: torch.Tensor) -> torch.Tensor | None:
    """``StepOutput.ended`` from a done mask (bool [B]): long [n] on the CPU, or None. Reads the
    mask on the host: for environments whose masks live there (or that synchronise anyway)."""
    rows = done.nonzero().squeeze(1).cpu()
    return rows if len(rows) else None


@runtime_checkable
class VecEnv(Protocol):
    num_envs: int
    device: torch.device
    spec: EnvSpec

    def reset(
        self, *, seed: int | Sequence[int] | None = None, env_ids: torch.Tensor | None = None
    ) -> Observation:
        """Reset all environments, or only ``env_ids`` (long [N]); returns the full batch.
        An int seeds the reset deterministically (CPU workers: environment i gets seed + i); a list
        gives each reset environment its own seed, and equal seeds give equal initial states."""

    def step(self, actions: torch.Tensor) -> StepOutput:
        """actions: float32 [B, A] in physical units. Finished environments reset automatically."""

    def render(self, env_ids: torch.Tensor | None = None) -> torch.Tensor | None:
        """uint8 [B, H, W, 3], or only ``env_ids``' rows (long [N], in their order: [N, H, W, 3]);
        None when the environment cannot render. A video shows a few rows: rendering only those
        spares the rest of the batch its renders."""

    def close(self) -> None: ...


def reset_seeds(seed: int | Sequence[int] | None, ids: Sequence[int]) -> list[int | None]:
    """The per-environment seeds of ``VecEnv.reset`` for environments ``ids``: an integer (any
    ``numbers.Integral``: numpy's too) gives environment i the seed ``seed + i``, a list is one
    seed per reset environment, None is unseeded."""
    if seed is None:
        return [None] * len(ids)
    if isinstance(seed, numbers.Integral):
        return [int(seed) + int(i) for i in ids]
    seeds = [int(s) for s in seed]
    if len(seeds) != len(ids):
        raise ValueError(f"reset: {len(seeds)} seeds for {len(ids)} environments")
    return seeds


@dataclass
class PolicyOutput:
    """actions: float32 [B, K, A] physical units; logprob: float32 [B] of the whole chunk;
    value: float32 [B] or None; extras: what ``evaluate`` needs again (e.g. raw samples)."""

    actions: torch.Tensor
    logprob: torch.Tensor
    value: torch.Tensor | None = None
    extras: dict[str, torch.Tensor] = field(default_factory=dict)


@runtime_checkable
class Policy(Protocol):
    def act(self, obs: Observation, *, deterministic: bool = False) -> PolicyOutput: ...

    def evaluate(
        self, obs: Observation, output: PolicyOutput
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(logprob [B], entropy [B], value [B] or None) of ``output`` under the current weights."""


@dataclass
class NormStats:
    """Per-key statistics computed from data (mean/std, or q01/q99 quantiles), float32 [D]."""

    mean: torch.Tensor | None = None
    std: torch.Tensor | None = None
    q01: torch.Tensor | None = None
    q99: torch.Tensor | None = None
    count: float = 0.0


__all__ = [
    "ACTION_SPACES",
    "ActionSpec",
    "CameraSpec",
    "EnvSpec",
    "NormStats",
    "ObsSpec",
    "Observation",
    "Policy",
    "PolicyOutput",
    "SimulatorConfig",
    "StepOutput",
    "UserError",
    "VecEnv",
    "ended_rows",
    "reset_seeds",
]
