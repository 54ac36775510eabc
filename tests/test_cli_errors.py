"""Errors users can act on: every bad input of every command is one line on stderr,
``embodied: error: <message naming the culprit>``, exit code 2, no traceback. Nothing here opens a
port or touches an arm (or its twin) before failing, and no simulator is built for a bad input
the config shows (those are patched to fail the test); BUILT_CASES are known only from the built
environment's spec."""

import importlib.util
import os
import shutil
import socket
import subprocess
import sys

import pytest
from cli_error_cases import BUILT_CASES, CASES, TINY, M
from one_line import fill, one_line_error, params, refuse_hardware, refuse_simulators, run_cli

from embodied.cli import main


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    """{placeholder: path} for the bad inputs: trained runs (MuJoCo reach on joint state, and
    one that reads the goal), damaged copies of a checkpoint and bad config files."""
    root = tmp_path_factory.mktemp("cli_errors")
    train = ["train", "configs/mujoco/reach_ppo.yaml", f"runner.output_dir={root}", *TINY]
    assert main([*train, "runner.name=run"]) == 0
    assert main([*train, "runner.name=goal", "policy.use_privileged=true"]) == 0
    ckpt = (root / "run" / "last").resolve()
    damaged = {
        "corrupt_meta": ("meta.json", "{not json"),
        "empty_meta": ("meta.json", "{}"),
        "corrupt_weights": ("model.safetensors", "garbage"),
        "corrupt_trainer": ("trainer.pt", "garbage\n"),  # (pickle reads a line: a ValueError)
        "list_meta": ("meta.json", "[]"),
    }
    for name, (file, text) in damaged.items():
        shutil.copytree(ckpt, root / name)
        (root / name / file).write_text(text)
    shutil.copytree(ckpt, root / "no_weights")  # (copied without its weights file)
    (root / "no_weights" / "model.safetensors").unlink()
    files = {
        "empty.yaml": "",
        "comments.yaml": "# nothing but a comment\n",
        "invalid.yaml": "env: {num_envs: 4\n",
        "list.yaml": "- a\n- b\n",
        "vla_ppo.yaml": "env: {simulator: mujoco, obs_mode: rgb}\n"
        "policy: {name: vla, value_head: false}\nalgorithm: {name: ppo}\n",
        "vla_state.yaml": "env: {simulator: mujoco, obs_mode: state}\n"
        "policy: {name: vla}\nalgorithm: {name: grpo}\n",
        "vla_rgb.yaml": "env: {simulator: mujoco, obs_mode: rgb, num_envs: 2}\n"
        "policy: {name: vla}\nalgorithm: {name: ppo}\n",
        "demos_no_expert.yaml": "episodes: 2\n",
        "no_tasks.yaml": "tasks: []\n",
        "cycle_a.yaml": "defaults: [cycle_b.yaml]\n",
        "cycle_b.yaml": "defaults: [cycle_a.yaml]\n",
        "defaults_text.yaml": "defaults: cycle_a.yaml\n",
    }
    for name, text in files.items():
        (root / name).write_text(text)
    (root / "dataset" / "meta").mkdir(parents=True)
    (root / "dataset" / "meta" / "info.json").write_text("{}")
    (root / "no_checkpoint").mkdir()
    (root / "leftover" / "data").mkdir(parents=True)  # (what an interrupted recording left)
    (root / "broken").symlink_to(root / "nowhere")
    for name, text in (("cut_record", '{"config": '), ("list_record", "[]")):
        (root / name / "rollouts" / "iter_000001").mkdir(parents=True)
        (root / name / "rollouts" / "iter_000001" / "record.json").write_text(text)
    return {
        "root": str(root),
        "run": str(root / "run"),
        "ckpt": str(ckpt),
        "goal": str(root / "goal" / "last"),
    }


@pytest.fixture(autouse=True)
def nothing_opened(monkeypatch):
    """Bad inputs fail before an arm (or its twin) connects or a server listens."""
    refuse_hardware(monkeypatch)


@pytest.mark.parametrize("argv, culprits", params(CASES) + params(BUILT_CASES))
def test_bad_input_is_one_line_naming_the_culprit(argv, culprits, paths, capsys, monkeypatch):
    if (argv, culprits) not in BUILT_CASES:  # (the config shows it: no simulator may be built)
        refuse_simulators(monkeypatch)
    rc, err = run_cli([fill(a, paths) for a in argv], capsys)
    one_line_error(rc, err, *[fill(c, paths) for c in culprits])


def test_a_run_that_cannot_start_leaves_no_run_directory(paths, capsys):
    out = f"{paths['root']}/never"
    bad = [f"runner.init_from={paths['root']}/corrupt_weights", "policy.privileged_keys=[nope]"]
    if importlib.util.find_spec("mani_skill") is not None:
        bad.append("env.simulator=maniskill")  # with reach_ppo's task, 'reach'
    for override in bad:
        rc, err = run_cli(["train", M, f"runner.output_dir={out}", override], capsys)
        one_line_error(rc, err)
    assert not os.path.exists(out)


def test_a_taken_port_is_one_line_naming_it(paths, capsys, monkeypatch):
    monkeypatch.undo()  # this server really tries to listen; its port is taken
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = ["serve", paths["ckpt"], "--host", "127.0.0.1", "--port", str(port)]
        rc, err = run_cli(argv, capsys)
    one_line_error(rc, err, f"127.0.0.1:{port}")


@pytest.mark.skipif(importlib.util.find_spec("lerobot") is None, reason="needs LeRobot")
def test_a_driver_message_over_several_lines_is_one_line(paths, capsys, monkeypatch):
    monkeypatch.undo()  # LeRobot's driver tries a serial port that does not exist
    argv = ["deploy", paths["ckpt"], "--robot", "so101", "--robot.port", "/dev/ttyNOPE"]
    rc, err = run_cli(argv, capsys)
    one_line_error(rc, err, "/dev/ttyNOPE")


@pytest.mark.parametrize(
    "argv, culprit",
    [
        (["train", "{root}/empty.yaml"], "config file is empty"),
        (["eval", "{root}/corrupt_meta"], "corrupt_meta/meta.json"),
    ],
)
def test_no_traceback_reaches_the_terminal(argv, culprit, paths):
    cmd = [sys.executable, "-m", "embodied.cli", *[fill(a, paths) for a in argv]]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    one_line_error(res.returncode, res.stderr, culprit)
    assert res.stdout == ""


def test_an_episode_that_cannot_begin_keeps_what_the_episodes_before_it_gave(
    paths, capsys, monkeypatch
):
    """The second episode's start pose is not reached: the line names it and what the first
    episode gave (its result was lost with the run)."""
    import embodied.deploy

    monkeypatch.undo()  # (the twin connects here)
    begin = embodied.deploy._begin
    calls = []

    def second_fails(*args):
        calls.append(1)
        return begin(*args) if len(calls) == 1 else False

    monkeypatch.setattr(embodied.deploy, "_begin", second_fails)
    argv = ["deploy", paths["ckpt"], "--robot", "so101-sim", "--episodes", "3"]
    rc, err = run_cli([*argv, "--episode-seconds", "0.2"], capsys)
    one_line_error(rc, err, "episode 1: the arm did not reach its start pose")
    assert "; before it: 1 episode(s) of " in err and " steps, success in " in err


def test_a_served_policys_first_call_may_take_longer_than_the_episodes_calls(
    paths, capsys, monkeypatch
):
    """deploy --server: the warm-up's request gets WARM_UP_S, the episodes' the client's
    timeout (--robot.watchdog's); a cold server's first call was held to 2 s."""
    import numpy as np

    from embodied.deploy import WARM_UP_S

    monkeypatch.undo()  # (the twin connects here)
    asked = []

    class Server:
        def __init__(self, url, agreed, timeout_s):
            self.timeout_s = timeout_s

        def infer(self, wire, timeout_s=None):
            asked.append(timeout_s)
            return np.zeros((1, 6), np.float32)

        def close(self):
            pass

    monkeypatch.setattr("embodied.robots.server.PolicyClient", Server)
    argv = ["deploy", paths["ckpt"], "--robot", "so101-sim", "--server", "ws://127.0.0.1:1"]
    rc, _ = run_cli([*argv, "--episode-seconds", "0.2"], capsys)
    assert rc == 0 and asked[0] == WARM_UP_S and len(asked) > 1 and set(asked[1:]) == {None}
