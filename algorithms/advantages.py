"""Advantage estimators: pure functions of ``[T, B]`` tensors, and the reduction of a chunk of K
environment steps to one decision step."""

from __future__ import annotations

import torch


def gae(
    *,
    rewards: torch.Tensor,
    values: torch.Tensor,
    next_values: torch.Tensor,
    terminated: torch.Tensor,
    truncated: torch.Tensor,
    gamma: float | torch.Tensor,
    gae_lambda: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over a time-major rollout.

    rewards, values, next_values: float32 [T, B]. ``next_values[t]`` is V(s_{t+1}), or V(final_obs)
    where an episode ended at step t. terminated, truncated: bool [T, B]. gamma: a float, or
    f32 [T, B] when steps last different numbers of environment steps (a chunk that ended its
    episode after k + 1 of its K actions discounts its bootstrap by gamma^(k+1)).
    A termination removes the bootstrap term; either end stops the recursion from flowing back
    across the episode boundary. Returns (advantages, returns), float32 [T, B].
    """
    T = rewards.shape[0]
    for name, t in (
        ("values", values),
        ("next_values", next_values),
        ("terminated", terminated),
        ("truncated", truncated),
    ):
        if t.shape != rewards.shape:
            raise ValueError(
                f"gae: {name} has shape {tuple(t.shape)}, rewards {tuple(rewards.shape)}"
            )
    if isinstance(gamma, torch.Tensor) and gamma.dim() and gamma.shape != rewards.shape:
        # (a [T] discount broadcast over B as if per environment where T == B)
        raise ValueError(
            f"gae: gamma has shape {tuple(gamma.shape)}, rewards {tuple(rewards.shape)}"
        )
    gamma = torch.as_tensor(gamma, dtype=rewards.dtype, device=rewards.device).expand_as(rewards)
    not_terminated = (~terminated).to(rewards.dtype)
    not_done = (~(terminated | truncated)).to(rewards.dtype)
    # TD error: r_t + gamma_t * V(s_{t+1}) * (1 - terminated_t) - V(s_t)
    deltas = rewards + gamma * next_values * not_terminated - values
    advantages = torch.zeros_like(rewards)
    last = torch.zeros_like(rewards[0])
    for t in reversed(range(T)):
        # A_t = delta_t + gamma_t * lambda * (1 - done_t) * A_{t+1}
        last = deltas[t] + gamma[t] * gae_lambda * not_done[t] * last
        advantages[t] = last
    return advantages, advantages + values


def chunk_returns(
    *, rewards: torch.Tensor, valid: torch.Tensor, gamma: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """A chunk of K environment steps as one decision step.

    rewards: f32 [..., K] per environment step; valid: bool [..., K], true for the actions that
    ran in the episode the chunk started in. Returns (sum_k gamma^k r_k over the valid actions,
    the discount of what follows: gamma^n for n valid actions), both f32 [...]."""
    if valid.shape != rewards.shape:  # (a [T, B] mask broadcast over K where B == K)
        raise ValueError(
            f"chunk_returns: valid has shape {tuple(valid.shape)}, rewards {tuple(rewards.shape)}"
        )
    K = rewards.shape[-1]
    powers = gamma ** torch.arange(K, dtype=rewards.dtype, device=rewards.device)  # f32 [K]
    weights = powers * valid.to(rewards.dtype)
    executed = valid.sum(-1).to(rewards.dtype)
    return (rewards * weights).sum(-1), gamma**executed
