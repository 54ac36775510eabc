"""GAE against hand-computed numbers and against a naive per-episode reference."""

import pytest
import torch

from embodied.algorithms import chunk_returns, gae


def test_gae_hand_computed_termination_and_truncation():
    # gamma=0.9, lambda=0.5. env 0 terminates at t=1 (no bootstrap; V(final_obs)=9 must be ignored);
    # env 1 is truncated at t=0 (bootstrap from V(final_obs)=4, recursion stops there).
    rewards = torch.tensor([[1.0, 0.5], [0.0, 1.0], [2.0, 1.0]])
    values = torch.tensor([[0.5, 2.0], [1.0, 1.0], [1.5, 0.0]])
    next_values = torch.tensor([[1.0, 4.0], [9.0, 0.0], [3.0, 2.0]])
    terminated = torch.tensor([[False, False], [True, False], [False, False]])
    truncated = torch.tensor([[False, True], [False, False], [False, False]])
    adv, ret = gae(
        rewards=rewards,
        values=values,
        next_values=next_values,
        terminated=terminated,
        truncated=truncated,
        gamma=0.9,
        gae_lambda=0.5,
    )
    # env 0: deltas 1.4, -1.0, 3.2 -> A = [1.4 + 0.45 * -1.0, -1.0, 3.2]
    # env 1: deltas 0.5 + 3.6 - 2 = 2.1, 0.0, 2.8 -> A = [2.1, 0 + 0.45 * 2.8, 2.8]
    expected_adv = torch.tensor([[0.95, 2.1], [-1.0, 1.26], [3.2, 2.8]])
    torch.testing.assert_close(adv, expected_adv)
    torch.testing.assert_close(ret, expected_adv + values)


def naive_gae(rewards, values, next_values, terminated, truncated, gamma, lam):
    """A_t = sum_l (gamma*lam)^l delta_{t+l} up to the end of t's episode, one env and step at a
    time."""
    T, B = rewards.shape
    adv = torch.zeros(T, B, dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            total, coef = 0.0, 1.0
            for u in range(t, T):
                boot = 0.0 if terminated[u, b] else gamma * next_values[u, b].item()
                delta = rewards[u, b].item() + boot - values[u, b].item()
                total += coef * delta
                if terminated[u, b] or truncated[u, b]:
                    break
                coef *= gamma * lam
            adv[t, b] = total
    return adv.float()


def test_gae_matches_naive_reference_on_random_rollouts():
    g = torch.Generator().manual_seed(0)
    T, B = 37, 6
    rewards = torch.randn(T, B, generator=g)
    values = torch.randn(T, B, generator=g)
    next_values = torch.randn(T, B, generator=g)
    terminated = torch.rand(T, B, generator=g) < 0.1
    truncated = (torch.rand(T, B, generator=g) < 0.1) & ~terminated
    adv, ret = gae(
        rewards=rewards,
        values=values,
        next_values=next_values,
        terminated=terminated,
        truncated=truncated,
        gamma=0.97,
        gae_lambda=0.9,
    )
    ref = naive_gae(rewards, values, next_values, terminated, truncated, 0.97, 0.9)
    torch.testing.assert_close(adv, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ret, ref + values, rtol=1e-5, atol=1e-5)


def test_gae_lambda_one_no_dones_is_discounted_return_minus_value():
    rewards = torch.tensor([[1.0], [1.0], [1.0]])
    values = torch.zeros(3, 1)
    next_values = torch.tensor([[0.0], [0.0], [10.0]])
    none = torch.zeros(3, 1, dtype=torch.bool)
    adv, _ = gae(
        rewards=rewards,
        values=values,
        next_values=next_values,
        terminated=none,
        truncated=none,
        gamma=0.5,
        gae_lambda=1.0,
    )
    # A_0 = 1 + 0.5 + 0.25 + 0.125 * 10
    torch.testing.assert_close(adv[:, 0], torch.tensor([3.0, 4.0, 6.0]))


def test_gae_with_a_discount_per_step():
    # a chunked rollout: step 0 lasted 2 environment steps (gamma^2 = 0.81), step 1 one (0.9)
    rewards = torch.tensor([[1.0], [2.0]])
    values = torch.tensor([[0.5], [1.0]])
    next_values = torch.tensor([[1.0], [3.0]])
    no = torch.zeros(2, 1, dtype=torch.bool)
    gamma = torch.tensor([[0.81], [0.9]])
    adv, _ = gae(
        rewards=rewards,
        values=values,
        next_values=next_values,
        terminated=no,
        truncated=no,
        gamma=gamma,
        gae_lambda=0.5,
    )
    a1 = 2.0 + 0.9 * 3.0 - 1.0
    a0 = 1.0 + 0.81 * 1.0 - 0.5 + 0.81 * 0.5 * a1
    torch.testing.assert_close(adv, torch.tensor([[a0], [a1]]))
    # a [T] discount where T == B was read as one per environment: refused
    square = dict(values=values.expand(2, 2), next_values=next_values.expand(2, 2))
    no = torch.zeros(2, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"gae: gamma has shape \(2,\), rewards \(2, 2\)"):
        gae(
            rewards=rewards.expand(2, 2),
            **square,
            terminated=no,
            truncated=no,
            gamma=torch.tensor([0.81, 0.9]),
            gae_lambda=0.5,
        )


def test_chunk_returns_sum_the_valid_actions_and_discount_by_their_count():
    rewards = torch.tensor([[1.0, 2.0, 3.0, 4.0], [1.0, 2.0, 3.0, 4.0]])
    valid = torch.tensor([[True, True, True, True], [True, True, False, False]])
    ret, discount = chunk_returns(rewards=rewards, valid=valid, gamma=0.5)
    torch.testing.assert_close(ret, torch.tensor([1 + 1 + 0.75 + 0.5, 1 + 1.0]))
    torch.testing.assert_close(discount, torch.tensor([0.0625, 0.25]))
    # a mask without its K axis was broadcast over K where B == K: refused
    with pytest.raises(ValueError, match=r"valid has shape \(4,\), rewards \(2, 4\)"):
        chunk_returns(rewards=rewards, valid=valid[0], gamma=0.5)
