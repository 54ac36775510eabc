"""`embodied demos`: an expert checkpoint drives ManiSkill with cameras on; episodes land in a
LeRobot v3.0 dataset with per-frame success; failures are dropped unless asked."""

import json

import pytest
import torch

from embodied.checkpoint import save_checkpoint
from embodied.cli import main
from embodied.dataset import DemoDataset
from embodied.models import ActorCritic, ActorCriticConfig
from embodied.schema import EnvSpec, ObsSpec, UserError
from embodied.simulators.maniskill import ManiSkillConfig, ManiSkillEnv
from embodied.train_config import TrainConfig, run_meta

ENV = dict(
    task="PushCube-v1",
    control_mode="pd_joint_delta_pos",
    max_episode_steps=6,
    num_envs=2,
    num_workers=1,
    image_size=32,
    render_size=32,
    ignore_terminations=True,
)


@pytest.fixture(scope="module")
def expert(tmp_path_factory):
    """An (untrained) state-based actor-critic saved as a training run would save it."""
    # (the spec only: the simulator in this process, no worker to start)
    spec_env = ManiSkillConfig(obs_mode="rgb+state", **{**ENV, "num_workers": 0})
    with ManiSkillEnv(spec_env) as env:
        state_spec = EnvSpec(
            obs=ObsSpec(state_names=env.spec.obs.state_names, privileged=env.spec.obs.privileged),
            action=env.spec.action,
            max_episode_steps=6,
            instructions=env.spec.instructions,
        )
    cfg = TrainConfig(
        env=ManiSkillConfig(obs_mode="state", **ENV), policy=ActorCriticConfig(hidden_sizes=[16])
    )
    torch.manual_seed(0)
    policy = ActorCritic(state_spec, cfg.policy)
    run = tmp_path_factory.mktemp("expert")
    save_checkpoint(
        run, 1, model=policy, optimizer=None, counters={}, meta=run_meta(cfg, state_spec)
    )
    return run


def _demos(tmp_path, expert, *extra):
    tmp_path.mkdir(parents=True, exist_ok=True)
    cfg = tmp_path / "demos.yaml"
    cfg.write_text(
        json.dumps(
            {
                "expert": str(expert),
                "env": {**ENV, "obs_mode": "rgb+state"},
                "output": str(tmp_path / "ds"),
            }
        )
    )
    return main(["demos", str(cfg), *extra])


# (22 s: the default suite's time budget; `embodied demos` runs in the two tests below)
@pytest.mark.slow
def test_records_episodes_with_cameras_and_success(tmp_path, expert, capsys):
    rc = _demos(
        tmp_path,
        expert,
        "episodes=3",
        "max_attempts=4",
        "keep_failed=true",
        "privileged_keys=[goal_pos]",
    )
    assert rc == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["episodes"] == 3 and summary["attempts"] == 4 and summary["frames"] == 18
    ds = DemoDataset.load(tmp_path / "ds")
    assert len(ds) == 18 and ds.starts.tolist() == [0, 6, 12]
    assert (
        ds.images["base_camera"].shape == (18, 32, 32, 3)
        and ds.images["base_camera"].float().std() > 0
    )
    assert (
        ds.state.shape == (18, 25)
        and ds.actions.shape == (18, 8)
        and ds.privileged["goal_pos"].shape == (18, 3)
    )
    assert ds.tasks == ["push the cube to the red and white target"]
    low, high = torch.tensor([-0.1] * 7 + [-0.01]), torch.tensor([0.1] * 7 + [0.04])
    assert bool(
        ((ds.actions >= low - 1e-6) & (ds.actions <= high + 1e-6)).all()
    )  # physical units, within bounds
    # the same seeds give the same first frames: the recording is reproducible
    rc = _demos(
        tmp_path / "again",
        expert,
        "episodes=3",
        "max_attempts=4",
        "keep_failed=true",
        "privileged_keys=[goal_pos]",
    )
    assert rc == 0
    again = DemoDataset.load(tmp_path / "again" / "ds")
    torch.testing.assert_close(again.state, ds.state)


def test_failed_episodes_are_dropped_and_an_expert_that_never_succeeds_is_an_error(
    tmp_path, expert, capsys
):
    rc = _demos(
        tmp_path, expert, "episodes=2", "max_attempts=2"
    )  # an untrained expert does not push the cube in 6 steps
    assert rc == 2
    assert "succeeded in none of 2 episodes" in capsys.readouterr().err


def test_config_errors(tmp_path, expert, capsys):
    assert _demos(tmp_path, expert, "episodes=5", "max_attempts=2") == 2
    assert "episodes" in capsys.readouterr().err
    assert _demos(tmp_path, expert, "env.obs_mode=state") == 2
    assert "cameras" in capsys.readouterr().err


def test_an_expert_of_another_task_or_other_actions_is_refused(tmp_path, expert, capsys):
    """The expert's checkpoint against the environment it would record: another task, or other
    actions, is one line before anything is written (they recorded, or failed in torch's matrix
    product at the first action)."""
    assert _demos(tmp_path / "a", expert, "env.task=PickCube-v1") == 2
    err = capsys.readouterr().err
    assert "expert: trained on maniskill's PushCube-v1, not maniskill's PickCube-v1" in err
    assert _demos(tmp_path / "b", expert, "env.control_mode=pd_ee_delta_pos") == 2
    assert "expert: trained with other inputs or actions (" in capsys.readouterr().err
    assert not (tmp_path / "a" / "ds").exists() and not (tmp_path / "b" / "ds").exists()
    # ManiSkill's rgb mode has no state agent's inputs: a KeyError at the first action before
    assert _demos(tmp_path / "c", expert, "env.obs_mode=rgb") == 2
    assert "reads goal_pos, " in capsys.readouterr().err


def test_a_checkpoint_expert_acts_where_the_simulator_gives_its_observations(
    tmp_path, expert, monkeypatch
):
    """A GPU simulator's observations are on its device, and the expert moves there (it stayed
    on the CPU: torch's device error at its first action). Here the device is torch's "meta"."""
    import embodied.multitask as multitask
    from embodied.demos import DemosConfig, _expert_and_env

    made = multitask.make_env

    def on_meta(cfg):
        env = made(cfg)
        env.device = torch.device("meta")
        return env

    monkeypatch.setattr(multitask, "make_env", on_meta)
    env_cfg = ManiSkillConfig(obs_mode="rgb+state", **{**ENV, "num_workers": 0})
    cfg = DemosConfig(expert=str(expert), env=env_cfg, output=str(tmp_path / "ds"))
    policy, _, env = _expert_and_env(cfg)
    env.close()
    assert {p.device.type for p in policy.parameters()} == {"meta"}


def test_an_expert_fits_an_environment_with_its_cameras_and_maybe_more():
    """Hand-built specs: a state expert drives an rgb environment (its cameras are what is
    recorded); an image expert needs its cameras at their size (one it lacked was a KeyError at
    the first action), and extra ones are recorded beside them."""
    from embodied.demos import expert_misfits
    from embodied.schema import ActionSpec, CameraSpec

    def spec(*cameras: tuple[str, int]) -> EnvSpec:
        obs = ObsSpec(tuple(CameraSpec(n, s, s) for n, s in cameras), ("a", "b"))
        action = ActionSpec("joint_delta", ("x", "y"), (-1.0, -1.0), (1.0, 1.0))
        return EnvSpec(obs=obs, action=action, max_episode_steps=4)

    state, front = spec(), spec(("front", 64))
    assert expert_misfits(state, spec(("front", 64), ("wrist", 64))) == []
    assert expert_misfits(front, spec(("front", 64), ("wrist", 64))) == []
    assert expert_misfits(front, spec(("wrist", 64))) == [
        "cameras ['front 64x64'] not in the environment"
    ]
    assert expert_misfits(front, spec(("front", 128))) == [
        "cameras ['front 64x64'] not in the environment"
    ]
    assert expert_misfits(spec(), EnvSpec(ObsSpec(state_names=("a",)), state.action, 4)) == [
        "state ['a', 'b'] -> ['a']"
    ]


def test_demonstrations_from_libero_are_refused_before_anything_is_built(tmp_path, capsys):
    """LIBERO's config names a suite and a task id, no task: it validated, then failed with an
    AttributeError after the expert and the simulator were built."""
    cfg = tmp_path / "demos.yaml"
    env = {"simulator": "libero", "obs_mode": "rgb"}
    cfg.write_text(json.dumps({"expert": str(tmp_path / "no-checkpoint"), "env": env}))
    assert main(["demos", str(cfg)]) == 2
    assert capsys.readouterr().err.strip() == (
        "embodied: error: env.simulator: demonstrations are recorded from ManiSkill's or "
        f"MuJoCo's tasks, not libero's (in {cfg})"
    )


def test_the_scripted_expert_records_the_mujoco_pick_task(tmp_path, capsys):
    # the shipped config as the README runs it, smaller: the expert needs no checkpoint
    argv = [
        "demos",
        "configs/mujoco/demos_pick.yaml",
        "episodes=2",
        "max_attempts=2",
        "env.num_envs=2",
        "env.image_size=32",
        f"output={tmp_path / 'ds'}",
    ]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["expert"] == "scripted" and summary["expert_task"] == "pick"
    assert summary["episodes"] == 2 and summary["expert_success_rate"] == 1.0
    ds = DemoDataset.load(tmp_path / "ds")
    assert len(ds) == 200 and ds.starts.tolist() == [0, 100]  # two whole 100-step episodes
    assert ds.images["base_camera"].shape == (200, 32, 32, 3)
    assert ds.tasks == ["pick up the cube and lift it"]
    assert ds.actions.abs().max() <= 0.1 + 1e-6  # joint deltas within the action limit
    assert ds.privileged["goal_pos"].shape == (200, 3)
    assert ds.info["embodied"]["action_space"] == "joint_delta"  # (SFT checks it: test_sft_data)


def test_scripted_experts_exist_for_mujoco_only(tmp_path, capsys):
    cfg = tmp_path / "demos.yaml"
    cfg.write_text(json.dumps({"expert": "scripted", "env": {**ENV, "obs_mode": "rgb+state"}}))
    assert main(["demos", str(cfg)]) == 2
    assert capsys.readouterr().err.strip() == (
        "embodied: error: expert: scripted experts exist for the MuJoCo tasks, not for maniskill; "
        "give a checkpoint (in " + str(cfg) + ")"
    )


def test_a_stop_keeps_the_episodes_recorded_before_it(tmp_path, capsys, monkeypatch):
    """Ctrl-C after the first round of two episodes: the dataset holds those two, whole and
    loadable, and the command says so with exit code 130 (it used to leave no dataset)."""
    import signal

    import embodied.demos as demos

    attempt = demos._attempt

    def then_ctrl_c(*args, **kwargs):
        episodes = attempt(*args, **kwargs)
        signal.raise_signal(signal.SIGINT)
        return episodes

    monkeypatch.setattr(demos, "_attempt", then_ctrl_c)
    argv = ["demos", "configs/mujoco/demos_pick.yaml", "episodes=6", "max_attempts=6"]
    small = ["env.num_envs=2", "env.image_size=32", f"output={tmp_path / 'ds'}"]
    assert main([*argv, *small]) == 130
    out = capsys.readouterr()
    summary = json.loads(out.out[out.out.index("{") :])
    assert summary["stopped"] == "SIGINT" and summary["episodes"] == summary["attempts"] == 2
    assert "stopped (SIGINT) after 2 of 6 episodes; the dataset holds them" in out.err
    ds = DemoDataset.load(tmp_path / "ds")
    assert ds.num_episodes == 2 and len(ds) == 200


def test_an_error_mid_recording_keeps_the_episodes_recorded_before_it(
    tmp_path, monkeypatch, capsys
):
    """A simulator's error in the second round: its traceback (it was one line and exit code 2,
    as bad input) and the dataset of the first round's two episodes (they were thrown away)."""
    import embodied.demos as demos

    attempt = demos._attempt

    def failing_in_round_2(error: Exception):
        rounds = []

        def then_fail(*args, **kwargs):
            rounds.append(1)
            if len(rounds) == 2:
                raise error
            return attempt(*args, **kwargs)

        return then_fail

    monkeypatch.setattr(demos, "_attempt", failing_in_round_2(RuntimeError("the simulator died")))
    argv = ["demos", "configs/mujoco/demos_pick.yaml", "episodes=6", "max_attempts=6"]
    small = ["env.num_envs=2", "env.image_size=32", f"output={tmp_path / 'ds'}"]
    with pytest.raises(RuntimeError, match="the simulator died") as raised:
        main([*argv, *small])
    assert raised.value.__notes__ == [
        f"embodied demos: the 2 episodes kept are in {tmp_path / 'ds'}"
    ]
    assert DemoDataset.load(tmp_path / "ds").num_episodes == 2
    # a user's error (a non-finite action, a full contact buffer): one line, the note in it
    again = [*argv, "env.num_envs=2", "env.image_size=32", f"output={tmp_path / 'again'}"]
    not_finite = UserError("MuJoCo pick: the actions of environments [0] are not finite")
    monkeypatch.setattr(demos, "_attempt", failing_in_round_2(not_finite))
    assert main(again) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.endswith(
        f"not finite; embodied demos: the 2 episodes kept are in {tmp_path / 'again'}"
    )
