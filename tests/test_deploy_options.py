"""`embodied deploy`'s parts that need no trained policy: its options, the summary it reports,
the goal check, how joint-delta chunks accumulate (end to end on the twin: tests/test_deploy.py)."""

import sys
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from embodied.cli import main
from embodied.robots.arm import ArmConfig


def test_a_goal_on_the_table_passes_the_reach_check_and_one_under_it_does_not():
    from embodied.cli_robot import _check_reachable

    _check_reachable("0.25,0.03,0.001", (0.25, 0.03, 0.001))  # push's goal marker, on the table
    with pytest.raises(ValueError, match="outside the box"):
        _check_reachable("0.25,0.03,-0.001", (0.25, 0.03, -0.001))


def test_a_given_goal_places_the_twins_cube_as_the_task_draws_it_and_another_height_is_refused():
    """Pick's goal is the cube's place lifted 5 cm: a given one puts the twin's cube under it,
    at rest, so the twin judges the lift (the drawn cube stayed where it was, and a goal at
    z = 0.01 was a success before anything moved). A goal at another height is one line, on a
    real arm too, where a policy trained on cubes of several sizes takes their heights."""
    from clocks import FakeClock

    from embodied.deploy import DeployError, episode_scenes
    from embodied.simulators.mujoco import MuJoCoConfig
    from embodied.simulators.mujoco.randomize import RandomizeConfig
    from embodied.twin import ArmTwin

    cfg = SimpleNamespace(env=MuJoCoConfig(task="pick"))
    scenes = episode_scenes(cfg, (0.21, 0.03, 0.065), twin=True, episodes=2, seed=0)
    for scene in scenes:
        np.testing.assert_allclose(scene.cube, [0.21, 0.03, 0.015])
        np.testing.assert_allclose(scene.goal, [0.21, 0.03, 0.065])
    twin = ArmTwin("pick", clock=FakeClock())
    twin.place(scenes[0].goal, scenes[0].cube)
    assert not twin.success()
    for twin_or_arm in (True, False):
        with pytest.raises(DeployError, match=r"--goal: pick's goal .* z = 0\.065 .* z = 0\.01$"):
            episode_scenes(cfg, (0.2, 0.0, 0.01), twin=twin_or_arm, episodes=1, seed=0)
    sizes = SimpleNamespace(env=MuJoCoConfig(task="pick", randomize=RandomizeConfig(cube_size=0.2)))
    (arm,) = episode_scenes(sizes, (0.2, 0.0, 0.0625), twin=False, episodes=1, seed=0)
    np.testing.assert_allclose(arm.goal, [0.2, 0.0, 0.0625])  # (a 2.5 cm cube's: 0.83x)
    with pytest.raises(DeployError, match=r"z in \[0\.062, 0\.068\] .* got z = 0\.06$"):
        episode_scenes(sizes, (0.2, 0.0, 0.06), twin=False, episodes=1, seed=0)
    with pytest.raises(DeployError, match=r"at z = 0\.065 "):  # (the twin's cube: as written)
        episode_scenes(sizes, (0.2, 0.0, 0.0625), twin=True, episodes=1, seed=0)
    drawn = episode_scenes(cfg, None, twin=True, episodes=2, seed=0)  # the task's own draws
    assert drawn[0].cube[0] != drawn[1].cube[0]
    # push: the cube behind the given goal by the middle of its offsets (the seed's own cube lay
    # within the success radius of 42 of 200 goals given at (0.2, 0, 0.001))
    push = SimpleNamespace(env=MuJoCoConfig(task="push"))
    scenes = episode_scenes(push, (0.25, 0.01, 0.001), twin=True, episodes=3, seed=0)
    for scene in scenes:
        np.testing.assert_allclose(scene.cube, [0.25 - 0.065, 0.01, 0.015], atol=1e-12)
    with pytest.raises(DeployError, match=r"^--goal: push's goal is on the table, at z = 0\.001"):
        episode_scenes(push, (0.22, 0.05, 0.12), twin=False, episodes=1, seed=0)


def test_joint_deltas_accumulate_as_the_simulator_clips_them():
    """Each delta within the policy's bounds (0.1 rad), each target within the arm's range (the
    first joint's top at 0.15): the third step moves back from where the arm is told to be, not
    from an unclipped sum (which gave 0.3, 0.6, 0.5 for the first joint)."""
    from types import SimpleNamespace as Namespace

    from embodied.deploy_policy import accumulate

    policy = Namespace(action=Namespace(low=(-0.1, -0.1), high=(0.1, 0.1)))
    arm = Namespace(action=Namespace(low=(-1.0, -1.0), high=(0.15, 1.0)))
    deltas = np.array([[0.3, 0.05], [0.3, 0.05], [-0.1, -0.3]])  # f64 [3, 2]
    targets = accumulate(np.zeros(2), deltas, policy, arm)
    np.testing.assert_allclose(targets, [[0.1, 0.05], [0.15, 0.1], [0.05, 0.0]], atol=1e-12)


def test_a_chunk_is_rejected_from_its_first_delta_that_is_not_finite():
    """An infinite delta is not the largest step (a clip made it one: a full-speed move the
    safety layer passed): that target and the rest of the chunk are NaN, which it rejects."""
    from embodied.deploy_policy import accumulate

    policy = SimpleNamespace(action=SimpleNamespace(low=(-0.1, -0.1), high=(0.1, 0.1)))
    arm = SimpleNamespace(action=SimpleNamespace(low=(-1.0, -1.0), high=(1.0, 1.0)))
    deltas = np.array([[0.05, 0.0], [np.inf, 0.0], [0.05, -np.inf], [0.05, 0.0]])
    targets = accumulate(np.zeros(2), deltas, policy, arm)
    np.testing.assert_allclose(targets[0], [0.05, 0.0])
    assert np.isnan(targets[1:]).all()


def test_a_joint_delta_chunk_starts_from_the_command_before_its_step():
    """The chunk asked for at a step adds its deltas to the command the observation was taken
    after, even when the inference thread runs only after that step's own command went out (it
    read the last command itself, then, and began a step ahead)."""
    import threading

    from clocks import CEILING_S

    from embodied.deploy_policy import RobotInfer
    from embodied.robots.control import ChunkExecutor
    from embodied.schema import ActionSpec, EnvSpec, Observation, ObsSpec

    names = tuple(f"j{i}" for i in range(6))
    sent = threading.Event()

    def deltas_within(bound: float) -> EnvSpec:
        action = ActionSpec(space="joint_delta", names=names, low=(-bound,) * 6, high=(bound,) * 6)
        return EnvSpec(ObsSpec(state_names=names), action, max_episode_steps=10)

    class Safety:
        command = np.full(6, 0.5)  # the command the observation follows

        @property
        def last(self) -> np.ndarray:
            if threading.current_thread() is not threading.main_thread():
                sent.wait(CEILING_S)  # (the inference thread reads after this step's send)
            return self.command

    class Arm:
        safety = Safety()
        spec = deltas_within(1.0)  # the arm's joint range, in the policy's frame

        def to_policy(self, command):
            return command.copy()

    infer = RobotInfer(lambda obs: np.full((3, 6), 0.01), deltas_within(0.1), Arm())
    executor = ChunkExecutor(infer, prepare=infer.prepare, request_when_left=0)
    obs = Observation(state=torch.zeros(1, 6), instruction=["reach"])
    assert executor.action(0, obs) is None  # asked for; nothing planned yet
    Arm.safety.command = np.full(6, 0.7)  # this step's command goes out
    sent.set()
    _, chunk, _ = executor._results.get(timeout=CEILING_S)
    executor.close()
    np.testing.assert_allclose(chunk[:, 0], [0.51, 0.52, 0.53])


@pytest.mark.parametrize("deltas_from", ["target", "measured"])
def test_deltas_are_added_as_the_policys_simulator_adds_them(deltas_from):
    """MuJoCo adds a delta to its last target; ManiSkill's pd_joint_delta_pos to the joints as
    measured at the step, so a blocked joint's target stays a delta from where it is. Deployed,
    the second kind wound up from the last command to the joint's limit (0.51, 0.52 here)."""
    from clocks import CEILING_S

    from embodied.deploy_policy import RobotInfer
    from embodied.robots.control import ChunkExecutor
    from embodied.schema import ActionSpec, EnvSpec, Observation, ObsSpec

    names = tuple(f"j{i}" for i in range(6))

    def deltas_within(bound: float) -> EnvSpec:
        action = ActionSpec(
            "joint_delta", names, (-bound,) * 6, (bound,) * 6, deltas_from=deltas_from
        )
        return EnvSpec(ObsSpec(state_names=names), action, max_episode_steps=10)

    arm = SimpleNamespace(
        safety=SimpleNamespace(last=np.full(6, 0.5)),  # the last command
        present=np.full(6, 0.4),  # where the (blocked) arm is
        spec=deltas_within(1.0),
        to_policy=lambda q: np.asarray(q, float) * 2 - 0.4,  # the policy's frame: 0.4 -> 0.4
    )
    infer = RobotInfer(lambda obs: np.full((3, 6), 0.02), deltas_within(0.01), arm)
    executor = ChunkExecutor(infer, prepare=infer.prepare, command=infer.command, wait_s=CEILING_S)
    obs = Observation(state=torch.zeros(1, 6), instruction=["reach"])
    try:
        first = executor.action(0, obs)
        arm.present = np.full(6, 0.45)  # the next step's reading
        second = executor.action(1, obs)
    finally:
        executor.close()
    # each delta within the policy's bound (0.01); from the last command 0.5 (0.6 in the frame)
    expected = [0.61, 0.62] if deltas_from == "target" else [0.41, 0.51]
    np.testing.assert_allclose([first[0], second[0]], expected, atol=1e-12)


def test_a_spec_saved_before_it_said_its_deltas_reads_them_from_the_control_mode():
    """A checkpoint's spec without ``deltas_from`` is read as its config's simulator adds them:
    ManiSkill's pd_joint_delta_pos from the joints as measured, its target modes and MuJoCo
    from the last target; demos and eval do not compare a spec that does not say."""
    from embodied.deploy_policy import _deltas_said
    from embodied.schema import ActionSpec, EnvSpec, ObsSpec

    action = {"space": "joint_delta", "names": ["j"], "low": [-1], "high": [1], "gripper": None}
    saved = {
        "obs": {"cameras": [], "state_names": ["j"], "privileged": {}},
        "action": {**action, "control_hz": 20.0},
        "max_episode_steps": 5,
        "instructions": [],
    }
    old = EnvSpec.from_dict(saved)
    assert old.action.deltas_from is None
    for simulator, mode, said in [
        ("maniskill", "pd_joint_delta_pos", "measured"),
        ("maniskill", "pd_joint_target_delta_pos", "target"),
        ("mujoco", None, "target"),
    ]:
        cfg = SimpleNamespace(env=SimpleNamespace(simulator=simulator, control_mode=mode))
        assert _deltas_said(old, cfg).action.deltas_from == said
    new = EnvSpec(ObsSpec(state_names=("j",)), ActionSpec("joint_delta", ("j",), (-1,), (1,)), 5)
    measured = EnvSpec(new.obs, ActionSpec(**{**vars(new.action), "deltas_from": "measured"}), 5)
    assert old.input_changes(measured) == [] and new.input_changes(old) == []
    assert new.input_changes(measured) == ["deltas from target -> measured"]


def test_the_twin_judges_success_by_the_tasks_own_rule():
    from clocks import FakeClock

    from embodied.twin import ArmTwin

    reach = ArmTwin("reach", clock=FakeClock())  # no time passes: the arm stays at home
    tcp = reach.data.site("tcp").xpos.copy()
    reach.place(goal=tcp + [0.0, 0.0, 0.019])
    assert reach.success()  # within 2 cm
    reach.place(goal=tcp + [0.0, 0.0, 0.021])
    assert not reach.success()
    pick = ArmTwin("pick", clock=FakeClock())
    pick.place(goal=np.array([0.2, 0.0, 0.065]), cube=np.array([0.2, 0.0, 0.066]))
    assert pick.success()  # lifted 5 cm (its centre at 6.5 cm or more)
    pick.place(goal=np.array([0.2, 0.0, 0.065]), cube=np.array([0.2, 0.0, 0.015]))
    assert not pick.success()


def test_the_summary_rates_success_over_episodes_that_ran_their_clock():
    """An emergency-stopped episode keeps its own entry but not the rate; the interventions of
    the moves to the start and safe poses are apart from the episodes'."""
    from embodied.deploy import _summary

    episodes = [
        {"end": "done", "success": True, "interventions": {"joint_limit": 3}},
        {"end": "done", "success": False, "interventions": {}},
        {"end": "estop", "success": False, "interventions": {"rate_limit": 1}},
    ]
    counts = Counter(joint_limit=3, rate_limit=5)  # the layer's, moves included
    env = SimpleNamespace(judge=object(), safety=SimpleNamespace(counts=counts))
    arm = SimpleNamespace(robot="so101-sim", control_hz=20.0)
    stop = SimpleNamespace(is_set=lambda: True, reason="SIGINT")
    summary = _summary(episodes, arm, env, SimpleNamespace(torque_off=True), stop)
    assert summary["success_rate"] == 0.5 and summary["judged_episodes"] == 2
    assert summary["interventions"] == {"joint_limit": 3, "rate_limit": 1}
    assert summary["interventions_in_moves"] == {"rate_limit": 4}
    assert summary["emergency_stop"] == "SIGINT"
    only_stopped = _summary(episodes[2:], arm, env, SimpleNamespace(torque_off=True), stop)
    assert "success_rate" not in only_stopped  # no episode ran its clock: no rate


def test_the_arms_speed_and_gripper_range_options_reach_its_config(monkeypatch, capsys):
    import embodied.deploy as deploy_module

    given = []

    def capture(checkpoint, arm, **options):
        given.append(arm)
        return {"episodes": [], "torque_off_at_safe_pose": True}

    monkeypatch.setattr(deploy_module, "run_deploy", capture)
    port = ["--robot", "so101", "--robot.port", "/dev/ttyACM0"]
    options = ["--robot.max-speed", "0.5", "--robot.gripper-range=-0.1,1.5"]  # (= before a -)
    assert main(["deploy", "ckpt", *port, *options]) == 0
    assert main(["deploy", "ckpt", *port]) == 0
    assert [(a.max_speed, a.gripper_range) for a in given] == [
        (0.5, (-0.1, 1.5)),
        (ArmConfig.max_speed, ArmConfig.gripper_range),  # ArmConfig's own defaults
    ]


def test_a_multi_task_policy_is_told_its_task_and_a_single_task_one_keeps_its_own():
    """Without --instruction a policy acts on the task it was trained on; one trained on several
    is refused, its tasks listed (it ran the first in silence, and recordings said so)."""
    from embodied.deploy import DeployError, _fit_arm
    from embodied.schema import ActionSpec, EnvSpec, ObsSpec

    action = ActionSpec(space="joint_delta", names=("j",), low=(-0.1,), high=(0.1,))

    def spec(*instructions):
        return EnvSpec(ObsSpec(), action, max_episode_steps=10, instructions=instructions)

    arm = ArmConfig(robot="so101-sim")
    _fit_arm(arm, spec("reach", "reach"), None, 1.0)  # (one task's rows: one instruction)
    assert arm.instruction == "reach"
    with pytest.raises(DeployError, match=r"trained on 2 tasks \(\['push', 'pick'\]\); say"):
        _fit_arm(ArmConfig(robot="so101-sim"), spec("push", "pick", "push"), None, 1.0)
    told = ArmConfig(robot="so101-sim", instruction="pick")
    _fit_arm(told, spec("push", "pick"), None, 1.0)
    assert told.instruction == "pick"


def test_an_episode_lasts_as_long_as_the_policys_training_episodes_unless_told():
    """Reach's 50 steps at 20 Hz: 2.5 s on the twin, as eval has its episodes (the default was
    30 s, 600 steps, and the twin's success counted any of them), also at another --hz."""
    from embodied.deploy import _fit_arm
    from embodied.schema import ActionSpec, EnvSpec, ObsSpec

    action = ActionSpec(space="joint_pos", names=("j",), low=(-1.0,), high=(1.0,))
    spec = EnvSpec(ObsSpec(), action, max_episode_steps=50, instructions=("reach",))
    trained = ArmConfig(robot="so101-sim")
    _fit_arm(trained, spec, None, None)
    assert (trained.control_hz, trained.max_episode_steps) == (20.0, 50)
    faster = ArmConfig(robot="so101-sim")
    _fit_arm(faster, spec, 30.0, None)
    assert faster.max_episode_steps == 75  # (2.5 s at 30 Hz)
    told = ArmConfig(robot="so101-sim")
    _fit_arm(told, spec, None, 1.0)
    assert told.max_episode_steps == 20


def test_a_start_pose_beyond_a_joints_calibrated_range_is_refused_naming_the_joint():
    """The arm would stop at the range's end and time out without a word of why; within the
    arrival tolerance of the range it is not refused."""
    from embodied.deploy import DeployError, Scene, _begin, _check_in_range
    from embodied.robots.safety import SafetyConfig, SafetyLayer

    safety = SafetyLayer(SafetyConfig(joint_low=(-2.0,) * 6, joint_high=(2.0, 2, 2, 1.4, 2, 2)))
    _check_in_range(safety, np.array([0.0, 0, 0, 1.44, 0, 0]))
    home = np.array([0.0, -0.4, 0.37, 1.59, 0, 0.6])
    with pytest.raises(DeployError, match=r"wrist_flex is \+1.59 rad .* range -2.00..\+1.40 rad"):
        _check_in_range(safety, home)
    env = SimpleNamespace(safety=safety, to_arm=lambda pose: pose)  # (refused before it moves)
    with pytest.raises(DeployError, match="wrist_flex"):
        _begin(env, None, Scene(None), home, stop=None, arm=None)


def test_a_deploy_to_a_koch_is_refused_before_anything_is_read_or_connected():
    """The safety layer has the SO-101's geometry and rest pose only; from Python as from the
    command line (tests/test_cli_errors.py), before the checkpoint is read."""
    from embodied.deploy import DeployError, run_deploy

    with pytest.raises(DeployError, match="--robot koch: deploy has the SO-100/SO-101's geometry"):
        run_deploy("no/such/checkpoint", ArmConfig(robot="koch", port="/dev/null"))


def test_deploys_help_offers_the_arms_it_drives(capsys):
    """The help named a Koch arm, which deploy always refuses; read-arm still reads one."""
    from embodied.cli import main

    for command, koch in (("deploy", False), ("read-arm", True)):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        shown = capsys.readouterr().out
        assert ("koch" in shown.lower()) == koch, shown
        assert "so101-sim" in shown


def test_a_policy_in_the_deploy_process_runs_on_its_device(monkeypatch):
    """It always ran on the CPU: a VLA on a machine with a GPU outlasted its chunks and the
    watchdog stopped its episodes. auto is cuda where the machine has it, as serve's."""
    from embodied import deploy

    asked = []

    def loaded(checkpoint, device, build):
        asked.append(device)
        raise deploy.DeployError("loaded")

    monkeypatch.setattr(deploy, "load_deployable", loaded)
    arm = ArmConfig(robot="so101-sim")
    for device in ("auto", "cpu"):
        with pytest.raises(deploy.DeployError, match="loaded"):
            deploy.run_deploy("ckpt", arm, device=device)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(deploy.DeployError, match="loaded"):
        deploy.run_deploy("ckpt", arm)
    assert asked == [torch.device("cpu")] * 2 + [torch.device("cuda")]


def test_a_recording_says_whether_its_episodes_success_was_judged(tmp_path):
    """A real arm has no judge: its recording's success column (all False) read as failures."""
    from embodied.deploy import _recorder

    arm = ArmConfig(robot="so101-sim")
    for judge, judged in ((None, False), (lambda: True, True)):
        env = SimpleNamespace(judge=judge, spec=None)
        assert _recorder(str(tmp_path), arm, env).judged is judged
    assert _recorder(None, arm, env) is None


def test_a_served_policy_may_take_as_long_as_the_watchdog_lets_the_arm_wait(monkeypatch):
    """The client's timeout is --robot.watchdog's (2 s at least): a served policy slower than
    2 s timed out on every request whatever the watchdog said."""
    from embodied import deploy
    from embodied.schema import Observation

    made = []
    monkeypatch.setattr(
        "embodied.robots.server.PolicyClient",
        lambda url, agreed, timeout_s: made.append(timeout_s),
    )
    deploy._client("ws://127.0.0.1:1", {}, 10.0)
    deploy._client("ws://127.0.0.1:1", {}, 0.5)
    assert made == [10.0, 2.0]
    # the warm-up's source asks with its own timeout, the episodes' with the client's
    asked = []
    client = SimpleNamespace(infer=lambda wire, timeout_s: asked.append(timeout_s))
    obs = Observation(state=torch.zeros(1, 12), instruction=["x"], images={}, privileged={})
    deploy._chunk_source(None, client, deploy.WARM_UP_S)(obs)
    deploy._chunk_source(None, client)(obs)
    assert asked == [deploy.WARM_UP_S, None] and deploy.WARM_UP_S >= 30


@pytest.mark.parametrize(
    "argv, missing",
    [
        (["read-arm", "--robot", "so101", "--robot.port", "/dev/ttyACM0"], "lerobot"),
        (["serve", "ck"], "msgpack"),
        (["deploy", "ck", "--robot", "so101-sim"], "websockets"),
    ],
)
def test_a_robot_command_without_the_real_extra_is_one_line(argv, missing, monkeypatch, capsys):
    """LeRobot, msgpack or websockets not installed: one line naming the install (it was a
    ModuleNotFoundError traceback, for deploy after the checkpoint was read)."""
    from embodied.cli import main

    monkeypatch.setitem(sys.modules, missing, None)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"needs {missing}, not installed here" in err
    assert "pip install 'embodied[real]'" in err
