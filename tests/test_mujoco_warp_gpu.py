"""The warp backend's fast path: a step compiled with torch.compile (``env.compile``) gives the
eager step's numbers, on Warp's CPU device (slow) and on a GPU; and on a GPU, no step, round or
reset waits on the device, envs share one side stream, and CPU and GPU agree.

The gpu tests run in ``benchmarks/gpu_suite.sh``'s warp_tests stage."""

import dataclasses

import pytest
import torch

pytest.importorskip("mujoco_warp")

from sync_sites import with_syncs  # noqa: E402

from embodied.schema import UserError  # noqa: E402
from embodied.simulators.mujoco import MuJoCoConfig, make_env  # noqa: E402
from embodied.simulators.mujoco.experts import EXPERTS  # noqa: E402

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
    assert {"physics", "forward"} <= set(gpu._graphs)  # (Warp's waits, which torch never sees)
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
    stats = EpisodeStats(envs.task_names, torch.device("cuda"))
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


@pytest.mark.gpu
def test_on_a_gpu_the_cameras_see_what_the_cpu_device_sees_and_a_masked_reset_redraws_its_rows():
    """The CUDA render path (the pose's captured graph on the side stream, the BVH refit on the
    device) against the CPU device's: the goal and cube on the same pixels (measured on the CPU
    against MuJoCo's renderer: within 1.5 px); a masked reset redraws its own rows only; and the
    contract's checks of a CUDA rgb env."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from test_mujoco_warp import _centroids

    from embodied.contract import check_env

    seeds = [11, 12, 13, 14]
    images = {}
    for device in ("cpu", "cuda"):
        cfg = MuJoCoConfig(
            task="push", num_envs=4, backend="warp", device=device, obs_mode="rgb", image_size=64
        )
        with make_env(cfg) as env:
            images[device] = env.reset(seed=seeds).images["base_camera"].cpu()
            stepped = env.step(torch.full((4, 6), 0.05, device=device)).obs
            again = env.reset(seed=[7], env_ids=torch.tensor([1], device=device))
            before, after = stepped.images["base_camera"].cpu(), again.images["base_camera"].cpu()
            assert torch.equal(after[[0, 2, 3]], before[[0, 2, 3]]), device
            assert not torch.equal(after[1], before[1]), device
    for color in ("red", "blue"):
        gap = _centroids(images["cuda"], color) - _centroids(images["cpu"], color)
        assert gap.abs().max() < 1.0, (color, gap)
    cfg = MuJoCoConfig(
        task="push",
        num_envs=3,
        backend="warp",
        device="cuda",
        obs_mode="rgb",
        image_size=32,
        max_episode_steps=6,
    )
    with make_env(cfg) as env:
        check_env(env, seed=1)


@pytest.mark.gpu
def test_on_a_gpu_randomized_worlds_are_the_cpu_devices_and_never_wait_on_the_device():
    """Per-world model rows written by torch, read by the captured graphs on the side stream:
    the same draws and the same motion as on the CPU device, and no wait (Warp's or torch's)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from embodied.simulators.mujoco.randomize import RandomizeConfig

    spread = RandomizeConfig(cube_size=0.3, mass=0.3, friction=0.3, servo_gain=0.3)
    cfg = dict(task="push", num_envs=8, backend="warp", max_episode_steps=50, randomize=spread)
    gpu = make_env(MuJoCoConfig(device="cuda", **cfg))
    cpu = make_env(MuJoCoConfig(device="cpu", **cfg))
    actions = torch.linspace(-0.05, 0.05, 8 * 6).reshape(8, 6)
    gpu.reset(seed=3)  # warm-up: the graphs, pinned memory
    gpu.step(actions.cuda())

    def round_on_the_gpu():
        gpu.reset(seed=5)
        for _ in range(4):
            out = gpu.step(actions.cuda())
        return out

    out, sites = with_syncs(round_on_the_gpu)
    assert sites == []
    cpu.reset(seed=5)
    for _ in range(4):
        expected = cpu.step(actions)
    # (the camera's rows: test_mujoco_randomize.py, rgb, on Warp's CPU device)
    for field in ("cube_scale", "mass_scale", "friction_scale", "gain_scale"):
        a, b = getattr(gpu.world_params, field).cpu(), getattr(cpu.world_params, field)
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0, msg=field)
    torch.testing.assert_close(out.obs.state.cpu(), expected.obs.state, atol=1e-4, rtol=0)
    gpu.close()
    cpu.close()
