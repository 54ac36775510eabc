"""What SFT checks of its datasets before it trains: hand-built dataset metadata against the
spec of the policy it trains; written datasets that differ from each other, or lack a column."""

import pytest

from embodied.dataset import features
from embodied.schema import ActionSpec, CameraSpec, EnvSpec, ObsSpec, UserError
from embodied.sft_data import Frames, check_fits

SPEC = EnvSpec(
    obs=ObsSpec(
        cameras=(CameraSpec("front", 64, 64),),
        state_names=("q0", "q1"),
        privileged={"goal_pos": (3,)},
    ),
    action=ActionSpec(space="joint_delta", names=("j0", "j1"), low=(-1.0,) * 2, high=(1.0,) * 2),
    max_episode_steps=10,
)


def info(space="joint_delta", cameras=None, state=2, actions=2, privileged=None) -> dict:
    """A dataset's meta/info.json as our writer makes it (another source's names its own way)."""
    cams = {"front": (64, 64)} if cameras is None else cameras
    made = features(
        cams, [f"s{i}" for i in range(state)], [f"a{i}" for i in range(actions)], privileged or {}
    )
    embodied = {} if space is None else {"action_space": space}
    return {"features": made, "embodied": embodied}


def fits(*infos, privileged=(), cameras=SPEC.obs.cameras, any_size=False) -> None:
    frames = Frames(None, [], [], [(f"ds{i}", x) for i, x in enumerate(infos)])
    check_fits(frames, SPEC, privileged, cameras, any_size)


def test_a_dataset_of_the_policys_kind_fits_whatever_it_names_its_columns():
    fits(info(), info(space=None))  # (a dataset that does not say its action space)
    fits({**info(), "fps": 20})  # (at the policy's rate)
    fits(info(privileged={"goal_pos": 3}), privileged=("goal_pos",))
    fits(info(cameras={}), cameras=())  # a policy that reads no camera (use_images=false)
    fits(info(cameras={"front": (32, 32)}), any_size=True)  # one that resizes (SmolVLA)


@pytest.mark.parametrize(
    "dataset, privileged, said",
    [
        (
            info(space="joint_pos"),
            (),
            "ds0 does not fit the policy: actions in joint_pos, the policy's in joint_delta",
        ),
        (info(actions=3), (), "3 actions, the policy's 2"),
        ({**info(), "fps": 30}, (), "recorded at 30 Hz, the policy acts at 20 Hz"),
        (info(state=5), (), "5 state, the policy's 2"),
        (info(cameras={"front": (32, 32)}), (), "camera front 32x32, the policy's 64x64"),
        (info(cameras={"wrist": (64, 64)}), (), "camera front none, the policy's 64x64"),
        (info(), ("goal_pos",), "no ['goal_pos'] (the policy reads them"),
    ],
)
def test_a_dataset_that_does_not_fit_is_named_with_what_differs(dataset, privileged, said):
    """Each used to train in silence (a deploy recording's joint positions as joint deltas) or
    fail deep in the model (a camera of another size, a missing privileged key)."""
    with pytest.raises(UserError, match="datasets: ") as refused:
        fits(info(), dataset, privileged=privileged)
    assert said.replace("ds0", "ds1") in str(refused.value)


def test_a_privileged_key_of_another_size_is_named():
    """It passed, and the policy's normalisation statistics failed to take it (a traceback)."""
    with pytest.raises(UserError) as refused:
        fits(info(privileged={"goal_pos": 2}), privileged=("goal_pos",))
    assert str(refused.value).endswith("does not fit the policy: 2 goal_pos, the policy's 3")
    # one the environment lacks (one task's of several): the policy's own error names it
    fits(info(privileged={"is_grasped": 1}), privileged=("is_grasped",))


def test_a_dataset_missing_a_file_is_one_line_naming_it(tmp_path):
    """A partly copied directory (info.json there, stats.json not) was a FileNotFoundError
    traceback from `embodied sft`."""
    from embodied.dataset import DemoDataset

    root = written(tmp_path / "partial")
    (root / "meta" / "stats.json").unlink()
    with pytest.raises(UserError) as refused:
        DemoDataset.load(root)
    assert str(refused.value).startswith(f"{root}: not a readable dataset (FileNotFoundError: ")


def written(root, state: int = 4, image: int = 8, goal: int = 0, actions=None):
    """A one-episode LeRobot dataset of 3 frames: ``state`` state values, 2 actions (f32 [3, 2]
    ``actions``, else zeros), one camera of ``image`` x ``image`` pixels and, where ``goal``, a
    privileged goal_pos of that size."""
    import numpy as np

    from embodied.dataset import LeRobotWriter

    writer = LeRobotWriter(
        root,
        fps=20,
        cameras={"front": (image, image)},
        state_names=[f"s{i}" for i in range(state)],
        action_names=["a0", "a1"],
        privileged={"goal_pos": goal} if goal else None,
    )
    writer.add_episode(
        images={"front": np.zeros((3, image, image, 3), np.uint8)},
        state=np.zeros((3, state), np.float32),
        actions=np.zeros((3, 2), np.float32) if actions is None else actions,
        rewards=np.zeros(3, np.float32),
        success=np.array([False, False, True]),
        task="push",
        privileged={"goal_pos": np.zeros((3, goal), np.float32)} if goal else None,
    )
    return writer.close()


@pytest.mark.parametrize(
    "other, said",
    [
        (dict(state=5), "'s state is (5,) per frame, "),
        (dict(image=16), "'s camera front is (16, 16, 3) per frame, "),
        (dict(goal=2), "'s goal_pos is (2,) per frame, "),
    ],
)
def test_datasets_of_other_sizes_are_named_before_their_frames_are_joined(tmp_path, other, said):
    """They were joined first (torch.cat's RuntimeError, a traceback) and checked after."""
    from embodied.sft_data import load_frames

    first = written(tmp_path / "first", goal=3)
    second = written(tmp_path / "second", **{"goal": 3, **other})
    with pytest.raises(UserError) as refused:
        load_frames([str(first), str(second)])
    assert str(refused.value).startswith(f"datasets: {second}{said}")
    assert len(load_frames([str(first), str(first)]).data) == 6  # (alike: joined)


def test_a_dataset_without_state_or_actions_is_one_line_naming_them(tmp_path):
    """An image-only dataset, or one naming its columns otherwise (without the columns too: a
    KeyError traceback before)."""
    import json

    from embodied.dataset import DemoDataset

    root = written(tmp_path / "data")
    meta = root / "meta" / "info.json"
    info = json.loads(meta.read_text())
    del info["features"]["observation.state"], info["features"]["action"]
    meta.write_text(json.dumps(info))
    with pytest.raises(ValueError) as refused:
        DemoDataset.load(root)
    assert str(refused.value) == f"{root}: no observation.state, action feature (meta/info.json)"


def test_a_dataset_with_a_non_finite_number_is_named_with_its_column_and_frame(tmp_path):
    """One NaN action made the normalisation statistics NaN, then every weight after one step;
    SFT trained on and saved them, and exited 0."""
    import numpy as np

    from embodied.sft_data import load_frames

    actions = np.zeros((3, 2), np.float32)
    actions[2, 1] = np.nan
    root = written(tmp_path / "nan", actions=actions)
    with pytest.raises(UserError) as refused:
        load_frames([str(root)])
    said = f"datasets: {root}'s action is not finite in 1 frames, first episode 0 frame 2: "
    assert str(refused.value) == said + "[0.0, nan]"


def test_a_dataset_of_no_task_with_env_tasks_is_one_line():
    """Its task was the env's every listed task: SFT trained, then stopped at its first
    evaluation on KeyError 'all'."""
    from embodied.sft_data import task_configs
    from embodied.simulators.maniskill import ManiSkillConfig

    several = ManiSkillConfig(tasks=["PickCube-v1", "PullCube-v1"], num_envs=4)
    with pytest.raises(UserError, match=r"^datasets: one names no task, and env.tasks lists"):
        task_configs(several, [None])
    assert task_configs(several, ["PullCube-v1"])["PullCube-v1"].tasks == []
