"""MultiTaskEnv: two ManiSkill tasks behind one VecEnv pass the contract; each environment carries
its own task's instruction; actions and resets reach the right task."""

import torch

from embodied.contract import check_env
from embodied.multitask import MultiTaskEnv, make_env
from embodied.simulators.maniskill import ManiSkillConfig

CFG = ManiSkillConfig(
    tasks=["PushCube-v1", "PullCube-v1"],
    obs_mode="rgb",
    num_envs=4,
    num_workers=2,
    image_size=32,
    render_size=32,
    control_mode="pd_joint_delta_pos",
    max_episode_steps=6,
)


def test_two_tasks_pass_the_contract_with_their_instructions():
    with make_env(CFG) as env:
        assert isinstance(env, MultiTaskEnv) and env.num_envs == 4
        assert env.task_of_env == ["PushCube-v1", "PushCube-v1", "PullCube-v1", "PullCube-v1"]
        check_env(env, seed=1)
        obs = env.reset(seed=[7, 8, 7, 8])
        assert obs.instruction[0] == "push the cube to the red and white target"
        assert obs.instruction[2] == "pull the cube back to the red and white target"
        # a partial reset of one task's environment leaves the other task's rows alone
        again = env.reset(seed=[9], env_ids=torch.tensor([3]))
        torch.testing.assert_close(again.images["base_camera"][:3], obs.images["base_camera"][:3])
        step = env.step(torch.zeros(4, env.spec.action.dim))
        assert step.reward.shape == (4,) and step.obs.instruction == obs.instruction


def test_partial_reset_before_any_reset_is_an_error():
    import pytest

    cfg = ManiSkillConfig(**{**CFG.__dict__, "obs_mode": "state"})
    with make_env(cfg) as env, pytest.raises(RuntimeError, match="reset all environments once"):
        env.reset(seed=[1], env_ids=torch.tensor([0]))


def test_uneven_split_is_a_config_error():
    import pytest

    with pytest.raises(ValueError, match="split evenly"):
        ManiSkillConfig(tasks=["PushCube-v1", "PullCube-v1"], num_envs=3).validate()


def test_reset_seeds_golden():
    import pytest

    from embodied.schema import reset_seeds

    assert reset_seeds(10, [0, 3]) == [10, 13] and reset_seeds([7, 8], [2, 5]) == [7, 8]
    assert reset_seeds(None, [1, 2]) == [None, None]
    with pytest.raises(ValueError, match="1 seeds for 2 environments"):
        reset_seeds([1], [0, 1])
