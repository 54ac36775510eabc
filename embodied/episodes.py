"""The episodes of a rollout record (``embodied episodes RUN``): each one found in the recorded
rounds, chosen by return, task or outcome, and written as an mp4 of the camera the policy saw
beside a PNG of its actions, rewards and success over time. The mp4 has the recorded
observations (one frame per chunk) or, re-simulated (embodied/resimulate.py), one per step.

An episode is the chunks of one environment row that share an ``episode_id``; its steps are the
actions that ran in it (``valid``). Every round starts with a seeded reset (the runner's
``_collect_round``), so no episode crosses from one iteration's record into the next: one
still running when its round ends is cut there, and is left out. An episode is whole when it
starts in the record too: at the round's reset, or after a chunk whose episode ran all its
actions. One that starts after an episode that ended mid-chunk is partial, left out unless
``partial``: the chunk's remaining actions ran, unrecorded, as its first steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from embodied.recording import RecordedRounds
from embodied.resimulate import Resimulated
from embodied.schema import EnvSpec
from embodied.video import write_mp4


@dataclass
class Episode:
    """One episode of a recorded round: where it is, what it did, how it went."""

    round_index: int
    row: int  # its environment row
    chunks: list[int]  # the round's chunks it spans, in order
    episode_id: int
    task: str
    whole: bool  # it starts and ends in the record
    ret: float  # the sum of its rewards
    success: bool  # success at some step (success once)
    success_at_end: bool
    length: int  # its steps
    seed: int | None = None  # its reset seed where ``with_seeds`` found one (a round's first)
    iteration: int = 0  # its record's

    def frames(self, record: RecordedRounds, camera: str) -> np.ndarray:
        """uint8 [chunks, H, W, 3]: the camera at each of its chunks' start."""
        images = record.rounds[self.round_index].obs.images[camera]
        return images[self.chunks, self.row].cpu().numpy()

    def steps(self, record: RecordedRounds) -> list[int]:
        """The round's environment steps (chunk * K + k) that ran in it, in order."""
        valid = record.rounds[self.round_index].valid[self.chunks, self.row]  # bool [chunks, K]
        K = valid.shape[1]
        return [t * K + k for t, v in zip(self.chunks, valid.tolist()) for k in range(K) if v[k]]

    def traces(self, record: RecordedRounds) -> dict[str, np.ndarray]:
        """Per step (the actions that ran): actions f32 [steps, A], reward f32 [steps], success
        bool [steps]."""
        batch = record.rounds[self.round_index]
        valid = batch.valid[self.chunks, self.row]  # bool [chunks, K]
        return {
            "actions": batch.actions[self.chunks, self.row][valid].cpu().numpy(),
            "reward": batch.rewards[self.chunks, self.row][valid].cpu().numpy(),
            "success": batch.success[self.chunks, self.row][valid].cpu().numpy(),
        }


def episodes_of(record: RecordedRounds, task_names: list[str] | None = None) -> list[Episode]:
    """Every episode that ends in the record's rounds, in round, row and chunk order."""
    found = []
    for r, batch in enumerate(record.rounds):
        ids = batch.episode_id.cpu()  # long [T, B]
        T, B = ids.shape
        done = (batch.terminated | batch.truncated) & batch.valid  # bool [T, B, K]
        for row in range(B):
            for episode_id in ids[:, row].unique().tolist():
                chunks = (ids[:, row] == episode_id).nonzero().squeeze(1).tolist()
                if not bool(done[chunks, row].any()):
                    continue  # it goes on after the round
                first = chunks[0]
                # whole: it starts at the round's reset, or where the previous episode's chunk
                # ran all its actions (one that ended mid-chunk let the rest run unrecorded in
                # this episode, its first steps)
                whole = first == 0 or bool(batch.valid[first - 1, row].all())
                found.append(_episode(batch, r, row, chunks, episode_id, whole))
    names = task_names or record_tasks(record.meta)
    for episode in found:
        index = int(episode.task)
        episode.task = names[index] if index < len(names) else str(index)
        episode.iteration = record.meta["iteration"]
    return found


def record_tasks(meta: dict) -> list[str]:
    """The tasks of the run whose record has ``meta``, in the env group's order: ``env.tasks``,
    or the one task of a single-task run by its name (``env.task``; a simulator without one:
    ``all``)."""
    env = meta["config"]["env"]
    return list(env.get("tasks") or [env.get("task") or "all"])


def with_seeds(record: RecordedRounds, episodes: list[Episode]) -> list[Episode]:
    """``episodes`` with the reset seed of each that began at its round's reset (the round's
    seeds, planned again: embodied/resimulate.py); one after an automatic reset has none, and
    neither has one of ManiSkill's GPU backend reset with an int (PPO's plan): ManiSkill
    derives each row's seed from it (design note 36)."""
    from embodied.resimulate import round_seeds

    env = record.meta["config"]["env"]
    derived = env.get("simulator") == "maniskill" and env.get("backend") == "gpu"
    seeds = {}
    for episode in episodes:
        if episode.chunks[0] != 0:
            continue
        r = episode.round_index
        if r not in seeds:
            seeds[r] = round_seeds(record, r)
        planned = seeds[r]
        row = episode.row
        if not isinstance(planned, int):
            episode.seed = int(planned[row])
        elif not derived:
            episode.seed = planned + row
    return episodes


def _episode(batch, r: int, row: int, chunks: list[int], episode_id: int, whole: bool):
    valid = batch.valid[chunks, row]  # bool [chunks, K]
    rewards = batch.rewards[chunks, row][valid]
    success = batch.success[chunks, row][valid]
    return Episode(
        round_index=r,
        row=row,
        chunks=chunks,
        episode_id=episode_id,
        task=str(int(batch.task_id[chunks[0], row])),
        whole=whole,
        ret=float(rewards.sum()),
        success=bool(success.any()),
        success_at_end=bool(success[-1]) if len(success) else False,
        length=int(valid.sum()),
    )


def choose(
    episodes: list[Episode],
    *,
    best: int = 0,
    worst: int = 0,
    task: str | None = None,
    outcome: str | None = None,
    partial: bool = False,
    seed: int | None = None,
) -> list[Episode]:
    """The episodes asked for: of ``task``, ``outcome`` ("successful", "failed") and reset
    ``seed`` (``with_seeds``), whole ones unless ``partial``; then the ``best`` and ``worst``
    by return (neither: all of them), of all ``episodes`` (several records' too)."""
    kept = [
        e
        for e in episodes
        if (partial or e.whole)
        and (task is None or e.task == task)
        and (outcome is None or e.success == (outcome == "successful"))
        and (seed is None or e.seed == seed)
    ]
    if not best and not worst:
        return kept
    ranked = sorted(kept, key=lambda e: (-e.ret, e.iteration, e.round_index, e.row, e.chunks[0]))
    chosen = ranked[:best] + [e for e in ranked[::-1][:worst] if e not in ranked[:best]]
    return chosen


def control_hz(record: RecordedRounds) -> float:
    """The recorded run's environment steps per second."""
    return EnvSpec.from_dict(record.meta["spec"]).action.control_hz


def write_episode(
    record: RecordedRounds, episode: Episode, out: Path, resimulated: Resimulated | None = None
) -> tuple[Path | None, Path]:
    """``out/<name>.mp4`` (the first camera: one frame per chunk as recorded, or per step as
    ``resimulated``; None without a camera) and ``out/<name>.png`` (actions, reward and success
    per step); the two paths."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    name = (
        f"iter{record.meta['iteration']:06d}_round{episode.round_index}_row{episode.row}_"
        f"ep{episode.episode_id}_{episode.task}"
    )
    cameras = sorted(record.rounds[episode.round_index].obs.images)
    out.mkdir(parents=True, exist_ok=True)
    video = out / f"{name}.mp4"
    if cameras and resimulated is not None:
        frames = resimulated.obs.images[cameras[0]][episode.steps(record), episode.row]
        write_mp4(video, list(frames.numpy()), fps=control_hz(record))
    elif cameras:
        fps = control_hz(record) / record.rounds[0].actions.shape[2]  # (a frame per chunk)
        write_mp4(video, list(episode.frames(record, cameras[0])), fps=fps)
    traces = episode.traces(record)
    figure, axes = plt.subplots(3, 1, figsize=(7, 6), sharex=True)
    steps = np.arange(len(traces["reward"]))
    for dim in range(traces["actions"].shape[-1]):
        axes[0].plot(steps, traces["actions"][:, dim], label=f"a{dim}")
    axes[0].set_ylabel("action")
    axes[0].legend(loc="upper right", fontsize="small", ncol=4)
    axes[1].plot(steps, traces["reward"])
    axes[1].set_ylabel("reward")
    axes[2].step(steps, traces["success"].astype(float), where="post")
    axes[2].set_ylabel("success")
    axes[2].set_xlabel("step")
    outcome = "success" if episode.success else "failure"
    figure.suptitle(f"{name}: return {episode.ret:.3f}, {episode.length} steps, {outcome}")
    plot = out / f"{name}.png"
    figure.savefig(plot, dpi=80)
    plt.close(figure)
    return (video if cameras else None), plot


def summary_line(episode: Episode) -> str:
    whole = "" if episode.whole else " (partial)"
    outcome = "success" if episode.success else "failure"
    return (
        f"round {episode.round_index} row {episode.row} episode {episode.episode_id} "
        f"({episode.task}): return {episode.ret:.3f}, {episode.length} steps, {outcome}{whole}"
    )
