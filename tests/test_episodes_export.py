"""``embodied episodes`` on the records of a MuJoCo reach run (embodied/episodes.py,
episode_dataset.py): a dataset holds what the recorded policy read and what its episodes were
(reset seed, world, success at the end), the choice of episodes is over every record, and a task
is chosen by its name."""

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from tiny_runs import TINY_REACH

from embodied.cli import main
from embodied.dataset import DemoDataset
from embodied.episodes import episodes_of
from embodied.models import ActorCriticConfig
from embodied.recording import read_rounds
from embodied.resimulate import simulator_for
from embodied.schema import EnvSpec
from embodied.sft_data import check_fits, load_frames

ROOT = Path(__file__).resolve().parents[1]
REACH = str(ROOT / "configs" / "mujoco" / "reach_ppo.yaml")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """3 iterations of PPO on reach from state and the goal (the shipped config's actor-critic,
    ``privileged_keys`` null: all of them), each recorded: rounds of 8 steps, episodes of 4,
    so each of the 4 rows ends two episodes a round, the second after an automatic reset;
    servo gains randomised per world."""
    root = tmp_path_factory.mktemp("episodes_export")
    argv = ["train", REACH, *TINY_REACH, f"runner.output_dir={root}", "runner.name=reach"]
    argv += ["env.max_episode_steps=4", "runner.total_env_steps=96", "runner.record_rollouts=1"]
    argv += ["env.randomize.servo_gain=0.3"]  # (a world of its own for every episode)
    assert main([*argv, "runner.report=false", "policy.hidden_sizes=[16]"]) == 0
    return root / "reach"


def test_a_dataset_holds_the_privileged_keys_the_policy_read(run, tmp_path):
    """The actor-critic with ``privileged_keys`` null reads every one: the dataset has them, as
    recorded, and fits that policy for ``embodied sft`` (it lacked them, and did not)."""
    ds = tmp_path / "ds"
    assert main(["episodes", str(run), "--iteration", "1", "--to-dataset", str(ds)]) == 0
    record = read_rounds(run, 1)
    spec = EnvSpec.from_dict(record.meta["spec"])
    read = ActorCriticConfig(use_privileged=True).read_privileged(spec)
    assert sorted(read) == sorted(spec.obs.privileged) and len(read) >= 2
    check_fits(load_frames([str(ds)]), spec, read, cameras=())
    data = DemoDataset.load(ds)
    first = episodes_of(record)[0]  # (row 0's first episode: the dataset's first)
    steps = first.steps(record)
    for key in read:
        recorded = record.rounds[0].obs.privileged[key][steps, first.row]
        torch.testing.assert_close(
            data.privileged[key][: len(steps)], recorded.reshape(len(steps), -1)
        )


def test_a_task_is_chosen_by_its_name_and_an_unknown_one_is_one_line(run, tmp_path, capsys):
    """A single-task run's task is its own (``reach``, which chose nothing before), not ``all``;
    a name the run does not have lists those it has."""
    argv = ["episodes", str(run), "--iteration", "1", "--out", str(tmp_path)]
    capsys.readouterr()
    assert main([*argv, "--task", "push"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "embodied: error: --task push: not a task of this run; its tasks: reach"
    assert main([*argv, "--task", "reach", "--best", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "iteration 1: 8 episodes end in the record, 1 chosen"
    assert "(reach): return" in out[1] and out[1].endswith("_reach.png")


def test_a_dataset_keeps_each_episodes_seed_world_and_success_at_end(run, tmp_path):
    """As ``embodied demos`` datasets do: the reset seed (none for an episode that began after
    an automatic reset), the world's randomised parameters (those the seed draws, and a draw of
    its own for the next episode) and success at the end."""
    ds = tmp_path / "ds"
    argv = ["episodes", str(run), "--iteration", "2", "--resimulate", "--to-dataset", str(ds)]
    assert main(argv) == 0
    table = pq.read_table(ds / "meta" / "episodes" / "chunk-000" / "file-000.parquet")
    record = read_rounds(run, 2)
    found = episodes_of(record)  # round 0: row 0's two episodes, then row 1's, ...
    assert [(e.row, e.chunks[0]) for e in found] == [(r, c) for r in range(4) for c in (0, 4)]
    assert table.column("success_at_end").to_pylist() == [e.success_at_end for e in found]
    seeds = table.column("seed").to_pylist()
    assert table.column("seed").type == pa.int64() and seeds[1::2] == [None] * 4
    worlds = table.column("world").to_pylist()
    with simulator_for(record) as env:  # the seeds draw the worlds the first episodes ran in
        env.reset(seed=seeds[0::2])
        drawn = env.world_params.to_dict()
    assert worlds[0::2] == [{k: v[row] for k, v in drawn.items()} for row in range(4)]
    assert len({tuple(w["gain_scale"]) for w in worlds}) == 8  # (each episode its own)


def test_the_best_and_worst_are_chosen_over_every_record(run, tmp_path, capsys):
    """Without ``--iteration``, ``--best 1`` is the one episode of highest return among the 24
    of the 3 records (it was one per record), and ``--worst 2`` the two lowest."""
    every = [e for i in (1, 2, 3) for e in episodes_of(read_rounds(run, i))]
    assert len(every) == 24 and len({e.ret for e in every}) > 3
    by_return = sorted(every, key=lambda e: e.ret)
    capsys.readouterr()
    assert main(["episodes", str(run), "--best", "1", "--out", str(tmp_path / "best")]) == 0
    out = capsys.readouterr().out.splitlines()
    counts = [int(line.split(", ")[1].split()[0]) for line in out[:3]]
    assert [line.split(":")[0] for line in out[:3]] == ["iteration 1", "iteration 2", "iteration 3"]
    assert sum(counts) == 1  # (one of the three records gave it)
    assert len(out) == 4 and f"return {by_return[-1].ret:.3f}," in out[3]
    assert len(list((tmp_path / "best").glob("*.png"))) == 1
    ds = tmp_path / "ds"
    assert main(["episodes", str(run), "--worst", "2", "--to-dataset", str(ds)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"wrote 2 episodes to {ds}"
    table = pq.read_table(ds / "meta" / "episodes" / "chunk-000" / "file-000.parquet")
    assert sorted(table.column("return").to_pylist()) == [e.ret for e in by_return[:2]]
