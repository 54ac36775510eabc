"""GRPO golden values: group statistics by group id, DAPO filtering, the KL penalty's value and
the direction of its gradient."""

import math

import pytest
import torch

from embodied.algorithms import grpo_advantages, informative_groups, kl_penalty

REWARDS = torch.tensor([1.0, 0, 0, 1, 1, 1, 1, 1, 0, 0, 1, 0])  # 3 groups of 4
GROUPS = torch.arange(12) // 4


def test_group_normalized_advantages_hand_computed():
    adv, metrics = grpo_advantages(rewards=REWARDS, group_ids=GROUPS, num_groups=3, eps=1e-12)
    s3 = math.sqrt(0.1875)  # population std of [0, 0, 1, 0]
    expected = [1, -1, -1, 1, 0, 0, 0, 0, -0.25 / s3, -0.25 / s3, 0.75 / s3, -0.25 / s3]
    torch.testing.assert_close(adv, torch.tensor(expected), atol=1e-6, rtol=0)
    assert metrics["grpo/degenerate_groups"].item() == pytest.approx(1 / 3)
    assert metrics["grpo/reward_mean"].item() == pytest.approx(7 / 12)
    # every group's advantages sum to zero
    torch.testing.assert_close(adv.view(3, 4).sum(1), torch.zeros(3), atol=1e-6, rtol=0)


def test_groups_by_id_need_not_be_contiguous_or_equal_in_size():
    # group 1 = members 0, 3, 5 (rewards 1, 0, 0); group 0 = members 1, 2, 4, 6 (0, 1, 1, 0)
    rewards = torch.tensor([1.0, 0, 1, 0, 1, 0, 0])
    groups = torch.tensor([1, 0, 0, 1, 0, 1, 0])
    adv, _ = grpo_advantages(rewards=rewards, group_ids=groups, num_groups=2, scale_by_std=False)
    expected = [1 - 1 / 3, -0.5, 0.5, -1 / 3, 0.5, -1 / 3, -0.5]
    torch.testing.assert_close(adv, torch.tensor(expected))


def test_without_std_scaling_is_reward_minus_group_mean():
    adv, _ = grpo_advantages(rewards=REWARDS, group_ids=GROUPS, num_groups=3, scale_by_std=False)
    expected = [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0, -0.25, -0.25, 0.75, -0.25]
    torch.testing.assert_close(adv, torch.tensor(expected))


def test_advantages_match_a_loop_over_groups():
    torch.manual_seed(0)
    r = torch.randn(5 * 6)
    adv, _ = grpo_advantages(rewards=r, group_ids=torch.arange(30) // 6, num_groups=5, eps=1e-6)
    for g in range(5):
        x = r[g * 6 : (g + 1) * 6].tolist()
        mean = sum(x) / 6
        std = math.sqrt(sum((v - mean) ** 2 for v in x) / 6)
        for m in range(6):
            assert adv[g * 6 + m].item() == pytest.approx((x[m] - mean) / (std + 1e-6), abs=1e-5)


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="must be 1-D of one length"):
        grpo_advantages(
            rewards=torch.zeros(10), group_ids=torch.zeros(8, dtype=torch.long), num_groups=2
        )


@pytest.mark.parametrize("reward", [0.1, 0.7, 3.3, 1000.1])
def test_a_group_of_equal_rewards_gets_advantage_zero_whatever_their_rounding(reward):
    """The float mean of seven 1000.1s misses them by a rounding error, which over the std (the
    same error) made an advantage of -0.98."""
    rewards = torch.cat([torch.full((7,), reward), torch.tensor([0.0, 1.0])])
    groups = torch.tensor([0] * 7 + [1, 1])
    adv, metrics = grpo_advantages(rewards=rewards, group_ids=groups, num_groups=2)
    assert adv[:7].tolist() == [0.0] * 7
    assert adv[7:].tolist() == pytest.approx([-1.0, 1.0], rel=1e-5)
    assert metrics["grpo/degenerate_groups"].item() == 0.5


def test_dynamic_sampling_drops_all_zero_and_all_one_groups():
    keep = informative_groups(rewards=REWARDS, group_ids=GROUPS, num_groups=3)
    assert keep.tolist() == [True, False, True]
    flat = torch.tensor([0.0, 0, 0, 0, 0.3, 0.3])
    pairs = torch.arange(6) // 2
    assert informative_groups(rewards=flat, group_ids=pairs, num_groups=4).tolist() == [False] * 4


def test_kl_penalty_k3_golden():
    logprob = torch.tensor([0.0, -1.0])
    loss, metrics = kl_penalty(
        logprob=logprob, ref_logprob=torch.tensor([-0.5, 0.0]), old_logprob=logprob
    )
    expected = ((math.exp(-0.5) + 0.5 - 1) + (math.exp(1) - 1 - 1)) / 2
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert metrics["policy/kl_ref"].item() == pytest.approx(expected, rel=1e-6)
    same, _ = kl_penalty(logprob=logprob, ref_logprob=logprob, old_logprob=logprob)
    assert same.item() == 0.0


def test_kl_penalty_leaves_out_what_the_behaviour_weight_cap_filters():
    """Decoupled PPO: the ratio is pi / pi_prox times pi_prox / pi_old, and an entry whose weight
    exceeds the cap is left out (still counted), as the policy loss leaves it out. Before, the
    second entry's weight e^100 made the term inf and its gradient NaN."""
    logprob = torch.zeros(3, requires_grad=True)
    ref = torch.tensor([-0.5, -0.5, 0.0])
    old = torch.tensor([0.0, -100.0, -1.0])
    prox = torch.tensor([0.0, 0.0, -0.5])
    loss, _ = kl_penalty(
        logprob=logprob, ref_logprob=ref, old_logprob=old, prox_logprob=prox, behaviour_weight_cap=5
    )
    k3 = math.exp(-0.5) + 0.5 - 1
    # entry 3: k3 is 0 (pi = ref); entry 1: weight 1, ratio 1
    assert loss.item() == pytest.approx(k3 / 3, rel=1e-6)
    (grad,) = torch.autograd.grad(loss, logprob)
    assert torch.isfinite(grad).all()
    assert grad[1].item() == 0.0
    uncapped, _ = kl_penalty(
        logprob=torch.tensor([0.0, 0.0]),
        ref_logprob=torch.tensor([-0.5, -1.0]),
        old_logprob=torch.tensor([0.0, -1.0]),
        prox_logprob=torch.tensor([0.0, -0.5]),
    )
    # weight e^0.5 times ratio e^0.5: the product is pi / pi_old, today's estimator
    plain, _ = kl_penalty(
        logprob=torch.tensor([0.0, 0.0]),
        ref_logprob=torch.tensor([-0.5, -1.0]),
        old_logprob=torch.tensor([0.0, -1.0]),
    )
    assert uncapped.item() == pytest.approx(plain.item(), rel=1e-6)


def test_kl_penalty_estimates_the_true_kl():
    """Averaged over samples of pi (= pi_old), k3 is unbiased for KL(pi || pi_ref)."""
    torch.manual_seed(1)
    pi, ref = torch.distributions.Normal(0.0, 1.0), torch.distributions.Normal(0.5, 1.2)
    x = pi.sample((200_000,))
    lp = pi.log_prob(x)
    loss, _ = kl_penalty(logprob=lp, ref_logprob=ref.log_prob(x), old_logprob=lp)
    assert loss.item() == pytest.approx(torch.distributions.kl_divergence(pi, ref).item(), rel=0.02)


def _expected_loss_gradient(weighted: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The exact expectation, over samples of pi_old = pi, of the KL penalty on a 4-way
    categorical, differentiated with respect to pi's logits; and the true gradients of
    KL(pi || ref) and KL(ref || pi)."""
    logits = torch.tensor([0.3, -0.2, 1.0, 0.1], requires_grad=True)
    ref = torch.log_softmax(torch.tensor([0.0, 0.5, -0.5, 0.2]), 0)
    logp = torch.log_softmax(logits, 0)
    behaviour = logp.detach().exp()  # samples come from pi_old, a frozen copy of pi
    old = logp.detach() if weighted else logp  # weighted: ratio pi / pi_old; else the ratio is 1
    per_sample = []
    for x in range(4):  # E_{x ~ pi_old}[penalty(x)] written out exactly
        loss, _ = kl_penalty(
            logprob=logp[x : x + 1], ref_logprob=ref[x : x + 1], old_logprob=old[x : x + 1]
        )
        per_sample.append(behaviour[x] * loss)
    (grad,) = torch.autograd.grad(torch.stack(per_sample).sum(), logits)
    p = torch.softmax(logits, 0)
    (forward,) = torch.autograd.grad((p * (torch.log(p) - ref)).sum(), logits)
    p = torch.softmax(logits, 0)
    (reverse,) = torch.autograd.grad((ref.exp() * (ref - torch.log(p))).sum(), logits)
    return grad, forward, reverse


def test_kl_penalty_gradient_is_that_of_kl_pi_to_ref():
    grad, forward, reverse = _expected_loss_gradient(weighted=True)
    torch.testing.assert_close(grad, forward)
    assert not torch.allclose(grad, reverse, atol=1e-3)


def test_k3_without_the_ratio_has_the_reverse_kl_gradient():
    """Why the ratio is there: k3 alone, its samples held fixed, follows KL(ref || pi)."""
    grad, forward, reverse = _expected_loss_gradient(weighted=False)
    torch.testing.assert_close(grad, reverse)
    assert not torch.allclose(grad, forward, atol=1e-3)
