"""GRPO: group-relative advantages from outcome rewards, DAPO's dynamic-sampling filter, and a
KL penalty to a reference policy. Pure functions, torch only.

A group is M episodes that start from the same reset seed (the same initial state); each
episode's outcome reward (e.g. success, or its return) is compared with its group's. The
advantage is the same for every step of an episode.
"""

from __future__ import annotations

import torch


def grpo_advantages(
    *, rewards: torch.Tensor, group_size: int, scale_by_std: bool = True, eps: float = 1e-6
) -> tuple[torch.Tensor, dict[str, float]]:
    """rewards: f32 [G * M], the outcome of each episode, groups contiguous (episode g*M + m is
    member m of group g). Returns advantages f32 [G * M]: (r - mean_g) / (std_g + eps), with the
    population std of the group (Shao et al. 2024); ``scale_by_std=False`` keeps r - mean_g only
    (Dr. GRPO). A group whose members all got the same reward gets advantage 0."""
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(
            f"grpo_advantages: rewards must be 1-D with a multiple of group_size={group_size} entries, "
            f"got shape {tuple(rewards.shape)}"
        )
    r = rewards.float().view(-1, group_size)  # f32 [G, M]
    mean = r.mean(1, keepdim=True)
    std = r.std(1, unbiased=False, keepdim=True)
    adv = r - mean
    if scale_by_std:
        adv = adv / (std + eps)
    metrics = {
        "grpo/reward_mean": r.mean().item(),
        "grpo/group_std_mean": std.mean().item(),
        "grpo/degenerate_groups": (std.squeeze(1) == 0).float().mean().item(),
    }
    return adv.view(-1), metrics


def informative_groups(*, rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """DAPO dynamic sampling: bool [G], False for groups whose members all got the same outcome
    (all failed or all succeeded), which carry no gradient under group-normalized advantages."""
    r = rewards.view(-1, group_size)
    return r.amax(1) > r.amin(1)


def kl_penalty(
    *, logprob: torch.Tensor, ref_logprob: torch.Tensor
) -> tuple[torch.Tensor, dict[str, float]]:
    """KL(pi || pi_ref) estimated on samples of pi with Schulman's unbiased, non-negative k3:
    exp(d) - d - 1 with d = ref_logprob - logprob. Inputs f32 [N, ...] at any log-prob level."""
    d = ref_logprob - logprob
    loss = (d.exp() - d - 1.0).mean()
    return loss, {"policy/kl_ref": loss.item()}
