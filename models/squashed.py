"""The squashed Gaussian of the actor-critic and of the VLA's chunk head: u ~ N(mean, std^2) in a
normalized space, the action tanh(u) in [-1, 1]."""

from __future__ import annotations

import math

import torch

HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)


def gaussian_logpdf(x: torch.Tensor, mean: torch.Tensor, log_std: torch.Tensor) -> torch.Tensor:
    """Elementwise log N(x; mean, exp(log_std)^2)."""
    z = (x - mean) * torch.exp(-log_std)
    return -0.5 * z * z - log_std - HALF_LOG_2PI


def tanh_log_det(u: torch.Tensor) -> torch.Tensor:
    """Elementwise log(1 - tanh(u)^2), log |d tanh / du|, numerically stable for any u."""
    return 2.0 * (math.log(2.0) - u - torch.nn.functional.softplus(-2.0 * u))


def squashed_entropy(mean: torch.Tensor, log_std: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The entropy of tanh(u), estimated at the policy's own samples u f32 [B, ...], per row
    f32 [B]: the Gaussian's entropy plus log |d tanh / du| at u. The Gaussian's alone grows with
    std without bound, so as a bonus it drove actions onto the bounds, where tanh's entropy
    falls. u is taken as mean + std * eps with eps fixed, so the gradient sees the squashing."""
    eps = ((u - mean) * torch.exp(-log_std)).detach()
    at = mean + torch.exp(log_std) * eps  # = u, differentiable in mean and log_std
    per_dim = 0.5 + HALF_LOG_2PI + log_std + tanh_log_det(at)
    return per_dim.flatten(1).sum(1)
