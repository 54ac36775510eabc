"""Advantage estimators: pure functions of ``[T, B]`` tensors."""

from __future__ import annotations

import torch


def gae(
    *,
    rewards: torch.Tensor,
    values: torch.Tensor,
    next_values: torch.Tensor,
    terminated: torch.Tensor,
    truncated: torch.Tensor,
    gamma: float,
    gae_lambda: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over a time-major rollout.

    rewards, values, next_values: float32 [T, B]. ``next_values[t]`` is V(s_{t+1}), or V(final_obs)
    where an episode ended at step t. terminated, truncated: bool [T, B].
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
    not_terminated = (~terminated).to(rewards.dtype)
    not_done = (~(terminated | truncated)).to(rewards.dtype)
    # TD error: r_t + gamma * V(s_{t+1}) * (1 - terminated_t) - V(s_t)
    deltas = rewards + gamma * next_values * not_terminated - values
    advantages = torch.zeros_like(rewards)
    last = torch.zeros_like(rewards[0])
    for t in reversed(range(T)):
        # A_t = delta_t + gamma * lambda * (1 - done_t) * A_{t+1}
        last = deltas[t] + gamma * gae_lambda * not_done[t] * last
        advantages[t] = last
    return advantages, advantages + values
