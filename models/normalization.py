"""Running observation normalization whose statistics live in the module's buffers, so they are
saved inside every checkpoint and applied in one place (the policy's input transform)."""

from __future__ import annotations

import torch
from torch import nn

from embodied.schema import NormStats


class RunningNorm(nn.Module):
    """Normalizes float32 [..., D] inputs with a running mean/variance (parallel Welford merge)."""

    def __init__(self, dim: int, clip: float = 10.0, eps: float = 1e-8):
        super().__init__()
        self.clip = clip
        self.eps = eps
        self.register_buffer("mean", torch.zeros(dim))  # f32 [D]
        self.register_buffer("var", torch.ones(dim))  # f32 [D]
        self.register_buffer("count", torch.zeros((), dtype=torch.float64))

    @torch.no_grad()
    def update(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).to(self.mean.dtype)
        n = x.shape[0]
        if n == 0:
            return
        batch_mean = x.mean(0)  # f32 [D]
        batch_var = x.var(0, unbiased=False)  # f32 [D]
        if self.count == 0:
            # the first batch (the first reset) sets the statistics; a feature constant across it
            # (velocities at rest) says nothing about its scale and keeps unit variance
            self.mean.copy_(batch_mean)
            self.var.copy_(torch.where(batch_var > 1e-8, batch_var, torch.ones_like(batch_var)))
            self.count.fill_(n)
            return
        total = self.count + n
        delta = batch_mean - self.mean
        self.mean += delta * (n / total).float()
        m2 = (
            self.var * self.count.float()
            + batch_var * n
            + delta.pow(2) * (self.count * n / total).float()
        )
        self.var.copy_(m2 / total.float())
        self.count.copy_(total)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.clamp((x - self.mean) / torch.sqrt(self.var + self.eps), -self.clip, self.clip)

    def stats(self) -> NormStats:
        return NormStats(mean=self.mean.clone(), std=self.var.sqrt(), count=float(self.count))
