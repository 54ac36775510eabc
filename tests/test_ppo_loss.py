"""PPO's loss as its parts add up (advantage normalisation, the clipped ratio, the value and
entropy terms with their signs and coefficients) and the target_kl early stop, written out by
hand on a real round of the bookkeeping task (tests/test_grpo_bookkeeping.py)."""

import pytest
import torch
from scripted_envs import prepared_samples
from test_data_parallel import policy_and_envs

from embodied.algorithm import update
from embodied.learner import TorchEngine
from embodied.ppo import PPO, PPOConfig


def ppo_round(**cfg):
    policy, envs = policy_and_envs(0)
    config = PPOConfig(num_steps=3, logprob_level="chunk", vf_clip=None, **cfg)
    algorithm = PPO(config, seed=0, num_envs=envs.num_envs)
    return policy, algorithm, prepared_samples(envs, policy, algorithm)


def test_the_loss_is_its_parts_by_hand():
    policy, algorithm, samples = ppo_round(ent_coef=0.03, vf_coef=0.7, clip_coef=0.2)
    with torch.no_grad():  # (another policy than the behaviour one: ratios leave the clip range)
        for p in policy.actor.parameters():
            p.add_(0.3 * torch.randn_like(p))
    engine = TorchEngine(policy, learning_rate=1e-3, max_grad_norm=0.5)
    loss, metrics = algorithm.loss(engine, samples)

    logprob, ent, value = engine.logprob(samples, "chunk")  # f32 [N] each
    ratio = (logprob - samples.behaviour_logprob("chunk")).exp()
    assert ((ratio < 0.8) | (ratio > 1.2)).any()
    adv = samples.advantages
    adv = (adv - adv.mean()) / (adv.std() + 1e-8)
    pg = torch.max(-adv * ratio, -adv * ratio.clamp(0.8, 1.2)).mean()
    v = 0.5 * ((value - samples.returns) ** 2).mean()
    expected = pg - 0.03 * ent.mean() + 0.7 * v
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    assert metrics["loss/total"].item() == pytest.approx(expected.item(), rel=1e-5)
    assert metrics["policy/entropy"].item() == pytest.approx(ent.mean().item(), rel=1e-5)


@pytest.mark.parametrize("target_kl, epochs", [(None, 4), (1e-12, 1), (1e6, 4)])
def test_epochs_stop_once_the_last_minibatchs_approx_kl_passes_target_kl(target_kl, epochs):
    # the first minibatch of epoch 1 is at the behaviour policy (kl 0); its last is past a step
    policy, algorithm, samples = ppo_round(target_kl=target_kl)
    engine = TorchEngine(policy, learning_rate=1e-2, max_grad_norm=0.5)
    metrics = update(engine, algorithm, samples, epochs=4, num_minibatches=2)
    assert metrics["policy/epochs"] == epochs
