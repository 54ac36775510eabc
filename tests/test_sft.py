"""`embodied sft`: a VLA trained on a LeRobot dataset, evaluated in ManiSkill per task, saved as a
checkpoint that carries its normalization and that `embodied eval` loads."""

import json
import math

import numpy as np
import pytest
import scripted_envs
import torch

from embodied.checkpoint import load_checkpoint
from embodied.cli import main
from embodied.dataset import LeRobotWriter

ENV = dict(
    task="PushCube-v1",
    obs_mode="rgb",
    control_mode="pd_joint_delta_pos",
    max_episode_steps=5,
    num_envs=2,
    num_workers=0,  # the simulator in this process: no worker to start per evaluation
    image_size=32,
    render_size=32,
    ignore_terminations=True,
)
TINY_VLA = {**scripted_envs.TINY_VLA, "chunk_size": 2}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    rng = np.random.default_rng(0)
    root = tmp_path_factory.mktemp("data") / "pushcube"
    names = [f"a{i}" for i in range(8)]
    w = LeRobotWriter(
        root,
        fps=20,
        cameras={"base_camera": (32, 32)},
        state_names=[f"s{i}" for i in range(25)],
        action_names=names,
        source={"simulator": "maniskill", "task": "PushCube-v1"},
    )
    for _ in range(3):
        T = 6
        actions = np.concatenate(
            [rng.uniform(-0.05, 0.05, (T, 7)), rng.uniform(0.0, 0.02, (T, 1))], 1
        ).astype(np.float32)
        w.add_episode(
            images={"base_camera": rng.integers(0, 256, (T, 32, 32, 3), dtype=np.uint8)},
            state=rng.normal(size=(T, 25)).astype(np.float32),
            actions=actions,
            rewards=np.zeros(T, np.float32),
            success=np.arange(T) == T - 1,
            task="push the cube to the red and white target",
        )
    return w.close()


def test_sft_trains_evaluates_and_saves_a_loadable_checkpoint(tmp_path, dataset, capsys):
    cfg = tmp_path / "sft.yaml"
    cfg.write_text(
        json.dumps(
            {
                "datasets": [str(dataset)],
                "env": ENV,
                "policy": TINY_VLA,
                "steps": 12,
                "batch_size": 4,
                "warmup_steps": 2,
                "runner": {
                    "name": "sft",
                    "output_dir": str(tmp_path),
                    "eval_episodes": 2,
                    "progress": False,
                },
            }
        )
    )
    assert main(["sft", str(cfg)]) == 0
    summary = json.loads((tmp_path / "sft" / "metrics.json").read_text())
    assert summary["steps"] == 12
    ended = (tmp_path / "sft" / "report.html").read_text()  # (runner.report: as the run ended)
    assert "<td>steps</td><td>12</td>" in ended
    result = summary["final"]["PushCube-v1"]
    assert result["eval/episodes"] == 2
    losses = [
        json.loads(line)["sft/loss"]
        for line in (tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()
        if "sft/loss" in line
    ]
    assert len(losses) == 2 and all(np.isfinite(losses))
    # normalization statistics from the data are inside the checkpoint
    ckpt = load_checkpoint(tmp_path / "sft" / "last", with_trainer_state=False)
    from embodied.dataset import DemoDataset

    actions = DemoDataset.load(dataset).actions
    torch.testing.assert_close(ckpt["model"]["action_q99"], torch.quantile(actions, 0.99, dim=0))
    torch.testing.assert_close(ckpt["model"]["state_mean"], DemoDataset.load(dataset).state.mean(0))
    # `embodied eval` rebuilds the VLA from the checkpoint alone
    capsys.readouterr()
    assert main(["eval", str(tmp_path / "sft" / "last"), "--episodes", "2"]) == 0
    again = json.loads(capsys.readouterr().out)
    # the same weights, seeds, deterministic actions and thread count (the checkpoint names
    # the run's: MKL and torch split their sums by thread): the SFT run's evaluation bit for bit
    assert ckpt["meta"]["config"]["runner"]["torch_threads"] == 2
    for key in ("eval/episodes", "eval/success_rate", "eval/return", "eval/length"):
        assert again[key] == result[key], key
    # `embodied report` reads the run: its steps, its final evaluation per task (a KeyError once)
    assert main(["report", str(tmp_path / "sft")]) == 0
    page = (tmp_path / "sft" / "report.html").read_text()
    assert "<td>steps</td><td>12</td>" in page and "<td>PushCube-v1</td><td>2</td>" in page


def test_sft_config_errors(tmp_path, capsys):
    cfg = tmp_path / "sft.yaml"
    cfg.write_text(json.dumps({"env": ENV, "policy": TINY_VLA}))
    assert main(["sft", str(cfg)]) == 2
    assert "datasets" in capsys.readouterr().err
    assert main(["sft", str(cfg), "datasets=[/nonexistent]"]) == 2
    assert "not a complete LeRobot dataset" in capsys.readouterr().err
    cfg.write_text(json.dumps({"env": ENV, "policy": {"name": "actor_critic"}, "datasets": ["d"]}))
    assert main(["sft", str(cfg)]) == 2  # (it crashed with an AttributeError once it had data)
    err = capsys.readouterr().err
    assert "policy.name: embodied sft trains vla or smolvla" in err and "'actor_critic'" in err
    cfg.write_text(json.dumps({"env": ENV, "policy": TINY_VLA, "datasets": ["d"], "steps": 50}))
    assert main(["sft", str(cfg)]) == 2  # (under the default warm-up of 100: half the rate)
    assert (
        "warmup_steps: 100 of 50 steps; the learning rate would never reach"
        in capsys.readouterr().err
    )


def test_a_step_that_is_not_finite_stops_the_run_unsaved(tmp_path, dataset, monkeypatch, capsys):
    """A NaN loss at step 3 (one NaN frame, or a diverged step: every weight NaN after it) is
    found at the next evaluation, log or checkpoint, here step 5's evaluation: exit 1, one line,
    no checkpoint. SFT trained on to the end, saved NaN weights and exited 0."""
    import embodied.sft

    step = embodied.sft.BCLearner.bc_step
    calls = []

    def diverging(self, *args):
        calls.append(1)
        metrics = step(self, *args)
        return {**metrics, "sft/loss": metrics["sft/loss"] * (math.nan if len(calls) == 3 else 1)}

    monkeypatch.setattr(embodied.sft.BCLearner, "bc_step", diverging)
    # an evaluation due at 5 reads it first (it acted with NaN weights: a simulator's error)
    assert main(["sft", sft_config(tmp_path, dataset, "nan"), "runner.eval_every=5"]) == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("embodied: error: step 3: the update is not finite (sft/loss nan")
    assert last.endswith("; no checkpoint was saved before it")
    assert not (tmp_path / "nan" / "last").exists() and len(calls) == 5


def test_a_multi_task_sft_checkpoint_is_evaluated_on_every_task(tmp_path):
    """The checkpoint's environment holds every task the datasets hold, so `embodied eval`
    scores each, as the run's own evaluations did (it named the first task alone)."""
    from types import SimpleNamespace

    from embodied.cli_eval import _eval_config
    from embodied.config import load_config
    from embodied.sft import SFTConfig, _meta
    from embodied.sft_data import task_configs

    cfg = tmp_path / "sft.yaml"
    cfg.write_text(json.dumps({"env": ENV, "policy": TINY_VLA, "datasets": ["d"]}))
    sft_cfg = load_config(SFTConfig, cfg, files=False)[0]
    tasks = ["PushCube-v1", "PullCube-v1"]
    spec = SimpleNamespace(to_dict=dict)
    meta = _meta(sft_cfg, task_configs(sft_cfg.env, tasks), spec)
    env = _eval_config(
        SimpleNamespace(overrides=[], num_envs=None), {"meta": meta, "path": cfg}
    ).env
    assert env.tasks == tasks and env.num_envs == 2 * ENV["num_envs"]


def test_few_shot_sft_keeps_the_first_episodes(dataset):
    from embodied.sft_data import load_frames as _load

    assert len(_load([str(dataset)]).data) == 18
    frames = _load(
        [str(dataset), str(dataset)], episodes=2
    )  # two datasets, 2 episodes of 6 frames each
    assert (
        len(frames.data) == 24
        and frames.data.ends.tolist() == [6, 12, 18, 24]
        and len(frames.instructions) == 24
    )


@pytest.mark.slow  # (35 s: a stopped run and its resume; CI runs the slow set)
def test_sft_stopped_by_sigterm_saves_the_step_it_reached(tmp_path, dataset, monkeypatch, capsys):
    """`embodied sft` stopped by SIGTERM: the step it reached saved, one line saying where,
    exit code 143 (128 + the signal), as `embodied train`; it was a traceback and exit 1. The
    stop came before that step's evaluation: the resumed run runs it first (it was lost)."""
    import os
    import signal

    import embodied.sft

    class SignallingLogger(embodied.sft.RunLogger):
        def log(self, metrics, step, **extra):
            super().log(metrics, step, **extra)
            if step == 10:
                os.kill(os.getpid(), signal.SIGTERM)

    cfg = tmp_path / "sft.yaml"
    run = {"name": "sft", "output_dir": str(tmp_path), "eval_episodes": 2, "progress": False}
    body = {"datasets": [str(dataset)], "env": ENV, "policy": TINY_VLA, "runner": run}
    cfg.write_text(json.dumps({**body, "steps": 12, "batch_size": 4, "warmup_steps": 2}))
    with monkeypatch.context() as m:
        m.setattr(embodied.sft, "RunLogger", SignallingLogger)
        assert main(["sft", str(cfg), "runner.eval_every=5"]) == 128 + signal.SIGTERM
    where = tmp_path / "sft" / "last"
    last = capsys.readouterr().err.splitlines()[-1]
    assert last == f"embodied: stopped after step 10; checkpoint: {where}"
    ckpt = load_checkpoint(tmp_path / "sft" / "last")
    assert ckpt["counters"]["iteration"] == 10
    assert not (tmp_path / "sft" / "metrics.json").exists()  # stopped before its evaluation
    assert (tmp_path / "sft" / "report.html").is_file()  # a stopped run has its report too
    # resumed evaluating every 10 steps: step 10 is still due (one evaluation, at 5, counted
    # as the one 10 steps gave, and 10's was lost)
    assert main(["sft", str(cfg), "runner.eval_every=10", f"runner.resume={where}"]) == 0
    assert len(json.loads((tmp_path / "sft" / "metrics.json").read_text())["evals"]) == 2
    rows = (json.loads(line) for line in open(tmp_path / "sft" / "metrics.jsonl"))
    evaluated = [r["iteration"] for r in rows if "eval/PushCube-v1/success_rate" in r]
    assert evaluated == [5, 10, 12]  # (12: the final evaluation)
    # a run resumed out of its time trains no step more (it trained one, then stopped)
    with monkeypatch.context() as m:
        m.setattr(embodied.sft.Clock, "out_of_time", property(lambda self: True))
        step_10 = tmp_path / "sft" / "checkpoints" / "iter_000010"
        assert main(["sft", str(cfg), "runner.max_minutes=1", f"runner.resume={step_10}"]) == 0
    assert load_checkpoint(tmp_path / "sft" / "last")["counters"]["iteration"] == 10


def test_the_evaluation_a_resume_owes_is_found_by_its_step_not_by_their_count():
    """A run evaluating every 5 steps, stopped at step 10 between the step and its evaluation,
    resumed evaluating every 10: its one evaluation (at 5) was counted as the one due by 10,
    and 10's was lost. A run that ended out of time skipped its evaluation: none is owed."""
    from types import SimpleNamespace

    from embodied.sft import SFTRun

    run = SFTRun.__new__(SFTRun)  # (its bookkeeping alone)
    run.cfg = SimpleNamespace(steps=20, runner=SimpleNamespace(eval_every=10))
    run.clock = SimpleNamespace(out_of_time=False)
    run.step, run.evals, run.evaluated_at = 10, [{}], 5
    assert run._unevaluated()
    run.evaluated_at = 10
    assert not run._unevaluated()
    run.evals, run.evaluated_at = [], None  # none yet
    assert run._unevaluated()
    run.evals = [{}]  # a checkpoint from before the step was kept: by the count
    assert not run._unevaluated()
    run.evaluated_at, run.clock.out_of_time = 5, True
    assert not run._unevaluated()


def sft_config(tmp_path, dataset, name: str, **extra) -> str:
    cfg = tmp_path / f"{name}.yaml"
    runner = {"name": name, "output_dir": str(tmp_path), "eval_episodes": 2, "progress": False}
    body = {"datasets": [str(dataset)], "env": ENV, "policy": TINY_VLA, "steps": 12}
    cfg.write_text(
        json.dumps({**body, "batch_size": 4, "warmup_steps": 2, "runner": runner, **extra})
    )
    return str(cfg)


@pytest.mark.slow  # (50 s: two SFT runs with their evaluations; the steps' parity is in
# tests/test_megatron.py)
def test_sft_on_megatron_at_tp2_gives_the_torch_runs_checkpoint(tmp_path, dataset):
    """`embodied sft CONFIG trainer.backend=megatron trainer.tensor_parallel=2`: the same logged
    losses and, joined from its two shards, the same weights as the torch run."""
    pytest.importorskip("megatron.core")
    assert main(["sft", sft_config(tmp_path, dataset, "torch")]) == 0
    megatron = sft_config(tmp_path, dataset, "tp2")
    assert main(["sft", megatron, "trainer.backend=megatron", "trainer.tensor_parallel=2"]) == 0
    assert len(list((tmp_path / "tp2" / "last").glob("model-tp*-of-02.safetensors"))) == 2
    rows = {
        name: [
            json.loads(line)
            for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        ]
        for name in ("torch", "tp2")
    }
    losses = {
        name: [r["sft/loss"] for r in table if "sft/loss" in r] for name, table in rows.items()
    }
    assert len(losses["torch"]) == 2
    assert losses["tp2"] == pytest.approx(losses["torch"], rel=1e-5)
    want = load_checkpoint(tmp_path / "torch" / "last")["model"]
    got = load_checkpoint(tmp_path / "tp2" / "last")["model"]
    assert got.keys() == want.keys()
    d = TINY_VLA["d_model"]
    for key, value in want.items():
        if key.endswith("in_proj_bias"):
            # the key bias: softmax ignores it, so its gradient is 0 up to rounding, which Adam
            # scales up to steps of the learning rate on either backend
            keys = slice(d, 2 * d)
            torch.testing.assert_close(got[key][keys], value[keys], rtol=0, atol=12 * 3e-4)
            got[key][keys] = value[keys]
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-5)


def loss_rows(run_dir) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["iteration"], r["sft/loss"]) for r in rows if "sft/loss" in r]


def test_a_resumed_sft_run_ends_where_the_uninterrupted_one_did(tmp_path, dataset, capsys):
    """Stopped after step 6 (its checkpoint) and resumed: the same losses after step 6 and the
    same weights at step 12, bit for bit; each step is logged once; the run directory is the
    original's, as `embodied train` keeps it. Its checkpoint holds evaluations (at 3 and 6: a
    resume from one was a KeyError), and the resumed run makes the one at 9."""
    cfg = sft_config(tmp_path, dataset, "run")
    every = ["runner.eval_every=3", "runner.eval_episodes=1"]
    assert main(["sft", cfg, "runner.save_every=6", *every]) == 0
    run = tmp_path / "run"
    whole = load_checkpoint(run / "last")
    rows = loss_rows(run)
    assert [step for step, _ in rows] == [10, 12]
    resume = f"runner.resume={run / 'checkpoints' / 'iter_000006'}"
    assert main(["sft", cfg, resume, *every]) == 0
    assert "resuming" in capsys.readouterr().out
    assert loss_rows(run) == rows
    assert len(json.loads((run / "metrics.json").read_text())["evals"]) == 3  # (3, 6 and 9)
    finals = [r["iteration"] for r in map(json.loads, open(run / "metrics.jsonl")) if "final" in r]
    assert finals == [12]  # its own final evaluation, once (the resume dropped the first run's)
    again = load_checkpoint(run / "last")
    assert again["counters"]["iteration"] == 12
    for key, value in whole["model"].items():
        assert torch.equal(again["model"][key], value), key


@pytest.mark.slow  # (30 s; CI runs the slow set)
def test_sft_keeps_an_earlier_run_unless_told_and_checks_a_resume(
    tmp_path, dataset, capsys, monkeypatch
):
    cfg = sft_config(tmp_path, dataset, "run", steps=2)
    assert main(["sft", cfg, "runner.eval_episodes=1"]) == 0
    capsys.readouterr()
    with monkeypatch.context() as m:  # refused before a simulator is started
        m.setattr("embodied.sft.make_env", lambda cfg: pytest.fail("an environment was built"))
        assert main(["sft", cfg]) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert main(["sft", cfg, "runner.overwrite=true", "runner.eval_episodes=1"]) == 0
    capsys.readouterr()
    assert main(["sft", cfg, f"runner.resume={tmp_path / 'run'}", "learning_rate=0.1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("embodied: error: runner.resume: learning_rate is 0.1 here but 0.0003")
    # an RL run refuses to resume it, forced or not (init_from starts RL from its weights)
    rl = ["train", "configs/mujoco/pick_ppo.yaml", f"runner.resume={tmp_path / 'run'}"]
    before = sorted(p.name for p in (tmp_path / "run").iterdir())
    assert main([*rl, "runner.resume_force=true"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is a checkpoint of embodied sft, not of an RL run" in err[0]
    assert err[0].endswith(f"runner.init_from={tmp_path / 'run' / 'checkpoints' / 'iter_000002'}")
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == before
    # a checkpoint trained in another precision (a GPU's bf16): refused before the run directory
    # is taken back (it deleted metrics.json and the final evaluation's rows first)
    meta = tmp_path / "run" / "checkpoints" / "iter_000002" / "meta.json"
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "precision": "bf16"}))
    metrics = (tmp_path / "run" / "metrics.jsonl").read_text()
    assert main(["sft", cfg, f"runner.resume={tmp_path / 'run'}", "runner.eval_episodes=1"]) == 2
    assert "trained in bf16 but this run trains in fp32" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == before
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == metrics


def test_sft_on_mujoco_demonstrations_evaluates_on_mujoco(tmp_path, capsys):
    """Any simulator's config: the scripted expert's pick demonstrations, SFT, the evaluation and
    the checkpoint's environment on MuJoCo."""
    demos = [
        "demos",
        "configs/mujoco/demos_pick.yaml",
        "episodes=1",
        "env.num_envs=1",
        "env.image_size=32",
        f"output={tmp_path / 'ds'}",
    ]
    assert main(demos) == 0
    env = {"simulator": "mujoco", "task": "pick", "obs_mode": "rgb", "image_size": 32}
    env.update(num_envs=2, max_episode_steps=5)
    cfg = tmp_path / "sft.yaml"
    runner = {"name": "sft", "output_dir": str(tmp_path), "eval_episodes": 2, "progress": False}
    body = {"datasets": [str(tmp_path / "ds")], "env": env, "policy": TINY_VLA, "steps": 2}
    cfg.write_text(json.dumps({**body, "batch_size": 4, "warmup_steps": 1, "runner": runner}))
    capsys.readouterr()
    assert main(["sft", str(cfg)]) == 0
    summary = json.loads((tmp_path / "sft" / "metrics.json").read_text())
    assert summary["final"]["pick"]["eval/episodes"] == 2
    meta = load_checkpoint(tmp_path / "sft" / "last", with_trainer_state=False)["meta"]
    assert meta["config"]["env"]["simulator"] == "mujoco"
    assert meta["config"]["env"]["task"] == "pick"


def test_sft_trains_on_the_episodes_of_a_recorded_rl_run(tmp_path, capsys):
    """The flywheel's plumbing: a recorded PPO iteration on MuJoCo's pick task (rgb), its
    episodes as a dataset (``embodied episodes --to-dataset``; ``--successful`` would keep the
    successes only), and ``embodied sft`` on it."""
    env = {"simulator": "mujoco", "task": "pick", "obs_mode": "rgb", "image_size": 32}
    env.update(num_envs=2, max_episode_steps=4)
    policy = {**scripted_envs.TINY_VLA, "value_head": True}
    cfg = tmp_path / "rl.yaml"
    runner = {"name": "rl", "output_dir": str(tmp_path), "progress": False, "video": False}
    runner.update(total_env_steps=16, record_rollouts=1, eval_every=0, final_eval_episodes=1)
    algorithm = {**scripted_envs.PPO, "num_steps": 8}
    cfg.write_text(
        json.dumps({"env": env, "policy": policy, "algorithm": algorithm, "runner": runner})
    )
    assert main(["train", str(cfg)]) == 0
    dataset = tmp_path / "rl_episodes"
    argv = ["episodes", str(tmp_path / "rl"), "--iteration", "1", "--partial"]
    assert main([*argv, "--to-dataset", str(dataset)]) == 0
    written = int(capsys.readouterr().out.split("wrote ")[1].split()[0])
    assert written >= 2  # (episodes of 4 steps in a round of 8 chunks on 2 environments)
    sft_cfg = tmp_path / "sft.yaml"
    runner = {"name": "sft", "output_dir": str(tmp_path), "eval_episodes": 1, "progress": False}
    body = {"datasets": [str(dataset)], "env": env, "policy": TINY_VLA, "steps": 1}
    sft_cfg.write_text(json.dumps({**body, "batch_size": 4, "warmup_steps": 1, "runner": runner}))
    assert main(["sft", str(sft_cfg)]) == 0
    summary = json.loads((tmp_path / "sft" / "metrics.json").read_text())
    assert summary["final"]["pick"]["eval/episodes"] == 1
