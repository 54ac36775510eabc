"""GRPO golden values: group statistics, DAPO filtering, the KL estimator."""

import math

import pytest
import torch

from embodied.algorithms import grpo_advantages, informative_groups, kl_penalty

REWARDS = torch.tensor([1.0, 0, 0, 1, 1, 1, 1, 1, 0, 0, 1, 0])  # 3 groups of 4


def test_group_normalized_advantages_hand_computed():
    adv, metrics = grpo_advantages(rewards=REWARDS, group_size=4, eps=0.0 + 1e-12)
    s3 = math.sqrt(0.1875)  # population std of [0, 0, 1, 0]
    expected = [1, -1, -1, 1, 0, 0, 0, 0, -0.25 / s3, -0.25 / s3, 0.75 / s3, -0.25 / s3]
    torch.testing.assert_close(adv, torch.tensor(expected), atol=1e-6, rtol=0)
    assert metrics["grpo/degenerate_groups"] == pytest.approx(1 / 3)
    assert metrics["grpo/reward_mean"] == pytest.approx(7 / 12)
    # every group's advantages sum to zero
    torch.testing.assert_close(adv.view(3, 4).sum(1), torch.zeros(3), atol=1e-6, rtol=0)


def test_without_std_scaling_is_reward_minus_group_mean():
    adv, _ = grpo_advantages(rewards=REWARDS, group_size=4, scale_by_std=False)
    expected = [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0, -0.25, -0.25, 0.75, -0.25]
    torch.testing.assert_close(adv, torch.tensor(expected))


def test_advantages_match_a_loop_over_groups():
    torch.manual_seed(0)
    r = torch.randn(5 * 6)
    adv, _ = grpo_advantages(rewards=r, group_size=6, eps=1e-6)
    for g in range(5):
        x = r[g * 6 : (g + 1) * 6].tolist()
        mean = sum(x) / 6
        std = math.sqrt(sum((v - mean) ** 2 for v in x) / 6)
        for m in range(6):
            assert adv[g * 6 + m].item() == pytest.approx((x[m] - mean) / (std + 1e-6), abs=1e-5)


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="multiple of group_size"):
        grpo_advantages(rewards=torch.zeros(10), group_size=4)


def test_dynamic_sampling_drops_all_zero_and_all_one_groups():
    keep = informative_groups(rewards=REWARDS, group_size=4)
    assert keep.tolist() == [True, False, True]
    assert informative_groups(
        rewards=torch.tensor([0.0, 0, 0, 0, 0.3, 0.3]), group_size=2
    ).tolist() == [False, False, False]


def test_kl_penalty_k3_golden():
    loss, metrics = kl_penalty(
        logprob=torch.tensor([0.0, -1.0]), ref_logprob=torch.tensor([-0.5, 0.0])
    )
    expected = ((math.exp(-0.5) + 0.5 - 1) + (math.exp(1) - 1 - 1)) / 2
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert metrics["policy/kl_ref"] == pytest.approx(expected, rel=1e-6)
    same, _ = kl_penalty(logprob=torch.tensor([-0.3, -2.0]), ref_logprob=torch.tensor([-0.3, -2.0]))
    assert same.item() == 0.0


def test_kl_penalty_estimates_the_true_kl():
    """Averaged over samples of pi, k3 is unbiased for KL(pi || pi_ref) of two Gaussians."""
    torch.manual_seed(1)
    pi, ref = torch.distributions.Normal(0.0, 1.0), torch.distributions.Normal(0.5, 1.2)
    x = pi.sample((200_000,))
    loss, _ = kl_penalty(logprob=pi.log_prob(x), ref_logprob=ref.log_prob(x))
    assert loss.item() == pytest.approx(torch.distributions.kl_divergence(pi, ref).item(), rel=0.02)
