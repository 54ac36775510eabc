"""The demonstrations ``embodied sft`` trains on: LeRobot datasets joined into one set of frames,
their normalisation statistics, batches of frames as observations, and a frozen image encoder's
features of every frame, computed once."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import torch
from tqdm import tqdm

from embodied.dataset import DemoDataset, image_key, privileged_key
from embodied.schema import (
    CameraSpec,
    EnvSpec,
    NormStats,
    Observation,
    SimulatorConfig,
    UserError,
)


@dataclass
class Frames:
    """All datasets' frames as one set of tensors (N frames)."""

    data: DemoDataset
    instructions: list[str]  # per frame
    tasks: list[str]  # simulator task id per dataset, in order
    infos: list[tuple[str, dict]]  # (path, meta/info.json) per dataset, in order


def task_configs(env: SimulatorConfig, tasks: list[str]) -> dict[str, SimulatorConfig]:
    """The evaluation config of each task the datasets hold (their order, each once)."""
    names = list(dict.fromkeys(tasks))
    if len(names) > 1 and env.simulator != "maniskill":
        raise UserError(
            f"datasets: tasks {names} on {env.simulator}; several tasks in one SFT run need "
            "ManiSkill (a multi-task environment), or one dataset's task per run"
        )
    configs = {}
    for name in names:
        if name is None and getattr(env, "tasks", None):  # (its task would be every one listed)
            raise UserError(
                f"datasets: one names no task, and env.tasks lists {list(env.tasks)}: set "
                "env.task to the task it holds, without env.tasks"
            )
        try:
            configs[name] = env if name is None else env.with_task(name)
        except ValueError as error:
            raise UserError(f"datasets: task {name!r} on {env.simulator}: {error}") from None
    return configs


def load_frames(paths: list[str], episodes: int = 0) -> Frames:
    parts = [DemoDataset.load(p) for p in paths]
    parts = [p.head(episodes) for p in parts] if episodes > 0 else parts
    sets = [set(p.images) for p in parts]
    if any(s != sets[0] for s in sets):
        raise UserError(f"datasets: cameras differ between datasets: {sets}")
    _check_sizes(paths, parts)
    _check_finite(paths, parts)
    offset = 0
    starts = []
    ends = []
    instructions = []
    for p in parts:
        starts.append(p.starts + offset)  # long [E]
        ends.append(p.ends + offset)  # long [E]
        instructions += [p.tasks[t] for t in p.task.tolist()]
        offset += len(p)
    priv_keys = set.intersection(*[set(p.privileged) for p in parts])
    cat = DemoDataset(
        images={c: torch.cat([p.images[c] for p in parts]) for c in parts[0].images},
        privileged={k: torch.cat([p.privileged[k] for p in parts]) for k in priv_keys},
        state=torch.cat([p.state for p in parts]),
        actions=torch.cat([p.actions for p in parts]),
        episode=torch.cat([p.episode for p in parts]),
        frame=torch.cat([p.frame for p in parts]),
        task=torch.cat([p.task for p in parts]),
        tasks=[],
        starts=torch.cat(starts),
        ends=torch.cat(ends),
        info=parts[0].info,
        stats=parts[0].stats,
    )
    tasks = [p.info.get("embodied", {}).get("task") for p in parts]
    return Frames(cat, instructions, tasks, [(str(path), p.info) for path, p in zip(paths, parts)])


def _check_sizes(paths: list[str], parts: list[DemoDataset]) -> None:
    """A UserError naming the first dataset whose state, actions, images or privileged keys
    differ in size from the first one's (their frames are joined into one batch: torch.cat's
    error otherwise)."""
    first = parts[0]
    for path, part in zip(paths[1:], parts[1:]):
        pairs = {"state": (part.state, first.state), "actions": (part.actions, first.actions)}
        pairs.update({f"camera {c}": (part.images[c], first.images[c]) for c in first.images})
        shared = sorted(set(part.privileged) & set(first.privileged))
        pairs.update({k: (part.privileged[k], first.privileged[k]) for k in shared})
        for what, (mine, theirs) in pairs.items():
            if mine.shape[1:] != theirs.shape[1:]:
                raise UserError(
                    f"datasets: {path}'s {what} is {tuple(mine.shape[1:])} per frame, "
                    f"{paths[0]}'s {tuple(theirs.shape[1:])}; one run's datasets share sizes"
                )


def _check_finite(paths: list[str], parts: list[DemoDataset]) -> None:
    """A UserError naming the first dataset, column and frame that is not finite: one NaN action
    made the normalisation statistics NaN, then the loss and, after one step, every weight (SFT
    trained on and saved them)."""
    for path, part in zip(paths, parts):
        columns = {"observation.state": part.state, "action": part.actions}
        columns.update({privileged_key(k): v for k, v in part.privileged.items()})
        for name, values in columns.items():
            bad = (~torch.isfinite(values)).any(dim=1).nonzero().flatten()  # long [n]
            if len(bad):
                at = int(bad[0])
                raise UserError(
                    f"datasets: {path}'s {name} is not finite in {len(bad)} frames, first "
                    f"episode {int(part.episode[at])} frame {int(part.frame[at])}: "
                    f"{values[at].tolist()}"
                )


def check_fits(
    frames: Frames,
    spec: EnvSpec,
    privileged: tuple[str, ...],
    cameras: tuple[CameraSpec, ...],
    any_size: bool = False,
) -> None:
    """A UserError naming the dataset and what differs, where a dataset's frames are not what
    the policy for ``spec`` reads and does (it reads ``privileged`` and ``cameras``, at their
    size unless ``any_size``: a policy that resizes): its action space (where the dataset
    says), its recording rate (where it says), the sizes of its actions and state, its cameras
    and their size. SFT on
    them trained in silence on numbers of another kind (a deploy recording's joint positions as
    joint deltas)."""
    for path, info in frames.infos:
        features = info["features"]
        problems = []
        space = info.get("embodied", {}).get("action_space")
        if space is not None and space != spec.action.space:
            problems.append(f"actions in {space}, the policy's in {spec.action.space}")
        fps = info.get("fps")  # (a step's delta and a chunk's span are the rate's)
        if fps is not None and abs(fps - spec.action.control_hz) > 1e-6:
            problems.append(
                f"recorded at {fps:g} Hz, the policy acts at {spec.action.control_hz:g} Hz"
            )
        for what, key, names in (
            ("actions", "action", spec.action.names),
            ("state", "observation.state", spec.obs.state_names),
        ):  # (by size: another source names the same joints its own way)
            size = features[key]["shape"][0]
            if size != len(names):
                problems.append(f"{size} {what}, the policy's {len(names)}")
        for camera in cameras:
            shape = features.get(image_key(camera.name), {}).get("shape")
            sized = any_size or shape is None or tuple(shape[:2]) == (camera.height, camera.width)
            if shape is None or not sized:
                size = "none" if shape is None else f"{shape[0]}x{shape[1]}"
                problems.append(
                    f"camera {camera.name} {size}, the policy's {camera.height}x"
                    f"{camera.width} (env.image_size)"
                )
        lacking = [k for k in privileged if privileged_key(k) not in features]
        if lacking:
            problems.append(f"no {lacking} (the policy reads them: policy.privileged_keys)")
        for key in sorted(set(privileged) - set(lacking) & set(spec.obs.privileged)):
            size = features[privileged_key(key)]["shape"][0]  # (one the env lacks: the policy's)
            if size != math.prod(spec.obs.privileged[key]):
                problems.append(f"{size} {key}, the policy's {math.prod(spec.obs.privileged[key])}")
        if problems:
            raise UserError(f"datasets: {path} does not fit the policy: " + "; ".join(problems))


def norm_data(frames: Frames) -> dict[str, torch.Tensor]:
    """What the normalisation statistics are computed from (no images: it goes to every rank)."""
    d = frames.data
    return {"state": d.state, "privileged": d.privileged, "actions": d.actions}


def set_norm_stats(policy, data: dict) -> None:
    obs = Observation(state=data["state"], instruction=[], privileged=data["privileged"])
    state = policy.state_vector(obs) if policy.state_dim else None
    actions = data["actions"]
    policy.set_norm_stats(
        state=NormStats(mean=state.mean(0), std=state.std(0)) if state is not None else None,
        action=NormStats(
            q01=torch.quantile(actions, 0.01, dim=0), q99=torch.quantile(actions, 0.99, dim=0)
        ),
    )


def batch_of(frames: Frames, idx: torch.Tensor) -> Observation:
    d = frames.data
    return Observation(
        state=d.state[idx],
        instruction=[frames.instructions[i] for i in idx.tolist()],
        images={c: v[idx] for c, v in d.images.items()},
        privileged={k: v[idx] for k, v in d.privileged.items()},
    )


@torch.no_grad()
def cached_features(policy, frames: Frames, batch: int = 64) -> torch.Tensor:
    """Frozen image encoder: every frame's features once, f32 [C, N, P, F]."""
    policy.eval()
    N = len(frames.data)
    out = []
    for lo in tqdm(
        range(0, N, batch),
        desc="image features",
        unit="batch",
        mininterval=0.1 if sys.stderr.isatty() else 30.0,
    ):
        idx = torch.arange(lo, min(N, lo + batch))
        f = policy.image_features(batch_of(frames, idx))  # f32 [C*b, P, F]
        out.append(f.view(-1, len(idx), *f.shape[1:]))
    return torch.cat(out, dim=1)
