"""Observation encoders: flat state (+ privileged) vectors and a small CNN for camera images."""

from __future__ import annotations

import torch
from torch import nn

from embodied.models.normalization import RunningNorm
from embodied.schema import EnvSpec, Observation, UserError


class StateEncoder(nn.Module):
    """Concatenates state and (optionally) privileged tensors in spec order, then normalizes."""

    def __init__(self, spec: EnvSpec, keys: tuple[str, ...], normalize: bool):
        super().__init__()
        unknown = sorted(set(keys) - set(spec.obs.privileged))
        if unknown:
            raise UserError(
                f"policy.privileged_keys: {unknown} not among the environment's "
                f"{sorted(spec.obs.privileged)}"
            )
        self.keys = tuple(sorted(keys))
        self.key_dims = {
            k: len(spec.obs.privileged[k]) for k in self.keys
        }  # per-env dims to flatten
        self.dim = spec.obs.state_dim + sum(
            int(torch.tensor(spec.obs.privileged[k]).prod()) for k in self.keys
        )
        self.norm = RunningNorm(self.dim) if normalize else None

    def raw(self, obs: Observation) -> torch.Tensor:
        """f32 [..., D]: works for [B, ...] and time-major [T, B, ...] observations alike."""
        parts = [obs.state] + [
            obs.privileged[k].flatten(obs.privileged[k].dim() - self.key_dims[k]) for k in self.keys
        ]
        return torch.cat(parts, dim=-1)

    def forward(self, obs: Observation) -> torch.Tensor:
        x = self.raw(obs)
        return self.norm(x) if self.norm is not None else x


class CNNEncoder(nn.Module):
    """NatureCNN-style encoder per camera: uint8 [B, H, W, 3] -> f32 [B, out_dim]."""

    MIN_SIDE = 36  # the smallest side its convolutions take: (36 - 8) / 4 + 1 = 8, 3, then 1

    def __init__(self, height: int, width: int, out_dim: int = 256):
        super().__init__()
        if min(height, width) < self.MIN_SIDE:
            raise UserError(
                f"env.image_size: the actor-critic's CNN needs images of at least "
                f"{self.MIN_SIDE}x{self.MIN_SIDE} pixels, got {height}x{width} "
                "(or policy.use_images=false)"
            )
        self.conv = nn.Sequential(
            nn.Conv2d(3, 32, 8, stride=4),
            nn.ReLU(),
            nn.Conv2d(32, 64, 4, stride=2),
            nn.ReLU(),
            nn.Conv2d(64, 64, 3, stride=1),
            nn.ReLU(),
            nn.Flatten(),
        )
        with torch.no_grad():
            n = self.conv(torch.zeros(1, 3, height, width)).shape[1]
        self.fc = nn.Sequential(nn.Linear(n, out_dim), nn.ReLU())
        self.out_dim = out_dim

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = images.permute(0, 3, 1, 2).float() / 255.0  # f32 [B, 3, H, W] in [0, 1]
        return self.fc(self.conv(x))
