"""PPO's rounds against the episode: every round starts from a seeded reset, so rounds shorter
than an episode train on episodes' starts only, and the run says so once (pick's reward for
lifting lies past step 16: rounds of 16 never lifted the cube; docs/benchmarks.md)."""

import pytest

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
