"""End to end on ManiSkill with a tiny budget: train -> checkpoints -> stop on SIGTERM -> resume ->
eval. A run stopped by SIGTERM (in this process, or a real `embodied train` process) or crashed
after its last checkpoint resumes to exactly the uninterrupted run; metrics.jsonl has one row per
iteration; retention keeps the newest checkpoints and the best; a resume whose config changes the
run is refused."""

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch
from clocks import wait_until

import embodied.runner
from embodied import numerics
from embodied.checkpoint import best_iteration, load_checkpoint
from embodied.cli import main
from embodied.config import ConfigError, load_config
from embodied.run import Stopped
from embodied.runner import train
from embodied.train_config import TrainConfig

TINY = [
    "env.num_envs=2",
    "env.num_workers=0",  # the simulator in this process: no worker to start per run
    "env.render_size=64",
    "algorithm.num_steps=8",
    "algorithm.update_epochs=2",
    "algorithm.num_minibatches=2",
    "policy.hidden_sizes=[32,32]",
    "runner.eval_every=2",
    "runner.eval_episodes=2",
    "runner.final_eval_episodes=2",
    "runner.save_every=1",
    "runner.progress=false",
    "runner.video=false",  # rendering is most of a tiny run: only the "full" run records one
]
STEPS_PER_ITER = 2 * 8
COMPARED = (
    "policy/loss",
    "value/loss",
    "policy/entropy",
    "policy/approx_kl",
    "value/explained_variance",
)


def tiny_overrides(tmp_path, name, iterations, extra=()):
    return TINY + [
        f"runner.output_dir={tmp_path}",
        f"runner.name={name}",
        f"runner.total_env_steps={iterations * STEPS_PER_ITER}",
        *extra,
    ]


def tiny_config(tmp_path, name, iterations, extra=()):
    overrides = tiny_overrides(tmp_path, name, iterations, extra)
    return load_config(TrainConfig, "configs/maniskill/pushcube_ppo.yaml", overrides)[0]


def rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def iteration_rows(run_dir):
    """{iteration: row} of the training rows; each iteration must appear once."""
    training = [r for r in rows(run_dir) if "policy/loss" in r]
    iterations = [r["iteration"] for r in training]
    assert len(iterations) == len(set(iterations)), iterations
    return {r["iteration"]: r for r in training}


class SignallingLogger(embodied.runner.RunLogger):
    """Logs as usual, then sends this process SIGTERM once iteration 2 is logged: the runner
    finishes the iteration, saves it and stops."""

    def log(self, metrics, step, **extra):
        super().log(metrics, step, **extra)
        if extra.get("iteration") == 2 and "policy/loss" in metrics:
            os.kill(os.getpid(), signal.SIGTERM)


class ProcessDied(BaseException):
    """A death nothing in the process outlives (a power loss): no handler saves after it."""


class CrashingLogger(embodied.runner.RunLogger):
    """Writes iteration 3's row, then the process dies: past its last checkpoint (2). (An
    ordinary error there would save iteration 3: its update is done.)"""

    def log(self, metrics, step, **extra):
        super().log(metrics, step, **extra)
        if extra.get("iteration") == 3 and "policy/loss" in metrics:
            raise ProcessDied("a crash after logging")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("runs")
    full = train(tiny_config(tmp, "full", 4, ["runner.video=true"]))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(embodied.runner, "RunLogger", SignallingLogger)
        with pytest.raises(Stopped) as stopped:
            train(tiny_config(tmp, "sigterm", 4, ["runner.save_every=0"]))
    assert stopped.value.signum == signal.SIGTERM
    assert load_checkpoint(tmp / "sigterm")["counters"]["iteration"] == 2  # saved on the signal
    resumed = train(tiny_config(tmp, "other", 4, [f"runner.resume={tmp / 'sigterm'}"]))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(embodied.runner, "RunLogger", CrashingLogger)
        with pytest.raises(ProcessDied, match="a crash after logging"):
            train(tiny_config(tmp, "crash", 4, ["runner.save_every=2"]))
    assert load_checkpoint(tmp / "crash")["counters"]["iteration"] == 2
    records = ["runner.record_rollouts=1"]  # (turned on at the resume: no number changes)
    again = ["runner.save_every=2", f"runner.resume={tmp / 'crash'}", *records]
    train(tiny_config(tmp, "crash", 4, again))
    return tmp, full, resumed


def test_run_directory_holds_everything(runs):
    tmp, full, _ = runs
    run = tmp / "full"
    for path in (
        "config.yaml",
        "metrics.json",
        "metrics.jsonl",
        "last/model.safetensors",
        "last/trainer.pt",
        "last/meta.json",
        "videos/final_eval.mp4",
    ):
        assert (run / path).is_file(), path
    assert list((run / "tb").glob("events.out.tfevents.*"))
    assert (run / "videos/final_eval.mp4").stat().st_size > 1000
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["final"]["eval/episodes"] == 2 and metrics["final"]["iteration"] == 4
    assert metrics["final"]["env_steps"] == 4 * STEPS_PER_ITER
    assert [e["iteration"] for e in metrics["evals"]] == [2]
    # anneal_lr: linearly to 0 over total_env_steps, iteration i at the steps collected before it
    lrs = [row["train/lr"] for _, row in sorted(iteration_rows(run).items())]
    assert lrs == pytest.approx([3e-4 * (1 - i / 4) for i in range(4)], rel=1e-6)
    ckpt = load_checkpoint(run)
    assert ckpt["counters"]["iteration"] == 4 and "state_encoder.norm.mean" in ckpt["model"]
    # normalisation: the first reset's 2 observations, then every iteration's 2 x 8
    assert float(ckpt["model"]["state_encoder.norm.count"]) == 2 + 4 * STEPS_PER_ITER
    # the host it ran on, beside the config (not in it: a resume elsewhere is the same run)
    (start,) = json.loads((run / "host.json").read_text())["starts"]
    assert start["iteration"] == 0 and start["deterministic"] is False  # (the default)
    paths = start["code_paths"]  # this process's (the run trained here)
    live = numerics.host()["code_paths"]
    for key in ("torch_cpu_capability", "numpy_builds", "mkl_branch", "onednn"):
        assert paths[key] == live[key], key
    assert paths["torch_threads"] == 1
    assert start["cpu"]["model"] and start["versions"]["torch"] == torch.__version__
    assert "code_paths" not in (run / "config.yaml").read_text()


def test_retention_keeps_the_newest_and_the_best(runs):
    tmp, full, _ = runs
    run = tmp / "full"
    kept = sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("iter_"))
    best = best_iteration(run)
    assert best == 2  # the one evaluation during training
    assert kept == ["iter_000002", "iter_000003", "iter_000004"]  # keep_checkpoints: 3
    assert full["best"] == {"iteration": 2, "success_rate": full["evals"][0]["success_rate"]}


def test_a_run_stopped_by_sigterm_resumes_to_the_uninterrupted_run(runs):
    tmp, full, resumed = runs
    assert resumed["run_dir"] == str(tmp / "sigterm")  # the resumed run keeps its directory
    a, b = iteration_rows(tmp / "full"), iteration_rows(tmp / "sigterm")
    assert sorted(b) == [1, 2, 3, 4]
    for it in (1, 2, 3, 4):
        for key in COMPARED:
            assert a[it][key] == b[it][key], (it, key)
    assert resumed["final"]["eval/return"] == full["final"]["eval/return"]
    # the evaluation due at iteration 2, which the stop came before, ran first on resume
    evals = [(e["iteration"], e["success_rate"]) for e in resumed["evals"]]
    assert [at for at, _ in evals] == [2]
    assert evals == [(e["iteration"], e["success_rate"]) for e in full["evals"]]
    assert resumed["best"] == full["best"] and best_iteration(tmp / "sigterm") == 2
    assert load_checkpoint(tmp / "sigterm")["counters"]["env_steps"] == 4 * STEPS_PER_ITER
    starts = json.loads((tmp / "sigterm" / "host.json").read_text())["starts"]
    assert [start["iteration"] for start in starts] == [0, 2]  # the resume added its start


def test_a_crash_after_the_last_checkpoint_leaves_no_duplicate_rows(runs):
    """Resumed with rollout records turned on: the same numbers, and a record of each
    iteration after the resume."""
    tmp, _, _ = runs
    a, b = iteration_rows(tmp / "full"), iteration_rows(tmp / "crash")  # asserts uniqueness
    assert sorted(b) == [1, 2, 3, 4]
    for it in (3, 4):
        for key in COMPARED:
            assert a[it][key] == b[it][key], (it, key)
    records = sorted(p.name for p in (tmp / "crash" / "rollouts").iterdir())
    assert records == ["iter_000003", "iter_000004"]


def test_a_resume_that_changes_the_run_is_refused(runs, tmp_path):
    tmp, _, _ = runs
    resume = f"runner.resume={tmp / 'full'}"
    changed = tiny_config(tmp_path, "x", 5, [resume, "algorithm.learning_rate=0.001"])
    with pytest.raises(ConfigError, match="algorithm.learning_rate is 0.001 here but 0.0003 in"):
        train(changed)
    rc = main(["train", "configs/maniskill/pushcube_ppo.yaml", *tiny_overrides(tmp_path, "x", 5)])
    assert rc == 0  # (a fresh run: nothing to compare)
    assert (
        main(
            [
                "train",
                "configs/maniskill/pushcube_ppo.yaml",
                *tiny_overrides(tmp_path, "x", 5, [resume, "policy.hidden_sizes=[16]"]),
            ]
        )
        == 2
    )


@pytest.mark.parametrize("given", ["", "last", "checkpoints/iter_000003"])
def test_a_run_copied_following_its_links_is_refused_with_how_to_copy_it(runs, tmp_path, given):
    """``cp -r`` or a sync makes RUN/last and RUN/best directories: the resume said the run was
    not a run directory, or failed moving the link (IsADirectoryError) after rewinding it."""
    tmp, _, _ = runs
    copy = tmp_path / "copied"
    shutil.copytree(tmp / "full", copy, symlinks=False)
    rows_before = (copy / "metrics.jsonl").read_text()
    resume = f"runner.resume={copy / given}" if given else f"runner.resume={copy}"
    with pytest.raises(ConfigError) as refused:
        train(tiny_config(tmp_path, "x", 4, [resume]))
    said = str(refused.value)
    assert said.startswith(f"runner.resume: {copy / 'last'} is a directory, not a link: ")
    assert "(cp -a, rsync -a)" in said and "\n" not in said
    assert (copy / "metrics.jsonl").read_text() == rows_before  # (nothing rewound)


def test_a_resume_from_an_older_checkpoint_abandons_the_later_ones(runs, tmp_path, capsys):
    tmp, _, _ = runs
    run = tmp_path / "older"
    shutil.copytree(tmp / "full", run, symlinks=True)
    forced = [
        f"runner.resume={run / 'checkpoints' / 'iter_000002'}",
        "runner.resume_force=true",
        "algorithm.anneal_lr=false",
        "algorithm.learning_rate=0.001",
    ]
    train(tiny_config(tmp_path, "ignored", 4, forced))
    assert "removed the later checkpoints ['iter_000003', 'iter_000004']" in capsys.readouterr().out
    assert sorted(iteration_rows(run)) == [1, 2, 3, 4]  # iterations 3 and 4 once: the new ones
    ckpt = load_checkpoint(run)
    assert ckpt["counters"]["iteration"] == 4
    # the forced learning rate, not the one in iteration 2's optimizer state
    assert ckpt["optimizer"]["param_groups"][0]["lr"] == 0.001
    assert not (tmp_path / "ignored").exists()  # a resumed run writes to its own directory


def test_a_new_run_into_an_earlier_one_is_refused_unless_overwritten(runs, tmp_path):
    tmp, _, _ = runs
    run = tmp_path / "full"
    shutil.copytree(tmp / "full", run, symlinks=True)
    with pytest.raises(ConfigError, match="already holds a run .*runner.overwrite=true"):
        train(tiny_config(tmp_path, "full", 1))
    summary = train(tiny_config(tmp_path, "full", 1, ["runner.overwrite=true"]))
    assert summary["final"]["iteration"] == 1
    assert sorted(iteration_rows(run)) == [1]  # nothing of the earlier run is left
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["iter_000001"]
    assert best_iteration(run) is None


def test_chunks_of_four_with_pipeline_stages_collect_in_lockstep(tmp_path, monkeypatch):
    """In process, pipelined collection steps one action at a time: with chunks of K > 1 a run
    asked for 2 stages steps every environment together, and its numbers are the lockstep run's."""
    from embodied.simulators.workers import WorkerVecEnv

    stepped = []  # environments in each step the worker is sent
    step_async = WorkerVecEnv.step_async

    def recorded(env, actions, env_ids):
        stepped.append(len(env_ids))
        return step_async(env, actions, env_ids)

    monkeypatch.setattr(WorkerVecEnv, "step_async", recorded)
    extra = [
        "policy.chunk_size=4",
        "runner.eval_every=0",
        "env.num_workers=1",  # a worker that could step subsets
    ]
    staged = train(tiny_config(tmp_path, "staged", 4, [*extra, "runner.pipeline_stages=2"]))
    assert stepped[: 8 * 4] == [2] * 8 * 4  # 8 chunks of 4 actions, each stepping both envs
    lockstep = train(tiny_config(tmp_path, "lockstep", 4, [*extra, "runner.pipeline_stages=1"]))
    assert staged["final"]["env_steps"] == 4 * STEPS_PER_ITER  # 2 envs x 8 chunks of 4
    a = iteration_rows(tmp_path / "staged")[1]
    b = iteration_rows(tmp_path / "lockstep")[1]
    untimed = [key for key in a if not key.startswith("time/")]
    assert {key: a[key] for key in untimed} == {key: b[key] for key in untimed}
    untimed_final = {
        k: v
        for k, v in staged["final"].items()
        if not k.startswith(("time/", "eval/policy_ms", "eval/env_steps_per_s", "minutes"))
    }
    assert untimed_final == {k: lockstep["final"][k] for k in untimed_final}


def test_cli_eval_reproduces_the_final_evaluation(runs, capsys):
    tmp, full, _ = runs
    assert main(["eval", str(tmp / "full" / "last"), "--episodes", "2", "--video"]) == 0
    out = capsys.readouterr().out
    result = json.loads(out[out.index("{") :])
    # the same weights, seeds, deterministic actions and thread count (the checkpoint's
    # runner.torch_threads: sums split by thread round otherwise): the final evaluation bit for bit
    for key in ("eval/episodes", "eval/success_rate", "eval/return", "eval/length"):
        assert result[key] == full["final"][key], key
    ckpt_dir = load_checkpoint(tmp / "full")["path"]
    assert (ckpt_dir / "eval.json").is_file() and (ckpt_dir / "eval_2.mp4").stat().st_size > 1000


# about 50 s; test_a_run_stopped_by_sigterm_resumes_to_the_uninterrupted_run covers the same stop
# and resume in process, in the default run
@pytest.mark.slow
def test_sigterm_to_a_training_process(tmp_path):
    """A real `embodied train` process: SIGTERM while it trains; it saves, says where, exits
    with 128 + 15, and the resumed run ends as an uninterrupted one."""
    iterations = 10  # the signal lands in the first few: it is sent once iteration 1 is logged
    extra = [
        "runner.eval_every=0",
        "runner.save_every=0",
        "algorithm.num_steps=40",
        "env.num_workers=1",  # the signal reaches the process group: the worker too
    ]
    cmd = ["train", "configs/maniskill/pushcube_ppo.yaml"]
    steps = f"runner.total_env_steps={iterations * 2 * 40}"
    reference = tiny_overrides(tmp_path, "reference", 1, [*extra, steps])
    assert main([*cmd, *reference]) == 0
    overrides = tiny_overrides(tmp_path, "real", 1, [*extra, steps])
    proc = subprocess.Popen(
        [sys.executable, "-m", "embodied.cli", *cmd, *overrides], stderr=subprocess.PIPE, text=True
    )
    log = tmp_path / "real" / "metrics.jsonl"
    wait_until(
        lambda: log.exists() and "policy/loss" in log.read_text(),
        "iteration 1's row",
        gone=lambda: proc.poll() is not None,
    )
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "Traceback" not in err and "stopped after iteration" in err
    stopped_at = load_checkpoint(tmp_path / "real")["counters"]["iteration"]
    assert 1 <= stopped_at < iterations
    assert main([*cmd, *overrides, f"runner.resume={tmp_path / 'real'}"]) == 0
    a = iteration_rows(tmp_path / "reference")
    b = iteration_rows(tmp_path / "real")
    assert sorted(b) == list(range(1, iterations + 1))
    for it in range(1, iterations + 1):
        for key in COMPARED:
            assert a[it][key] == b[it][key], (it, key)


def test_every_commands_help_prints_its_text_as_written(capsys):
    """argparse %-formats a help= text but not a description without ``%(prog)``: a ``%%``
    there reached the user (``embodied report --help`` said "95%% intervals")."""
    import argparse

    from embodied.cli import build_parser

    commands = next(
        a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)
    ).choices
    assert len(commands) >= 10
    for command in commands:
        with pytest.raises(SystemExit):
            main([command, "--help"])
        out = capsys.readouterr().out
        assert "%%" not in out and "%(" not in out, command


def test_cli_help_and_errors(tmp_path):
    res = subprocess.run(
        [sys.executable, "-m", "embodied.cli", "--help"], capture_output=True, text=True
    )
    assert res.returncode == 0 and "train" in res.stdout and "eval" in res.stdout
    assert main(["eval", str(tmp_path / "no_such_run")]) == 2
    res = subprocess.run(
        [sys.executable, "-m", "embodied.cli", "train", str(tmp_path / "missing.yaml")],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 2
    assert "config file not found" in res.stderr and "Traceback" not in res.stderr


@pytest.mark.parametrize("iterations, noted", [(1, True), (2, False)])
def test_a_budget_spent_by_the_first_iteration_is_noted(tmp_path, capsys, iterations, noted):
    """A step budget sized for few environments, run with many (the warp config's 200,000 at
    4096 worlds x 50 steps): the run says its first iteration spends it."""
    overrides = [o for o in tiny_overrides(tmp_path, "short", iterations) if "workers" not in o]
    overrides.append("runner.eval_every=0")
    train(load_config(TrainConfig, "configs/mujoco/reach_ppo.yaml", overrides)[0])
    note = (
        f"note: runner.total_env_steps={STEPS_PER_ITER * iterations} is spent by the first "
        "iteration, whose round is 16 env steps (2 environments x 8 steps)"
    )
    assert (note in capsys.readouterr().out.splitlines()) == noted


def test_the_first_iteration_note_counts_grpos_rounds():
    """PPO collects one round an iteration, GRPO up to max_rounds: 4096 x 50 = 204,800 steps."""
    from embodied.runner import first_iteration_note

    assert first_iteration_note(204_800, 4096, 50, 1) == (
        "note: runner.total_env_steps=204,800 is spent by the first iteration, whose round is "
        "204,800 env steps (4096 environments x 50 steps)"
    )
    assert first_iteration_note(204_801, 4096, 50, 1) == ""
    assert first_iteration_note(819_200, 4096, 50, 4) == (
        "note: runner.total_env_steps=819,200 may be spent by the first iteration, which "
        "collects up to 4 rounds of 204,800 env steps (4096 environments x 50 steps)"
    )
    assert first_iteration_note(204_800, 4096, 50, 4).startswith(
        "note: runner.total_env_steps=204,800 is spent by the first iteration, which collects"
    )
    assert first_iteration_note(819_201, 4096, 50, 4) == ""
