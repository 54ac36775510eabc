"""Vision-language-action policies: backbones, action heads, the VLA policy."""

from embodied.models.levels import LEVELS
from embodied.models.vla.heads import (
    HEADS,
    DiscreteTokenHead,
    FlowMatchingHead,
    GaussianChunkHead,
)
from embodied.models.vla.policy import VLA, VLAConfig

__all__ = [
    "HEADS",
    "LEVELS",
    "VLA",
    "VLAConfig",
    "DiscreteTokenHead",
    "FlowMatchingHead",
    "GaussianChunkHead",
]
