"""What SFT checks of its datasets before it trains: hand-built dataset metadata against the
spec of the policy it trains."""

import pytest

from embodied.dataset import features
from embodied.schema import ActionSpec, CameraSpec, EnvSpec, ObsSpec
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
        (info(state=5), (), "5 state, the policy's 2"),
        (info(cameras={"front": (32, 32)}), (), "camera front 32x32, the policy's 64x64"),
        (info(cameras={"wrist": (64, 64)}), (), "camera front none, the policy's 64x64"),
        (info(), ("goal_pos",), "no ['goal_pos'] (the policy reads them"),
    ],
)
def test_a_dataset_that_does_not_fit_is_named_with_what_differs(dataset, privileged, said):
    """Each used to train in silence (a deploy recording's joint positions as joint deltas) or
    fail deep in the model (a camera of another size, a missing privileged key)."""
    with pytest.raises(ValueError, match="datasets: ") as refused:
        fits(info(), dataset, privileged=privileged)
    assert said.replace("ds0", "ds1") in str(refused.value)
