"""PPO's rounds against the episode: every round starts from a seeded reset, so rounds shorter
than an episode train on episodes' starts only, and the run says so once (pick's reward for
lifting lies past step 16: rounds of 16 never lifted the cube; docs/benchmarks.md)."""

import pytest
from scripted_envs import PPO, TINY_VLA, PushRightEnv, metric_rows, run_on

from embodied.config import load_config
from embodied.simulators.mujoco import MuJoCoConfig, make_env
from embodied.train_config import TrainConfig


@pytest.mark.parametrize(
    "num_steps, chunk, noted",
    [(16, 1, True), (79, 1, True), (80, 1, False), (100, 1, False), (15, 5, True), (16, 5, False)],
)
def test_ppo_notes_rounds_shorter_than_an_episode(num_steps, chunk, noted):
    overrides = [f"algorithm.num_steps={num_steps}", f"policy.chunk_size={chunk}"]
    cfg, _ = load_config(TrainConfig, "configs/mujoco/push_ppo.yaml", overrides)
    with make_env(MuJoCoConfig(task="push", num_envs=2)) as env:
        assert env.spec.max_episode_steps == 80
        algorithm = cfg.algorithm.build(cfg, env.spec, task_of_env=[0, 0])
    steps = num_steps * chunk  # (a chunk is K actions, each an env step)
    expected = [
        f"PPO: a round is {steps} env steps and an episode up to 80; every round starts from "
        f"a seeded reset, so training sees only each episode's first {steps} steps (if the "
        "task's reward comes later, raise algorithm.num_steps)"
    ]
    assert algorithm.notes() == (expected if noted else [])


def test_a_run_of_rounds_shorter_than_its_episodes_prints_the_note_once(tmp_path, capsys):
    """Once in a run of several iterations: not per iteration, nor per copy of the algorithm
    (the runner's plans rounds, the learner's computes advantages)."""
    ppo = {**PPO, "num_steps": 2}  # rounds of 2 steps; the push env's episodes take 3
    policy = {**TINY_VLA, "value_head": True}
    run = tmp_path / "run"
    run_on(PushRightEnv(8), run, total_env_steps=3 * 8 * 2, algorithm=ppo, policy=policy)
    assert metric_rows(run, "iteration")[-1] == 3
    note = (
        "PPO: a round is 2 env steps and an episode up to 3; every round starts from a seeded "
        "reset, so training sees only each episode's first 2 steps (if the task's reward comes "
        "later, raise algorithm.num_steps)"
    )
    assert capsys.readouterr().out.count(note) == 1
