"""Demonstrations on disk in the LeRobotDataset v3.0 layout, and back into tensors.

    ROOT/meta/info.json                            codebase_version "v3.0", fps, features, totals
    ROOT/meta/stats.json                           per feature: mean, std, min, max, q01, q99, count
    ROOT/meta/tasks.parquet                        task string (index) -> task_index
    ROOT/meta/episodes/chunk-000/file-000.parquet  one row per episode: length, tasks, frame range,
                                                   data file, per-episode stats, our `success`
    ROOT/data/chunk-000/file-NNN.parquet           one row per frame (written by HF `datasets`)

Camera frames are stored as PNG inside the data parquet (feature dtype "image"), not as mp4.
LeRobot's own writer (lerobot 0.4.4) cannot be imported on a CPU-only machine: its dataset module
imports torchvision, whose registry builds are CUDA builds that fail to load next to CPU torch
(see shared/ENVIRONMENT.md). The files follow its v3.0 layout so LeRobot can read them where it
runs.
"""

from __future__ import annotations

import io
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from embodied.schema import UserError

CODEBASE_VERSION = "v3.0"
DATA_PATH = "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
EPISODES_PATH = "meta/episodes/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
DEFAULT_FEATURES = {
    name: {"dtype": dtype, "shape": [1], "names": None}
    for name, dtype in (
        ("timestamp", "float32"),
        ("frame_index", "int64"),
        ("episode_index", "int64"),
        ("index", "int64"),
        ("task_index", "int64"),
    )
}
SCALARS = set(DEFAULT_FEATURES) | {"next.reward", "next.success"}  # one value per frame
FILE_SIZE_MB = 100  # a new data file once the buffered frames exceed this


def write_rows(rows: list[dict], path: Path) -> None:
    """``rows`` as a parquet table, a column per key (a row without one: null), each column's
    type inferred from all its values, so that an integer column with nulls (an RL episode's
    reset seed after an automatic reset) stays integer (pandas made it float)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    names = list(dict.fromkeys(key for row in rows for key in row))
    pq.write_table(pa.table({n: pa.array([row.get(n) for row in rows]) for n in names}), path)


def image_key(camera: str) -> str:
    return f"observation.images.{camera}"


def privileged_key(key: str) -> str:
    return f"observation.privileged.{key}"


def _hf_features(features: dict):
    import datasets

    out = {}
    for key, ft in features.items():
        if ft["dtype"] == "image":
            out[key] = datasets.Image()
        elif key in SCALARS or list(ft["shape"]) == [1]:  # (LeRobot: a 1-vector is a value)
            out[key] = datasets.Value(ft["dtype"])
        else:
            out[key] = datasets.Sequence(datasets.Value(ft["dtype"]), length=ft["shape"][0])
    return datasets.Features(out)


def _column(values: np.ndarray, T: int) -> list:
    """A per-frame f32 vector feature [T, D] as parquet holds it: lists, or values where D is 1
    (LeRobot reads a feature of shape [1] as a value)."""
    values = values.astype(np.float32).reshape(T, -1)
    return (values[:, 0] if values.shape[1] == 1 else values).tolist()


def _stats(x: np.ndarray) -> dict:
    """Statistics of x [N, D] (float) over frames, each a list of D floats (LeRobot's keys)."""
    x = x.astype(np.float64)
    q01, q99 = np.quantile(x, [0.01, 0.99], axis=0)
    return {
        "mean": x.mean(0).tolist(),
        "std": x.std(0).tolist(),
        "min": x.min(0).tolist(),
        "max": x.max(0).tolist(),
        "q01": q01.tolist(),
        "q99": q99.tolist(),
        "count": [len(x)],
    }


def _image_stats(frames: np.ndarray) -> dict:
    """Per-channel statistics of uint8 [N, H, W, 3] frames scaled to [0, 1], shaped [3, 1, 1]."""
    every = max(1, len(frames) // 100)  # (about 100 frames)
    x = frames[::every].reshape(-1, 3).astype(np.float64) / 255.0
    out = _stats(x)
    return {k: [[[v]] for v in vals] if k != "count" else [len(frames)] for k, vals in out.items()}


def features(
    cameras: dict[str, tuple[int, int]],
    state_names: list[str],
    action_names: list[str],
    privileged: dict[str, int],
) -> dict[str, dict]:
    """info.json's features: each camera's frames, the state, the privileged keys' values, the
    action, reward and success, and LeRobot's own columns."""
    out = {
        image_key(c): {
            "dtype": "image",
            "shape": [h, w, 3],
            "names": ["height", "width", "channels"],
        }
        for c, (h, w) in cameras.items()
    }
    state = {"dtype": "float32", "shape": [len(state_names)], "names": list(state_names)}
    out["observation.state"] = state
    for key, size in privileged.items():
        out[privileged_key(key)] = {"dtype": "float32", "shape": [size], "names": None}
    out["action"] = {"dtype": "float32", "shape": [len(action_names)], "names": list(action_names)}
    out["next.reward"] = {"dtype": "float32", "shape": [1], "names": None}
    out["next.success"] = {"dtype": "bool", "shape": [1], "names": None}
    out.update(DEFAULT_FEATURES)
    return out


def taken(root: Path) -> str | None:
    """Why a dataset cannot be written to ``root`` ("already holds a dataset", "is not empty":
    an interrupted recording's data files would be read as the new one's); None where it can."""
    if (root / "meta" / "info.json").exists():
        return "already holds a dataset; choose another output directory"
    if root.is_dir() and any(root.iterdir()):
        return "is not empty (what an interrupted recording left?); choose another output directory"
    return None


class LeRobotWriter:
    """Append episodes, then ``close()`` to write the metadata. Not safe to resume: a crash leaves
    a directory without ``meta/info.json``, which ``DemoDataset`` refuses to read."""

    def __init__(
        self,
        root: str | Path,
        *,
        fps: float,
        cameras: dict[str, tuple[int, int]],
        state_names: list[str],
        action_names: list[str],
        privileged: dict[str, int] | None = None,
        robot_type: str | None = None,
        source: dict | None = None,
    ):
        self.root = Path(root)
        if why := taken(self.root):
            raise FileExistsError(f"{self.root} {why}")
        self.root.mkdir(parents=True, exist_ok=True)
        self.privileged = dict(privileged or {})  # simulator-only keys stored per frame -> size
        self.features = features(cameras, state_names, action_names, self.privileged)
        self.fps = fps
        self.robot_type = robot_type
        self.cameras = list(cameras)
        # where the data came from (simulator, task, expert), kept in info.json
        self.source = source or {}
        self.tasks: dict[str, int] = {}
        self.episodes: list[dict] = []
        self._buffer: list[dict] = []  # episodes not yet in a data file
        self._buffer_bytes = 0
        self._file_index = 0
        self._frames = 0
        self._all: dict[str, list[np.ndarray]] = {
            "observation.state": [],
            "action": [],
            **{privileged_key(k): [] for k in self.privileged},
        }
        self._images: dict[str, list[np.ndarray]] = {c: [] for c in cameras}

    def add_episode(
        self,
        *,
        images: dict[str, np.ndarray],
        state: np.ndarray,
        actions: np.ndarray,
        rewards: np.ndarray,
        success: np.ndarray,
        task: str,
        privileged: dict[str, np.ndarray] | None = None,
        extra: dict | None = None,
    ) -> int:
        """images: camera -> uint8 [T, H, W, 3]; state f32 [T, S]; actions f32 [T, A] (the action
        taken at each frame); rewards f32 [T]; success bool [T] after each action; privileged:
        key -> f32 [T, D] for the keys given at construction; extra: more episode metadata.
        -> index."""
        T = len(actions)
        privileged = privileged or {}
        self._check_episode(images, state, rewards, success, privileged, T)
        ep = len(self.episodes)
        task_index = self.tasks.setdefault(task, len(self.tasks))
        frames = {image_key(c): [images[c][t] for t in range(T)] for c in self.cameras}
        frames.update(self._columns(state, actions, rewards, success, ep, task_index))
        frames.update(
            {privileged_key(k): _column(v.reshape(T, -1), T) for k, v in privileged.items()}
        )
        stats = {"observation.state": _stats(state), "action": _stats(actions)}
        stats.update({image_key(c): _image_stats(images[c]) for c in self.cameras})
        meta = self._episode_meta(ep, task, T, success, extra)
        meta.update({f"stats/{f}/{k}": v for f, s in stats.items() for k, v in s.items()})
        self.episodes.append(meta)
        self._buffer.append(frames)
        self._all["observation.state"].append(state)
        self._all["action"].append(actions)
        for k, v in privileged.items():
            self._all[privileged_key(k)].append(v.reshape(T, -1))
        for c in self.cameras:
            self._images[c].append(images[c][:: max(1, T // 10)])
        self._frames += T
        # PNG compresses camera frames ~4x
        self._buffer_bytes += sum(v.nbytes for v in images.values()) // 4
        if self._buffer_bytes > FILE_SIZE_MB * 2**20:
            self._flush()
        return ep

    def _check_episode(self, images, state, rewards, success, privileged, T: int) -> None:
        if set(privileged) != set(self.privileged):
            raise ValueError(
                f"add_episode: privileged keys {sorted(privileged)}, "
                f"expected {sorted(self.privileged)}"
            )
        if not (len(state) == len(rewards) == len(success) == T) or any(
            len(v) != T for v in images.values()
        ):
            raise ValueError("add_episode: every per-frame array must have the same length")

    def _columns(self, state, actions, rewards, success, ep: int, task_index: int) -> dict:
        """An episode's columns but its images and privileged keys, a value per frame."""
        T = len(actions)
        return {
            "observation.state": _column(state, T),
            "action": _column(actions, T),
            "next.reward": rewards.astype(np.float32).tolist(),
            "next.success": success.astype(bool).tolist(),
            "timestamp": (np.arange(T) / self.fps).astype(np.float32).tolist(),
            "frame_index": list(range(T)),
            "episode_index": [ep] * T,
            "index": list(range(self._frames, self._frames + T)),
            "task_index": [task_index] * T,
        }

    def _episode_meta(self, ep: int, task: str, T: int, success, extra: dict | None) -> dict:
        """The episode's row of meta/episodes, its statistics aside."""
        return {
            "episode_index": ep,
            "tasks": [task],
            "length": T,
            "data/chunk_index": 0,
            "data/file_index": self._file_index,
            "dataset_from_index": self._frames,
            "dataset_to_index": self._frames + T,
            "meta/episodes/chunk_index": 0,
            "meta/episodes/file_index": 0,
            "success": bool(success.any()),
            **(extra or {}),
        }

    @property
    def total_frames(self) -> int:
        return self._frames

    def _flush(self) -> None:
        import datasets
        from datasets.table import embed_table_storage

        if not self._buffer:
            return
        columns = {k: [x for ep in self._buffer for x in ep[k]] for k in self._buffer[0]}
        features = _hf_features(self.features)
        ds = datasets.Dataset.from_dict(columns, features=features, split="train")
        ds = ds.with_format("arrow").map(embed_table_storage, batched=False)  # PNGs in it
        path = self.root / DATA_PATH.format(chunk_index=0, file_index=self._file_index)
        path.parent.mkdir(parents=True, exist_ok=True)
        ds.to_parquet(str(path))
        self._buffer = []
        self._buffer_bytes = 0
        self._file_index += 1

    def close(self) -> Path:
        import pandas as pd

        self._flush()
        if not self.episodes:
            raise ValueError(f"no episodes were recorded into {self.root}")
        meta = self.root / "meta"
        path = self.root / EPISODES_PATH.format(chunk_index=0, file_index=0)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_rows(self.episodes, path)
        tasks = pd.DataFrame({"task_index": list(self.tasks.values())}, index=list(self.tasks))
        tasks.to_parquet(meta / "tasks.parquet")
        stats = {k: _stats(np.concatenate(v)) for k, v in self._all.items()}
        images = {image_key(c): _image_stats(np.concatenate(v)) for c, v in self._images.items()}
        stats.update(images)
        (meta / "stats.json").write_text(json.dumps(stats, indent=2))
        info = {
            "codebase_version": CODEBASE_VERSION,
            "robot_type": self.robot_type,
            "total_episodes": len(self.episodes),
            "total_frames": self._frames,
            "total_tasks": len(self.tasks),
            "chunks_size": 1000,
            "data_files_size_in_mb": FILE_SIZE_MB,
            "video_files_size_in_mb": 200,
            "fps": self.fps,
            "splits": {"train": f"0:{len(self.episodes)}"},
            "data_path": DATA_PATH,
            "video_path": None,
            "features": self.features,
            "embodied": self.source,
        }
        # written last, whole or not at all (a rename): it marks the dataset complete, so a
        # process killed while writing it leaves no half-written marker
        partial = meta / "info.json.partial"
        partial.write_text(json.dumps(info, indent=2))
        # on disk before it (after a power loss the marker could stand over empty files), the
        # rename and the dataset's own entry after it
        _sync([*sorted(self.root.rglob("*")), self.root])
        os.replace(partial, meta / "info.json")
        _sync([meta, self.root.parent])
        return self.root


def _sync(paths: list[Path]) -> None:
    """Each file or folder (its entries) of ``paths`` flushed to disk."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)


def _data_columns(root: Path, info: dict) -> dict[str, list]:
    """Every data file's columns, joined; a ValueError where they hold other than the frames
    info.json counts (a directory an interrupted recording had written into)."""
    import pyarrow.parquet as pq

    cols: dict[str, list] = {}
    for f in sorted((root / "data").glob("chunk-*/file-*.parquet")):
        for k, v in pq.read_table(f).to_pydict().items():
            cols.setdefault(k, []).extend(v)
    frames = len(cols.get("episode_index", []))
    if frames != info.get("total_frames"):
        raise UserError(
            f"{root}: its data files hold {frames} frames, meta/info.json counts "
            f"{info.get('total_frames')}: files of another recording are mixed in; record "
            "again into a new directory"
        )
    return cols


@dataclass
class DemoDataset:
    """A LeRobot v3.0 dataset in memory as tensors: frames N, cameras C.

    images: camera -> uint8 [N, H, W, 3]; privileged: key -> f32 [N, D]; state f32 [N, S];
    actions f32 [N, A]; episode, frame, task: long [N] (episode index, frame within it, task
    index); tasks: the strings; starts/ends long [E]: each episode's frame range; info, stats: the
    metadata JSON.
    """

    images: dict[str, torch.Tensor]
    privileged: dict[str, torch.Tensor]
    state: torch.Tensor
    actions: torch.Tensor
    episode: torch.Tensor
    frame: torch.Tensor
    task: torch.Tensor
    tasks: list[str]
    starts: torch.Tensor
    ends: torch.Tensor
    info: dict
    stats: dict

    @staticmethod
    def load(root: str | Path) -> DemoDataset:
        try:
            return DemoDataset._read(Path(root))
        except UserError:
            raise
        except (OSError, ValueError) as e:  # (a partly copied directory: a file missing or cut)
            first = (str(e).strip().splitlines() or [""])[0]
            raise UserError(
                f"{root}: not a readable dataset ({type(e).__name__}: {first})"
            ) from None

    @staticmethod
    def _read(root: Path) -> DemoDataset:
        import pandas as pd
        from PIL import Image

        root = Path(root)
        if not (root / "meta" / "info.json").exists():
            raise UserError(f"{root} is not a complete LeRobot dataset (no meta/info.json)")
        info = json.loads((root / "meta" / "info.json").read_text())
        if info.get("codebase_version") != CODEBASE_VERSION:
            raise UserError(
                f"{root}: dataset version {info.get('codebase_version')}, "
                f"expected {CODEBASE_VERSION}"
            )
        needed = ("observation.state", "action", "episode_index", "frame_index", "task_index")
        lacking = [k for k in needed if k not in info.get("features", {})]
        if lacking:  # (an image-only dataset, or one that names its columns otherwise)
            raise UserError(f"{root}: no {', '.join(lacking)} feature (meta/info.json)")
        stats = json.loads((root / "meta" / "stats.json").read_text())
        tasks_df = pd.read_parquet(root / "meta" / "tasks.parquet")
        tasks = [
            t for t, _ in sorted(zip(tasks_df.index, tasks_df["task_index"]), key=lambda x: x[1])
        ]
        videos = [k for k, ft in info["features"].items() if ft["dtype"] == "video"]
        if videos:
            raise UserError(
                f"{root}: cameras stored as video ({', '.join(videos)}) are not read; store them "
                "as images (LeRobotDataset.create(..., use_videos=False))"
            )
        cols = _data_columns(root, info)
        cams = [k for k, ft in info["features"].items() if ft["dtype"] == "image"]
        images = {
            k.removeprefix("observation.images."): torch.from_numpy(
                np.stack(
                    [np.asarray(Image.open(io.BytesIO(x["bytes"])).convert("RGB")) for x in cols[k]]
                )
            )
            for k in cams
        }
        episode = torch.tensor(cols["episode_index"], dtype=torch.long)
        change = torch.nonzero(episode[1:] != episode[:-1]).squeeze(1) + 1
        starts = torch.cat([torch.zeros(1, dtype=torch.long), change])
        ends = torch.cat([change, torch.tensor([len(episode)])])
        prefix = privileged_key("")
        N = len(episode)
        privileged = {
            k.removeprefix(prefix): torch.tensor(v, dtype=torch.float32).view(N, -1)
            for k, v in cols.items()
            if k.startswith(prefix)
        }
        return DemoDataset(
            images=images,
            privileged=privileged,
            state=torch.tensor(cols["observation.state"], dtype=torch.float32).view(N, -1),
            actions=torch.tensor(cols["action"], dtype=torch.float32).view(N, -1),
            episode=episode,
            frame=torch.tensor(cols["frame_index"], dtype=torch.long),
            task=torch.tensor(cols["task_index"], dtype=torch.long),
            tasks=tasks,
            starts=starts,
            ends=ends,
            info=info,
            stats=stats,
        )

    def __len__(self) -> int:
        return len(self.actions)

    @property
    def num_episodes(self) -> int:
        return len(self.starts)

    def head(self, episodes: int) -> DemoDataset:
        """The first ``episodes`` episodes (all of them if there are fewer); stats stay the
        file's."""
        if episodes >= self.num_episodes:
            return self
        n = int(self.ends[episodes - 1])  # frames kept
        return DemoDataset(
            images={k: v[:n] for k, v in self.images.items()},
            privileged={k: v[:n] for k, v in self.privileged.items()},
            state=self.state[:n],
            actions=self.actions[:n],
            episode=self.episode[:n],
            frame=self.frame[:n],
            task=self.task[:n],
            tasks=self.tasks,
            starts=self.starts[:episodes],
            ends=self.ends[:episodes],
            info=self.info,
            stats=self.stats,
        )

    def action_chunks(self, idx: torch.Tensor, K: int) -> tuple[torch.Tensor, torch.Tensor]:
        """For frames idx (long [N]): the next K actions f32 [N, K, A] and a mask f32 [N, K] that is
        0 past the episode's end (those steps repeat the episode's last action)."""
        ends = self.ends[torch.searchsorted(self.starts, idx, right=True) - 1]  # long [N]
        steps = idx[:, None] + torch.arange(K)  # long [N, K]
        mask = (steps < ends[:, None]).float()
        return self.actions[torch.minimum(steps, ends[:, None] - 1)], mask
