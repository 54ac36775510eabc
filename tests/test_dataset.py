"""Demonstrations round-trip through the LeRobot v3.0 layout exactly."""

import json

import numpy as np
import pytest
import torch

from embodied.dataset import DemoDataset, LeRobotWriter
from embodied.schema import UserError


def _episode(rng, T, task):
    return dict(
        images={"base_camera": rng.integers(0, 256, (T, 16, 24, 3), dtype=np.uint8)},
        state=rng.normal(size=(T, 5)).astype(np.float32),
        actions=rng.uniform(-1, 1, (T, 3)).astype(np.float32),
        rewards=rng.uniform(size=T).astype(np.float32),
        success=np.arange(T) >= T - 2,
        task=task,
    )


def test_round_trip_and_metadata(tmp_path):
    rng = np.random.default_rng(0)
    eps = [
        _episode(rng, 7, "push the cube"),
        _episode(rng, 4, "pick up the cube"),
        _episode(rng, 5, "push the cube"),
    ]
    w = LeRobotWriter(
        tmp_path / "ds",
        fps=20,
        cameras={"base_camera": (16, 24)},
        state_names=[f"q{i}" for i in range(5)],
        action_names=["a", "b", "g"],
        privileged={"goal_pos": 3},
        robot_type="panda",
    )
    goals = [rng.normal(size=(len(e["actions"]), 3)).astype(np.float32) for e in eps]
    for e, g in zip(eps, goals):
        w.add_episode(**e, privileged={"goal_pos": g})
    root = w.close()

    info = json.loads((root / "meta" / "info.json").read_text())
    assert (
        info["codebase_version"] == "v3.0"
        and info["total_episodes"] == 3
        and info["total_frames"] == 16
    )
    assert (
        info["total_tasks"] == 2
        and info["features"]["observation.images.base_camera"]["dtype"] == "image"
    )
    assert (root / "data" / "chunk-000" / "file-000.parquet").exists()

    ds = DemoDataset.load(root)
    assert len(ds) == 16 and ds.tasks == ["push the cube", "pick up the cube"]
    assert ds.starts.tolist() == [0, 7, 11] and ds.ends.tolist() == [7, 11, 16]
    assert ds.task.tolist() == [0] * 7 + [1] * 4 + [0] * 5 and ds.frame[7:11].tolist() == [
        0,
        1,
        2,
        3,
    ]
    torch.testing.assert_close(
        ds.state, torch.from_numpy(np.concatenate([e["state"] for e in eps]))
    )
    torch.testing.assert_close(
        ds.actions, torch.from_numpy(np.concatenate([e["actions"] for e in eps]))
    )
    torch.testing.assert_close(ds.privileged["goal_pos"], torch.from_numpy(np.concatenate(goals)))
    assert "observation.privileged.goal_pos" in ds.stats
    assert torch.equal(
        ds.images["base_camera"],
        torch.from_numpy(np.concatenate([e["images"]["base_camera"] for e in eps])),
    )
    all_actions = np.concatenate([e["actions"] for e in eps])
    np.testing.assert_allclose(ds.stats["action"]["mean"], all_actions.mean(0), rtol=1e-6)
    np.testing.assert_allclose(
        ds.stats["action"]["q99"], np.quantile(all_actions, 0.99, axis=0), rtol=1e-6
    )

    import pandas as pd

    episodes = pd.read_parquet(root / "meta" / "episodes" / "chunk-000" / "file-000.parquet")
    assert episodes["length"].tolist() == [7, 4, 5] and episodes["dataset_from_index"].tolist() == [
        0,
        7,
        11,
    ]
    assert episodes["success"].tolist() == [True, True, True]

    two = ds.head(2)  # few-shot SFT: the first episodes only
    assert len(two) == 11 and two.num_episodes == 2 and two.ends.tolist() == [7, 11]
    assert torch.equal(two.images["base_camera"], ds.images["base_camera"][:11])
    torch.testing.assert_close(two.privileged["goal_pos"], ds.privileged["goal_pos"][:11])
    assert ds.head(5) is ds


def test_action_chunks_stop_at_episode_ends(tmp_path):
    rng = np.random.default_rng(1)
    w = LeRobotWriter(
        tmp_path / "ds", fps=20, cameras={"c": (8, 8)}, state_names=["q"], action_names=["a"]
    )
    w.add_episode(
        **{
            **_episode(rng, 3, "t"),
            "state": np.zeros((3, 1), np.float32),
            "actions": np.array([[1.0], [2.0], [3.0]], np.float32),
            "images": {"c": np.zeros((3, 8, 8, 3), np.uint8)},
        }
    )
    w.add_episode(
        **{
            **_episode(rng, 2, "t"),
            "state": np.zeros((2, 1), np.float32),
            "actions": np.array([[4.0], [5.0]], np.float32),
            "images": {"c": np.zeros((2, 8, 8, 3), np.uint8)},
        }
    )
    ds = DemoDataset.load(w.close())
    chunks, mask = ds.action_chunks(torch.tensor([0, 2, 3]), K=3)
    assert chunks[..., 0].tolist() == [[1, 2, 3], [3, 3, 3], [4, 5, 5]]
    assert mask.tolist() == [[1, 1, 1], [1, 0, 0], [1, 1, 0]]


def test_refuses_overwrite_and_incomplete(tmp_path):
    w = LeRobotWriter(
        tmp_path / "ds", fps=20, cameras={"c": (8, 8)}, state_names=["q"], action_names=["a"]
    )
    w.add_episode(
        **_episode(np.random.default_rng(2), 2, "t")
        | {
            "state": np.zeros((2, 1), np.float32),
            "actions": np.zeros((2, 1), np.float32),
            "images": {"c": np.zeros((2, 8, 8, 3), np.uint8)},
        }
    )
    with pytest.raises(UserError, match="not a complete LeRobot dataset"):
        DemoDataset.load(tmp_path / "ds")  # not closed yet
    w.close()
    with pytest.raises(FileExistsError):
        LeRobotWriter(
            tmp_path / "ds", fps=20, cameras={"c": (8, 8)}, state_names=["q"], action_names=["a"]
        )


def test_a_directory_an_interrupted_recording_left_is_refused_and_never_read_as_complete(tmp_path):
    """A killed recording leaves data files without meta/info.json: a new one into that directory
    is refused (it used to write beside them, and the loader read the old frames as its own),
    and a dataset whose data files hold frames its info.json does not count is refused."""
    import json
    import shutil

    def writer(root):
        return LeRobotWriter(root, fps=20, cameras={}, state_names=["q"], action_names=["a"])

    left = tmp_path / "left"
    (left / "data" / "chunk-000").mkdir(parents=True)
    (left / "data" / "chunk-000" / "file-000.parquet").write_bytes(b"an old run's frames")
    with pytest.raises(FileExistsError, match="is not empty"):
        writer(left)
    w = writer(tmp_path / "ds")
    zeros = {"state": np.zeros((2, 1), np.float32), "actions": np.zeros((2, 1), np.float32)}
    w.add_episode(**_episode(np.random.default_rng(2), 2, "t") | zeros | {"images": {}})
    root = w.close()
    assert len(DemoDataset.load(root)) == 2
    data = root / "data" / "chunk-000"
    shutil.copy(data / "file-000.parquet", data / "file-001.parquet")  # another run's file
    with pytest.raises(ValueError, match="hold 4 frames, meta/info.json counts 2"):
        DemoDataset.load(root)
    (data / "file-001.parquet").unlink()
    info = json.loads((root / "meta" / "info.json").read_text())
    info["features"]["observation.images.front"] = {"dtype": "video", "shape": [8, 8, 3]}
    (root / "meta" / "info.json").write_text(json.dumps(info))
    with pytest.raises(ValueError, match=r"stored as video \(observation.images.front\)"):
        DemoDataset.load(root)


def test_lerobots_own_loader_reads_what_we_write(tmp_path):
    # LeRobot's LeRobotDataset (0.4.4) on our files: frames, tasks and episode boundaries as written
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    rng = np.random.default_rng(3)
    eps = [_episode(rng, 5, "push the cube"), _episode(rng, 3, "pick up the cube")]
    w = LeRobotWriter(
        tmp_path / "ds",
        fps=20,
        cameras={"base_camera": (16, 24)},
        state_names=[f"q{i}" for i in range(5)],
        action_names=["a", "b", "g"],
    )
    for e in eps:
        w.add_episode(**e)
    ds = LeRobotDataset("local/test", root=w.close())
    assert (ds.num_episodes, ds.num_frames, ds.fps) == (2, 8, 20)
    frame = ds[6]  # the second episode's second frame
    assert (
        frame["task"] == "pick up the cube"
        and int(frame["episode_index"]) == 1
        and int(frame["frame_index"]) == 1
    )
    torch.testing.assert_close(frame["observation.state"], torch.from_numpy(eps[1]["state"][1]))
    torch.testing.assert_close(frame["action"], torch.from_numpy(eps[1]["actions"][1]))
    image = (
        torch.from_numpy(eps[1]["images"]["base_camera"][1]).permute(2, 0, 1).float() / 255
    )  # LeRobot: f32 [3, H, W]
    torch.testing.assert_close(frame["observation.images.base_camera"], image)


def test_a_dataset_is_on_disk_before_its_info_json_marks_it_complete(tmp_path, monkeypatch):
    """Nothing was synced: after a power loss info.json could stand over data files cut short
    (deploy's and demos' recordings promise their finished episodes survive a crash)."""
    import os

    synced = []
    replace = os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(os.readlink(f"/proc/self/fd/{fd}")))

    def replace_seen(src, dst):
        synced.append(f"renamed {dst}")
        replace(src, dst)

    monkeypatch.setattr(os, "replace", replace_seen)
    w = LeRobotWriter(tmp_path / "ds", fps=20, cameras={}, state_names=["q"], action_names=["a"])
    zeros = {"state": np.zeros((2, 1), np.float32), "actions": np.zeros((2, 1), np.float32)}
    w.add_episode(**_episode(np.random.default_rng(2), 2, "t") | zeros | {"images": {}})
    root = w.close()
    before = synced[: synced.index(f"renamed {root / 'meta' / 'info.json'}")]
    files = [str(p) for p in root.rglob("*") if p.is_file() and p.name != "info.json"]
    assert set(files) | {str(root / "meta" / "info.json.partial")} <= set(before)
    assert str(root / "data" / "chunk-000" / "file-000.parquet") in before
    after = synced[len(before) + 1 :]  # the rename, and the dataset's entry in its folder
    assert after == [str(root / "meta"), str(tmp_path)]
