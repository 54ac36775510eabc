"""The MuJoCo Warp backend (``env.backend=warp``) on Warp's CPU device: the very kernels a GPU
runs. It passes the contract, starts from the same initial states as the ``mujoco.rollout``
backend for the same seeds, follows the same trajectories under the same actions within measured
tolerances, and fails in one line where a user can act (device, Warp version, contact buffers).

Warp compiles its kernels once into its cache (~/.cache/warp; scripts/setup.sh warms it), so
these tests load them instead of compiling."""

import dataclasses
import re

import pytest
import torch

pytest.importorskip("mujoco_warp")

from sync_sites import with_syncs  # noqa: E402

from embodied.contract import check_env  # noqa: E402
from embodied.schema import UserError  # noqa: E402
from embodied.simulators.mujoco import TASKS, MuJoCoConfig, make_env  # noqa: E402
from embodied.simulators.mujoco.experts import EXPERTS  # noqa: E402
from embodied.simulators.mujoco.warp_env import (  # noqa: E402
    NJMAX,
    BufferOverflow,
    LaggedRead,
)

# Worst difference between the backends over 32 worlds x 60 steps (seeds 100-131,
# docs/benchmarks.md), with a margin of about 2x, under the same actions: random deltas in free
# motion (reach), and on the contact tasks the scripted expert's actions recorded on the rollout
# backend (it pushes, grasps and lifts the cube). Free motion agrees to float32 precision; in
# contact the two pipelines (MuJoCo's C collision functions and solver in float64, MuJoCo Warp's
# in float32) part by millimetres, and a squeezed gripper settles 0.1 rad apart. That is the
# backends, not chaos: the rollout backend against itself with 1e-6 rad moved joints stays within
# 1e-5 on the same actions. (Random deltas jam the fingers into the table in a few worlds, where
# one backend's wrist sticks and the other's slips: 0.36 rad; docs/benchmarks.md.)
TOLERANCE = {
    "reach": {"joint": 1e-4, "tcp_pos": 1e-4},
    "push": {"joint": 0.03, "tcp_pos": 0.01, "cube_pos": 0.065},
    "pick": {"joint": 0.22, "tcp_pos": 0.002, "cube_pos": 0.02},
}


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
    warp, rollout = _pair(task, num_envs=8)
    seeds = list(range(100, 108))
    first_w = warp.reset(seed=seeds)
    first_r = rollout.reset(seed=seeds)
    assert torch.equal(first_w.state[:, :6], first_r.state[:, :6])  # the very same f32 draws
    for key in first_w.privileged:
        torch.testing.assert_close(
            first_w.privileged[key], first_r.privileged[key], atol=1e-6, rtol=0
        )
    g = torch.Generator().manual_seed(0)
    expert = EXPERTS[task]()
    worst = dict.fromkeys(TOLERANCE[task], 0.0)
    obs_r = first_r
    for _ in range(50):
        if task == "reach":
            actions = torch.rand(8, 6, generator=g) * 0.2 - 0.1
        else:  # the expert acts on the rollout backend; both take its actions
            actions = expert.act(obs_r).actions[:, 0]
        out_w = warp.step(actions)
        out_r = rollout.step(actions)
        obs_r = out_r.obs
        joint = (out_w.obs.state[:, :6] - out_r.obs.state[:, :6]).abs().max().item()
        worst["joint"] = max(worst["joint"], joint)
        for key in set(worst) - {"joint"}:
            gap = (out_w.obs.privileged[key] - out_r.obs.privileged[key]).norm(dim=-1).max()
            worst[key] = max(worst[key], gap.item())
        assert torch.equal(out_w.truncated, out_r.truncated)
    assert all(worst[k] <= TOLERANCE[task][k] for k in worst), worst


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
    with pytest.raises(BufferOverflow, match="constraint buffer holds \\(8\\)"):
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


ON_DEVICES = pytest.mark.parametrize(
    "device",
    [pytest.param("cpu", marks=pytest.mark.slow), pytest.param("cuda", marks=pytest.mark.gpu)],
)


@ON_DEVICES
def test_a_compiled_step_gives_the_eager_steps_numbers(device):
    """``env.compile``: the step's reading of the new state through torch.compile gives what the
    eager step gives, up to float rounding, also where every episode ends (compiling takes some
    20 s on a CPU: slow there)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    cfg = MuJoCoConfig(task="push", num_envs=6, backend="warp", device=device, max_episode_steps=4)
    eager = make_env(cfg)
    fused = make_env(dataclasses.replace(cfg, compile=True))
    torch.testing.assert_close(fused.reset(seed=3).state, eager.reset(seed=3).state)
    deltas = torch.linspace(-0.05, 0.05, 6 * 6, device=device).reshape(6, 6)
    for t in range(6):  # the episodes end at the 4th step
        a = eager.step(deltas * (t % 3 - 1))
        b = fused.step(deltas * (t % 3 - 1))
        torch.testing.assert_close(b.reward, a.reward, atol=1e-6, rtol=0)
        torch.testing.assert_close(b.obs.state, a.obs.state, atol=1e-5, rtol=0)
        assert torch.equal(b.success, a.success) and torch.equal(b.truncated, a.truncated)
        assert (a.ended is None) == (b.ended is None) == (t != 3)
        if t == 3:  # the episodes' last observations, read before the resets
            torch.testing.assert_close(b.final_obs.state, a.final_obs.state, atol=1e-5, rtol=0)
    torch.testing.assert_close(b.obs.privileged["cube_pos"], a.obs.privileged["cube_pos"])
    eager.close()
    fused.close()


@ON_DEVICES
def test_a_compiled_step_ends_episodes_on_success_where_the_eager_step_does(device):
    """With ``ignore_terminations=false`` success ends an episode (a graph of its own): reach,
    driven by its scripted expert, terminates and resets the same worlds at the same steps."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    cfg = MuJoCoConfig(task="reach", num_envs=6, backend="warp", device=device)
    cfg = dataclasses.replace(cfg, ignore_terminations=False)
    eager = make_env(cfg)
    fused = make_env(dataclasses.replace(cfg, compile=True))
    expert = EXPERTS["reach"](device)
    obs = eager.reset(seed=5)
    torch.testing.assert_close(fused.reset(seed=5).state, obs.state)
    terminated = torch.zeros(6, dtype=torch.bool, device=device)
    for _ in range(10):  # (the expert reaches in 1-8 steps)
        actions = expert.act(obs).actions[:, 0]
        a = eager.step(actions)
        b = fused.step(actions)
        assert torch.equal(b.terminated, a.terminated) and torch.equal(b.success, a.success)
        assert (a.ended is None) == (b.ended is None)
        if a.ended is not None:  # the same worlds, and their last observations
            assert torch.equal(b.ended, a.ended)
            torch.testing.assert_close(b.final_obs.state, a.final_obs.state, atol=1e-5, rtol=0)
        torch.testing.assert_close(b.obs.state, a.obs.state, atol=1e-5, rtol=0)
        terminated |= a.terminated
        obs = a.obs
    assert terminated.sum() >= 4  # success ended episodes in most worlds
    eager.close()
    fused.close()


def test_env_compile_without_a_compiler_is_a_one_line_error_before_the_model_is_built(
    monkeypatch,
):
    monkeypatch.setenv("CXX", "no-such-compiler++")
    monkeypatch.setattr(
        "embodied.simulators.mujoco.warp_env.build_model",
        lambda *a: pytest.fail("the model was built before the compiler check"),
    )
    with pytest.raises(UserError) as raised:
        make_env(MuJoCoConfig(task="reach", num_envs=1, backend="warp", compile=True))
    assert str(raised.value) == (
        "env.compile on a CPU needs a C++ compiler (g++, or the one CXX names): apt install g++, "
        "or set env.compile=false"
    )


@pytest.mark.slow
def test_compiled_envs_of_more_configurations_than_torchs_cap_all_step():
    """torch.compile keeps at most ``recompile_limit`` (8) compiled versions of a function per
    process; past that, with fullgraph, a call fails (FailOnRecompileLimitHit). Every env
    compiles its own copy, so a process may hold envs of any number of configurations (here
    sizes: a graph each)."""
    settings = torch._dynamo.config  # (torch before 2.7 names the cap cache_size_limit)
    cap = getattr(settings, "recompile_limit", None) or settings.cache_size_limit
    for worlds in range(1, cap + 2):
        cfg = MuJoCoConfig(task="reach", num_envs=worlds, backend="warp", compile=True)
        with make_env(cfg) as env:
            env.reset(seed=worlds)
            out = env.step(torch.full((worlds, 6), 0.01))
            assert out.obs.state.shape == (worlds, 12) and out.reward.shape == (worlds,)


@pytest.mark.gpu
def test_on_a_gpu_no_step_reads_the_device_until_episodes_end_and_cpu_agrees():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    cfg = dict(task="push", num_envs=64, backend="warp", max_episode_steps=5)
    gpu = make_env(MuJoCoConfig(device="cuda", **cfg))
    cpu = make_env(MuJoCoConfig(device="cpu", **cfg))
    first = gpu.reset(seed=0)
    assert torch.equal(first.state[:, :6].cpu(), cpu.reset(seed=0).state[:, :6])
    actions = torch.full((64, 6), 0.05, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any read of the device raises
    try:
        for _ in range(4):  # one captured graph of substeps per step; no episode ends
            out = gpu.step(actions)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for _ in range(4):
        expected = cpu.step(actions.cpu())
    torch.testing.assert_close(out.obs.state.cpu(), expected.obs.state, atol=1e-4, rtol=0)
    torch.cuda.set_sync_debug_mode("error")
    try:  # every episode ends, by the host's count: the peaks are copied, not waited for
        last = gpu.step(actions)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert last.ended.tolist() == list(range(64)) and last.final_obs is not None


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_on_a_gpu_a_round_never_waits_on_the_device(compiled):
    """The collect phase (env steps, MLP policy, buffers, episode statistics) over two episodes
    of 5 steps: no host sync, also where episodes end. Host rows (the plan, the ended rows) reach
    the device from pinned memory, and the buffer peaks the host, without a wait. The same with
    ``env.compile`` and ``policy.compile_act``."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from embodied.env_group import EnvGroup
    from embodied.episode_stats import EpisodeStats
    from embodied.inference import InferencePolicy
    from embodied.models import ActorCritic, ActorCriticConfig
    from embodied.rollout import CollectPlan, collect

    cfg = MuJoCoConfig(task="push", num_envs=64, backend="warp", device="cuda", compile=compiled)
    envs = EnvGroup(make_env(dataclasses.replace(cfg, max_episode_steps=5)))
    policy = ActorCritic(envs.spec, ActorCriticConfig()).to("cuda")
    inference = InferencePolicy(policy, compile_act=compiled)
    plan = CollectPlan(seeds=0, group_of_env=torch.full((64,), -1), num_chunks=10, episode_base=0)
    stats = EpisodeStats(64, envs.task_names, torch.device("cuda"))
    collect(envs, inference, envs.reset(seed=0), plan, stats)  # warm-up: graphs, pinned memory
    obs = envs.reset(seed=0)
    (batch, _), sites = with_syncs(lambda: collect(envs, inference, obs, plan, stats))
    assert batch.truncated[4].all() and batch.truncated[9].all()
    assert sites == []


@pytest.mark.gpu
def test_on_a_gpu_a_seeded_reset_never_waits_on_the_device():
    """A round starts from a seeded reset of every world; a masked one resets some. The seeds
    and rows reach the device from pinned memory: no wait (before, two per reset)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    env = make_env(MuJoCoConfig(task="push", num_envs=64, backend="warp", device="cuda"))
    env.reset(seed=0)  # warm-up: the forward pass's graph, pinned memory

    def resets() -> None:
        env.reset(seed=64)
        env.reset(seed=[7, 9], env_ids=torch.tensor([1, 2]))

    _, sites = with_syncs(resets)
    assert sites == []


@pytest.mark.gpu
def test_on_a_gpu_envs_share_one_side_stream_which_a_freed_env_leaves_working():
    """Torch hands out its 32 pooled streams in turn: with one of its own, an env built 32
    requests after another would get the same stream, and freeing the older one would remove
    that stream from Warp's registry under the newer ("unknown stream" at its next capture).
    Every env of a device takes the process's one side stream instead."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    import gc

    cfg = MuJoCoConfig(task="reach", num_envs=4, backend="warp", device="cuda")
    first = make_env(cfg)
    for _ in range(31):  # the pool around, to the stream the first env had
        torch.cuda.Stream()
    second = make_env(cfg)
    assert second._side_stream is first._side_stream
    first.close()
    del first
    gc.collect()
    second.reset(seed=0)  # captures the forward pass's graph on the side stream
    out = second.step(torch.full((4, 6), 0.01, device="cuda"))  # and the physics'
    assert torch.isfinite(out.obs.state).all()


@pytest.mark.gpu
def test_on_a_gpu_the_scripted_expert_records_what_it_records_on_the_cpu():
    """`embodied demos` on a GPU env: each step's tensors come to the host once (its mask of
    running worlds on the host too; before, a CPU mask met the GPU's done mask and raised), and
    reach's free motion under the expert (the IK's solve reads nothing) agrees with the CPU's."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    import numpy as np

    from embodied.demos import _attempt, scripted_expert

    recorded = {}
    for device in ("cpu", "cuda"):
        cfg = MuJoCoConfig(
            task="reach", num_envs=2, backend="warp", device=device, obs_mode="rgb", image_size=32
        )
        with make_env(cfg) as env:
            obs = env.reset(seed=[5, 6])
            expert = scripted_expert(cfg, env.device)
            recorded[device] = _attempt(env, expert, obs, 2, True, ["goal_pos"])
    for cpu, gpu in zip(recorded["cpu"], recorded["cuda"], strict=True):
        assert len(gpu.state) == len(cpu.state) == len(gpu.images["base_camera"]) == 50
        assert gpu.images["base_camera"][0].dtype == np.uint8
        # the joints (the state's velocities are 20x their differences: within float32 noise
        # over 50 closed-loop steps, not a tolerance of their own)
        joints = [np.stack(episode.state)[:, :6] for episode in (gpu, cpu)]
        np.testing.assert_allclose(*joints, atol=1e-3)
        np.testing.assert_allclose(np.stack(gpu.actions), np.stack(cpu.actions), atol=1e-3)


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
