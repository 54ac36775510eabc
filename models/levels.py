"""Log-probability levels every policy reports: per chunk, per action, per action dimension."""

from __future__ import annotations

import torch

LEVELS = ("chunk", "action", "token")


def logprob_at_level(logp: torch.Tensor, level: str) -> torch.Tensor:
    """Per-dimension log-probabilities f32 [B, K, A] -> f32 [B] (chunk), [B, K] (action) or as they
    are (token)."""
    if level not in LEVELS:
        raise ValueError(f"level: must be one of {LEVELS}, got {level!r}")
    if level == "chunk":
        return logp.sum((1, 2))
    if level == "action":
        return logp.sum(2)
    return logp
