"""MultiTaskEnv: two ManiSkill tasks behind one VecEnv pass the contract; each environment carries
its own task's instruction; actions and resets reach the right task."""

from dataclasses import replace

import pytest
import torch
from scripted_envs import PushRightEnv, ScriptedEnv

from embodied.contract import check_env
from embodied.multitask import MultiTaskEnv, make_env
from embodied.schema import UserError
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


@pytest.mark.slow  # (41 s: two ManiSkill tasks' contract; CI runs the slow set)
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
        # one environment of each task steps alone (a pipeline stage); the others stay as they were
        assert env.can_step_subsets
        rows = torch.tensor([1, 2])
        env.step_async(torch.zeros(2, env.spec.action.dim), rows)
        part = env.step_wait(rows)
        assert part.reward.shape == (2,) and part.obs.instruction == obs.instruction[1:3]
        last = env.reset(seed=[5], env_ids=torch.tensor([0]))
        camera = "base_camera"
        torch.testing.assert_close(last.images[camera][1:3], part.obs.images[camera])
        torch.testing.assert_close(last.images[camera][3], step.obs.images[camera][3])


def test_partial_reset_before_any_reset_is_an_error():
    import pytest

    # (MultiTaskEnv's own check: the tasks' simulators run in this process)
    cfg = ManiSkillConfig(**{**CFG.__dict__, "obs_mode": "state", "num_workers": 0})
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
    import numpy as np

    seeds = reset_seeds(np.int64(10), [0, 3])  # any integer (a TypeError for numpy's before)
    assert seeds == [10, 13] and all(type(s) is int for s in seeds)
    with pytest.raises(ValueError, match="1 seeds for 2 environments"):
        reset_seeds([1], [0, 1])


class RecordsSeeds(PushRightEnv):
    """PushRightEnv that keeps the seed argument of each reset."""

    def __init__(self, num_envs: int):
        super().__init__(num_envs)
        self.seeds = []

    def reset(self, *, seed=None, env_ids=None):
        self.seeds.append(seed)
        return super().reset(seed=seed, env_ids=env_ids)


def test_an_int_seed_reaches_each_task_as_an_int_from_its_first_row():
    """An int seeds a batch in one call (ManiSkill's GPU backend: one reset of every world, not
    one per seed); a task took it as a list of per-row ints. A list stays a list."""
    tasks = [RecordsSeeds(2), RecordsSeeds(3)]
    env = MultiTaskEnv(tasks, ["a", "b"])
    together = env.reset(seed=7)
    assert [t.seeds for t in tasks] == [[7], [9]]
    env.reset(seed=[1, 2, 3, 4, 5])
    assert [t.seeds[-1] for t in tasks] == [[1, 2], [3, 4, 5]]
    alone = [RecordsSeeds(2).reset(seed=7), RecordsSeeds(3).reset(seed=9)]
    assert torch.equal(together.images["cam"], torch.cat([o.images["cam"] for o in alone]))


def test_a_subset_of_rows_steps_in_its_own_tasks_and_the_other_rows_stay():
    """Rows of both tasks step alone (a cluster env worker's pipeline stage): each task's
    environments get their own rows' actions, the answer has those rows in order, an episode
    that ends among them is named by its position there, and a later partial reset of one task
    reports the other task's rows as their last steps left them."""
    from scripted_envs import ScriptedEnv

    push = ScriptedEnv([2, 0, 3], max_episode_steps=5, instruction="push", can_step_subsets=True)
    pull = ScriptedEnv([0, 3], max_episode_steps=5, instruction="pull", can_step_subsets=True)
    env = MultiTaskEnv([push, pull], ["push", "pull"])
    assert env.can_step_subsets
    env.reset(seed=0)  # state of each row: [steps, its index in its task, its seed]

    def step(rows: list[int]):
        ids = torch.tensor(rows)
        env.step_async(10.0 * ids[:, None] + 1, ids)  # f32 [n, 1]: each row's own action
        return env.step_wait(ids)

    first = step([0, 2, 4])
    assert first.obs.state.tolist() == [[1, 0, 0], [1, 2, 2], [1, 1, 4]]
    assert first.obs.instruction == ["push", "push", "pull"] and first.ended is None
    second = step([0, 4])  # row 0 terminates on its second step and starts again
    assert second.terminated.tolist() == [True, False] and second.ended.tolist() == [0]
    assert second.final_obs.state[0].tolist() == [2, 0, 0]  # (final_obs: a row for every row)
    assert second.obs.state.tolist() == [[0, 0, 0], [2, 1, 4]]
    third = step([2, 4])  # row 4, the second of these and the pull task's, on its third
    assert third.terminated.tolist() == [False, True] and third.ended.tolist() == [1]
    assert third.final_obs.state[1].tolist() == [3, 1, 4]
    step([4])
    after = env.reset(seed=10, env_ids=torch.tensor([1]))
    assert after.state.tolist() == [[0, 0, 0], [0, 1, 11], [2, 2, 2], [0, 0, 3], [1, 1, 4]]
    assert after.instruction == ["push"] * 3 + ["pull"] * 2
    # each task's environments (local indices) got their own rows' actions
    sent = [[(ids.tolist(), a.tolist()) for ids, a in e.actions_log] for e in (push, pull)]
    assert sent[0] == [([0, 2], [1.0, 21.0]), ([0], [1.0]), ([2], [21.0])]
    assert sent[1] == [([1], [41.0])] * 4


def test_tasks_that_step_only_all_together_step_each_with_its_own_actions():
    """(ManiSkill's GPU backend steps every environment of a task at once.)"""
    from scripted_envs import PushRightEnv

    env = MultiTaskEnv([PushRightEnv(2, threshold=0.5), PushRightEnv(1, threshold=2.0)], ["a", "b"])
    assert not env.can_step_subsets
    env.reset(seed=0)
    out = env.step(torch.tensor([[1.0, 0.0], [0.0, 0.0], [1.0, 0.0]]))
    assert out.success.tolist() == [True, False, False]  # row 2 is task b's: 1 < its threshold


def test_tasks_that_cannot_step_side_by_side_are_a_user_error_naming_them():
    short = ScriptedEnv([2], max_episode_steps=5)
    long = ScriptedEnv([2], max_episode_steps=7)
    with pytest.raises(UserError, match="env.tasks: a and b end episodes at 5 and 7 steps"):
        MultiTaskEnv([short, long], ["a", "b"])
    with pytest.raises(UserError, match="env.tasks: a and c observe different cameras"):
        MultiTaskEnv([short, PushRightEnv(1)], ["a", "c"])
    # the joined spec says the first task's rate: deploy's, a dataset's fps (it was accepted)
    faster = ScriptedEnv([2], max_episode_steps=5)
    faster.spec = replace(faster.spec, action=replace(faster.spec.action, control_hz=50.0))
    with pytest.raises(
        UserError, match="env.tasks: a and d differ in action control_hz: 20.0 and 50"
    ):
        MultiTaskEnv([short, faster], ["a", "d"])
