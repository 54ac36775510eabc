"""Policy-gradient losses: pure functions with explicit keyword arguments returning
``(loss, metrics)``.

Metric keys are ``group/name``; metric values are detached 0-dim tensors on the loss's device, so
that computing them never waits for the device: the caller gathers them and moves them to the
host once (the runner does so once per epoch).

``mask`` (bool, the shape of ``logprob``) selects the entries that count: an action executed after
its episode ended inside a chunk belongs to no episode's credit and is left out of every mean.

``count`` (every loss takes one) is the denominator of the loss's means when the inputs are one
data-parallel rank's share of a minibatch: the whole minibatch's count of entries divided by the
number of ranks. The ranks' gradients are averaged, so their average is then the whole
minibatch's gradient, however its rows and masked entries fall between the ranks. None: each
mean divides by its own count.
"""

from __future__ import annotations

import torch


def masked_mean(
    x: torch.Tensor, mask: torch.Tensor | None, count: torch.Tensor | float | None = None
) -> torch.Tensor:
    """Mean of ``x`` over the entries where ``mask`` (bool, x's shape) is true; all without one.
    ``count``: the denominator to use instead of the number of those entries (see above)."""
    if mask is None:
        return x.mean() if count is None else x.sum() / count
    # where, not a product: an inf or NaN in a masked-out entry must not reach the mean
    kept = torch.where(mask, x, torch.zeros_like(x))
    if count is None:
        count = mask.sum().clamp(min=1).to(x.dtype)
    return kept.sum() / count


def behaviour_weights(
    prox_logprob: torch.Tensor, old_logprob: torch.Tensor, cap: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decoupled PPO's weights pi_prox / pi_old (no gradient), 0 where they exceed ``cap``
    (AReaL's filter), and the bool mask of those entries (their shape)."""
    weight = (prox_logprob - old_logprob).detach().exp()
    over_cap = torch.zeros_like(weight, dtype=torch.bool)
    if cap is not None:
        over_cap = weight > cap
        weight = torch.where(over_cap, 0.0, weight)  # (an inf weight would make NaN gradients)
    return weight, over_cap


def ppo_policy_loss(
    *,
    logprob: torch.Tensor,
    old_logprob: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float,
    clip_high: float | None = None,
    mask: torch.Tensor | None = None,
    prox_logprob: torch.Tensor | None = None,
    behaviour_weight_cap: float | None = None,
    count: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped-ratio PPO surrogate (Schulman et al. 2017), asymmetric clip allowed (DAPO's
    clip-higher): ratio is clipped to [1 - clip_low, 1 + clip_high]. logprob, old_logprob and
    advantages share one shape (f32 [N] per chunk, [N, K] per action, [N, K, A] per token).

    ``prox_logprob`` (decoupled PPO, Hilton et al. 2022, for data from older weights): the
    ratio is taken to the proximal policy (the weights the update started from) and clipped
    there, and every term is weighted by pi_prox / pi_old (no gradient), old being the
    behaviour policy that collected the data. Without it the proximal policy is the behaviour
    policy (weight 1): the standard surrogate.

    ``behaviour_weight_cap`` (with ``prox_logprob``; AReaL's filter): entries whose weight
    exceeds it are left out of the loss (weight 0, still counted in the mean's denominator),
    so that a few entries the behaviour policy found unlikely cannot dominate the update."""
    clip_high = clip_low if clip_high is None else clip_high
    anchor = old_logprob if prox_logprob is None else prox_logprob
    log_ratio = logprob - anchor
    ratio = log_ratio.exp()
    pg_loss1 = -advantages * ratio
    pg_loss2 = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    surrogate = torch.max(pg_loss1, pg_loss2)
    if prox_logprob is not None:
        behaviour_weight, over_cap = behaviour_weights(
            prox_logprob, old_logprob, behaviour_weight_cap
        )
        # where, not only the product: a filtered entry's inf must not make a NaN (inf * 0)
        surrogate = torch.where(over_cap, 0.0, behaviour_weight * surrogate)
    loss = masked_mean(surrogate, mask, count)
    with torch.no_grad():
        clipped = (ratio < 1.0 - clip_low) | (ratio > 1.0 + clip_high)
        metrics = {
            "policy/loss": loss.detach(),
            "policy/clipfrac": masked_mean(clipped.float(), mask, count),
            "policy/approx_kl": approx_kl(log_ratio=log_ratio, mask=mask, count=count),
            "policy/ratio_mean": masked_mean(ratio, mask, count),
        }
        if prox_logprob is not None:
            metrics["policy/behaviour_weight"] = masked_mean(behaviour_weight, mask, count)
            metrics["policy/behaviour_filtered"] = masked_mean(over_cap.float(), mask, count)
    return loss, metrics


def value_loss(
    *,
    values: torch.Tensor,
    returns: torch.Tensor,
    old_values: torch.Tensor | None = None,
    clip: float | None = None,
    count: float | None = None,
    whole_returns: torch.Tensor | None = None,
    whole_old_values: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """0.5 * (V - R)^2, optionally clipped around the rollout's values (PPO2 style):
    max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2). All inputs float32 [N].

    The explained variance 1 - Var(R - V) / Var(R) comes from the first two moments of R and
    of R - V, centred at the mean return and mean residual R - V_old, so that E[x^2] - E[x]^2
    loses no precision (``explained_variance``). It is no mean over entries, so a data-parallel
    rank (``count``) reports those moments instead (``EXPLAINED_VARIANCE_MOMENTS``), as means
    over the whole minibatch divided by the ranks: they average over the ranks like every other
    metric, and ``explained_variance`` makes the whole minibatch's value of them. A rank
    centres at the whole minibatch's means (``whole_returns``, ``whole_old_values``: every
    rank has them); without them, at its own mean return and residual R - V."""
    squared = (values - returns) ** 2
    if clip is not None:
        if old_values is None:
            raise ValueError("value_loss: clip needs old_values")
        v_clipped = old_values + torch.clamp(values - old_values, -clip, clip)
        squared = torch.max(squared, (v_clipped - returns) ** 2)
    loss = 0.5 * masked_mean(squared, None, count)
    metrics = {"value/loss": loss.detach()}
    with torch.no_grad():
        if whole_returns is None or whole_old_values is None:  # (centred at its own means)
            whole_returns, whole_old_values = returns, values
        centre = whole_returns.mean()
        residual_centre = (whole_returns - whole_old_values).mean()
        centred_returns = returns - centre
        centred_residuals = (returns - values) - residual_centre
        parts = (centred_returns, centred_returns**2, centred_residuals, centred_residuals**2)
        moments = [masked_mean(part, None, count) for part in parts]
        if count is None:
            metrics["value/explained_variance"] = explained_variance(*moments)
        else:
            metrics.update(zip(EXPLAINED_VARIANCE_MOMENTS, moments))
    return loss, metrics


# a data-parallel rank's share of the explained variance (see value_loss)
EXPLAINED_VARIANCE_MOMENTS = (
    "value/ev_returns",
    "value/ev_returns_sq",
    "value/ev_residuals",
    "value/ev_residuals_sq",
)


def explained_variance(
    returns: torch.Tensor,
    returns_sq: torch.Tensor,
    residuals: torch.Tensor,
    residuals_sq: torch.Tensor,
) -> torch.Tensor:
    """1 - Var(R - V) / Var(R) from the centred moments ``value_loss`` takes (a data-parallel
    rank's, averaged over the ranks); NaN where the returns do not vary: where their variance
    is no more than the rounding of E[x^2] - E[x]^2 (constant returns whose float mean is off
    by a rounding error have a tiny variance that would make the ratio huge)."""
    var = returns_sq - returns**2
    explained = 1 - (residuals_sq - residuals**2) / var
    rounding = 16 * torch.finfo(var.dtype).eps * returns_sq
    return torch.where(var > rounding, explained, torch.full_like(explained, float("nan")))


def entropy(
    *, entropies: torch.Tensor, count: float | None = None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Mean entropy bonus term (to be subtracted from the loss with its coefficient). [N] -> []."""
    loss = masked_mean(entropies, None, count)
    return loss, {"policy/entropy": loss.detach()}


def approx_kl(
    *,
    log_ratio: torch.Tensor,
    mask: torch.Tensor | None = None,
    count: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """Low-variance estimate of KL(old || new): E[(r - 1) - log r] (Schulman's k3), with
    r = exp(log_ratio). A detached 0-dim tensor."""
    with torch.no_grad():
        return masked_mean((log_ratio.exp() - 1) - log_ratio, mask, count)
