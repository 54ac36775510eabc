"""GPU backend (physx_cuda): tensors stay on the device; skipped without a CUDA GPU."""

import pytest

from embodied.models import ActorCritic, ActorCriticConfig
from embodied.schema import check_env, check_policy
from embodied.simulators.maniskill import ManiSkillConfig, ManiSkillEnv

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("task", ["PushCube-v1", "PickCube-v1"])
def test_gpu_backend_contract(task):
    env = ManiSkillEnv(
        ManiSkillConfig(task=task, backend="gpu", num_envs=64, control_mode="pd_joint_delta_pos")
    )
    try:
        assert env.device.type == "cuda"
        check_env(env, seed=0)
        policy = ActorCritic(env.spec, ActorCriticConfig(hidden_sizes=[64])).to(env.device)
        check_policy(policy, env.spec, batch_size=4, device="cuda")
        out = env.step(policy.act(env.reset(seed=0)).actions[:, 0])
        assert out.obs.state.device.type == "cuda" and out.reward.device.type == "cuda"
    finally:
        env.close()
