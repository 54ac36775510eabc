"""Contract checks over the ManiSkill adapter (cpu backend) and the policies that drive it."""

import subprocess
import sys

import pytest
import torch

from embodied.contract import check_env, check_policy
from embodied.models import ActorCritic, ActorCriticConfig
from embodied.simulators.maniskill import (
    ManiSkillConfig,
    ManiSkillEnv,
    MissingAssetError,
    check_assets,
)

# the default run keeps each task and each obs mode; PickCube on rgb (the same camera path as
# PushCube's) runs with the slow tests
CASES = [
    pytest.param(("PushCube-v1", "state"), id="PushCube-v1-state"),
    pytest.param(("PickCube-v1", "state"), id="PickCube-v1-state"),
    pytest.param(("PushCube-v1", "rgb"), id="PushCube-v1-rgb"),
    pytest.param(("PickCube-v1", "rgb"), id="PickCube-v1-rgb", marks=pytest.mark.slow),
]


@pytest.fixture(scope="module", params=CASES)
def env(request):
    task, obs_mode = request.param
    e = ManiSkillEnv(
        ManiSkillConfig(
            task=task,
            obs_mode=obs_mode,
            num_envs=3,
            num_workers=2,
            image_size=64,
            control_mode="pd_joint_delta_pos",
            render_size=64,
        )
    )
    yield e
    e.close()


def test_check_env(env):
    report = check_env(env, seed=3)
    assert report["num_envs"] == 3


def test_spec_is_physical_and_observations_split_as_designed(env):
    spec = env.spec
    low, high = spec.action.bounds()
    assert spec.action.space == "joint_delta" and spec.action.gripper == 7
    # two statements: assert_close returns None, so `a and b` would never run the second check
    torch.testing.assert_close(low[:7], torch.full((7,), -0.1))
    torch.testing.assert_close(high[:7], torch.full((7,), 0.1))
    assert spec.action.low[7] == pytest.approx(-0.01) and spec.action.high[7] == pytest.approx(0.04)
    assert spec.max_episode_steps == 50 and spec.action.control_hz == 20
    assert spec.obs.state_names[:9] == tuple(f"qpos_{i}" for i in range(9))  # proprioception first
    if env.cfg.obs_mode == "state":
        assert (
            "goal_pos" in spec.obs.privileged
        )  # object/goal ground truth is privileged, not state
    if env.cfg.obs_mode == "rgb":
        assert [c.name for c in spec.obs.cameras] == ["base_camera"]
        assert spec.obs.cameras[0].height == 64
    obs = env.reset(seed=0)
    assert obs.instruction[0] == spec.instructions[0] and "cube" in obs.instruction[0]


def test_per_env_seeds_reproduce_episodes(env):
    # the robot's initial joint noise is drawn from the episode seed, in every obs mode
    a = env.reset(seed=[11, 12, 11])
    torch.testing.assert_close(a.state[0], a.state[2])
    assert not torch.allclose(a.state[0], a.state[1])
    b = env.reset(seed=[12, 11, 12])
    torch.testing.assert_close(a.state[1], b.state[0])


def test_policy_contract_on_env_spec(env):
    cfg = ActorCriticConfig(
        hidden_sizes=[32], use_privileged=env.cfg.obs_mode == "state", image_features=32
    )
    policy = ActorCritic(env.spec, cfg)
    check_policy(policy, env.spec, batch_size=2)
    out = policy.act(env.reset(seed=0))  # real observations through the policy into the env
    step = env.step(out.actions[:, 0])
    assert step.reward.shape == (3,)


def test_missing_asset_fails_fast_with_a_named_asset_and_no_prompt():
    with pytest.raises(MissingAssetError, match=r"ycb.*download_asset PickSingleYCB-v1"):
        check_assets("PickSingleYCB-v1")
    # the whole path in a fresh process with no stdin: an error, never a (y|n) prompt
    code = (
        "from embodied.simulators.maniskill import ManiSkillEnv, ManiSkillConfig\n"
        "ManiSkillEnv(ManiSkillConfig(task='PickSingleYCB-v1'))"
    )
    res = subprocess.run(
        [sys.executable, "-c", code],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode != 0 and "MissingAssetError" in res.stderr and "(y|n)" not in res.stdout


def test_a_tasks_robot_assets_are_checked_with_the_tasks():
    """The robot's own assets (its description, meshes) were not checked: every worker failed
    on them instead."""
    from mani_skill.utils import assets

    if assets.is_data_source_downloaded("unitree_h1"):
        pytest.skip("the unitree_h1 assets are installed here")
    with pytest.raises(
        MissingAssetError, match=r"unitree_h1 \(expected.*download_asset unitree_h1"
    ):
        check_assets("UnitreeH1Stand-v1")


def test_control_modes_get_the_contracts_action_space_and_velocities_are_refused():
    """The checks that a policy's actions are an environment's compare the action space: the
    target-delta poses were labelled absolute poses, and velocities joint positions."""
    from embodied.schema import UserError
    from embodied.simulators.maniskill.tasks import action_space, check_control_mode

    expected = {
        "pd_ee_target_delta_pose": "ee_delta_pose",
        "pd_ee_target_delta_pos": "ee_delta_pose",
        "pd_ee_delta_pose": "ee_delta_pose",
        "pd_ee_pose": "ee_pose",
        "pd_joint_pos": "joint_pos",
        "pd_joint_delta_pos": "joint_delta",
        "pd_joint_target_delta_pos": "joint_delta",
    }
    assert {mode: action_space(mode) for mode in expected} == expected
    for mode in ("pd_joint_vel", "pd_joint_pos_vel"):
        with pytest.raises(UserError, match=f"^env.control_mode: {mode} commands velocities"):
            check_control_mode("PickCube-v1", mode)


def test_a_config_of_several_tasks_sets_up_one_only_through_with_task():
    """with_task kept env.tasks (SFT built every listed task for a dataset of one, and stopped
    at its first evaluation on KeyError 'all'), task_name named the ignored task, and a
    ManiSkillEnv ran env.task, ignoring env.tasks."""
    from embodied.schema import UserError

    several = ManiSkillConfig(tasks=["PickCube-v1", "PullCube-v1"], num_envs=4)
    assert several.task_name() is None
    one = several.with_task("PullCube-v1")
    assert (one.task, one.tasks, one.task_name()) == ("PullCube-v1", [], "PullCube-v1")
    with pytest.raises(UserError, match=r"^env.tasks: one ManiSkillEnv runs one task"):
        ManiSkillEnv(several)


def test_a_non_finite_action_is_a_one_line_error_before_any_step(env):
    """A NaN reached ManiSkill's controllers (their drive target) and inf a full-bound command."""
    from embodied.schema import UserError

    env.reset(seed=0)
    bad = torch.zeros(3, env.spec.action.dim)
    bad[2, 0] = float("nan")
    with pytest.raises(UserError, match=r"the actions of environments \[2\] are not finite"):
        env.step(bad)
    assert env.step(torch.zeros(3, env.spec.action.dim)).reward.shape == (3,)


def test_unknown_task_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown ManiSkill task 'PushCubez-v1'"):
        check_assets("PushCubez-v1")


def test_ignore_terminations_runs_every_episode_to_the_time_limit():
    env = ManiSkillEnv(
        ManiSkillConfig(
            task="PushCube-v1",
            num_envs=2,
            num_workers=1,
            ignore_terminations=True,
            control_mode="pd_joint_delta_pos",
            max_episode_steps=12,
        )
    )
    try:
        env.reset(seed=0)
        zero = torch.zeros(2, env.spec.action.dim)
        for t in range(1, 25):
            out = env.step(zero)
            assert not out.terminated.any()
            assert (
                out.truncated.tolist() == [t % 12 == 0] * 2
            )  # exactly at the time limit, then reset
            assert out.success.dtype == torch.bool  # still reported every step
            assert (out.final_obs is not None) == (t % 12 == 0)
    finally:
        env.close()


def test_rgb_plus_state_gives_cameras_and_the_state_modes_inputs():
    """A state-based expert acts on rgb+state observations exactly as on state ones (demos)."""
    common = dict(
        task="PickCube-v1",
        num_envs=2,
        num_workers=0,  # (in this process: workers give the same numbers, tested below)
        control_mode="pd_joint_delta_pos",
        render_size=64,
    )
    with (
        ManiSkillEnv(ManiSkillConfig(obs_mode="rgb+state", image_size=64, **common)) as both,
        ManiSkillEnv(ManiSkillConfig(obs_mode="state", **common)) as state,
    ):
        assert [c.name for c in both.spec.obs.cameras] == ["base_camera"]
        assert (
            both.spec.obs.privileged == state.spec.obs.privileged
            and "obj_pose" in both.spec.obs.privileged
        )
        a, b = both.reset(seed=[5, 6]), state.reset(seed=[5, 6])
        assert a.images["base_camera"].shape == (2, 64, 64, 3)
        torch.testing.assert_close(a.state, b.state)
        for k in b.privileged:
            torch.testing.assert_close(a.privileged[k], b.privileged[k])


def test_a_worker_that_dies_at_start_is_an_error_not_a_hang(tmp_path):
    """A script without a __main__ guard makes spawned workers die while starting: fail at once."""
    script = tmp_path / "noguard.py"
    script.write_text(
        "from embodied.simulators.maniskill import ManiSkillConfig, ManiSkillEnv\n"
        "ManiSkillEnv(ManiSkillConfig(num_envs=1, num_workers=1))\n"
    )
    res = subprocess.run(
        [sys.executable, str(script)],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert res.returncode != 0 and "worker process died" in res.stderr and "__main__" in res.stderr


def test_in_process_backend_passes_the_contract_and_matches_the_workers_step_for_step():
    # num_workers=0 runs the same core in this process: same numbers as a worker, no round trip
    common = dict(
        task="PushCube-v1", num_envs=3, control_mode="pd_joint_delta_pos", max_episode_steps=6
    )
    local, pooled = (
        ManiSkillEnv(ManiSkillConfig(**common, num_workers=0)),
        ManiSkillEnv(ManiSkillConfig(**common, num_workers=1)),
    )
    try:
        assert not local._pool._procs and len(pooled._pool._procs) == 1
        check_env(local, seed=1)
        torch.testing.assert_close(
            local.reset(seed=[5, 6, 7]).state, pooled.reset(seed=[5, 6, 7]).state, rtol=0, atol=0
        )
        g = torch.Generator().manual_seed(0)
        low, high = local.spec.action.bounds()
        for t in range(8):  # crosses the 6-step time limit: auto-reset and final_obs on both
            a = low + (high - low) * torch.rand(3, local.spec.action.dim, generator=g)
            x, y = local.step(a), pooled.step(a)
            torch.testing.assert_close(x.obs.state, y.obs.state, rtol=0, atol=0)
            # the cube after an automatic (unseeded) reset too: it comes from the env's seeded RNG,
            # not from the process's global one (enhanced_determinism)
            torch.testing.assert_close(
                x.obs.privileged["obj_pose"], y.obs.privileged["obj_pose"], rtol=0, atol=0
            )
            torch.testing.assert_close(x.reward, y.reward, rtol=0, atol=0)
            assert torch.equal(x.truncated, y.truncated) and bool(x.truncated.all()) == (t == 5)
        # two subsets in flight at once, answered in order
        local.step_async(a[:1], torch.tensor([0]))
        local.step_async(a[1:], torch.tensor([1, 2]))
        assert local.step_wait(torch.tensor([0])).reward.shape == (1,)
        assert local.step_wait(torch.tensor([1, 2])).reward.shape == (2,)
    finally:
        local.close()
        pooled.close()


class RenderBuffer:
    """What physx_cuda's cameras give (ManiSkill 3.0.1, its default shader): every render's
    images are views of one buffer per camera, which the next render overwrites. Installed on a
    physx_cpu core's env, so that the core's handling of them runs here; ``frames`` keeps a copy
    of each render."""

    def __init__(self, env):
        self.buffers: dict[str, torch.Tensor] = {}
        self.frames: list[dict[str, torch.Tensor]] = []
        env.step = self._wrap(env.step, lambda out: out[0])
        env.reset = self._wrap(env.reset, lambda out: out[0])
        env.get_obs = self._wrap(env.get_obs, lambda out: out)

    def _wrap(self, method, raw_of):
        def rendering(*args, **kwargs):
            out = method(*args, **kwargs)
            frames = {}
            for cam, data in raw_of(out)["sensor_data"].items():
                buffer = self.buffers.setdefault(cam, torch.empty_like(data["rgb"]))
                buffer.copy_(data["rgb"])
                data["rgb"] = buffer  # uint8 [B, H, W, 3]: a view of the buffer
                frames[cam] = buffer.clone()
            self.frames.append(frames)
            return out

        return rendering


def test_final_images_are_the_last_frames_though_the_renderer_reuses_its_buffer():
    """The ended row's final_obs images are the frames its last step rendered, not the reset's
    render into the same buffer (what physx_cuda's final_obs held); a running row's are obs's."""
    from embodied.simulators.maniskill.core import CoreOptions, ManiSkillCore

    opts = CoreOptions(
        task="PushCube-v1",
        num_envs=2,
        obs_mode="rgb",
        control_mode="pd_joint_delta_pos",
        image_size=32,
        render_size=32,
        max_episode_steps=2,
        ignore_terminations=True,
    )
    core = ManiSkillCore(opts)
    try:
        buffer = RenderBuffer(core.env)
        core.reset(seed=[3, 4])
        gen = torch.Generator().manual_seed(0)
        low, high = core.action_spec.bounds()
        core.step(low + (high - low) * torch.rand(2, len(low), generator=gen))
        core.reset(seed=[5], env_ids=torch.tensor([1]))  # env 1 starts a step later
        actions = low + (high - low) * torch.rand(2, len(low), generator=gen)
        obs, _, _, truncated, _, final, ended = core.step(actions)
        assert truncated.tolist() == [True, False] and ended.tolist() == [0]
        stepped, reset = buffer.frames[-2], buffer.frames[-1]  # the step's render, the reset's
        for cam, frames in stepped.items():
            assert not torch.equal(frames[0], reset[cam][0])  # (the arm moved, the cube too)
            assert torch.equal(final.images[cam][0], frames[0])
            assert torch.equal(final.images[cam][1], obs.images[cam][1])
            assert torch.equal(obs.images[cam], reset[cam])
    finally:
        core.close()
