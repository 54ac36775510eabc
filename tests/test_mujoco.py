"""The MuJoCo desktop-arm tasks pass the environment contract (state and rgb), are reproducible
from their seeds, move the arm where the servos are told, and score with the documented
reward/success."""

import math

import numpy as np
import pytest
import torch

pytest.importorskip("mujoco")

from embodied.contract import check_env  # noqa: E402
from embodied.schema import UserError  # noqa: E402
from embodied.simulators.mujoco import TASKS, MuJoCoConfig, MuJoCoEnv  # noqa: E402


@pytest.mark.parametrize("task", sorted(TASKS))
@pytest.mark.parametrize("obs_mode", ["state", "rgb"])
def test_contract(task, obs_mode):
    with MuJoCoEnv(
        MuJoCoConfig(
            task=task,
            obs_mode=obs_mode,
            cameras=["base_camera", "wrist_camera"],
            num_envs=3,
            image_size=32,
            render_size=32,
            max_episode_steps=6,
        )
    ) as env:
        check_env(env, seed=1)  # keys, shapes, dtypes, partial reset, auto-reset with final_obs
        assert env.spec.obs.privileged["tcp_pos"] == (3,) and env.spec.action.names[-1] == "gripper"


def test_same_seed_same_trajectory():
    def run():
        with MuJoCoEnv(MuJoCoConfig(task="push", num_envs=2)) as env:
            env.reset(seed=[5, 6])
            g = torch.Generator().manual_seed(0)
            for _ in range(10):
                out = env.step(torch.rand(2, 6, generator=g) * 0.2 - 0.1)
            return out.obs.state, out.obs.privileged["cube_pos"]

    (a, ca), (b, cb) = run(), run()
    assert torch.equal(a, b) and torch.equal(ca, cb)


def test_a_numpy_integer_seed_is_an_int_seed():
    with MuJoCoEnv(MuJoCoConfig(task="push", num_envs=2)) as env:
        given = env.reset(seed=np.int64(3))  # (a TypeError before: not iterable)
        plain = env.reset(seed=3)
        assert torch.equal(given.state, plain.state)
        assert torch.equal(given.privileged["cube_pos"], plain.privileged["cube_pos"])
        assert not torch.equal(plain.privileged["cube_pos"][0], plain.privileged["cube_pos"][1])


def test_a_non_finite_action_is_a_one_line_error_and_steps_nothing():
    """A NaN delta held world 0's servo target at NaN until its episode ended (MuJoCo zeroed the
    control and the arm drifted); now the step refuses it before any world moves."""
    with MuJoCoEnv(MuJoCoConfig(task="push", num_envs=3)) as env:
        env.reset(seed=[1, 2, 3])
        bad = torch.zeros(3, 6)
        bad[1, 0] = float("nan")
        bad[2, 4] = float("inf")
        with pytest.raises(UserError) as raised:
            env.step(bad)
        message = str(raised.value)
        assert message == (
            "MuJoCo push: the actions of environments [1, 2] are not finite "
            "(first: [nan, 0.0, 0.0, 0.0, 0.0, 0.0])"
        )
        after = env.step(torch.zeros(3, 6)).obs.state
    with MuJoCoEnv(MuJoCoConfig(task="push", num_envs=3)) as fresh:
        fresh.reset(seed=[1, 2, 3])
        assert torch.equal(after, fresh.step(torch.zeros(3, 6)).obs.state)  # as if never sent


def test_actions_not_one_row_per_world_are_a_one_line_error():
    """A [1, 6] row was added to every world's servo targets (broadcast): each world did world
    0's action."""
    with MuJoCoEnv(MuJoCoConfig(task="push", num_envs=3)) as env:
        env.reset(seed=[1, 2, 3])
        for shape in ((1, 6), (6,), (3, 5)):
            with pytest.raises(UserError) as raised:
                env.step(torch.zeros(shape))
            assert str(raised.value) == f"MuJoCo push: actions of shape {shape}, expected (3, 6)"


def test_the_home_pose_noise_is_uniform_over_what_each_joint_range_holds():
    """The wrist's home angle is 0.018 rad inside its target bound: clamping +-0.1 rad of noise
    put 40% of the episodes' wrists on that bound. Each joint is uniform over the part of its
    +-noise its range holds (the others as before: home + (2u - 1) noise)."""
    from embodied.simulators.mujoco.arm import JOINTS
    from embodied.simulators.mujoco.streams import Streams
    from embodied.simulators.mujoco.worlds import HIGH, HOME_POSE, LOW, draw_initial

    ids = torch.arange(20_000)
    streams = Streams(len(ids), torch.device("cpu"))
    streams.reseed(ids, ids)
    joints = draw_initial(streams, TASKS["pick"], ids, 0.1).joints.double()  # [N, 6]
    low = torch.tensor([max(h - 0.1, lo) for h, lo in zip(HOME_POSE, LOW)], dtype=torch.float64)
    high = torch.tensor([min(h + 0.1, hi) for h, hi in zip(HOME_POSE, HIGH)], dtype=torch.float64)
    assert high[JOINTS.index("wrist_flex")] < HOME_POSE[JOINTS.index("wrist_flex")] + 0.02
    assert ((joints >= low - 1e-6) & (joints <= high + 1e-6)).all()
    assert (joints == torch.tensor(HIGH, dtype=torch.float64)).double().mean() < 1e-3
    # uniform: the mean in the middle, a quarter below the first quarter (+-4 standard errors)
    torch.testing.assert_close(
        joints.mean(0), (low + high) / 2, atol=4 * 0.2 / 12**0.5 / 141, rtol=0
    )
    below = (joints < low + (high - low) / 4).double().mean(0)
    torch.testing.assert_close(
        below, torch.full((6,), 0.25, dtype=torch.float64), atol=0.013, rtol=0
    )


def test_servos_follow_the_commanded_deltas():
    with MuJoCoEnv(MuJoCoConfig(task="reach", num_envs=2)) as env:
        start = env.reset(seed=0).state[:, :6]
        delta = torch.tensor([[0.05, 0.0, 0.0, 0.0, 0.0, 0.0], [0.0, 0.0, -0.05, 0.0, 0.0, 0.0]])
        for _ in range(6):
            obs = env.step(delta).obs
        for _ in range(10):  # hold the targets while the servos settle
            obs = env.step(torch.zeros(2, 6)).obs
        moved = obs.state[:, :6] - start
        torch.testing.assert_close(
            moved[0, 0], torch.tensor(0.3), atol=0.03, rtol=0
        )  # shoulder_pan +0.3 rad
        torch.testing.assert_close(
            moved[1, 2], torch.tensor(-0.3), atol=0.05, rtol=0
        )  # elbow_flex -0.3 rad
        assert moved[0, 1:5].abs().max() < 0.05  # the other joints hold


def test_reach_reward_and_success_golden():
    goal = torch.tensor([[0.2, 0.0, 0.1]] * 3)
    tcp = goal + torch.tensor([[0.0, 0.0, 0.0], [0.1, 0.0, 0.0], [0.0, 0.019, 0.0]])
    reward, success = TASKS["reach"].evaluate({"tcp_pos": tcp, "goal_pos": goal})
    assert success.tolist() == [True, False, True]
    np.testing.assert_allclose(reward, [1.0, 1.0 - math.tanh(1.0), 1.0], rtol=1e-6)


def test_push_success_is_the_cube_on_the_target():
    goal = torch.tensor([[0.25, 0.0, 0.001], [0.25, 0.0, 0.001]])
    cube = torch.tensor([[0.26, 0.01, 0.015], [0.2, 0.0, 0.015]])
    behind = torch.stack([torch.zeros(3), cube[1] - torch.tensor([0.035, 0.0, 0.0])])
    # the tool right behind cube 1
    reward, success = TASKS["push"].evaluate(
        {"tcp_pos": behind, "goal_pos": goal, "cube_pos": cube}
    )
    assert success.tolist() == [True, False]
    np.testing.assert_allclose(reward[1], (1.0 + 2.0 * (1.0 - math.tanh(0.5))) / 3.0, rtol=1e-6)


def test_push_succeeds_inside_the_red_disc_it_draws():
    """The disc was drawn 3 cm across the centre, and success needed 2.5 cm: a cube inside the
    red target the camera shows failed."""
    import mujoco

    from embodied.simulators.mujoco.worlds import build_model

    model = build_model(MuJoCoConfig(task="push"), TASKS["push"])
    radius = float(model.geom_size[int(model.body_geomadr[model.body("goal").id]), 0])
    goal = torch.tensor([[0.25, 0.0, 0.001]] * 2)
    cube = goal + torch.tensor([[radius - 1e-4, 0.0, 0.014], [radius + 1e-4, 0.0, 0.014]])
    _, success = TASKS["push"].evaluate({"tcp_pos": cube, "goal_pos": goal, "cube_pos": cube})
    assert (
        model.geom_type[int(model.body_geomadr[model.body("goal").id])]
        == mujoco.mjtGeom.mjGEOM_CYLINDER
    )
    assert success.tolist() == [True, False]


def test_unknown_task_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown MuJoCo task 'stack'"):
        MuJoCoConfig(task="stack").validate()


def test_train_from_yaml_on_mujoco(tmp_path):
    import json

    from embodied.cli import main

    rc = main(
        [
            "train",
            "configs/mujoco/reach_ppo.yaml",
            f"runner.output_dir={tmp_path}",
            "env.num_envs=4",
            "algorithm.num_steps=8",
            "runner.total_env_steps=64",
            "runner.eval_episodes=4",
            "runner.final_eval_episodes=4",
            "runner.progress=false",
            "env.render_size=32",
        ]
    )
    assert rc == 0
    run = tmp_path / "mujoco_reach_ppo"
    summary = json.loads((run / "metrics.json").read_text())
    assert summary["final"]["eval/episodes"] == 4 and (run / "last" / "model.safetensors").exists()
    assert "simulator: mujoco" in (run / "config.yaml").read_text()
    assert (
        main(["eval", str(run / "last"), "--episodes", "2"]) == 0
    )  # rebuilds the MuJoCo env from the run
    rollout = json.loads((run / "last" / "eval.json").read_text())
    # the same checkpoint on the other backend (same seeds, same initial states)
    assert main(["eval", str(run / "last"), "--episodes", "2", "env.backend=warp"]) == 0
    warp = json.loads((run / "last" / "eval.json").read_text())
    assert warp["eval/episodes"] == rollout["eval/episodes"] == 2
    assert warp["eval/return"] == pytest.approx(rollout["eval/return"], rel=1e-3)  # free motion


def test_eval_overrides_only_the_env(tmp_path, capsys):
    from embodied.cli import main

    run = tmp_path / "run"
    argv = ["train", "configs/mujoco/reach_ppo.yaml", f"runner.output_dir={tmp_path}"]
    argv += ["runner.name=run", "env.num_envs=2", "algorithm.num_steps=4"]
    argv += ["runner.total_env_steps=8", "runner.final_eval_episodes=2", "runner.video=false"]
    assert main([*argv, "runner.progress=false"]) == 0
    capsys.readouterr()
    assert main(["eval", str(run / "last"), "policy.hidden_sizes=[8]"]) == 2
    assert capsys.readouterr().err.strip() == (
        "embodied: error: policy.hidden_sizes=[8]: eval overrides env.* keys only (the policy is "
        "the checkpoint's)"
    )
    assert main(["eval", str(run / "last"), "env.backend=physx"]) == 2
    assert capsys.readouterr().err.strip() == (
        "embodied: error: env.backend: must be one of ['rollout', 'warp'], got 'physx' "
        "(in the command line)"
    )


def test_an_unknown_simulator_is_a_config_error(capsys):
    from embodied.cli import main

    assert main(["train", "configs/mujoco/reach_ppo.yaml", "env.simulator=isaac"]) == 2
    assert "env.simulator: unknown env 'isaac'" in capsys.readouterr().err


@pytest.mark.parametrize("backend", ["rollout", "warp"])
def test_joint_velocities_are_measured_as_an_arm_driver_measures_them(backend):
    if backend == "warp":
        pytest.importorskip("mujoco_warp")
    from embodied.simulators.mujoco import make_env

    with make_env(MuJoCoConfig(task="reach", num_envs=2, backend=backend)) as env:
        first = env.reset(seed=[3, 4]).state
        assert torch.equal(first[:, 6:], torch.zeros(2, 6))  # at rest after a reset
        moved = env.step(torch.full((2, 6), 0.05)).obs.state
        # the change of the joint positions over the step, times the control rate (20 Hz)
        expected = (moved[:, :6] - first[:, :6]) * 20.0
        torch.testing.assert_close(moved[:, 6:], expected, atol=1e-4, rtol=1e-4)
        assert expected.abs().max() > 0.5  # they moved
        again = env.reset(seed=[3], env_ids=torch.tensor([1])).state
        assert torch.equal(again[1, 6:], torch.zeros(6))  # the reset world starts at rest
        assert torch.equal(again[0], moved[0])  # the other goes on


def test_an_unknown_camera_is_a_clear_error():
    with pytest.raises(ValueError) as raised:
        MuJoCoConfig(obs_mode="rgb", cameras=["top"]).validate()
    assert str(raised.value) == (
        "cameras: one or more of ['base_camera', 'wrist_camera'], each once, got ['top']"
    )


@pytest.mark.parametrize("backend", ["rollout", "warp"])
def test_simulate_holds_servo_targets_for_the_raw_throughput_benchmark(backend):
    if backend == "warp":
        pytest.importorskip("mujoco_warp")
    from embodied.simulators.mujoco import make_env

    with make_env(MuJoCoConfig(task="reach", num_envs=2, backend=backend)) as env:
        start = env.reset(seed=[1, 2]).state[:, :6]
        targets = start + torch.tensor([0.3, 0.0, -0.2, 0.0, 0.4, 0.0])
        for _ in range(10):  # half a second of physics, no observation or reward
            env.simulate(targets)
        held = env.step(torch.zeros(2, 6)).obs.state[:, :6]  # the targets stay
        torch.testing.assert_close(held, targets, atol=0.05, rtol=0)
