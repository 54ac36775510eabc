"""End to end on a tiny budget: train -> checkpoint -> resume -> eval, and resume determinism."""

import json
import subprocess
import sys

import pytest

import embodied.trainer
from embodied.checkpoint import load_checkpoint
from embodied.cli import main
from embodied.config import load_config
from embodied.trainer import TrainConfig, train

TINY = [
    "env.num_envs=2",
    "env.num_workers=1",
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
]
STEPS_PER_ITER = 2 * 8


def tiny_config(tmp_path, name, iterations, extra=()):
    cfg, _ = load_config(
        TrainConfig,
        "configs/maniskill/pushcube_ppo.yaml",
        TINY
        + [
            f"runner.output_dir={tmp_path}",
            f"runner.name={name}",
            f"runner.total_env_steps={iterations * STEPS_PER_ITER}",
            *extra,
        ],
    )
    return cfg


def iteration_rows(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["iteration"]: r for r in rows if "policy/loss" in r}


class InterruptingLogger(embodied.trainer.RunLogger):
    """Logs as usual, then interrupts the run (as Ctrl-C would) once iteration 2 is logged."""

    def log(self, metrics, step, **extra):
        super().log(metrics, step, **extra)
        if extra.get("iteration") == 2:
            raise KeyboardInterrupt


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("runs")
    full = train(tiny_config(tmp, "full", 3))
    # the same config, interrupted after iteration 2 (before its periodic checkpoint), then resumed
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(embodied.trainer, "RunLogger", InterruptingLogger)
        with pytest.raises(KeyboardInterrupt):
            train(tiny_config(tmp, "split", 3, ["runner.save_every=0"]))
    assert load_checkpoint(tmp / "split")["counters"]["iteration"] == 2  # saved on the interrupt
    resumed = train(
        tiny_config(tmp, "ignored", 3, ["runner.save_every=0", f"runner.resume={tmp / 'split'}"])
    )
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
    assert (
        metrics["final"]["eval/episodes"] == 2
        and 0.0 <= metrics["final"]["eval/success_rate"] <= 1.0
    )
    assert metrics["final"]["env_steps"] == 3 * STEPS_PER_ITER
    assert [e["iteration"] for e in metrics["evals"]] == [2]
    ckpt = load_checkpoint(run)
    assert ckpt["counters"]["iteration"] == 3 and "state_encoder.norm.mean" in ckpt["model"]
    assert (
        float(ckpt["model"]["state_encoder.norm.count"]) == 3 * STEPS_PER_ITER
    )  # statistics saved
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        "iter_000001",
        "iter_000002",
        "iter_000003",
    ]


def test_resume_continues_the_run_and_reproduces_the_next_losses(runs):
    tmp, full, resumed = runs
    assert resumed["run_dir"] == str(
        tmp / "split"
    )  # the resumed run keeps writing to its directory
    a, b = iteration_rows(tmp / "full"), iteration_rows(tmp / "split")
    assert sorted(b) == [1, 2, 3]
    for it in (1, 2, 3):
        for key in (
            "policy/loss",
            "value/loss",
            "policy/entropy",
            "policy/approx_kl",
            "value/explained_variance",
        ):
            assert a[it][key] == b[it][key], (it, key)
    assert load_checkpoint(tmp / "split")["counters"]["env_steps"] == 3 * STEPS_PER_ITER


def test_cli_eval_of_a_checkpoint(runs, capsys):
    tmp, _, _ = runs
    assert main(["eval", str(tmp / "full" / "last"), "--episodes", "3", "--video"]) == 0
    out = capsys.readouterr().out
    result = json.loads(out[out.index("{") :])
    assert result["eval/episodes"] == 3
    ckpt_dir = load_checkpoint(tmp / "full")["path"]
    assert (ckpt_dir / "eval.json").is_file() and (ckpt_dir / "eval_3.mp4").stat().st_size > 1000


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
    assert (
        res.returncode == 2
        and "config file not found" in res.stderr
        and "Traceback" not in res.stderr
    )
