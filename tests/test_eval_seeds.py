"""Which seeds reset which rows: training below 2e9, selection evaluations (periodic, before RL)
from 2e9 + seed, held-out ones (final, ``embodied eval``, bench, the twin) from 3e9 + seed."""

import types

import pytest
import torch
from one_line import one_line_error, run_cli
from scripted_envs import GRPO, PPO, TINY_VLA, PushRightEnv, run_on
from tiny_runs import TINY_REACH

from embodied.cli import main
from embodied.evaluations import Evaluations
from embodied.grpo import GRPO as GRPOAlgorithm
from embodied.grpo import GRPOConfig
from embodied.ppo import PPO as PPOAlgorithm
from embodied.ppo import PPOConfig
from embodied.schema import UserError, reset_seeds
from embodied.seeds import (
    EVAL_SEED_OFFSET,
    HELD_OUT_SEED_OFFSET,
    MAX_SEED,
    check_seed,
    check_training_seeds,
    eval_seed,
    largest_training_seed,
)

SELECTION = 2_000_000_000
HELD_OUT = 3_000_000_000


def test_each_kind_of_evaluation_starts_from_its_own_seed():
    assert eval_seed(0, held_out=False) == SELECTION
    assert eval_seed(7, held_out=False) == SELECTION + 7
    assert eval_seed(7, held_out=True) == HELD_OUT + 7
    # LIBERO's initial state is the seed % 50: episode i of seed 0 stays initial state i
    assert EVAL_SEED_OFFSET % 50 == HELD_OUT_SEED_OFFSET % 50 == 0
    # ManiSkill seeds numpy's RandomState: below 2**32 at the largest seed, a billion episodes on
    assert eval_seed(MAX_SEED - 1, held_out=True) + 10**9 < 2**32


@pytest.mark.parametrize("seed", [-1, MAX_SEED, 1.0, True])
def test_a_seed_out_of_range_is_refused(seed):
    with pytest.raises(UserError, match=r"^seed: must be an integer in \[0, 100_000_000\)"):
        check_seed("seed", seed)


@pytest.mark.parametrize(
    "argv, culprit",
    [
        (["eval", "nowhere", "--seed", "-1"], "--seed: must be an integer in [0, 100_000_000)"),
        (["train", "configs/mujoco/reach_ppo.yaml", "seed=-1"], "seed: must be an integer"),
        (["bench", "configs/bench/smoke.yaml", "seed=100000000"], "got 100000000"),
        (["sft", "configs/maniskill/multitask_vla_sft.yaml", "seed=-2"], "seed: must be"),
        (["deploy", "nowhere", "--robot", "so101-sim", "--seed", "-1"], "--seed: must be"),
    ],
)
def test_a_seed_out_of_range_is_one_line_naming_it(argv, culprit, capsys):
    rc, err = run_cli(argv, capsys)
    one_line_error(rc, err, culprit)


class SeedLog(PushRightEnv):
    """The test task, noting the seed of each row at each reset of every row."""

    def __init__(self, num_envs: int):
        super().__init__(num_envs)
        self.resets: list[list[int]] = []

    def reset(self, *, seed=None, env_ids=None):
        if env_ids is None:
            self.resets.append(reset_seeds(seed, range(self.num_envs)))
        return super().reset(seed=seed, env_ids=env_ids)


def rows(first: int, n: int = 8) -> list[int]:
    return list(range(first, first + n))


def test_ppo_trains_below_2e9_and_evaluates_periodically_and_finally_on_seeds_apart(tmp_path):
    """PPO, 8 environments, rounds of 48 env steps, a budget of two: iteration i resets row b
    with i*8 + b; iteration 1's evaluation (16 episodes: two rounds) row b with 2e9 + b, then
    2e9 + 8 + b; the final one with 3e9 + b, then 3e9 + 8 + b."""
    torch.manual_seed(0)
    env = SeedLog(8)
    policy = {**TINY_VLA, "value_head": True}
    run_on(env, tmp_path / "run", total_env_steps=96, policy=policy, algorithm=PPO, eval_every=1)
    assert env.resets == [
        rows(8),  # iteration 1
        rows(SELECTION),  # its evaluation, episodes 0-7 then 8-15
        rows(SELECTION + 8),
        rows(16),  # iteration 2 (the last)
        rows(HELD_OUT),  # the final evaluation
        rows(HELD_OUT + 8),
    ]
    ppo = PPOAlgorithm(
        PPOConfig(**{k: v for k, v in PPO.items() if k != "name"}), seed=0, num_envs=8
    )
    assert largest_training_seed(ppo, round_steps=48, total_env_steps=96) == 23


def test_grpo_evaluates_before_rl_on_the_selection_seeds(tmp_path):
    """GRPO (groups of 4 of 8 environments) evaluates before RL on the selection seeds, trains one
    iteration (round r resets group g's rows with r*2 + g) and ends on the held-out seeds."""
    torch.manual_seed(0)
    env = SeedLog(8)
    run_on(env, tmp_path / "run", total_env_steps=24)  # one round's steps: one iteration
    before = [rows(SELECTION), rows(SELECTION + 8)]
    final = [rows(HELD_OUT), rows(HELD_OUT + 8)]
    assert env.resets[:2] == before and env.resets[-2:] == final
    training = env.resets[2:-2]
    assert 1 <= len(training) <= 3
    for r, seeds in enumerate(training):
        assert seeds == [r * 2] * 4 + [r * 2 + 1] * 4
    cfg = GRPOConfig(**{k: v for k, v in GRPO.items() if k != "name"})
    grpo = GRPOAlgorithm(
        cfg, seed=0, task_of_env=torch.zeros(8, dtype=torch.long), chunk_size=1, max_episode_steps=3
    )
    # one iteration at most, its third round (round 2 of the run) at most: 2*2 + group 1
    assert largest_training_seed(grpo, round_steps=24, total_env_steps=24) == 5
    # two iterations: the second's third round is round 5 of the run
    assert largest_training_seed(grpo, round_steps=24, total_env_steps=25) == 5 * 2 + 1


def test_an_evaluation_beside_training_is_a_selection_one():
    """The evaluation workers get the selection seed; ``split_episodes`` shares it from there."""
    calls = []
    roles = types.SimpleNamespace(start_evaluation=lambda **call: calls.append(call))
    cfg = types.SimpleNamespace(seed=5, runner=types.SimpleNamespace(eval_episodes=16))
    points = types.SimpleNamespace(run_dir=None)
    evaluations = Evaluations(cfg, roles, None, points, None, None, None)
    evaluations.start({"iteration": 1})
    assert calls == [{"episodes": 16, "seed": SELECTION + 5, "weights": None}]


def test_training_seeds_at_the_evaluation_seeds_are_refused(tmp_path, capsys):
    check_training_seeds(SELECTION - 1)
    with pytest.raises(UserError, match="seed: training's reset seeds would reach"):
        check_training_seeds(SELECTION)
    # 4 environments, rounds of 32 env steps: iteration i resets up to seed + 4i + 3
    out = tmp_path / "runs"
    argv = ["train", "configs/mujoco/reach_ppo.yaml", *TINY_REACH, f"runner.output_dir={out}"]
    budget = 32 * (SELECTION - 3 - 99_999_997) // 4  # the last iteration reaches 2e9 exactly
    rc, err = run_cli([*argv, "seed=99999997", f"runner.total_env_steps={budget}"], capsys)
    one_line_error(rc, err, "seed: training's reset seeds would reach 2_000_000_000")
    assert not out.exists()


def test_eval_of_the_best_checkpoint_shares_no_seed_with_the_evaluations_that_chose_it(
    tmp_path, monkeypatch, capsys
):
    """A MuJoCo run of two iterations evaluated after the first (its best); ``embodied eval``
    of RUN/best resets its rows on the held-out seeds, the final evaluation's."""
    import embodied.multitask
    import embodied.runner

    resets = []
    make_env = embodied.multitask.make_env

    def logging_env(cfg):
        env = make_env(cfg)
        reset = env.reset

        def logged(*, seed=None, env_ids=None):
            if env_ids is None and seed is not None:
                resets.append(reset_seeds(seed, range(env.num_envs)))
            return reset(seed=seed, env_ids=env_ids)

        env.reset = logged
        return env

    monkeypatch.setattr(embodied.runner, "make_env", logging_env)
    monkeypatch.setattr(embodied.multitask, "make_env", logging_env)
    run = ["train", "configs/mujoco/reach_ppo.yaml", *TINY_REACH, f"runner.output_dir={tmp_path}"]
    assert main([*run, "runner.name=run", "runner.total_env_steps=64", "runner.eval_every=1"]) == 0
    selection = [rows(SELECTION, 4)]  # 2 episodes on 4 environments: one round
    held_out = [rows(HELD_OUT, 4)]
    assert resets == [rows(4, 4), *selection, rows(8, 4), *held_out]
    resets.clear()
    assert main(["eval", str(tmp_path / "run" / "best"), "--episodes", "2"]) == 0
    assert resets == held_out
    resets.clear()
    assert main(["eval", str(tmp_path / "run" / "best"), "--episodes", "6", "--seed", "3"]) == 0
    assert resets == [rows(HELD_OUT + 3, 4), rows(HELD_OUT + 7, 4)]
    capsys.readouterr()


def test_a_start_that_scored_above_the_best_checkpoint_is_said_at_the_end():
    """GRPO from an SFT policy at 0.8 before RL whose best periodic evaluation reached 0.2:
    RUN/best names the 0.2 checkpoint (the start has none), and the summary says so."""
    from embodied.evaluations import start_beats_best

    def results(rate: float) -> dict:
        return {"all": {"eval/success_rate": rate, "eval/episodes": 10}}

    best = {"iteration": 1, "success_rate": 0.2}
    line = start_beats_best(results(0.8), best)
    assert line is not None and line.startswith("the best checkpoint (iteration 1, success 0.200)")
    assert "(0.800 before RL" in line
    assert start_beats_best(results(0.2), best) is None  # (a tie: the checkpoint is as good)
    assert start_beats_best(None, best) is None and start_beats_best(results(0.8), None) is None
