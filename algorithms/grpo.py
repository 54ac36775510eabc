"""GRPO: group-relative advantages from outcome rewards, DAPO's dynamic-sampling filter, and a
KL penalty to a reference policy. Pure functions, torch only.

A group is the episodes that started from the same reset seed (the same initial state); each
episode's outcome reward (e.g. success) is compared with its group's. Episodes name their group
by an integer id, so groups may have different sizes and need not be contiguous.
"""

from __future__ import annotations

import torch

from embodied.algorithms.losses import behaviour_weights, masked_mean


def _group_sums(values: torch.Tensor, group_ids: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Sum of ``values`` (f32 [E]) per group: f32 [G]. index_add_, not bincount: no host sync."""
    sums = torch.zeros(num_groups, dtype=values.dtype, device=values.device)
    return sums.index_add_(0, group_ids, values)


def grpo_advantages(
    *,
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    num_groups: int,
    scale_by_std: bool = True,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """rewards: f32 [E], the outcome of each episode; group_ids: long [E] in [0, num_groups).
    Returns advantages f32 [E]: (r - mean_g) / (std_g + eps), with the population std of the
    episode's group (Shao et al. 2024); ``scale_by_std=False`` keeps r - mean_g only (Dr. GRPO).
    A group whose members all got the same reward gets advantage 0. Metrics are 0-dim tensors."""
    if rewards.dim() != 1 or group_ids.shape != rewards.shape:
        raise ValueError(
            f"grpo_advantages: rewards {tuple(rewards.shape)} and group_ids "
            f"{tuple(group_ids.shape)} must be 1-D of one length"
        )
    r = rewards.float()
    ones = torch.ones_like(r)
    count = _group_sums(ones, group_ids, num_groups).clamp(min=1.0)  # f32 [G]
    mean = _group_sums(r, group_ids, num_groups) / count  # f32 [G]
    centred = r - mean[group_ids]  # f32 [E]
    # equal rewards, compared as such: their float mean can miss them by a rounding error, and
    # that error over the std (the same error) would be an advantage of order 1
    high, low = _group_extremes(r, group_ids, num_groups)  # f32 [G] each
    uniform = (high == low)[group_ids]  # bool [E]
    centred = torch.where(uniform, 0.0, centred)
    std = (_group_sums(centred * centred, group_ids, num_groups) / count).sqrt()  # f32 [G]
    adv = centred / (std[group_ids] + eps) if scale_by_std else centred
    present = _group_sums(ones, group_ids, num_groups) > 0
    degenerate = (std == 0) & present
    metrics = {
        "grpo/reward_mean": r.mean(),
        "grpo/group_std_mean": _present_mean(std, present),
        "grpo/degenerate_groups": _present_mean(degenerate.float(), present),
    }
    return adv, metrics


def _present_mean(x: torch.Tensor, present: torch.Tensor) -> torch.Tensor:
    """Mean of x (f32 [G]) over the groups that have members, without boolean indexing."""
    weights = present.to(x.dtype)
    return (x * weights).sum() / weights.sum().clamp(min=1.0)


def _group_extremes(
    r: torch.Tensor, group_ids: torch.Tensor, num_groups: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The highest and lowest of ``r`` (f32 [E]) per group: f32 [G] each, -inf and inf for a
    group without members."""
    high = torch.full((num_groups,), -torch.inf, device=r.device)
    low = torch.full((num_groups,), torch.inf, device=r.device)
    high = high.scatter_reduce(0, group_ids, r, reduce="amax")
    low = low.scatter_reduce(0, group_ids, r, reduce="amin")
    return high, low


def informative_groups(
    *, rewards: torch.Tensor, group_ids: torch.Tensor, num_groups: int
) -> torch.Tensor:
    """DAPO dynamic sampling: bool [G], True for groups whose members' outcomes differ. Groups
    whose members all got the same outcome (all failed, all succeeded) carry no gradient under
    group-normalised advantages; groups without members are False too."""
    high, low = _group_extremes(rewards.float(), group_ids, num_groups)
    return high > low


def kl_penalty(
    *,
    logprob: torch.Tensor,
    ref_logprob: torch.Tensor,
    old_logprob: torch.Tensor,
    mask: torch.Tensor | None = None,
    count: torch.Tensor | float | None = None,
    prox_logprob: torch.Tensor | None = None,
    behaviour_weight_cap: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL(pi || pi_ref) on samples drawn by the behaviour policy pi_old, with Schulman's k3.

    k3 = exp(d) - d - 1, d = ref_logprob - logprob, is non-negative and its mean over samples of pi
    is KL(pi || pi_ref). Its gradient, with the samples held fixed, is not: the expected gradient of
    k3 alone is that of KL(pi_ref || pi). Weighting each sample by the importance ratio
    pi / pi_old (gradient through it) makes the loss's expectation KL(pi || pi_ref) as a function
    of pi, so its gradient is that of KL(pi || pi_ref). Inputs share one shape at any log-prob
    level; ``mask`` (bool, that shape) selects the entries that count; ``count``: a data-parallel
    rank's denominator (embodied.algorithms.losses).

    ``prox_logprob`` and ``behaviour_weight_cap`` (decoupled PPO, data from older weights): the
    ratio is pi / pi_prox times the weight pi_prox / pi_old (no gradient), and the entries whose
    weight exceeds the cap are left out, as ``ppo_policy_loss`` leaves them out of the policy
    loss: an action the behaviour policy all but never took would make the term inf."""
    d = ref_logprob - logprob
    k3 = d.exp() - d - 1.0
    if prox_logprob is None:
        weighted = (logprob - old_logprob).exp() * k3
    else:
        behaviour_weight, over_cap = behaviour_weights(
            prox_logprob, old_logprob, behaviour_weight_cap
        )
        weighted = (logprob - prox_logprob).exp() * behaviour_weight * k3
        # where, not only the product: a filtered entry's inf k3 must not make a NaN (inf * 0)
        weighted = torch.where(over_cap, 0.0, weighted)
    loss = masked_mean(weighted, mask, count)
    return loss, {"policy/kl_ref": loss.detach()}
