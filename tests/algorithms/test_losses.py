"""PPO losses against hand-computed values."""

import math

import pytest
import torch

from embodied.algorithms import (
    EXPLAINED_VARIANCE_MOMENTS,
    approx_kl,
    entropy,
    explained_variance,
    ppo_policy_loss,
    value_loss,
)


def test_ppo_policy_loss_symmetric_clip():
    logprob = torch.tensor([0.0, 0.5, -0.5])
    old = torch.zeros(3)
    adv = torch.tensor([1.0, 1.0, -1.0])
    loss, m = ppo_policy_loss(logprob=logprob, old_logprob=old, advantages=adv, clip_low=0.2)
    # per-sample max(-A r, -A clip(r)): [-1, -1.2, 0.8]  (r = 1, e^0.5, e^-0.5)
    assert loss.item() == pytest.approx((-1.0 - 1.2 + 0.8) / 3, abs=1e-6)
    assert m["policy/clipfrac"].item() == pytest.approx(2 / 3)
    r = torch.tensor([1.0, math.exp(0.5), math.exp(-0.5)])
    assert m["policy/approx_kl"].item() == pytest.approx(
        ((r - 1) - r.log()).mean().item(), abs=1e-6
    )


def test_ppo_policy_loss_asymmetric_clip_higher():
    logprob = torch.tensor([0.0, 0.5, -0.5])
    loss, _ = ppo_policy_loss(
        logprob=logprob,
        old_logprob=torch.zeros(3),
        advantages=torch.tensor([1.0, 1.0, -1.0]),
        clip_low=0.2,
        clip_high=0.28,
    )
    assert loss.item() == pytest.approx((-1.0 - 1.28 + 0.8) / 3, abs=1e-6)


def test_ppo_policy_loss_gradient_is_zero_when_clipped():
    logprob = torch.tensor([0.5], requires_grad=True)
    loss, _ = ppo_policy_loss(
        logprob=logprob, old_logprob=torch.zeros(1), advantages=torch.ones(1), clip_low=0.2
    )
    loss.backward()
    assert logprob.grad.item() == 0.0


def test_value_loss_plain_and_clipped():
    loss, m = value_loss(values=torch.tensor([1.0, 2.0]), returns=torch.tensor([0.0, 2.0]))
    assert loss.item() == pytest.approx(0.25)
    # clipped: V_old + clip(0.2 - 0, -0.1, 0.1) = 0.1 -> (0.1 - 1)^2 = 0.81 > (0.2 - 1)^2 = 0.64
    loss, _ = value_loss(
        values=torch.tensor([0.2]),
        returns=torch.tensor([1.0]),
        old_values=torch.tensor([0.0]),
        clip=0.1,
    )
    assert loss.item() == pytest.approx(0.5 * 0.81)
    with pytest.raises(ValueError):
        value_loss(values=torch.zeros(1), returns=torch.zeros(1), clip=0.1)


def test_entropy_and_approx_kl():
    loss, m = entropy(entropies=torch.tensor([1.0, 3.0]))
    assert loss.item() == 2.0 and m["policy/entropy"].item() == 2.0
    assert approx_kl(log_ratio=torch.zeros(5)).item() == 0.0
    assert approx_kl(log_ratio=torch.tensor([math.log(2.0)])).item() == pytest.approx(
        1 - math.log(2.0)
    )


def test_masked_entries_do_not_count():
    # per action: the second action of chunk 0 ran after its episode ended (masked out)
    logprob = torch.tensor([[0.0, 5.0], [0.5, 0.0]])
    adv = torch.tensor([[1.0, 1.0], [1.0, 1.0]])
    mask = torch.tensor([[True, False], [True, True]])
    loss, m = ppo_policy_loss(
        logprob=logprob, old_logprob=torch.zeros(2, 2), advantages=adv, clip_low=0.2, mask=mask
    )
    # the three valid entries: -1, -1.2 (clipped), -1
    assert loss.item() == pytest.approx((-1.0 - 1.2 - 1.0) / 3, abs=1e-6)
    assert m["policy/clipfrac"].item() == pytest.approx(1 / 3)
    logprob.requires_grad_(True)
    loss, _ = ppo_policy_loss(
        logprob=logprob, old_logprob=torch.zeros(2, 2), advantages=adv, clip_low=0.2, mask=mask
    )
    loss.backward()
    assert logprob.grad[0, 1].item() == 0.0 and logprob.grad[0, 0].item() != 0.0


def test_value_loss_explained_variance_is_nan_without_variance():
    _, m = value_loss(values=torch.tensor([1.0, 2.0]), returns=torch.tensor([3.0, 3.0]))
    assert math.isnan(m["value/explained_variance"].item())
    # seven returns of 0.1: their float32 mean is off by a rounding error, and a two-pass
    # variance of ~1e-18 made the explained variance about -1e16
    returns = torch.full((7,), 0.1)
    _, m = value_loss(values=torch.linspace(0, 1, 7), returns=returns)
    assert math.isnan(m["value/explained_variance"].item())
    # a small variance that float32 holds is kept: 1 - Var(R - V) / Var(R) = 1 - 0.25
    returns = torch.tensor([10.0, 10.002])
    _, m = value_loss(values=torch.tensor([10.0005, 10.0015]), returns=returns)
    assert m["value/explained_variance"].item() == pytest.approx(0.75, abs=2e-3)


def test_decoupled_ppo_clips_at_the_proximal_policy_and_weights_by_it():
    """Hand-computed (Hilton et al. 2022): entry 0 has ratio 1 to the proximal policy and weight
    pi_prox / pi_old = 2; entry 1 has ratio 1.5 (clipped at 1.2 but the unclipped term is
    larger for a negative advantage) and weight 1."""
    logprob = torch.tensor([0.0, math.log(1.5)], requires_grad=True)
    old = torch.tensor([math.log(0.5), 0.0])
    prox = torch.tensor([0.0, 0.0])
    adv = torch.tensor([1.0, -1.0])
    loss, m = ppo_policy_loss(
        logprob=logprob, old_logprob=old, advantages=adv, clip_low=0.2, prox_logprob=prox
    )
    assert loss.item() == pytest.approx((-2.0 + 1.5) / 2)
    assert m["policy/behaviour_weight"].item() == pytest.approx(1.5)
    assert m["policy/ratio_mean"].item() == pytest.approx(1.25)
    assert m["policy/clipfrac"].item() == pytest.approx(0.5)
    # the same data with the behaviour policy as the anchor: ratios 2 and 1.5
    plain, _ = ppo_policy_loss(logprob=logprob, old_logprob=old, advantages=adv, clip_low=0.2)
    assert plain.item() == pytest.approx((-1.2 + 1.5) / 2)
    # d loss / d logprob: entry 0 unclipped (ratio 1): -adv * ratio * weight / N = -1;
    # entry 1 unclipped (the larger term): -adv * ratio / N = 0.75
    loss.backward()
    assert logprob.grad.tolist() == pytest.approx([-1.0, 0.75])


def test_decoupled_ppo_with_the_proximal_policy_equal_to_the_behaviour_one_is_ppo():
    g = torch.Generator().manual_seed(0)
    logprob = torch.randn(6, 3, generator=g)
    old = torch.randn(6, 3, generator=g)
    adv = torch.randn(6, 3, generator=g)
    plain, _ = ppo_policy_loss(logprob=logprob, old_logprob=old, advantages=adv, clip_low=0.2)
    decoupled, m = ppo_policy_loss(
        logprob=logprob, old_logprob=old, advantages=adv, clip_low=0.2, prox_logprob=old
    )
    assert decoupled.item() == pytest.approx(plain.item(), rel=1e-6)
    assert m["policy/behaviour_weight"].item() == pytest.approx(1.0)


def test_decoupled_ppo_leaves_out_entries_whose_behaviour_weight_exceeds_the_cap():
    """Hand-computed: weights pi_prox / pi_old of 2, 8 and e^100 (an action the behaviour
    policy all but never took); with cap 5 the last two are left out of the loss but not of
    its denominator, and their gradient is 0, not NaN."""
    logprob = torch.tensor([0.0, 0.0, 0.0], requires_grad=True)
    old = torch.tensor([math.log(0.5), math.log(0.125), -100.0])
    prox = torch.zeros(3)
    adv = torch.tensor([1.0, 1.0, -1.0])
    loss, m = ppo_policy_loss(
        logprob=logprob,
        old_logprob=old,
        advantages=adv,
        clip_low=0.2,
        prox_logprob=prox,
        behaviour_weight_cap=5.0,
    )
    # ratios are 1 (logprob = prox): entry 0 gives -adv * 1 * weight 2; the others 0
    assert loss.item() == pytest.approx(-2.0 / 3)
    assert m["policy/behaviour_filtered"].item() == pytest.approx(2 / 3)
    assert m["policy/behaviour_weight"].item() == pytest.approx(2 / 3)
    loss.backward()
    assert logprob.grad.tolist() == pytest.approx([-2.0 / 3, 0.0, 0.0])
    # without the cap the unlikely entry dominates: weight e^100 on its term
    uncapped, m = ppo_policy_loss(
        logprob=logprob, old_logprob=old, advantages=adv, clip_low=0.2, prox_logprob=prox
    )
    assert uncapped.item() > 1e40
    assert m["policy/behaviour_filtered"].item() == 0.0
    # a cap no entry exceeds changes nothing
    first_two = dict(
        logprob=logprob[:2], old_logprob=old[:2], advantages=adv[:2], prox_logprob=prox[:2]
    )
    capped_high, _ = ppo_policy_loss(**first_two, clip_low=0.2, behaviour_weight_cap=10.0)
    plain, _ = ppo_policy_loss(**first_two, clip_low=0.2)
    assert capped_high.item() == plain.item() == pytest.approx((-2.0 - 8.0) / 2)


def test_explained_variance_from_two_ranks_moments():
    """Returns [1, 3] and values [0.5, 3.5] split over two ranks (one row each, count 1):
    Var(R) = 1, Var(R - V) = 0.25, so 0.75 as the one-process value; constant returns: NaN."""
    returns = torch.tensor([1.0, 3.0])
    values = torch.tensor([0.5, 3.5])
    whole = dict(whole_returns=returns, whole_old_values=values)
    shares = [
        value_loss(values=values[i : i + 1], returns=returns[i : i + 1], count=1.0, **whole)[1]
        for i in range(2)
    ]
    averaged = [sum(share[key] for share in shares) / 2 for key in EXPLAINED_VARIANCE_MOMENTS]
    assert explained_variance(*averaged).item() == pytest.approx(0.75)
    _, alone = value_loss(values=values, returns=returns)
    assert alone["value/explained_variance"].item() == pytest.approx(0.75)
    constant = [torch.tensor(0.0), torch.tensor(0.0), torch.tensor(0.5), torch.tensor(1.0)]
    assert math.isnan(explained_variance(*constant).item())
