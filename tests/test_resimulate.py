"""Recorded rounds simulated again (embodied/resimulate.py): the rewards and the observations at
chunk starts come back as recorded, a changed action is named where it diverges, and a chunked
policy's episodes become a dataset with a frame per step that LeRobot reads and SFT trains on."""

import json
import math

import numpy as np
import pytest
import scripted_envs
import torch
from scripted_envs import GRPO, TINY_VLA, PushRightEnv, run_on

from embodied.cli import main
from embodied.episodes import choose, episodes_of, with_seeds
from embodied.recording import read_record
from embodied.resimulate import by_step, resimulate, round_seeds, simulator_for


@pytest.fixture
def recorded(tmp_path):
    """One GRPO iteration of a policy acting in chunks of 2 on the test task, recorded."""
    torch.manual_seed(0)
    policy = {**TINY_VLA, "chunk_size": 2}
    run_dir = tmp_path / "run"
    run_on(
        PushRightEnv(8),
        run_dir,
        total_env_steps=32,
        record_rollouts=1,
        policy=policy,
        algorithm=GRPO,
    )
    return read_record(run_dir, 1)


def test_steps_of_chunks_are_in_chunk_then_action_order():
    chunks = torch.arange(2 * 3 * 2).reshape(2, 3, 2)  # [T=2, B=3, K=2]: t * 6 + b * 2 + k
    steps = by_step(chunks)  # [4, 3]
    assert steps[:, 1].tolist() == [2, 3, 8, 9]  # env 1: chunk 0 actions 0, 1, chunk 1 ...


def test_a_recorded_round_resimulates_to_its_rewards_and_chunk_start_observations(recorded):
    batch = recorded.rounds[0]
    T, B, K = batch.rewards.shape
    assert K == 2
    again = resimulate(recorded, 0, PushRightEnv(8))
    assert again.divergences == []
    assert again.summary() == (
        "round 0: re-simulated rewards and observations equal the recorded ones"
    )
    assert torch.equal(again.rewards, by_step(batch.rewards))
    assert torch.equal(again.success, by_step(batch.success))
    # what the record keeps, before each chunk, is the re-simulation's before each step t * K
    assert torch.equal(again.obs.images["cam"][::K], batch.obs.images["cam"])
    assert torch.equal(again.obs.state[::K], batch.obs.state)
    assert again.obs.state[1, :, 0].tolist() == [1.0] * B  # mid-chunk: one step into the episode


def test_a_chunk_start_that_differs_is_named_though_the_rewards_agree(recorded):
    """The record says chunk 1 began elsewhere: every row diverges at its first step, named by
    the state's component (a sparse reward, agreeing until success, hid it)."""
    K = recorded.rounds[0].rewards.shape[2]
    recorded.rounds[0].obs.state[1, :, 0] += 5.0
    again = resimulate(recorded, 0, PushRightEnv(8))
    assert [(d.row, d.step, d.what) for d in again.divergences] == [
        (row, K, "state[0]") for row in range(8)
    ]
    assert all(d.recorded == d.resimulated + 5.0 for d in again.divergences)
    assert "row 0 from step 2 (state[0] recorded " in again.summary()
    assert again.agrees(0, K - 1) and not again.agrees(0, K)


def test_a_changed_action_is_named_where_the_rewards_diverge(recorded):
    batch = recorded.rounds[0]
    K = batch.rewards.shape[2]
    succeeded = (batch.rewards == 1).nonzero()
    assert len(succeeded), "the recorded round has no rewarded action to change"
    t, row, k = succeeded[0].tolist()
    batch.actions[t, row, k, 0] = -1.0  # x below the threshold: no reward
    step = t * K + k
    again = resimulate(recorded, 0, PushRightEnv(8))
    found = [(d.row, d.step, d.recorded, d.resimulated) for d in again.divergences]
    assert found == [(row, step, 1.0, 0.0)]
    assert again.summary() == (
        f"round 0: the re-simulation diverges at row {row} from step {step} (reward recorded 1, "
        "re-simulated 0)"
    )
    assert again.agrees(row, step - 1) and not again.agrees(row, step)
    assert again.agrees((row + 1) % 8, 10**6)


def test_episode_steps_skip_the_actions_run_after_it_ended(recorded):
    batch = recorded.rounds[0]
    episodes = [e for e in episodes_of(recorded) if e.round_index == 0 and e.row == 0]
    first = episodes[0]
    # 3 steps in chunks of 2: chunk 0's two actions and chunk 1's first
    assert first.chunks == [0, 1] and first.steps(recorded) == [0, 1, 2] and first.length == 3
    assert batch.valid[1, 0].tolist() == [True, False]


def test_an_episode_is_chosen_by_its_reset_seed(recorded):
    """GRPO's plan: group g of round r of iteration 1 gets seed r * 8 + g (run seed 0, 8
    environments, groups of 4); the first episode of each row carries its group's seed, the one
    after an automatic reset none."""
    found = with_seeds(recorded, episodes_of(recorded))
    firsts = [e for e in found if e.chunks[0] == 0]
    assert [e.seed for e in firsts] == round_seeds(recorded, 0)
    assert all(e.seed is None for e in found if e.chunks[0] != 0)
    assert round_seeds(recorded, 0) == [0, 0, 0, 0, 1, 1, 1, 1]
    chosen = choose(found, seed=1)
    assert [e.row for e in chosen] == [4, 5, 6, 7]


def test_an_int_seed_on_maniskills_gpu_backend_gives_its_episodes_no_seed(monkeypatch):
    """PPO plans one int a round; ManiSkill's GPU backend derives each row's seed from it
    (design note 36), so no row's episode is labelled ``seed + row``, which it did not start
    from. Elsewhere row b started from ``seed + b``."""
    from types import SimpleNamespace

    from embodied import resimulate as resimulate_module
    from embodied.episodes import Episode

    monkeypatch.setattr(resimulate_module, "round_seeds", lambda record, r: 100)

    def seeds(env: dict) -> list:
        record = SimpleNamespace(meta={"config": {"env": env}})
        episodes = [
            Episode(r, row, [0], row, "0", True, 0.0, False, False, 1)
            for r in (0, 1)
            for row in (0, 2)
        ]
        return [e.seed for e in with_seeds(record, episodes)]

    assert seeds({"simulator": "maniskill", "backend": "gpu"}) == [None] * 4
    assert seeds({"simulator": "maniskill", "backend": "cpu"}) == [100, 102] * 2
    assert seeds({"simulator": "mujoco", "backend": "warp"}) == [100, 102] * 2


def test_a_chunked_policys_episodes_become_a_dataset_through_resimulation(tmp_path, capsys):
    """MuJoCo's pick task from cameras, a policy acting in chunks of 2, every iteration
    recorded: ``--to-dataset`` (no ``--iteration``: every record) re-simulates the rounds, keeps
    a frame per step, LeRobot reads it and ``embodied sft`` trains on it."""
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    env = {"simulator": "mujoco", "task": "pick", "obs_mode": "rgb", "image_size": 32}
    env.update(num_envs=2, max_episode_steps=4)
    policy = {**scripted_envs.TINY_VLA, "value_head": True, "chunk_size": 2}
    runner = {"name": "rl", "output_dir": str(tmp_path), "progress": False, "video": False}
    runner.update(total_env_steps=32, record_rollouts=1, eval_every=0, final_eval_episodes=1)
    algorithm = {**scripted_envs.PPO, "num_steps": 4}
    body = {"env": env, "policy": policy, "algorithm": algorithm, "runner": runner}
    (tmp_path / "rl.yaml").write_text(json.dumps(body))
    assert main(["train", str(tmp_path / "rl.yaml")]) == 0
    capsys.readouterr()
    dataset = tmp_path / "rl_episodes"
    assert main(["episodes", str(tmp_path / "rl"), "--to-dataset", str(dataset)]) == 0
    out = capsys.readouterr().out
    assert out.count("re-simulated rewards and observations equal the recorded ones") == 2
    assert "left out" not in out
    written = int(out.split("wrote ")[1].split()[0])
    records = [read_record(tmp_path / "rl", i) for i in (1, 2)]
    chosen = [(r, e) for r in records for e in choose(episodes_of(r))]
    # episodes of 4 steps, rounds of 8 steps (4 chunks of 2) on 2 environments: 4 per record, and
    # the second of each row begins after an automatic reset the re-simulation repeats
    assert written == len(chosen) == 8
    ds = LeRobotDataset("rl_episodes", root=dataset)
    assert ds.num_episodes == written
    assert ds.num_frames == sum(e.length for _, e in chosen)
    record, episode = chosen[0]
    batch = record.rounds[episode.round_index]
    camera = sorted(batch.obs.images)[0]
    frames = [ds[i][f"observation.images.{camera}"] for i in range(episode.length)]
    got = np.stack([(f.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8) for f in frames])
    # at the episode's chunk starts: the recorded frames
    recorded = batch.obs.images[camera][episode.chunks, episode.row].numpy()  # uint8 [c, H, W, 3]
    assert np.array_equal(got[::2], recorded)
    # at every step: another re-simulation's, and the state moves between chunk starts too
    simulator = simulator_for(record)
    try:
        again = resimulate(record, episode.round_index, simulator)
    finally:
        simulator.close()
    steps = episode.steps(record)
    assert np.array_equal(got, again.obs.images[camera][steps, episode.row].numpy())
    states = np.stack([ds[i]["observation.state"].numpy() for i in range(episode.length)])
    assert np.array_equal(states, again.obs.state[steps, episode.row].numpy())
    assert not np.array_equal(states[0], states[1])
    # a second export into the same directory, or one an interrupted export left, is refused
    assert main(["episodes", str(tmp_path / "rl"), "--to-dataset", str(dataset)]) == 2
    (tmp_path / "left").mkdir()
    (tmp_path / "left" / "data").write_text("")
    assert main(["episodes", str(tmp_path / "rl"), "--to-dataset", str(tmp_path / "left")]) == 2
    assert (
        capsys.readouterr()
        .err.splitlines()[-1]
        .endswith(
            "left is not empty (what an interrupted recording left?); "
            "choose another output directory"
        )
    )
    sft = tmp_path / "sft.yaml"
    runner = {"name": "sft", "output_dir": str(tmp_path), "eval_episodes": 1, "progress": False}
    body = {"datasets": [str(dataset)], "env": env, "policy": policy, "steps": 1}
    sft.write_text(json.dumps({**body, "batch_size": 4, "warmup_steps": 1, "runner": runner}))
    assert main(["sft", str(sft)]) == 0


def test_a_nan_against_a_number_differs_and_a_nan_against_a_nan_does_not():
    """``>`` is False for a NaN: a re-simulation that blew up agreed with its record, and its
    NaN frames went into a dataset."""
    from embodied.resimulate import _divergences

    recorded = torch.tensor([[1.0, float("nan"), 2.0]])  # [S=1, B=3]
    again = torch.tensor([[float("nan"), float("nan"), 2.0]])
    found = _divergences(recorded, again, 0.0)
    assert [(d.row, d.step, d.recorded) for d in found] == [(0, 0, 1.0)]
    assert math.isnan(found[0].resimulated)
