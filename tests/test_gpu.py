"""On a CUDA GPU (skipped without one): the runner with its tensors on the device, PPO and GRPO
iterations of the MLP and of a small VLA, rollout steps without host synchronisation, ManiSkill
physx_cpu feeding a policy on the GPU, and ManiSkill's physx_cuda backend (the contract, grouped
seeded resets, PPO and GRPO iterations), which also needs SAPIEN's PhysX GPU library."""

import json

import pytest
import torch
from physx_gpu import needs_physx_gpu
from scripted_envs import GRPO, PPO, TINY_VLA, PushRightEnv, ScriptedEnv, run_on
from sync_sites import with_syncs

from embodied.checkpoint import load_checkpoint
from embodied.config import load_config
from embodied.contract import ContractError, check_env, check_policy
from embodied.env_group import EnvGroup
from embodied.episode_stats import EpisodeStats
from embodied.inference import InferencePolicy
from embodied.models import ActorCritic, ActorCriticConfig
from embodied.rollout import CollectPlan, collect
from embodied.runner import train
from embodied.simulators.maniskill import ManiSkillConfig, ManiSkillEnv
from embodied.train_config import TrainConfig

pytestmark = pytest.mark.gpu


def gpu_env(task="PushCube-v1", num_envs=64, **kw):
    cfg = ManiSkillConfig(
        task=task, backend="gpu", num_envs=num_envs, control_mode="pd_joint_delta_pos", **kw
    )
    return ManiSkillEnv(cfg)


@needs_physx_gpu
@pytest.mark.parametrize("task", ["PushCube-v1", "PickCube-v1"])
def test_gpu_backend_contract(task):
    env = gpu_env(task)
    try:
        assert env.device.type == "cuda"
        check_env(env, seed=0)
        policy = ActorCritic(env.spec, ActorCriticConfig(hidden_sizes=[64])).to(env.device)
        check_policy(policy, env.spec, batch_size=4, device="cuda")
        out = env.step(policy.act(env.reset(seed=0)).actions[:, 0])
        assert out.obs.state.device.type == "cuda" and out.reward.device.type == "cuda"
    finally:
        env.close()


@needs_physx_gpu
def test_final_images_on_physx_cuda_are_the_last_frames_not_the_reset_ones():
    """physx_cuda's images are views of the cameras' render buffer, which the automatic reset
    renders over: final_obs must hold a copy of the ended rows' last frames (the cpu path's
    test emulates that buffer: tests/test_maniskill_contract.py)."""
    env = gpu_env(
        num_envs=4, obs_mode="rgb", image_size=64, max_episode_steps=3, ignore_terminations=True
    )
    try:
        env.reset(seed=0)
        low, high = env.spec.action.bounds(env.device)
        g = torch.Generator().manual_seed(0)
        for _ in range(3):
            u = torch.rand(4, env.spec.action.dim, generator=g).to(env.device)
            out = env.step(low + (high - low) * u)
        assert out.ended.tolist() == [0, 1, 2, 3]
        for cam, final in out.final_obs.images.items():
            reset = out.obs.images[cam]
            for row in range(4):
                assert not torch.equal(final[row], reset[row]), (cam, row)
    finally:
        env.close()


def test_check_env_refuses_tensors_on_another_gpu_than_the_env_names():
    """The device's index counts: tensors on cuda:0 from an env that says cuda:1."""
    env = ScriptedEnv([2, 0, 3], device="cuda")
    env.device = torch.device("cuda", 1)  # (constructed without allocating: any GPU count)
    with pytest.raises(ContractError, match=r"reset\(\)\.state: on cuda:0, expected cuda:1"):
        check_env(env, deterministic=False)


@needs_physx_gpu
def test_equal_seeds_give_equal_initial_states_on_the_gpu():
    env = gpu_env("PickCube-v1", num_envs=8)
    try:
        seeds = [5, 5, 5, 5, 9, 9, 9, 9]
        obs = env.reset(seed=seeds)
        state = obs.state
        torch.testing.assert_close(state[:4], state[:1].expand(4, -1))
        torch.testing.assert_close(state[4:], state[4:5].expand(4, -1))
        assert not torch.allclose(state[0], state[4])
        for key, value in obs.privileged.items():
            torch.testing.assert_close(value[:4], value[:1].expand(4, -1), msg=key)
        alone = env.reset(seed=[9] * 8).state[0]
        torch.testing.assert_close(alone, state[4])
    finally:
        env.close()


@needs_physx_gpu
def test_rollout_steps_without_episode_ends_do_not_synchronise():
    """Terminations ignored: within an episode a chunk of the rollout (policy, environment step,
    statistics, buffers) never waits for the device."""
    env = gpu_env(num_envs=256, ignore_terminations=True)
    try:
        envs = EnvGroup(env)
        policy = ActorCritic(env.spec, ActorCriticConfig(hidden_sizes=[64])).to(env.device)
        inference = InferencePolicy(policy)
        stats = EpisodeStats(envs.task_names, env.device)
        plan = CollectPlan(
            seeds=0,
            group_of_env=torch.full((env.num_envs,), -1),
            num_chunks=20,  # 20 of the 50 steps: no episode ends
            episode_base=0,
        )
        obs = envs.reset(seed=0)
        collect(envs, inference, obs, plan, stats)  # warm-up
        obs = envs.reset(seed=0)
        (batch, _), syncs = with_syncs(lambda: collect(envs, inference, obs, plan, stats))
        assert batch.actions.device.type == "cuda" and batch.valid.all()
        assert syncs == [], f"host synchronisations in 20 rollout steps at {syncs}"
    finally:
        env.close()


def tiny_run(tmp_path, config, name, overrides):
    common = [
        f"runner.output_dir={tmp_path}",
        f"runner.name={name}",
        "runner.progress=false",
        "runner.video=false",
        "env.backend=gpu",
    ]  # (a later env.backend in overrides wins)
    cfg = load_config(TrainConfig, config, common + overrides)[0]
    return train(cfg)


@needs_physx_gpu
def test_ppo_iterations_of_the_mlp_on_physx_cuda(tmp_path):
    summary = tiny_run(
        tmp_path,
        "configs/maniskill/pushcube_ppo.yaml",
        "ppo",
        [
            "env.num_envs=512",
            "algorithm.num_steps=50",
            "runner.total_env_steps=102400",  # 4 iterations
            "runner.eval_every=2",
            "runner.eval_episodes=512",
            "runner.final_eval_episodes=512",
        ],
    )
    rows = [json.loads(x) for x in (tmp_path / "ppo" / "metrics.jsonl").read_text().splitlines()]
    training = [r for r in rows if "policy/loss" in r]
    assert [r["iteration"] for r in training] == [1, 2, 3, 4]
    assert all(r["episode/count"] == 512 for r in training)  # every env ended one episode
    assert summary["final"]["eval/episodes"] == 512
    assert training[-1]["episode/return"] > training[0]["episode/return"]


@needs_physx_gpu
def test_grpo_iterations_of_a_small_vla_on_physx_cuda(tmp_path):
    summary = tiny_run(
        tmp_path,
        "configs/maniskill/multitask_vla_grpo.yaml",
        "grpo",
        [
            "env.tasks=[PushCube-v1]",
            "env.num_envs=32",
            "env.max_episode_steps=20",
            "env.obs_mode=rgb",
            "policy.privileged_keys=[]",
            "policy.vision_pretrained=false",
            "policy.vision_width=0.25",
            "policy.vision_depth=0.25",
            "policy.text_pretrained=false",
            "policy.text_hidden=32",
            "policy.text_layers=1",
            "policy.d_model=64",
            "policy.layers=1",
            "policy.heads=2",
            "algorithm.exploration_log_std=null",
            "algorithm.dynamic_sampling=false",
            "runner.init_from=null",
            "runner.total_env_steps=2560",  # 4 iterations of 32 envs x 20 steps
            "runner.eval_episodes=32",
            "runner.final_eval_episodes=32",
            "runner.max_minutes=null",
        ],
    )
    rows = [json.loads(x) for x in (tmp_path / "grpo" / "metrics.jsonl").read_text().splitlines()]
    training = [r for r in rows if "policy/loss" in r]
    assert [r["iteration"] for r in training] == [1, 2, 3, 4]
    assert all(r["grpo/rounds"] == 1 for r in training)
    assert summary["before"]["PushCube-v1"]["eval/episodes"] == 32
    assert (tmp_path / "grpo" / "last" / "model.safetensors").exists()


# --- the runner on the GPU with scripted environments (no simulator library needed) ----------
def on_the_gpu(tmp_path, **kw) -> dict:
    env = PushRightEnv(8, device="cuda")
    summary = run_on(env, tmp_path / "run", **kw)
    weights = load_checkpoint(tmp_path / "run")["model"]
    assert summary["final"]["eval/episodes"] == 16 and weights  # saved from the GPU
    return summary


def test_grpo_on_the_gpu_raises_success(tmp_path):
    torch.manual_seed(0)
    algorithm = {**GRPO, "kl_coef": 0.01}  # the reference policy's log-probabilities too
    summary = on_the_gpu(tmp_path, total_env_steps=8 * 3 * 12, algorithm=algorithm)
    before = summary["before"]["all"]["eval/success_rate"]
    after = summary["tasks"]["all"]["eval/success_rate"]
    assert before < 0.5 and after == 1.0, (before, after)


def test_ppo_on_the_gpu_raises_success(tmp_path):
    torch.manual_seed(0)
    policy = {**TINY_VLA, "value_head": True}
    summary = on_the_gpu(tmp_path, total_env_steps=8 * 6 * 15, policy=policy, algorithm=PPO)
    assert summary["final"]["eval/success_rate"] == 1.0


def test_a_scripted_gpu_rollout_synchronises_only_where_episodes_end():
    """Our loop alone (the scripted environment's steps are a few tensor ops): a rollout step in
    which no episode ends never waits for the device. Steps are counted by difference, 30 chunks
    against 10, so what a round costs once (its plan's upload) cancels out."""
    from embodied.models import ActorCritic, ActorCriticConfig

    env = ScriptedEnv([0] * 64, max_episode_steps=40, device="cuda")
    envs = EnvGroup(env)
    policy = ActorCritic(env.spec, ActorCriticConfig(hidden_sizes=[64])).to("cuda")
    inference = InferencePolicy(policy)
    stats = EpisodeStats(envs.task_names, env.device)

    def rollout(chunks):
        plan = CollectPlan(
            seeds=0, group_of_env=torch.full((64,), -1), num_chunks=chunks, episode_base=0
        )
        obs = envs.reset(seed=0)
        batch, sites = with_syncs(lambda: collect(envs, inference, obs, plan, stats))
        return batch, len(sites)

    rollout(45)  # warm-up
    (short, _), syncs_10 = rollout(10)
    (batch, _), syncs_30 = rollout(30)
    assert batch.actions.device.type == "cuda" and short.valid.all() and batch.valid.all()
    assert syncs_30 - syncs_10 == 0, (syncs_10, syncs_30)
    (batch, _), syncs_45 = rollout(45)  # every episode ends at step 40
    assert syncs_45 > syncs_30, (syncs_30, syncs_45)  # the counting sees the end's resets


def test_maniskill_on_the_cpu_feeds_a_policy_on_the_gpu(tmp_path):
    pytest.importorskip("mani_skill")  # (a MuJoCo Warp visit brings no ManiSkill)
    summary = tiny_run(
        tmp_path,
        "configs/maniskill/pushcube_ppo.yaml",
        "cpu_env",
        [
            "env.backend=cpu",
            "env.num_envs=8",
            "env.num_workers=2",
            "runner.device=cuda",
            "algorithm.num_steps=50",
            "runner.total_env_steps=1200",  # 3 iterations
            "runner.eval_every=0",
            "runner.final_eval_episodes=8",
        ],
    )
    rows = [
        json.loads(x) for x in (tmp_path / "cpu_env" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["iteration"] for r in rows if "policy/loss" in r] == [1, 2, 3]
    assert summary["final"]["eval/episodes"] == 8


def test_a_stream_drawing_on_a_second_gpu_swaps_that_devices_generator():
    """A role on cuda:1 draws from its stream there, and cuda:0's generator (the current
    device's) is left alone; a saved state continues the cuda:1 draws."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    from embodied.streams import Stream

    torch.cuda.init()
    devices = ("cuda:0", "cuda:1")
    torch.cuda.manual_seed_all(5)
    expected_outside = [torch.rand(3, device=d) for d in devices]
    torch.cuda.manual_seed_all(5)
    stream = Stream.derived(0, "rollout", 0)
    with stream.drawing("cuda:1"):
        inside = torch.rand(4, device="cuda:1")
    own = torch.Generator("cuda:1").manual_seed(stream.seed)
    assert torch.equal(inside, torch.rand(4, device="cuda:1", generator=own))
    for device, expected in zip(devices, expected_outside):
        assert torch.equal(torch.rand(3, device=device), expected), device
    saved = stream.state()
    with stream.drawing("cuda:1"):
        expected_next = torch.rand(4, device="cuda:1")
    again = Stream.derived(0, "rollout", 0)
    again.load(saved)
    with again.drawing("cuda:1"):
        assert torch.equal(torch.rand(4, device="cuda:1"), expected_next)


def test_an_evaluation_times_the_policys_kernels_as_the_policys():
    """``act`` returns before its kernels run; the step's transfer waited for them, so the policy
    read as nearly free and the simulator as slower by its time. A policy of matmuls costing
    more than the scripted steps: its measured time is what ``eval/policy_ms`` says."""
    from embodied.evaluate import evaluate
    from embodied.schema import PolicyOutput

    weights = torch.randn(4096, 4096, device="cuda")

    class HeavyPolicy:
        def act(self, obs, *, deterministic=True):
            x = weights
            for _ in range(50):
                x = (x @ weights).tanh()
            actions = torch.zeros(obs.batch_size, 1, 1, device="cuda") + x[0, 0] * 0
            return PolicyOutput(actions=actions, logprob=torch.zeros(obs.batch_size, device="cuda"))

    env = ScriptedEnv([0] * 8, max_episode_steps=5, device="cuda")
    policy = HeavyPolicy()
    policy.act(env.reset(seed=0))  # (cuBLAS's first call)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    policy.act(env.reset(seed=0))
    end.record()
    torch.cuda.synchronize()
    kernels_ms = start.elapsed_time(end)  # the same calls, timed on the device
    summary = evaluate(env, policy, episodes=8, seed=0)
    assert summary["eval/policy_ms"] > 0.5 * kernels_ms, (summary["eval/policy_ms"], kernels_ms)
