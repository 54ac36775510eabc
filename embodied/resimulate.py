"""A recorded round simulated again (``embodied episodes --resimulate``): every round starts with
a seeded reset (the runner's ``_collect_round``), its seeds are the algorithm's plan for the
recorded iteration and round, and its actions are in the record, so the simulator can run the
round again step by step and give what the record keeps only where chunks start: the
observation before every action. Each world's randomisation is drawn from its reset seed, so it
comes back too. The re-simulated rewards, and the state and privileged observations where chunks
start, are compared with the recorded ones (images are not: renderers differ across machines);
where they differ (another machine's physics, a simulator that is not deterministic) each row's
first step that differs is named.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from embodied.recording import RecordedRounds
from embodied.replay import record_config
from embodied.schema import Observation, UserError


@dataclass
class Divergence:
    """The first step where a row's re-simulation differs from the record: its reward, or a
    component of its state or privileged observation where a chunk starts."""

    row: int
    step: int  # the round's environment step (chunk * K + k)
    recorded: float
    resimulated: float
    what: str = "reward"  # "reward", "state[i]", or "<privileged key>[i]"


@dataclass
class Resimulated:
    """One recorded round simulated again: per environment step s of its T * K (the round's
    steps, in order) the observation each environment saw before action s, and what followed."""

    round_index: int
    obs: Observation  # every tensor [S, B, ...]
    rewards: torch.Tensor  # f32 [S, B]
    success: torch.Tensor  # bool [S, B]
    divergences: list[Divergence]  # per row that diverges, its first step; empty: none
    # (row, step) -> the randomised parameters of the world whose episode began at that step
    # (a simulator that draws them, as MuJoCo's ``world_params``; empty for one that does not)
    worlds: dict = field(default_factory=dict)

    def agrees(self, row: int, until: int) -> bool:
        """Whether ``row``'s rewards and chunk-start observations equal the recorded ones up to
        step ``until``."""
        return all(d.step > until for d in self.divergences if d.row == row)

    def summary(self) -> str:
        """One line: the round matches its record, or where each diverging row parts."""
        if not self.divergences:
            return (
                f"round {self.round_index}: re-simulated rewards and observations equal the "
                "recorded ones"
            )
        parts = [
            f"row {d.row} from step {d.step} ({d.what} recorded {d.recorded:.6g}, "
            f"re-simulated {d.resimulated:.6g})"
            for d in self.divergences
        ]
        return f"round {self.round_index}: the re-simulation diverges at " + "; ".join(parts)


def simulator_for(record: RecordedRounds):
    """The recorded run's environments as its config builds them (all of them, here)."""
    from embodied.multitask import make_env

    return make_env(record_config(record).env)


class Resimulator:
    """The recorded run's environments, built once for every record re-simulated."""

    def __init__(self):
        self.env = None

    def rounds(
        self, record: RecordedRounds, round_indices, atol: float = 0.0
    ) -> dict[int, Resimulated]:
        """The rounds of ``record`` simulated again, by index (rewards compared to ``atol``)."""
        if not round_indices:
            return {}
        if self.env is None:
            self.env = simulator_for(record)
        return {r: resimulate(record, r, self.env, atol) for r in sorted(round_indices)}

    def close(self) -> None:
        if self.env is not None:
            self.env.close()


def round_seeds(record: RecordedRounds, round_index: int) -> int | list[int]:
    """The reset seeds of a recorded round: the run's algorithm planned them from the iteration
    and round (embodied/ppo.py, grpo.py), so its plan gives them again."""
    from embodied.roles import build_algorithm
    from embodied.schema import EnvSpec

    cfg = record_config(record)
    spec = EnvSpec.from_dict(record.meta["spec"])
    task_of_env = torch.tensor(record.meta["task_of_env"], dtype=torch.long)
    algorithm = build_algorithm(cfg, spec, task_of_env)
    return algorithm.plan(record.meta["iteration"], round_index, episode_base=0).seeds


def resimulate(record: RecordedRounds, round_index: int, env, atol: float = 0.0) -> Resimulated:
    """Run round ``round_index`` of ``record`` again on ``env`` (the run's environments, built
    as its config says: the same tasks, in the same order, on the same kind of simulator)."""
    batch = record.rounds[round_index]
    T, B, K = batch.rewards.shape
    if env.num_envs != B:
        raise UserError(
            f"{record.path}: the record has {B} environments, its config's simulator "
            f"{env.num_envs}; it cannot be re-simulated"
        )
    actions = batch.actions.to(getattr(env, "device", "cpu"))  # f32 [T, B, K, A]
    before = [env.reset(seed=round_seeds(record, round_index)).map(lambda x: x.cpu())]
    worlds = _worlds(env, range(B), 0)
    rewards = []
    success = []
    for t in range(T):
        for k in range(K):
            out = env.step(actions[t, :, k])
            rewards.append(out.reward.float().cpu())
            success.append(out.success.cpu())
            before.append(out.obs.map(lambda x: x.cpu()))  # (T * K of them: on the host)
            reset = (out.terminated | out.truncated).cpu().nonzero().squeeze(1).tolist()
            worlds.update(_worlds(env, reset, t * K + k + 1))  # (their next episode's draw)
    rewards = torch.stack(rewards)  # f32 [S, B]
    obs = _stack(before[:-1])
    found = _divergences(by_step(batch.rewards.cpu()), rewards, atol)
    found += _obs_divergences(batch.obs, obs, K, atol)
    return Resimulated(
        round_index=round_index,
        obs=obs,
        rewards=rewards,
        success=torch.stack(success),
        divergences=_first_per_row(found),
        worlds=worlds,
    )


def _worlds(env, rows, step: int) -> dict:
    """{(row, step): parameters} of ``rows``' worlds as drawn for the episodes they begin at
    ``step`` (the env's ``world_params``, as ``embodied demos`` keeps them); {} without."""
    params = getattr(env, "world_params", None)
    if params is None or not len(rows):
        return {}
    table = params.to_dict()  # name -> a list, world by world
    return {(row, step): {name: values[row] for name, values in table.items()} for row in rows}


def by_step(chunks: torch.Tensor) -> torch.Tensor:
    """[T, B, K, ...] per chunk and action -> [T * K, B, ...] per environment step t * K + k."""
    T, B, K = chunks.shape[:3]
    return chunks.transpose(1, 2).reshape(T * K, B, *chunks.shape[3:])


def _stack(steps: list[Observation]) -> Observation:
    """Observations of [B, ...] per step -> one of [S, B, ...]."""
    first = steps[0]
    return Observation(
        state=torch.stack([o.state for o in steps]),
        instruction=list(first.instruction),
        images={c: torch.stack([o.images[c] for o in steps]) for c in first.images},
        privileged={k: torch.stack([o.privileged[k] for o in steps]) for k in first.privileged},
    )


def _obs_divergences(recorded: Observation, again: Observation, K: int, atol: float):
    """Each row's first chunk start whose state or privileged observation differs by more than
    ``atol`` (``recorded``: [T, B, ...] at chunk starts; ``again``: [T * K, B, ...] per step)."""
    pairs = {"state": (recorded.state, again.state)}
    pairs.update({k: (v, again.privileged[k]) for k, v in recorded.privileged.items()})
    found = []
    for name, (before, resimulated) in pairs.items():
        before = before.cpu().flatten(2)  # [T, B, D]
        resimulated = resimulated[::K].cpu().flatten(2)  # [T, B, D]
        differs = _apart(before, resimulated, atol)  # bool [T, B, D]
        for row in differs.any(2).any(0).nonzero().squeeze(1).tolist():
            t = int(differs[:, row].any(1).nonzero()[0])
            i = int(differs[t, row].nonzero()[0])
            a, b = float(before[t, row, i]), float(resimulated[t, row, i])
            found.append(Divergence(row, t * K, a, b, f"{name}[{i}]"))
    return found


def _first_per_row(found: list[Divergence]) -> list[Divergence]:
    """Each row's earliest divergence (a reward's before an observation's at one step), by row."""
    first: dict[int, Divergence] = {}
    for d in found:
        if d.row not in first or d.step < first[d.row].step:
            first[d.row] = d
    return [first[row] for row in sorted(first)]


def _divergences(recorded: torch.Tensor, resimulated: torch.Tensor, atol: float):
    """Each row's first step whose rewards differ by more than ``atol``."""
    differs = _apart(recorded, resimulated, atol)  # bool [S, B]
    found = []
    for row in differs.any(0).nonzero().squeeze(1).tolist():
        step = int(differs[:, row].nonzero()[0])
        found.append(
            Divergence(row, step, float(recorded[step, row]), float(resimulated[step, row]))
        )
    return found


def _apart(recorded: torch.Tensor, resimulated: torch.Tensor, atol: float) -> torch.Tensor:
    """Where two values differ by more than ``atol``, a NaN against a number included (``>``
    is False for a NaN: a re-simulation that blew up agreed with its record)."""
    return ~torch.isclose(recorded, resimulated, rtol=0.0, atol=atol, equal_nan=True)
