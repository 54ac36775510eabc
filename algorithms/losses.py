"""Policy-gradient losses: pure functions with explicit keyword arguments returning
``(loss, metrics)``; metric keys are ``group/name`` and metric values are floats."""

from __future__ import annotations

import torch


def ppo_policy_loss(
    *,
    logprob: torch.Tensor,
    old_logprob: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float,
    clip_high: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped-ratio PPO surrogate (Schulman et al. 2017), asymmetric clip allowed (DAPO's
    clip-higher): ratio is clipped to [1 - clip_low, 1 + clip_high]. All inputs float32 [N]."""
    clip_high = clip_low if clip_high is None else clip_high
    log_ratio = logprob - old_logprob
    ratio = log_ratio.exp()
    pg_loss1 = -advantages * ratio
    pg_loss2 = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = torch.max(pg_loss1, pg_loss2).mean()
    with torch.no_grad():
        clipfrac = ((ratio < 1.0 - clip_low) | (ratio > 1.0 + clip_high)).float().mean().item()
        metrics = {
            "policy/loss": loss.item(),
            "policy/clipfrac": clipfrac,
            "policy/approx_kl": approx_kl(log_ratio=log_ratio),
            "policy/ratio_mean": ratio.mean().item(),
        }
    return loss, metrics


def value_loss(
    *,
    values: torch.Tensor,
    returns: torch.Tensor,
    old_values: torch.Tensor | None = None,
    clip: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """0.5 * (V - R)^2, optionally clipped around the rollout's values (PPO2 style):
    max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2). All inputs float32 [N]."""
    unclipped = (values - returns) ** 2
    if clip is not None:
        if old_values is None:
            raise ValueError("value_loss: clip needs old_values")
        v_clipped = old_values + torch.clamp(values - old_values, -clip, clip)
        loss = 0.5 * torch.max(unclipped, (v_clipped - returns) ** 2).mean()
    else:
        loss = 0.5 * unclipped.mean()
    with torch.no_grad():
        var = returns.var(unbiased=False)
        explained = (
            (1 - (returns - values).var(unbiased=False) / var).item() if var > 0 else float("nan")
        )
    return loss, {"value/loss": loss.item(), "value/explained_variance": explained}


def entropy(*, entropies: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    """Mean entropy bonus term (to be subtracted from the loss with its coefficient). [N] -> []."""
    loss = entropies.mean()
    return loss, {"policy/entropy": loss.item()}


def approx_kl(*, log_ratio: torch.Tensor) -> float:
    """Low-variance estimator of KL(old || new): E[(r - 1) - log r] (Schulman's k3), r = exp(log_ratio)."""
    with torch.no_grad():
        return ((log_ratio.exp() - 1) - log_ratio).mean().item()
