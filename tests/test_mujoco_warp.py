"""The MuJoCo Warp backend (``env.backend=warp``) on Warp's CPU device: the very kernels a GPU
runs. It passes the contract, starts from the same initial states as the ``mujoco.rollout``
backend for the same seeds, follows the same trajectories under the same actions within measured
tolerances, and fails in one line where a user can act (device, Warp version, contact buffers).

Warp compiles its kernels once into its cache (~/.cache/warp; scripts/setup.sh warms it), so
these tests load them instead of compiling."""

import re

import pytest
import torch

pytest.importorskip("mujoco_warp")


from embodied.contract import check_env  # noqa: E402
from embodied.schema import UserError  # noqa: E402
from embodied.simulators.mujoco import TASKS, MuJoCoConfig, make_env  # noqa: E402
from embodied.simulators.mujoco.experts import EXPERTS  # noqa: E402
from embodied.simulators.mujoco.warp_env import NJMAX  # noqa: E402
from embodied.simulators.mujoco.warp_guard import BufferOverflow, LaggedRead  # noqa: E402

# Twice the worst difference between the backends that this test's own run measured (8 worlds,
# seeds 100-107, 50 steps; 2026-11-28, docs/benchmarks.md), rounded up at the second digit, under
# the same actions: random deltas in free motion (reach), and on the contact tasks the scripted
# expert's actions recorded on the rollout backend (it pushes, grasps and lifts the cube).
# Measured: reach 7.8e-7 rad and 1.2e-7 m (float32 precision); push 0.016 rad, 3.5 mm for the
# tool point and 2.5 cm for the cube; pick 0.107 rad (the squeezing gripper), 0.7 mm and 8.5 mm.
# In contact the two pipelines (MuJoCo's C collision functions and solver in float64, MuJoCo
# Warp's in float32) part by millimetres, and a squeezed gripper settles 0.1 rad apart. That is
# the backends, not chaos: the rollout backend against itself with 1e-6 rad moved joints stays
# within 1e-5 on the same actions. In contact a world may part further: a push that moves the
# cube on one backend and slips past it on the other (over seeds 100-131, 3 of push's 32 worlds'
# cubes parted by more than its bound below, by up to 0.27 m, where the wrist's start is uniform
# over its range; 1 of 32 while 40% of the wrists started on its bound). So in contact each
# bound holds in all but one of the 8 worlds; the experts' success over 100 seeds on both
# backends measures the rest (test_mujoco_experts.py).
TOLERANCE = {
    "reach": {"joint": 1.6e-6, "tcp_pos": 2.4e-7},
    "push": {"joint": 0.032, "tcp_pos": 0.0071, "cube_pos": 0.049},
    "pick": {"joint": 0.22, "tcp_pos": 0.0014, "cube_pos": 0.018},
}
SEEDS = list(range(100, 108))  # the worlds the tolerances were measured on
# what no world may pass, parted or not: twice the largest over seeds 100-131 (0.154 rad, 35 mm,
# 0.27 m), so one world's arm sent somewhere else (a row written to the wrong world) still fails
CEILING = {"joint": 0.3, "tcp_pos": 0.07, "cube_pos": 0.54}


def _pair(task: str, num_envs: int, **kw):
    warp = make_env(MuJoCoConfig(task=task, num_envs=num_envs, backend="warp", **kw))
    rollout = make_env(MuJoCoConfig(task=task, num_envs=num_envs, **kw))
    return warp, rollout


@pytest.mark.parametrize("task", sorted(TASKS))
def test_contract_on_the_warp_backend(task):
    with make_env(MuJoCoConfig(task=task, num_envs=3, backend="warp", max_episode_steps=6)) as env:
        check_env(env, seed=1)  # keys, shapes, dtypes, partial reset, auto-reset with final_obs
        assert env.device == torch.device("cpu")


@pytest.mark.parametrize("task", sorted(TASKS))
def test_both_backends_start_alike_and_follow_the_same_trajectories(task):
    warp, rollout = _pair(task, num_envs=len(SEEDS))
    first_w = warp.reset(seed=SEEDS)
    first_r = rollout.reset(seed=SEEDS)
    assert torch.equal(first_w.state[:, :6], first_r.state[:, :6])  # the very same f32 draws
    for key in first_w.privileged:
        torch.testing.assert_close(
            first_w.privileged[key], first_r.privileged[key], atol=1e-6, rtol=0
        )
    g = torch.Generator().manual_seed(0)
    expert = EXPERTS[task]()
    worst = {key: torch.zeros(len(SEEDS)) for key in TOLERANCE[task]}  # f32 [8]: each world's
    obs_r = first_r
    for _ in range(50):
        if task == "reach":
            actions = torch.rand(8, 6, generator=g) * 0.2 - 0.1
        else:  # the expert acts on the rollout backend; both take its actions
            actions = expert.act(obs_r).actions[:, 0]
        out_w = warp.step(actions)
        out_r = rollout.step(actions)
        obs_r = out_r.obs
        joint = (out_w.obs.state[:, :6] - out_r.obs.state[:, :6]).abs().amax(1)
        worst["joint"] = torch.maximum(worst["joint"], joint)
        for key in set(worst) - {"joint"}:
            gap = (out_w.obs.privileged[key] - out_r.obs.privileged[key]).norm(dim=-1)
            worst[key] = torch.maximum(worst[key], gap)
        assert torch.equal(out_w.truncated, out_r.truncated)
    parted = {key: int((worst[key] > TOLERANCE[task][key]).sum()) for key in worst}
    assert all(n <= (0 if task == "reach" else 1) for n in parted.values()), (parted, worst)
    assert all(worst[key].max() <= CEILING[key] for key in worst), worst


def test_equal_seeds_give_equal_worlds_and_a_masked_reset_leaves_the_others():
    with make_env(MuJoCoConfig(task="push", num_envs=4, backend="warp")) as env:
        obs = env.reset(seed=[7, 7, 7, 8])
        assert torch.equal(obs.privileged["cube_pos"][0], obs.privileged["cube_pos"][2])
        assert not torch.equal(obs.privileged["cube_pos"][0], obs.privileged["cube_pos"][3])
        moved = env.step(torch.full((4, 6), 0.1)).obs
        again = env.reset(seed=[7], env_ids=torch.tensor([1]))
        assert torch.equal(again.privileged["goal_pos"][1], obs.privileged["goal_pos"][1])
        assert torch.equal(again.state[1], obs.state[1])  # world 1 starts over exactly
        assert torch.equal(again.state[[0, 2, 3]], moved.state[[0, 2, 3]])  # the others go on


def overflow_where_episodes_end(**buffers) -> str:
    """The BufferOverflow of 4 push worlds with these buffer sizes, raised where episodes end:
    the peaks copied at the first ending are looked at in the second (no wait on the device)."""
    cfg = MuJoCoConfig(task="push", num_envs=4, backend="warp", max_episode_steps=2, **buffers)
    with make_env(cfg) as env:
        env.reset(seed=0)
        env.step(torch.zeros(4, 6))  # no episode ends: nothing is read from the device
        first = env.step(torch.zeros(4, 6))  # episodes end: the peaks are copied, not waited for
        assert first.ended.tolist() == [0, 1, 2, 3]
        env.step(torch.zeros(4, 6))
        with pytest.raises(BufferOverflow) as raised:
            env.step(torch.zeros(4, 6))  # episodes end: the first ending's copy is checked
    return str(raised.value)  # (and close, on leaving, does not raise it again)


def _overflowed_unseen():
    """A push env whose constraint buffer (8) overflowed in a step that nothing has looked at
    since (no episode ended)."""
    cfg = MuJoCoConfig(task="push", num_envs=4, backend="warp", max_episode_steps=50, njmax=8)
    env = make_env(cfg)
    env.reset(seed=0)
    env.step(torch.zeros(4, 6))
    return env


def test_an_overflow_after_the_last_look_is_raised_at_close():
    env = _overflowed_unseen()
    with pytest.raises(UserError, match="constraint buffer holds \\(8\\)"):  # (one line)
        env.close()


@pytest.mark.parametrize("closed_by", ["with", "close(error)"])
def test_an_overflow_at_close_is_printed_beside_an_error_on_its_way_out(capsys, closed_by):
    """A run that fails (here a ValueError) closes its env on the way out: the overflow found
    then is said on stderr, and the error that ended the run is the one raised."""
    env = _overflowed_unseen()
    with pytest.raises(ValueError, match="the run's own error"):
        if closed_by == "with":
            with env:
                raise ValueError("the run's own error")
        else:
            try:
                raise ValueError("the run's own error")
            except ValueError as error:
                env.close(error)
                raise
    err = capsys.readouterr().err
    assert "also: MuJoCo Warp task 'push'" in err
    assert "constraint buffer holds (8)" in err


def test_an_overflow_at_close_is_raised_after_an_error_was_handled():
    """An error caught and dealt with before the env is closed is not on its way out: the
    overflow is the error then."""
    env = _overflowed_unseen()
    with pytest.raises(BufferOverflow, match="constraint buffer holds \\(8\\)"):
        try:
            raise KeyError("handled")
        except KeyError:
            with env:
                pass


BAD_ACTIONS_ERROR = (
    "MuJoCo Warp task 'push': the actions of environments [1, 2] were not finite "
    "(NaN or infinite; those entries acted as 0)"
)


def _bad_actions() -> torch.Tensor:
    """f32 [3, 6]: NaN for world 1, infinity for world 2."""
    bad = torch.zeros(3, 6)
    bad[1, 0] = float("nan")
    bad[2, 4] = float("inf")
    return bad


def _push(**kw) -> object:
    cfg = MuJoCoConfig(task="push", num_envs=3, backend="warp", max_episode_steps=2, **kw)
    env = make_env(cfg)
    env.reset(seed=[1, 2, 3])
    return env


def test_actions_not_one_row_per_world_are_a_one_line_error():
    """A [1, 6] row broadcast to every world (each did world 0's action)."""
    with _push() as env:
        with pytest.raises(UserError) as raised:
            env.step(torch.zeros(1, 6))
    assert str(raised.value) == "MuJoCo Warp task 'push': actions of shape (1, 6), expected (3, 6)"


def test_a_non_finite_action_acts_as_zero_and_is_an_error_where_episodes_end():
    """The warp step reads nothing from the device to check actions: a world's NaN action held
    its servo target at NaN for the episode. It acts as zero, and the guard's next look (the
    copy made where episodes end, checked where they end next) names the worlds."""
    env = _push()
    with pytest.raises(UserError) as raised:
        with env:  # (close, on leaving, does not raise it again)
            env.step(torch.zeros(3, 6))
            states = env.step(_bad_actions()).final_obs.state  # episodes end: flags copied
            env.step(torch.zeros(3, 6))
            env.step(torch.zeros(3, 6))  # episodes end: the copy is checked
    assert str(raised.value) == BAD_ACTIONS_ERROR
    with _push() as env:
        env.step(torch.zeros(3, 6))
        zeros = env.step(torch.zeros(3, 6)).final_obs.state
    assert torch.isfinite(states).all() and torch.equal(states, zeros)


def test_a_non_finite_action_is_an_error_in_its_own_step_where_the_done_mask_is_read():
    """With terminations the step reads the done mask every step: the guard's flags come along."""
    with _push(ignore_terminations=False) as env:
        env.step(torch.zeros(3, 6))
        with pytest.raises(UserError) as raised:
            env.step(_bad_actions())
    assert str(raised.value) == BAD_ACTIONS_ERROR


@pytest.mark.parametrize("fault", ["overflow", "non-finite"])
def test_rounds_shorter_than_episodes_are_looked_at_from_their_resets(fault):
    """The runner starts every round with a seeded reset, and its rounds are shorter than the
    episodes (push: 40 steps of 80), so no episode ends inside a step: each reset looks (at the
    copy the reset before made; no wait), and the round after the fault's raises."""
    njmax = 8 if fault == "overflow" else None
    cfg = MuJoCoConfig(task="push", num_envs=3, backend="warp", max_episode_steps=50, njmax=njmax)
    actions = torch.zeros(3, 6) if fault == "overflow" else _bad_actions()
    env = make_env(cfg)
    env.reset(seed=0)
    env.step(actions)  # the fault, in a step nothing reads
    env.step(torch.zeros(3, 6))
    env.reset(seed=1)  # the flags copied
    env.step(torch.zeros(3, 6))
    expected = BufferOverflow if fault == "overflow" else UserError
    with pytest.raises(expected) as raised:
        env.reset(seed=2)  # the copy checked
    env.close()  # (said once: close does not raise it again)
    said = "constraint buffer holds (8)" if fault == "overflow" else BAD_ACTIONS_ERROR
    assert said in str(raised.value)


def test_a_lagged_read_returns_the_copy_of_the_call_before():
    """Hand-built: each call returns what the previous call copied, never the tensor now."""
    source = torch.tensor([1, 2], dtype=torch.int32)
    read = LaggedRead(source)
    assert read(source) is None  # nothing copied before
    source[0] = 5
    assert read(source) == [1, 2]
    source[1] = 7
    assert read(source) == [5, 2]
    assert read(source) == [5, 7]


def test_a_lagged_read_whose_copy_is_in_flight_waits_for_a_later_call():
    """The GPU's case on the CPU: a copy not landed yet is neither returned nor overwritten."""
    read = LaggedRead(torch.tensor([1, 2], dtype=torch.int32))
    read(torch.tensor([3, 4], dtype=torch.int32))

    class InFlight:
        done = False

        def query(self) -> bool:
            return self.done

    read._landed = InFlight()
    assert read(torch.tensor([9, 9], dtype=torch.int32)) is None
    read._landed.done = True
    assert read(torch.tensor([5, 6], dtype=torch.int32)) == [3, 4]  # the copy it waited for


def test_an_env_is_freed_without_the_cycle_collector():
    """Nothing in the env refers back to it (a stored bound method would): its device memory
    goes when the last reference does."""
    import gc
    import weakref

    gc.disable()
    try:
        env = make_env(MuJoCoConfig(task="reach", num_envs=2, backend="warp"))
        gone = weakref.ref(env)
        env.close()
        del env
        assert gone() is None
    finally:
        gc.enable()


def test_a_contact_buffer_overflow_is_an_error_naming_the_task_and_buffer():
    # push's cube rests on the table with 4 contacts; 1 per world, 4 for all 4, cannot hold them
    found = re.fullmatch(
        r"MuJoCo Warp task 'push': (\d+) contacts in one substep \(all worlds together\), more "
        r"than its contact buffer holds \(4\); raise env\.nconmax \(contacts per world\)",
        overflow_where_episodes_end(nconmax=1),
    )
    assert found and int(found[1]) >= 16  # 4 worlds' cubes on the table: 4 contacts each


def test_the_constraint_buffer_is_the_measured_size_and_an_overflow_names_it():
    """MuJoCo Warp's default of 64 rows per world overflowed at 1024 worlds on a GPU (78 rows):
    env.njmax defaults to NJMAX, twice that peak; a buffer set too small is an error naming it."""
    with make_env(MuJoCoConfig(task="push", num_envs=2, backend="warp")) as env:
        assert env._d.njmax == NJMAX == 160
    found = re.fullmatch(
        r"MuJoCo Warp task 'push': (\d+) constraints in one world, more than its constraint "
        r"buffer holds \(8\); raise env\.njmax",
        overflow_where_episodes_end(njmax=8),
    )
    assert found and int(found[1]) >= 16  # the cube's 4 contacts, 4 pyramid rows each


def test_cuda_on_a_machine_without_it_is_a_one_line_error(capsys, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    from embodied.cli import main

    argv = ["train", "configs/mujoco/reach_ppo.yaml", "env.backend=warp", "env.device=cuda"]
    assert main([*argv, f"runner.output_dir={tmp_path}"]) == 2  # (not a run the user made)
    err = capsys.readouterr().err.strip()
    assert err == (
        "embodied: error: env.device=cuda needs a CUDA GPU and this machine has none; use "
        "env.device=cpu (the same kernels on Warp's CPU device, for correctness)"
    )


def test_another_warp_version_is_a_one_line_error_naming_both(monkeypatch):
    import warp

    monkeypatch.setattr(warp, "__version__", "1.19.0")
    with pytest.raises(UserError) as raised:
        make_env(MuJoCoConfig(task="reach", num_envs=1, backend="warp"))
    assert str(raised.value) == (
        "env.backend=warp: warp-lang 1.19.0 is installed, but mujoco-warp 3.8.1's kernels compile "
        "with warp-lang 1.12.0: pip install warp-lang==1.12.0"
    )


@pytest.mark.parametrize(
    "override, message",
    [
        ("backend=physx", "backend: must be one of ['rollout', 'warp'], got 'physx'"),
        ("device=gpu", "device: must be cpu, cuda or cuda:N, got 'gpu'"),
        (
            "device=cuda",
            "device: the rollout backend runs on the CPU; env.backend=warp runs on cuda",
        ),
        ("njmax=0", "njmax: must be >= 1 or null, got 0"),
        ("compile=1", "compile: only the warp backend compiles its step (env.backend=warp)"),
    ],
)
def test_bad_backend_settings_are_config_errors(override, message):
    key, value = override.split("=")
    value = int(value) if value.isdigit() else value
    value = bool(value) if key == "compile" else value
    with pytest.raises(ValueError) as raised:
        MuJoCoConfig(**{key: value}).validate()
    assert str(raised.value) == message


def test_cameras_render_on_the_device_and_pass_the_contract():
    cfg = MuJoCoConfig(
        task="pick",
        num_envs=3,
        backend="warp",
        obs_mode="rgb",
        cameras=["base_camera", "wrist_camera"],
        image_size=32,
        render_size=48,
        max_episode_steps=6,
    )
    with make_env(cfg) as env:
        check_env(env, seed=1)  # images uint8 [B, 32, 32, 3] per camera, on the env's device
        obs = env.reset(seed=[1, 2, 3])
        assert set(obs.images) == {"base_camera", "wrist_camera"}
        assert env.render().shape == (3, 48, 48, 3)
        wrist = obs.images["wrist_camera"].float()
        assert wrist.std() > 10 and not torch.equal(wrist[0], wrist[1])  # each world its own view


def _centroids(images: torch.Tensor, color: str) -> torch.Tensor:
    """f32 [B, 2]: the (row, column) centroid of each 64 x 64 image's pixels of one of push's
    colours: the red goal region (flat on the table) or the blue cube."""
    r, g, b = images.float().unbind(-1)
    if color == "red":  # (the fingertip pads are redder than the table but 3x, not 4x, green)
        mask = (r > 4 * g) & (r > 4 * b) & (r > 100)
    else:  # (not the ray caster's dark blue sky)
        mask = (b > 1.5 * r) & (b > 1.3 * g) & (b > 60)
    rows, cols = torch.meshgrid(torch.arange(64.0), torch.arange(64.0), indexing="ij")
    count = mask.sum((1, 2)).float()
    assert count.min() >= 4  # in view in every world
    return torch.stack([(mask * rows).sum((1, 2)), (mask * cols).sum((1, 2))], 1) / count[:, None]


def test_the_ray_cast_camera_sees_the_scene_where_mujocos_renderer_does():
    # the same seeds, the same scene: goal and cube land on the same pixels through MuJoCo Warp's
    # ray caster as through MuJoCo's OpenGL renderer (their shading differs; their cameras must
    # not). Measured: within 1 pixel at 64 x 64 (a colour threshold on different shading)
    warp, rollout = _pair("push", num_envs=4, obs_mode="rgb", image_size=64)
    seeds = [11, 12, 13, 14]
    ray_cast = warp.reset(seed=seeds).images["base_camera"]
    opengl = rollout.reset(seed=seeds).images["base_camera"]
    for color, pixels in (("red", 1.5), ("blue", 2.0)):
        gap = _centroids(ray_cast, color) - _centroids(opengl, color)
        assert gap.abs().max() < pixels, (color, gap)
    spread = _centroids(opengl, "red").max(0).values - _centroids(opengl, "red").min(0).values
    assert spread.max() > 5  # the goals are apart: the comparison can tell places apart
