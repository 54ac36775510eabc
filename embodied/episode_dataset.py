"""Recorded RL episodes as LeRobot v3 datasets (``embodied episodes --to-dataset DIR``), which
``embodied sft`` and LeRobot's ``LeRobotDataset`` read: successful episodes become
demonstrations (the data flywheel). Per step: the camera frames and state before the action,
the privileged keys the policy read, the action, its reward and success; the task's instruction
as the LeRobot task. A record keeps observations where chunks start, so a policy that acted in
chunks of several actions needs its rounds re-simulated (embodied/resimulate.py) for the frames
in between. ``embodied sft`` reads one task per dataset: a run of several tasks gets one dataset
per task, ``DIR/<task>``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from embodied.dataset import taken
from embodied.episodes import Episode, record_tasks
from embodied.recording import RecordedRounds
from embodied.replay import record_config
from embodied.resimulate import Resimulated, by_step
from embodied.schema import EnvSpec, UserError


class DatasetError(UserError):
    """Episodes that cannot become a dataset; ``str()`` is one line."""


def dataset_roots(root: Path, record: RecordedRounds) -> dict[str, Path]:
    """Where each task's episodes go: ``root`` for a run of one task, ``root/<task>`` else."""
    names = record_tasks(record.meta)
    if len(names) == 1:
        return {names[0]: Path(root)}
    return {name: Path(root) / name for name in names}


def check_free(roots: dict[str, Path]) -> None:
    """``DatasetError`` when a dataset directory holds anything already (a dataset, or what an
    interrupted one left), before anything is written."""
    for path in roots.values():
        if why := taken(path):
            raise DatasetError(f"{path} {why}")


class EpisodeDatasets:
    """One ``LeRobotWriter`` per task, made when its first episode comes; ``close()`` writes
    their metadata."""

    def __init__(self, root: Path, record: RecordedRounds, source: dict):
        self.roots = dataset_roots(root, record)
        check_free(self.roots)
        self.spec = EnvSpec.from_dict(record.meta["spec"])
        # what the recorded policy read (an MLP's privileged_keys null: all of them), so that
        # the dataset fits that policy for embodied sft
        config = record_config(record)
        self.privileged = config.policy.read_privileged(self.spec)
        self.source = source
        self.simulator_task = config.env.task_name()  # (the name of a one-task run's "all")
        self.writers = {}
        self.count = 0

    def add(
        self, record: RecordedRounds, episode: Episode, resimulated: Resimulated | None
    ) -> None:
        steps = episode_steps(record, episode, resimulated, self.privileged)
        writer = self.writers.get(episode.task) or self._writer(episode.task, steps)
        batch = record.rounds[episode.round_index]
        writer.add_episode(
            **steps,
            task=batch.instructions[int(batch.task_id[episode.chunks[0], episode.row])],
            extra=episode_extra(record, episode, resimulated),
        )
        self.count += 1

    def _writer(self, task: str, steps: dict):
        from embodied.dataset import LeRobotWriter

        cameras = {c: tuple(frames.shape[1:3]) for c, frames in steps["images"].items()}
        privileged = {k: int(v.shape[1]) for k, v in steps["privileged"].items()}
        source = {**self.source, "task": self.simulator_task if task == "all" else task}
        source["action_space"] = self.spec.action.space
        self.writers[task] = LeRobotWriter(
            self.roots[task],
            fps=self.spec.action.control_hz,
            cameras=cameras,
            state_names=list(self.spec.obs.state_names),
            action_names=list(self.spec.action.names),
            privileged=privileged,
            source=source,
        )
        return self.writers[task]

    def close(self) -> list[Path]:
        return [writer.close() for writer in self.writers.values()]


def episode_extra(
    record: RecordedRounds, episode: Episode, resimulated: Resimulated | None
) -> dict:
    """An episode's row of the dataset's metadata besides its frames, with the fields of an
    ``embodied demos`` dataset: ``seed`` (its reset seed, ``with_seeds``; None for one that
    began after an automatic reset), ``success_at_end``, and ``world`` (its randomised
    parameters, where its round was re-simulated on a simulator that draws them); and its
    return and episode id in the run."""
    first = episode.steps(record)[0]
    world = None if resimulated is None else resimulated.worlds.get((episode.row, first))
    return {
        "seed": episode.seed,
        "success_at_end": episode.success_at_end,
        **({} if world is None else {"world": world}),
        "return": episode.ret,
        "rl_episode_id": episode.episode_id,
    }


def episode_steps(
    record: RecordedRounds, episode: Episode, resimulated: Resimulated | None, keys=()
) -> dict:
    """The episode per step (the actions that ran in it), as ``LeRobotWriter.add_episode``
    takes them: images, state, the privileged ``keys``, actions, rewards, success."""
    batch = record.rounds[episode.round_index]
    K = batch.rewards.shape[2]
    row = episode.row
    steps = episode.steps(record)  # the round's environment steps, t * K + k
    if resimulated is not None:
        obs = resimulated.obs  # [S, B, ...]: before every step
    elif K == 1:
        obs = batch.obs  # [T, B, ...]: before every chunk, which is one step
    else:
        raise DatasetError(
            f"--to-dataset: the policy acted in chunks of {K} steps and the record keeps the "
            "observations where chunks start; re-simulate its rounds (--resimulate)"
        )
    return {
        "images": {c: v[steps, row].cpu().numpy() for c, v in obs.images.items()},
        "state": obs.state[steps, row].cpu().numpy(),
        "privileged": {
            k: obs.privileged[k][steps, row].reshape(len(steps), -1).cpu().numpy() for k in keys
        },
        "actions": by_step(batch.actions)[steps, row].cpu().numpy(),
        "rewards": by_step(batch.rewards)[steps, row].cpu().numpy().astype(np.float32),
        "success": by_step(batch.success)[steps, row].cpu().numpy(),
    }
