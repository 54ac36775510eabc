"""What every VLA policy keeps in its own buffers, so in every checkpoint: the proprioception
(+ privileged goal) inputs it reads and their (mean, std), and the map between physical actions
and the normalized space [-1, 1] (the data's 1st/99th percentiles clipped to the ActionSpec
bounds; OpenVLA normalises with the same percentiles but leaves the gripper dimension out, where
here every dimension, the gripper's too, is normalised). Until ``set_norm_stats`` is called they
are (0, 1) and the bounds. The normalised state is clipped to +-CLIP, and a column that hardly
varies in the data keeps unit scale, as ``RunningNorm`` (models/normalization.py) does for the
actor-critic."""

from __future__ import annotations

import math

import torch
from torch import nn

from embodied.schema import EnvSpec, NormStats, Observation, UserError

CLIP = 10.0  # |normalised state| at most, as RunningNorm's clip
MIN_STD = 1e-4  # a column with a std at most this keeps unit scale (RunningNorm: variance 1e-8)


class NormalizedVLA(nn.Module):
    """Base class: ``state_vector``, ``set_norm_stats``, ``to_physical``, ``to_normalized``."""

    def __init__(self, spec: EnvSpec, *, use_state: bool, privileged_keys: list[str]):
        super().__init__()
        unknown = sorted(set(privileged_keys) - set(spec.obs.privileged))
        if unknown:
            raise UserError(
                f"policy.privileged_keys: {unknown} not among the environment's "
                f"{sorted(spec.obs.privileged)}"
            )
        self.use_state = use_state
        self.priv_keys = tuple(sorted(privileged_keys))
        priv_dim = sum(math.prod(spec.obs.privileged[k]) for k in self.priv_keys)
        self.state_dim = (spec.obs.state_dim if use_state else 0) + priv_dim
        low, high = spec.action.bounds()
        self.register_buffer("action_low", low)  # f32 [A] physical bounds
        self.register_buffer("action_high", high)
        self.register_buffer("action_q01", low.clone())  # f32 [A]: maps to -1
        self.register_buffer("action_q99", high.clone())  # f32 [A]: maps to +1
        self.register_buffer("state_mean", torch.zeros(self.state_dim))  # f32 [S']
        self.register_buffer("state_std", torch.ones(self.state_dim))

    @property
    def privileged_inputs(self) -> tuple[str, ...]:
        """The privileged (simulator-only) keys the policy reads: none means it can run on a
        robot."""
        return self.priv_keys

    def state_vector(self, obs: Observation) -> torch.Tensor:
        """Raw proprioception (+ privileged) f32 [B, S'] as the policy sees it before
        normalization."""
        parts = [obs.state] if self.use_state else []
        parts += [obs.privileged[k].reshape(obs.batch_size, -1) for k in self.priv_keys]
        return torch.cat(parts, dim=-1)

    def normalized_state(self, obs: Observation) -> torch.Tensor:
        """f32 [B, S'] standardized with the stored statistics, clipped to +-CLIP."""
        z = (self.state_vector(obs) - self.state_mean) / self.state_std  # f32 [B, S']
        return z.clamp(-CLIP, CLIP)

    @torch.no_grad()
    def set_norm_stats(
        self, *, state: NormStats | None = None, action: NormStats | None = None
    ) -> None:
        """Install statistics computed from data (state: mean/std; action: q01/q99). A state
        column (nearly) constant in the data says nothing about its scale: it keeps its mean and
        std 1, so a value off the data's by a millimetre is not scaled by 1e6."""
        if state is not None and self.state_dim:
            std = state.std.to(self.state_std)  # f32 [S']
            self.state_mean.copy_(state.mean)
            self.state_std.copy_(torch.where(std > MIN_STD, std, torch.ones_like(std)))
        if action is not None:
            q01 = torch.maximum(action.q01.to(self.action_low), self.action_low)
            q99 = torch.minimum(action.q99.to(self.action_high), self.action_high)
            same = (q99 - q01) < 1e-6  # a constant dimension: keep a non-empty range around it
            self.action_q01.copy_(torch.where(same, q01 - 1e-3, q01))
            self.action_q99.copy_(torch.where(same, q99 + 1e-3, q99))

    def to_physical(self, a: torch.Tensor) -> torch.Tensor:
        """Normalized f32 [..., A] in [-1, 1] -> physical units, within the ActionSpec bounds."""
        phys = self.action_q01 + (a + 1.0) * 0.5 * (self.action_q99 - self.action_q01)
        return torch.maximum(torch.minimum(phys, self.action_high), self.action_low)

    def to_normalized(self, actions: torch.Tensor) -> torch.Tensor:
        """Physical f32 [..., A] -> [-1, 1] (clipped)."""
        return (
            2.0 * (actions - self.action_q01) / (self.action_q99 - self.action_q01) - 1.0
        ).clamp(-1.0, 1.0)

    def update_normalizer(self, obs: Observation) -> None:
        """Statistics come from the demonstrations (``set_norm_stats``), not from rollouts."""
