"""Rollout records and the replay of an update (embodied/recording.py, embodied/replay.py): which
iterations are written, the records kept, a round's tensors back as they were, and a recorded
PPO and GRPO update run again offline bit for bit; a damaged record is one line naming its
file."""

import json
import math
import shutil

import pytest
import torch
from scripted_envs import GRPO, PPO, TINY_VLA, PushRightEnv, run_on

from embodied.cli import main
from embodied.episodes import choose, episodes_of
from embodied.record_files import prune_records
from embodied.recording import (
    Pending,
    RecordPolicy,
    RunRecords,
    batch_from,
    batch_tensors,
    logged_grad_norms,
    read_record,
    read_rounds,
    record_dir,
)
from embodied.replay import differences, replay

MLP = {"name": "actor_critic", "hidden_sizes": [16], "use_images": False}


# torch on one thread, as a run and its replay set it (runner.torch_threads): the runs recorded
# here sum as those replaying them do
pytestmark = pytest.mark.usefixtures("one_thread")


def test_every_nth_iteration_and_any_non_finite_or_spiking_update_is_recorded():
    policy = RecordPolicy(every=3, spike_factor=10.0)
    norms = [1.0, 2.0, 1.5, 30.0, 2.0, 1.0]
    reasons = [policy.reason(i + 1, {"policy/grad_norm": n}) for i, n in enumerate(norms)]
    # iteration 4: 30 > 10 x median(1, 2, 1.5) = 15; 3 and 6 are every third
    assert reasons == [None, None, "every", "spike", None, "every"]
    assert policy.grad_norms == norms  # (the spike enters the window too)
    assert policy.reason(7, {"policy/loss": math.nan, "policy/grad_norm": 1.0}) == "non-finite"
    assert policy.reason(8, {"policy/grad_norm": 1.0}) is None  # (a streak ends: below)
    assert policy.reason(9, {"policy/loss": 0.5, "policy/grad_norm": math.inf}) == "non-finite"
    assert policy.grad_norms[-1] == 1.0  # a non-finite norm is not in the window
    # the window is the last 20 iterations; fewer than two: no spike yet
    fresh = RecordPolicy(every=0, spike_factor=10.0)
    assert fresh.reason(1, {"policy/grad_norm": 1e6}) is None
    for i in range(25):
        fresh.reason(i + 2, {"policy/grad_norm": 100.0 if i < 5 else 1.0})
    assert len(fresh.grad_norms) == 20 and fresh.reason(30, {"policy/grad_norm": 11.0}) == "spike"


def test_a_resumed_run_judges_spikes_against_the_gradient_norms_it_logged(tmp_path):
    """The window comes back from metrics.jsonl: the last 20 finite norms (evaluation rows,
    non-finite norms and a line cut by a crash left out)."""
    rows = [{"iteration": i, "policy/grad_norm": float(i)} for i in range(1, 26)]
    rows.insert(3, {"iteration": 3, "eval/success_rate": 0.5})
    rows.append({"iteration": 26, "policy/grad_norm": math.inf})
    lines = [json.dumps(row) for row in rows] + ['{"iteration": 27, "policy/gr']
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines))
    assert logged_grad_norms(tmp_path) == [float(i) for i in range(6, 26)]
    assert logged_grad_norms(tmp_path / "new") == []
    runner = type("Runner", (), {"record_rollouts": 0, "spike_factor": 10.0, "keep_rollouts": 5})
    records = RunRecords(runner, tmp_path, learner=None)
    # median of 6..25 is 15.5: 156 spikes at once, where a fresh window would need two norms
    assert records.policy.reason(28, {"policy/grad_norm": 156.0}) == "spike"


def test_only_the_newest_records_of_every_nth_iteration_are_pruned(tmp_path):
    for iteration, reason in [
        (2, "every"),
        (3, "spike"),
        (4, "every"),
        (6, "every"),
        (7, "non-finite"),
    ]:
        path = record_dir(tmp_path, iteration)
        path.mkdir(parents=True)
        (path / "record.json").write_text(json.dumps({"reason": reason}))
    assert prune_records(tmp_path, keep=1) == [2, 4]
    kept = sorted(p.name for p in (tmp_path / "rollouts").iterdir())
    assert kept == ["iter_000003", "iter_000006", "iter_000007"]


def test_a_round_comes_back_as_it_was_collected():
    from embodied.env_group import EnvGroup
    from embodied.episode_stats import EpisodeStats
    from embodied.inference import InferencePolicy
    from embodied.models import ActorCriticConfig, build_policy
    from embodied.ppo import PPO as PPOAlgorithm
    from embodied.ppo import PPOConfig
    from embodied.rollout import collect

    torch.manual_seed(0)
    envs = EnvGroup(PushRightEnv(4))
    policy = build_policy(envs.spec, ActorCriticConfig(hidden_sizes=[8], use_images=False))
    algorithm = PPOAlgorithm(PPOConfig(**PPO), seed=0, num_envs=4)
    plan = algorithm.plan(1, 0, episode_base=0)
    stats = EpisodeStats(envs.task_names, torch.device("cpu"))
    batch, _ = collect(envs, InferencePolicy(policy), envs.reset(seed=plan.seeds), plan, stats)
    tensors = batch_tensors(batch, "r0/")
    assert "r0/advantages" not in tensors and "r0/obs/images/cam" in tensors
    assert tensors["r0/actions"].shape == batch.actions.shape
    back = batch_from(tensors, "r0/", batch.instructions)
    assert batch_tensors(back, "r0/").keys() == tensors.keys()  # (a camera lost: none compared)
    for name, tensor in batch_tensors(back, "r0/").items():
        assert torch.equal(tensor, tensors[name]), name
    assert back.instructions == batch.instructions


@pytest.mark.parametrize("algorithm", ["ppo", "grpo"])
def test_a_recorded_update_replays_bit_for_bit(tmp_path, algorithm, capsys):
    """Every iteration recorded: each replayed update gives the logged metrics and the weights
    after it exactly; ``embodied replay`` says so, and exits 1 with one line when the record's
    logged numbers are not what the update gives."""
    kw = {
        "ppo": dict(policy=MLP, algorithm=PPO, total_env_steps=3 * 6 * 8),
        "grpo": dict(policy=TINY_VLA, algorithm=GRPO, total_env_steps=3 * 3 * 8 * 2),
    }
    torch.manual_seed(0)
    run_dir = tmp_path / "run"
    run_on(PushRightEnv(8), run_dir, record_rollouts=1, **kw[algorithm])
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = {r["iteration"]: r["policy/loss"] for r in rows if "policy/loss" in r}
    recorded = sorted(int(p.name.split("_")[1]) for p in (run_dir / "rollouts").iterdir())
    # (a GRPO iteration without an informative group has no update, and is recorded too)
    assert len(losses) >= 2 and set(losses) <= set(recorded) == set(range(1, max(recorded) + 1))
    for iteration in recorded:
        record, metrics, digest = replay(run_dir, iteration)
        assert record.meta["reason"] == "every" and record.meta["precision"] == "fp32"
        assert metrics.get("policy/loss") == losses.get(iteration)
        logged = record.meta["metrics"]
        assert differences(logged, metrics, weights=(record.meta["digest_after"], digest)) == []
        # the run's counters after the iteration, as its metrics row logged them
        steps = next(r["env_steps"] for r in rows if r["iteration"] == iteration)
        counters = record.meta["counters"]
        assert (counters["iteration"], counters["env_steps"]) == (iteration, steps)
        assert counters["policy_version"] == iteration
    capsys.readouterr()
    assert main(["replay", str(run_dir), "--iteration", "2"]) == 0
    assert "bit for bit" in capsys.readouterr().out
    meta = record_dir(run_dir, 2) / "record.json"
    changed = json.loads(meta.read_text())
    changed["metrics"]["policy/loss"] += 1.0
    meta.write_text(json.dumps(changed))
    assert main(["replay", str(run_dir), "--iteration", "2"]) == 1
    out = capsys.readouterr()
    assert len(out.err.strip().splitlines()) == 1 and "policy/loss logged" in out.err


def test_a_damaged_or_missing_record_is_one_line_naming_the_file(tmp_path, capsys):
    torch.manual_seed(0)
    run_dir = tmp_path / "run"
    policy = {"name": "actor_critic", "hidden_sizes": [16], "use_images": False}
    run_on(
        PushRightEnv(8),
        run_dir,
        total_env_steps=8 * 3,
        record_rollouts=1,
        policy=policy,
        algorithm=PPO,
    )
    whole = read_record(run_dir, 1)
    learner = record_dir(run_dir, 1) / "learner.safetensors"
    learner.rename(learner.with_suffix(".kept"))
    rounds_only = read_rounds(run_dir, 1)  # (what episodes and the report read)
    assert rounds_only.meta == whole.meta and len(rounds_only.rounds) == len(whole.rounds) == 1
    assert torch.equal(rounds_only.rounds[0].actions, whole.rounds[0].actions)
    with pytest.raises(Exception, match="learner.safetensors: missing"):
        read_record(run_dir, 1)
    learner.with_suffix(".kept").rename(learner)
    rounds = record_dir(run_dir, 1) / "rounds.safetensors.zst"
    rounds.write_bytes(rounds.read_bytes()[:100])  # truncated
    assert main(["replay", str(run_dir), "--iteration", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(rounds) in err and "damaged" in err
    (record_dir(run_dir, 1) / "optimizer.pt").unlink()
    rounds.unlink()
    with pytest.raises(Exception, match="rounds.safetensors.zst: missing"):
        read_record(run_dir, 1)
    assert main(["replay", str(run_dir), "--iteration", "5"]) == 2
    assert "no record of iteration 5" in capsys.readouterr().err
    meta = record_dir(run_dir, 1) / "record.json"
    written = json.loads(meta.read_text())
    meta.write_text(json.dumps({**written, "metrics": {"policy/loss": "abc"}}))
    with pytest.raises(Exception, match=r"record.json: damaged \(metric policy/loss is 'abc'\)"):
        read_record(run_dir, 1)
    meta.write_text(json.dumps({"reason": "every"}))
    with pytest.raises(Exception, match=r"record.json: damaged \(no config, digest_after"):
        read_record(run_dir, 1)


def test_replay_within_a_tolerance_says_the_weights_compare_bit_for_bit_only(tmp_path, capsys):
    """``--rtol``: the metrics within it decide; the weights, of which a record keeps a digest,
    are said to be equal or not, never claimed to be compared within it."""
    torch.manual_seed(0)
    run_dir = tmp_path / "run"
    kw = dict(total_env_steps=8 * 6, record_rollouts=1, policy=MLP, algorithm=PPO)
    run_on(PushRightEnv(8), run_dir, **kw)
    argv = ["replay", str(run_dir), "--iteration", "1", "--rtol", "1e-6"]
    capsys.readouterr()
    assert main(argv) == 0
    out = capsys.readouterr().out.strip()
    assert out.endswith("compare bit for bit only (the record keeps their digest), equal")
    meta = record_dir(run_dir, 1) / "record.json"
    changed = json.loads(meta.read_text())
    changed["digest_after"] = "0" * 64
    meta.write_text(json.dumps(changed))
    assert main(argv) == 0
    out = capsys.readouterr().out.strip()
    assert "within rtol 1e-06:" in out and "metrics and the weights" not in out
    assert "(the record keeps their digest), differ (digest 000000000000 vs " in out
    assert main(argv[:-2]) == 1  # (bit for bit, the weights are compared)
    assert "weights after the update differ" in capsys.readouterr().err


def test_a_run_trains_the_tiny_task_from_recordings_alone(tmp_path, monkeypatch, capsys):
    """``runner.replay_from``: no simulator is made; each record is one update, in order, at its
    learning rate. From the records of every iteration of a PPO run that learns the task, the
    updates reproduce the run (each starts from the recorded weights: on-policy) and the
    weights that come out solve the task; without a record in the middle, the updates after
    the gap are off-policy, and said to be."""
    from embodied import runner as runner_module
    from embodied.checkpoint import load_checkpoint
    from embodied.config import compose
    from embodied.demos import load_policy
    from embodied.evaluate import evaluate
    from embodied.recording import state_digest
    from embodied.train_config import TrainConfig

    torch.manual_seed(0)
    recorded = tmp_path / "recorded"
    policy = {**TINY_VLA, "value_head": True}
    iterations = 15
    kw = dict(total_env_steps=8 * 6 * iterations, policy=policy, algorithm=PPO)
    run_on(PushRightEnv(8), recorded, record_rollouts=1, keep_rollouts=iterations, **kw)
    monkeypatch.setattr(runner_module, "make_env", no_simulator)

    def from_records(name: str) -> dict:
        runner = {"name": name, "output_dir": str(tmp_path), "progress": False}
        runner["replay_from"] = str(recorded / "rollouts")
        runner["keep_checkpoints"] = 1
        source = {"seed": 0, "policy": policy, "algorithm": PPO, "runner": runner}
        return runner_module.train(compose(TrainConfig, [("test", source)]))

    capsys.readouterr()
    summary = from_records("whole")
    out = capsys.readouterr().out
    assert "equals the recorded one" in out and "reproduces the recorded one" in out
    assert summary["updates"] == iterations and summary["off_policy"] == []
    assert summary["first_update_matches"] is True
    rows = [json.loads(line) for line in (tmp_path / "whole" / "metrics.jsonl").open()]
    assert [r["replayed"] for r in rows] == list(range(1, iterations + 1))
    assert rows[-1]["env_steps"] == 8 * 6 * iterations
    checkpoint = load_checkpoint(tmp_path / "whole")
    last = record_dir(recorded, iterations) / "record.json"
    assert state_digest(checkpoint["model"]) == json.loads(last.read_text())["digest_after"]
    # the weights trained from the records alone solve the task (deterministic actions)
    trained, _ = load_policy(tmp_path / "whole")
    success = evaluate(PushRightEnv(8), trained, episodes=16, seed=0)["eval/success_rate"]
    trained.load_state_dict(read_record(recorded, 1).model)  # (where they started)
    before = evaluate(PushRightEnv(8), trained, episodes=16, seed=0)["eval/success_rate"]
    assert before < 0.5 and success == 1.0, (before, success)
    # a gap: the updates after it start from weights the recorded run never had
    shutil.rmtree(recorded / "rollouts" / "iter_000005")
    summary = from_records("gap")
    assert summary["off_policy"] == list(range(6, iterations + 1))
    assert "off-policy: records [6, 7" in capsys.readouterr().out


def no_simulator(*args, **kw):
    raise AssertionError("a simulator was made")


def hand_built_record():
    """One PPO round, T=4 chunks by B=2 rows, K=1, a 2x2 camera: row 0 holds episode 5 (chunks
    0-1, begun before the round: the first chunk), then episode 6 (chunks 2-3, whole); row 1
    episode 7, which goes on after the round."""
    from embodied.recording import Record
    from embodied.rollout import RolloutBatch
    from embodied.schema import Observation

    T, B = 4, 2
    done = torch.zeros(T, B, 1, dtype=torch.bool)
    done[1, 0] = done[3, 0] = True
    success = torch.zeros(T, B, 1, dtype=torch.bool)
    success[3, 0] = True
    images = torch.arange(T * B * 2 * 2 * 3, dtype=torch.uint8).view(T, B, 2, 2, 3)
    batch = RolloutBatch(
        obs=Observation(state=torch.zeros(T, B, 1), instruction=[], images={"cam": images}),
        instructions=("push right",),
        actions=torch.arange(T * B, dtype=torch.float32).view(T, B, 1, 1),
        extras={},
        logprob_token=torch.zeros(T, B, 1, 1),
        values=torch.zeros(T, B),
        next_values=torch.zeros(T, B),
        rewards=torch.tensor([[0.5, 0.1], [1.0, 0.1], [0.25, 0.1], [2.0, 0.1]]).view(T, B, 1),
        terminated=done,
        truncated=torch.zeros(T, B, 1, dtype=torch.bool),
        success=success,
        valid=torch.ones(T, B, 1, dtype=torch.bool),
        episode_id=torch.tensor([[5, 7], [5, 7], [6, 7], [6, 7]]),
        group_id=torch.full((T, B), -1),
        task_id=torch.zeros(T, B, dtype=torch.long),
        policy_version=torch.zeros(T, B, dtype=torch.long),
    )
    meta = {"iteration": 3, "config": {"env": {}}, "spec": PushRightEnv(1).spec.to_dict()}
    return Record(None, meta, [batch], {}, {}, {}, {})


def test_the_episodes_of_a_record_are_found_chosen_and_written(tmp_path):
    from PIL import Image

    from embodied.episodes import choose, episodes_of, write_episode

    record = hand_built_record()
    found = episodes_of(record)
    assert [(e.row, e.episode_id, e.chunks, e.whole) for e in found] == [
        (0, 5, [0, 1], True),  # (begun at the round's reset)
        (0, 6, [2, 3], True),
    ]
    assert [(e.ret, e.success, e.success_at_end, e.length) for e in found] == [
        (1.5, False, False, 2),
        (2.25, True, True, 2),
    ]
    assert found[0].task == "all"
    assert choose(found) == found
    assert choose(found, best=1) == [found[1]]
    assert choose(found, worst=1) == [found[0]]
    assert choose(found, outcome="failed") == [found[0]]
    assert choose(found, task="other") == []
    traces = found[1].traces(record)
    assert traces["actions"].tolist() == [[4.0], [6.0]] and traces["reward"].tolist() == [0.25, 2.0]
    assert found[1].frames(record, "cam").shape == (2, 2, 2, 3)
    video, plot = write_episode(record, found[1], tmp_path)
    assert video.stat().st_size > 0 and Image.open(plot).size[0] > 100
    assert video.name == "iter000003_round0_row0_ep6_all.mp4"


def test_embodied_episodes_writes_the_best_and_worst_of_a_recorded_grpo_iteration(tmp_path, capsys):
    """GRPO rounds start with a reset: every episode of the record is whole."""
    torch.manual_seed(0)
    run_dir = tmp_path / "run"
    run_on(
        PushRightEnv(8),
        run_dir,
        total_env_steps=3 * 8,
        record_rollouts=1,
        policy=TINY_VLA,
        algorithm=GRPO,
    )
    capsys.readouterr()
    argv = ["episodes", str(run_dir), "--iteration", "1", "--best", "2", "--worst", "1"]
    assert main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "iteration 1: 8 episodes end in the record, 3 chosen"
    videos = sorted((run_dir / "episodes").glob("*.mp4"))
    assert len(videos) == 3 and len(list((run_dir / "episodes").glob("*.png"))) == 3
    returns = [float(line.split("return ")[1].split(",")[0]) for line in out[1:]]
    assert returns[0] >= returns[1] >= returns[2]


def test_episodes_of_a_record_become_a_dataset_lerobot_reads(tmp_path, capsys):
    """``--to-dataset``: the chosen episodes, step by step, in LeRobot's own loader; a record of
    a policy acting in chunks is one line."""
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    from embodied.episodes import choose, episodes_of

    torch.manual_seed(0)
    run_dir = tmp_path / "run"
    kw = dict(total_env_steps=3 * 8, record_rollouts=1, policy=TINY_VLA, algorithm=GRPO)
    run_on(PushRightEnv(8), run_dir, **kw)
    argv = ["episodes", str(run_dir), "--iteration", "1", "--best", "3"]
    assert main([*argv, "--to-dataset", str(tmp_path / "ds")]) == 0
    assert "wrote 3 episodes" in capsys.readouterr().out
    record = read_record(run_dir, 1)
    chosen = choose(episodes_of(record), best=3)
    ds = LeRobotDataset("local/rl", root=tmp_path / "ds")
    assert ds.num_episodes == 3 and ds.num_frames == sum(e.length for e in chosen)
    batch = record.rounds[0]
    first = chosen[0]
    frame = ds[0]  # the best episode's first step
    assert frame["task"] == "push right"
    torch.testing.assert_close(frame["action"], batch.actions[first.chunks[0], first.row, 0])
    state = batch.obs.state[first.chunks[0], first.row]  # f32 [1]: LeRobot's is a value
    torch.testing.assert_close(frame["observation.state"], state[0])
    image = batch.obs.images["cam"][first.chunks[0], first.row].permute(2, 0, 1).float() / 255
    torch.testing.assert_close(frame["observation.images.cam"], image)
    assert main([*argv, "--to-dataset", str(tmp_path / "ds")]) == 2  # (it holds one already)
    assert "already holds a dataset" in capsys.readouterr().err


def test_a_round_dropped_by_the_learner_leaves_the_record_in_progress_too():
    """A round lost on another data-parallel rank is dropped where it was added (``drop_round``):
    the record in progress forgets it too, so a replay sees the rounds the update saw."""
    from embodied.config import compose
    from embodied.roles import Learner
    from embodied.train_config import TrainConfig

    source = {"seed": 0, "policy": MLP, "algorithm": PPO, "runner": {"record_rollouts": 1}}
    cfg = compose(TrainConfig, [("test", source)])
    env = PushRightEnv(2)
    learner = Learner(cfg, env.spec, torch.zeros(2, dtype=torch.long), torch.device("cpu"))
    batch = hand_built_record().rounds[0]
    for _ in range(2):
        learner.add_round(batch)
    learner.drop_last_round()
    assert len(learner.rounds) == 1 and len(learner.pending.rounds) == 1
    assert len(learner.pending.instructions) == 1


def test_only_rank_0_keeps_records_and_it_asks_for_its_rank_when_a_round_comes():
    """Data-parallel ranks learn their rank after they are built: a learner that became rank 1
    keeps nothing (only rank 0 is asked to write)."""
    from embodied.config import compose
    from embodied.roles import Learner
    from embodied.train_config import TrainConfig

    source = {"seed": 0, "policy": MLP, "algorithm": PPO, "runner": {"record_rollouts": 1}}
    cfg = compose(TrainConfig, [("test", source)])
    learner = Learner(cfg, PushRightEnv(2).spec, torch.zeros(2, dtype=torch.long), "cpu")
    learner.engine.rank = 1  # (as distribute() sets it on the second rank)
    learner.add_round(hand_built_record().rounds[0])
    assert learner.pending is None and not learner.records


def test_an_episode_after_one_that_ended_mid_chunk_is_partial():
    """Chunks of K=2: episode 1 ends at the first action of chunk 0, so the chunk's second
    action ran, unrecorded, as episode 2's first step: episode 2 is partial."""
    record = hand_built_record()
    batch = record.rounds[0]
    T, B = 4, 2
    batch.valid = torch.ones(T, B, 2, dtype=torch.bool)
    batch.valid[1, 0, 1] = False  # episode 5 ends at chunk 1's first action
    for name in ("rewards", "success", "truncated"):
        setattr(batch, name, getattr(batch, name).expand(T, B, 2).clone())
    batch.terminated = torch.zeros(T, B, 2, dtype=torch.bool)
    batch.terminated[1, 0, 0] = batch.terminated[3, 0, 1] = True
    found = episodes_of(record)
    assert [(e.episode_id, e.whole, e.length) for e in found] == [(5, True, 3), (6, False, 4)]
    assert choose(found) == [found[0]]  # whole ones only
    # the round's steps (chunk * 2 + k) that ran in each: not chunk 1's second action in 5
    assert [e.steps(record) for e in found] == [[0, 1, 2], [4, 5, 6, 7]]


def test_a_record_is_on_disk_before_its_rename_makes_it_one(tmp_path, monkeypatch):
    """Every staged file and the staging folder are flushed before the rename, the folders above
    after: a crash (power loss too) leaves either no record or a whole one."""
    import embodied.recording as recording

    flushed = []  # (path, whether the final record existed then)
    final = record_dir(tmp_path, 3)
    monkeypatch.setattr(recording, "fsync", lambda path: flushed.append((path, final.exists())))
    pending = Pending(
        model={"w": torch.ones(2)},
        optimizer={"state": {}, "param_groups": []},
        lr=1e-3,
        stream={"seed": 0},
        main_weights={},
        rounds=[{"r0/x": torch.arange(3)}],
        instructions=[("push",)],
    )
    assert pending.write(tmp_path, 3, "every", {"loss": 0.5}, {}) == final
    staging = final.with_name(final.name + ".tmp")
    before = {path for path, existed in flushed if not existed}
    files = {"rounds.safetensors.zst", "learner.safetensors", "optimizer.pt", "record.json"}
    assert before == {staging / name for name in files} | {staging}
    assert flushed[-2:] == [(final.parent, True), (tmp_path, True)]
    assert sorted(p.name for p in final.iterdir()) == sorted(files)


def test_a_replay_runs_at_the_precision_its_record_says(monkeypatch):
    """A GPU run's config says precision auto (bf16 there): replayed on the CPU, auto is float32,
    a different update said to differ. The record says what the update ran in."""
    from types import SimpleNamespace

    import embodied.replay
    import embodied.roles
    from embodied.config import to_dict
    from embodied.train_config import TrainConfig

    class Built(Exception):
        pass

    def learner_for(cfg, *args):
        raise Built(cfg.trainer.precision)

    config = to_dict(TrainConfig())  # (trainer.precision: auto)
    for said, precision in (({"precision": "bf16"}, "bf16"), ({}, "auto")):
        meta = {"config": config, "spec": PushRightEnv(2).spec.to_dict(), "task_of_env": [0, 0]}
        record = SimpleNamespace(meta={**meta, **said})
        monkeypatch.setattr(embodied.replay, "read_record", lambda *args, r=record: r)
        monkeypatch.setattr(embodied.roles, "learner_for", learner_for)
        with pytest.raises(Built, match=f"^{precision}$"):  # (a record from before: as it was)
            embodied.replay.replay("run", 1)
