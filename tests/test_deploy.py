"""`embodied deploy` and `embodied serve` end to end on the digital twin."""

import json
import logging
import os
import signal
import subprocess
import sys
import threading
from collections import Counter

import numpy as np
import pytest
from clocks import CEILING_S, wait_until

os.environ.setdefault("MUJOCO_GL", "egl")

from tiny_runs import TINY_REACH  # noqa: E402

from embodied.cli import main  # noqa: E402
from embodied.dataset import DemoDataset  # noqa: E402

TINY = [*TINY_REACH, "policy.hidden_sizes=[32]"]
# a watchdog no inference outlasts on a busy machine: an episode runs all its steps (a slow one
# holds a step; the watchdog's steps are exact on a fake clock in tests/test_control.py)
PATIENT = ["--robot.watchdog", str(CEILING_S)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Reach policies on joint state only (deployable), on joints and the goal a user gives
    (deployable with a goal) and on everything the simulator knows (not deployable)."""
    root = tmp_path_factory.mktemp("ckpt")
    out = {}
    inputs = {
        "state_only": ["policy.use_privileged=false"],
        "told_goal": ["policy.privileged_keys=[goal_pos]"],
        "with_goal": ["policy.use_privileged=true"],
    }
    for name, overrides in inputs.items():
        argv = [
            "train",
            "configs/mujoco/reach_ppo.yaml",
            f"runner.output_dir={root}",
            f"runner.name={name}",
            *overrides,
            *TINY,
        ]
        assert main(argv) == 0
        out[name] = str(root / name / "last")
    return out


def deploy(args, capsys):
    rc = main(["deploy", *args])
    captured = capsys.readouterr()
    return rc, (json.loads(captured.out[captured.out.index("{") :]) if rc == 0 else captured.err)


def test_deploy_on_the_twin_records_each_episode_and_ends_at_the_safe_pose(
    checkpoints, tmp_path, capsys
):
    rc, summary = deploy(
        [
            checkpoints["state_only"],
            "--robot",
            "so101-sim",
            "--episodes",
            "2",
            "--camera",
            "wrist=wrist",
            "--episode-seconds",
            "0.75",
            "--record",
            str(tmp_path / "rec"),
            *PATIENT,
        ],
        capsys,
    )
    assert rc == 0, summary
    assert summary["hz"] == 20.0  # the MuJoCo arm's control rate, which the policy was trained at
    assert [e["steps"] for e in summary["episodes"]] == [15, 15] and all(
        e["end"] == "done" for e in summary["episodes"]
    )
    # the policy acted (one-action chunks inferred in the background); how many steps it acted in
    # depends on the machine's speed: the loop runs in real time here (exact on a fake clock in
    # tests/test_control.py)
    assert all(e["acted"] >= 1 for e in summary["episodes"])
    assert summary["torque_off_at_safe_pose"] is True
    in_episodes = sum((Counter(e["interventions"]) for e in summary["episodes"]), Counter())
    assert summary["interventions"] == dict(in_episodes)
    for i in range(2):
        data = DemoDataset.load(tmp_path / "rec" / f"episode_{i:04d}")
        assert len(data) == 15 and data.actions.shape == (15, 6)  # the commands sent, radians
        assert data.info["embodied"]["action_space"] == "joint_pos"  # (absolute, not deltas)
        assert data.tasks == ["move the gripper to the green ball"]  # the policy's own words
        assert (
            data.images["wrist"].shape[0] == 15
            and (tmp_path / "rec" / f"episode_{i:04d}" / "wrist.mp4").stat().st_size > 0
        )


def test_deploy_through_the_server_and_the_watchdog_when_it_stops(checkpoints, capsys, monkeypatch):
    """The robot's side builds no policy where a server acts (a VLA's weights and its VLM
    directory need only be on the server's machine)."""
    from embodied.deploy import serve

    server = serve(checkpoints["state_only"], host="127.0.0.1", port=0)
    built = lambda *args, **kw: pytest.fail("the robot's side built the policy")  # noqa: E731
    monkeypatch.setattr("embodied.demos.load_policy", built)

    finished = threading.Event()

    def stop_mid_run():  # the server goes away once it has answered 10 requests
        answered = lambda: server.stats["requests"] >= 10 or finished.is_set()  # noqa: E731
        wait_until(answered, "10 requests to the server")
        server.stop()

    stopper = threading.Thread(target=stop_mid_run, daemon=True)
    stopper.start()
    try:
        rc, summary = deploy(
            [
                checkpoints["state_only"],
                "--robot",
                "so101-sim",
                "--episode-seconds",
                "300",  # the watchdog ends it once the server is gone, however slow the machine
                "--server",
                f"ws://127.0.0.1:{server.port}",
            ],
            capsys,
        )
    finally:
        finished.set()  # (a deploy that ended early: the server goes now)
        stopper.join()
    assert rc == 0, summary
    (episode,) = summary["episodes"]
    # it ran, then lost the server and the watchdog stopped it (when it holds and stops, in steps,
    # tests/test_control.py shows on a fake clock; here wall time decides, so only that it fired)
    assert episode["end"] == "watchdog" and episode["watchdog"]["stop"] == 1
    assert episode["inference_errors"] >= 1 and episode["acted"] >= 1
    assert summary["torque_off_at_safe_pose"] is True


def test_a_delta_policy_at_another_rate_is_refused(checkpoints, capsys):
    rc, err = deploy(
        [
            checkpoints["state_only"],
            "--robot",
            "so101-sim",
            "--hz",
            "50",
            "--episode-seconds",
            "0.2",
        ],
        capsys,
    )
    assert rc == 2 and "trained at 20 Hz" in err


def test_a_checkpoint_that_reads_simulator_state_is_refused_on_a_real_arm(checkpoints, capsys):
    # refused before anything connects: no serial port is opened
    argv = [checkpoints["with_goal"], "--robot", "so101", "--robot.port", "/dev/ttyNONE"]
    rc, err = deploy([*argv, "--goal", "0.2,0,0.1"], capsys)
    assert rc == 2 and err.strip() == (
        "embodied: error: the checkpoint cannot drive this arm: simulator-only inputs ['tcp_pos'] "
        "(train with policy.use_privileged=false, or policy.privileged_keys=[goal_pos])"
    )


def test_the_twin_gives_a_policy_what_its_simulator_knows(checkpoints, capsys):
    # the tool point and the goal come from the twin's simulator, as in training
    argv = [checkpoints["with_goal"], "--robot", "so101-sim", "--episode-seconds", "0.3"]
    rc, summary = deploy([*argv, *PATIENT], capsys)
    assert rc == 0, summary
    assert summary["episodes"][0]["steps"] == 6 and "success" in summary["episodes"][0]


def test_a_policy_told_its_goal_needs_one_on_a_real_arm(checkpoints, capsys):
    # refused before anything connects: no serial port is opened
    argv = [checkpoints["told_goal"], "--robot", "so101", "--robot.port", "/dev/ttyNONE"]
    rc, err = deploy(argv, capsys)
    assert rc == 2 and err.strip() == (
        "embodied: error: the checkpoint cannot drive this arm: the input goal_pos (give --goal "
        "X,Y,Z: metres in the arm's base frame)"
    )
    rc, err = deploy([*argv, "--goal", "0.2,0.1"], capsys)
    assert rc == 2 and err.strip() == (
        "embodied: error: --goal '0.2,0.1': expected 3 comma-separated finite numbers, one per "
        "axis (metres: x,y,z)"
    )


def test_the_twin_judges_each_episode_of_a_policy_told_its_goal(checkpoints, capsys, tmp_path):
    argv = [checkpoints["told_goal"], "--robot", "so101-sim", "--episode-seconds", "0.5"]
    argv += PATIENT  # (an episode the watchdog ended would end the deploy: one episode, not 2)
    rc, summary = deploy([*argv, "--episodes", "2", "--seed", "7"], capsys)
    assert rc == 0, summary
    from embodied.simulators.mujoco import MuJoCoConfig, make_env

    with make_env(MuJoCoConfig(task="reach", num_envs=2)) as env:  # eval --seed 7's episodes
        drawn = env.reset(seed=[3_000_000_007, 3_000_000_008]).privileged["goal_pos"]
    for episode, goal in zip(summary["episodes"], drawn.tolist()):
        assert episode["goal"] == pytest.approx(goal, abs=1e-4)  # the task's own scene per seed
        assert isinstance(episode["success"], bool) and "success_at_end" in episode
    assert summary["success_rate"] == sum(e["success"] for e in summary["episodes"]) / 2
    record = ["--record", str(tmp_path / "rec")]
    rc, summary = deploy([*argv, "--goal", "0.2,0.05,0.1", *record], capsys)  # the user's goal
    assert rc == 0 and summary["episodes"][0]["goal"] == [0.2, 0.05, 0.1]
    # the recording keeps what the policy read besides the arm, frame by frame (SFT needs it)
    data = DemoDataset.load(tmp_path / "rec" / "episode_0000")
    goals = data.privileged["goal_pos"]  # f32 [T, 3]
    assert len(goals) == summary["episodes"][0]["steps"] == len(data)
    np.testing.assert_allclose(goals.numpy(), [[0.2, 0.05, 0.1]] * len(goals), atol=1e-6)


def test_serve_runs_the_policy_on_its_device_and_answers_as_in_process(checkpoints):
    """`embodied serve --device` (auto by default: cuda where the machine has it, README: "on
    the GPU host"); on the CPU here the served chunk equals the policy's own."""
    import torch

    from embodied.cli import parse
    from embodied.deploy import serve, serve_device
    from embodied.deploy_policy import load_deployable, policy_chunk, wire_to_obs
    from embodied.robots.server import PolicyClient

    ckpt = checkpoints["state_only"]
    auto = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert serve_device(parse(["serve", ckpt]).device) == auto
    assert serve_device("cpu") == torch.device("cpu")
    policy, spec, agreed, _ = load_deployable(ckpt, "cpu")
    state = np.linspace(-0.5, 0.5, spec.obs.state_dim, dtype=np.float32)  # f32 [S]
    msg = {"state": state, "images": {}, "instruction": spec.instructions[0]}
    server = serve(ckpt, host="127.0.0.1", port=0, device=torch.device("cpu"))
    try:
        client = PolicyClient(f"ws://127.0.0.1:{server.port}", agreed)
        try:
            served = client.infer(msg)  # f32 [K, A]
        finally:
            client.close()
    finally:
        server.stop()
    np.testing.assert_array_equal(served, policy_chunk(policy, wire_to_obs(msg, spec)))


def test_a_mismatched_server_is_refused(checkpoints, capsys):
    from embodied.deploy import serve

    server = serve(checkpoints["with_goal"], host="127.0.0.1", port=0)
    try:
        rc, err = deploy(
            [
                checkpoints["state_only"],
                "--robot",
                "so101-sim",
                "--episode-seconds",
                "0.2",
                "--server",
                f"ws://127.0.0.1:{server.port}",
            ],
            capsys,
        )
    finally:
        server.stop()
    assert rc == 2 and "contract mismatch" in err


def test_recordings_survive_a_crash_of_the_deploy_process(checkpoints, tmp_path):
    rec = tmp_path / "rec"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "embodied.cli",
            "deploy",
            checkpoints["state_only"],
            "--robot",
            "so101-sim",
            "--episodes",
            "50",
            "--episode-seconds",
            "0.75",
            "--record",
            str(rec),
            *PATIENT,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        stdin=subprocess.DEVNULL,
    )
    try:
        wait_until(
            (rec / "episode_0001" / "meta" / "info.json").exists,
            "the second episode's recording",
            gone=lambda: proc.poll() is not None,
        )
        os.kill(proc.pid, signal.SIGKILL)  # no clean-up of any kind
    finally:
        proc.wait(30)
    done = sorted(p.name for p in rec.iterdir() if (p / "meta" / "info.json").exists())
    assert done[:2] == ["episode_0000", "episode_0001"]
    for name in done:
        assert len(DemoDataset.load(rec / name)) == 15


def test_a_pickcube_so100_policy_trained_in_maniskill_deploys_to_the_twin_unchanged(
    tmp_path, capsys
):
    # ManiSkill's SO-100 has LeRobot's joints: its columns and actions are named after them, and a
    # policy on joint state only (no tool pose, no privileged) deploys as it is
    pytest.importorskip("mani_skill")
    assert (
        main(
            [
                "train",
                "configs/maniskill/pickcube_ppo.yaml",
                "env.task=PickCubeSO100-v1",
                f"runner.output_dir={tmp_path}",
                "runner.name=so100",
                "env.proprioception=[qpos,qvel]",
                "env.num_workers=0",
                "policy.use_privileged=false",
                "env.control_mode=pd_joint_delta_pos",
                *[a for a in TINY if not a.startswith("env.render")],
            ]
        )
        == 0
    )
    from embodied.deploy_policy import load_deployable

    _, spec, _, _ = load_deployable(tmp_path / "so100" / "last")
    assert spec.obs.state_names[:2] == ("shoulder_pan.pos", "shoulder_lift.pos")
    # (pd_joint_delta_pos adds its deltas to the joints as read: deploy adds them so)
    assert spec.action.names[-1] == "gripper" and spec.action.deltas_from == "measured"
    argv = [str(tmp_path / "so100" / "last"), "--robot", "so101-sim", "--episode-seconds", "0.5"]
    rc, summary = deploy([*argv, *PATIENT], capsys)
    assert rc == 0, summary
    (episode,) = summary["episodes"]
    assert summary["hz"] == spec.action.control_hz == 20.0 and episode["steps"] == 10  # 0.5 s
    # every inference gave a chunk and the arm acted; in how many steps depends on the machine's
    # speed (the loop runs in real time here; exact on a fake clock in test_control.py)
    assert episode["end"] == "done" and episode["inference_errors"] == 0 and episode["acted"] >= 1


def test_a_stop_before_the_first_episode_and_a_second_signal_still_end_at_the_safe_pose(
    checkpoints, capsys, monkeypatch, caplog
):
    """A stop that comes before any episode began ends the deploy with no episode; a Ctrl-C
    while the arm goes to its safe pose does not cut that short (it used to raise
    KeyboardInterrupt there, torque on, mid-move)."""
    import embodied.deploy as deploy_module
    import embodied.robots.shutdown as shutdown_module

    shut_down = shutdown_module.shut_down

    def interrupted_shut_down(*args, **kwargs):
        signal.raise_signal(signal.SIGINT)  # a second Ctrl-C as the shutdown begins
        return shut_down(*args, **kwargs)

    monkeypatch.setattr(deploy_module, "_warm_up", lambda *a: signal.raise_signal(signal.SIGUSR1))
    monkeypatch.setattr(shutdown_module, "shut_down", interrupted_shut_down)
    caplog.set_level(logging.WARNING, logger="embodied.robots.control")
    args = [checkpoints["state_only"], "--robot", "so101-sim", "--episodes", "3"]
    rc, summary = deploy(args, capsys)
    assert rc == 0, summary
    assert summary["episodes"] == [] and summary["emergency_stop"] == "SIGUSR1"
    assert summary["torque_off_at_safe_pose"] is True
    assert "already stopping (SIGINT)" in caplog.text


def test_an_arm_whose_limits_cannot_be_read_is_released_with_torque_off(
    checkpoints, capsys, monkeypatch
):
    """An error between connecting and the safe shutdown's start (here the calibration's joint
    limits) leaves the arm as LeRobot's connect found it: torque off, disconnected."""
    import embodied.robots.arm as arm
    import embodied.twin as twin

    made = []
    make_twin_robot = twin.make_twin_robot

    def recorded(*args, **kwargs):
        made.append(make_twin_robot(*args, **kwargs))
        return made[-1]

    def unreadable(robot, cfg, **overrides):
        raise ValueError("calibration: range_min above range_max")

    monkeypatch.setattr(twin, "make_twin_robot", recorded)
    monkeypatch.setattr(arm, "default_safety", unreadable)
    rc, err = deploy([checkpoints["state_only"], "--robot", "so101-sim"], capsys)
    assert rc == 2 and "range_min above range_max" in err
    robot, _, port = made[0]
    assert not any(port.torque().values()) and not robot.is_connected


def test_a_first_inference_that_fails_ends_the_deploy_before_the_first_episode(
    checkpoints, capsys, monkeypatch
):
    """No episode begins (no move to its start pose, no step): the arm goes from where it was
    connected straight to its safe pose."""
    import embodied.deploy as deploy_module

    def out_of_memory(policy, obs):
        raise RuntimeError("out of memory")

    begun = []
    monkeypatch.setattr(deploy_module, "policy_chunk", out_of_memory)
    monkeypatch.setattr(deploy_module, "_begin", lambda *args: begun.append(args))
    rc, err = deploy([checkpoints["state_only"], "--robot", "so101-sim"], capsys)
    assert rc == 2 and begun == []
    assert "the first inference failed, before the first episode: out of memory" in err


def test_an_arm_left_short_of_its_safe_pose_is_an_exit_code_not_a_quiet_field(
    checkpoints, capsys, monkeypatch
):
    import embodied.robots.shutdown as shutdown_module

    monkeypatch.setattr(
        shutdown_module, "_move_to_safe_pose", lambda *a, **k: False
    )  # a timed-out move
    args = [checkpoints["state_only"], "--robot", "so101-sim", "--episode-seconds", "0.3"]
    rc = main(["deploy", *args])
    captured = capsys.readouterr()
    summary = json.loads(captured.out[captured.out.index("{") :])
    assert rc == 1 and summary["torque_off_at_safe_pose"] is False
    assert "did not reach its safe pose: its torque stays on" in captured.err
    monkeypatch.undo()  # a torque off that fails after the episodes: their results are said
    no_status = ConnectionError("torque off: no status packet")
    monkeypatch.setattr(shutdown_module, "_torque_off", lambda _, rep: rep.failed("off", no_status))
    assert main(["deploy", *args]) == 2
    assert "before it: 1 episode(s) of 6 steps" in capsys.readouterr().err


def test_a_goal_the_user_gives_reaches_the_policy_from_its_first_inference(
    checkpoints, capsys, monkeypatch
):
    """On a real arm the policy's goal is the one given (``--goal``), read at every inference,
    the one before the first move included. The twin here stands in for the arm, its scene not
    read (as for a policy trained on another simulator)."""
    import embodied.deploy as deploy_module

    monkeypatch.setattr(deploy_module, "_sim_scene", lambda twin, train_cfg: False)
    goals = []
    policy_chunk = deploy_module.policy_chunk

    def recorded(policy, obs):
        goals.append(obs.privileged["goal_pos"][0].tolist())
        return policy_chunk(policy, obs)

    monkeypatch.setattr(deploy_module, "policy_chunk", recorded)
    argv = [checkpoints["told_goal"], "--robot", "so101-sim", "--episode-seconds", "0.3"]
    rc, summary = deploy([*argv, "--goal", "0.2,0.05,0.1"], capsys)
    assert rc == 0, summary
    assert len(goals) >= 2 and all(g == pytest.approx([0.2, 0.05, 0.1]) for g in goals)


def test_a_camera_that_stops_giving_frames_is_one_error_and_the_arm_goes_to_its_safe_pose(
    checkpoints, capsys, monkeypatch
):
    """LeRobot's cameras raise RuntimeError (or TimeoutError) when no frame comes: one line, not a
    traceback, after the shutdown (which reads the bus alone) has switched the torque off."""
    import embodied.twin_camera as twin_camera

    def no_frame(self, max_age_ms: int = 500):  # LeRobot's get_observation reads the latest
        raise RuntimeError(f"{self}: no frame in {max_age_ms} ms")

    released = []
    monkeypatch.setattr(twin_camera.TwinCamera, "read_latest", no_frame)
    import embodied.robots.shutdown as shutdown_module

    torque_off = shutdown_module.SafeShutdown.__exit__

    def exit_and_note(self, *exc):
        out = torque_off(self, *exc)
        released.append(self.torque_off)
        return out

    monkeypatch.setattr(shutdown_module.SafeShutdown, "__exit__", exit_and_note)
    args = [checkpoints["state_only"], "--robot", "so101-sim", "--camera", "wrist=wrist"]
    rc, err = deploy(args, capsys)
    assert rc == 2 and released == [True]
    (line,) = err.strip().splitlines()
    assert line.startswith("embodied: error: ") and "no frame in" in line
