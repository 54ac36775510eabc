"""embodied: RL fine-tuning of robot policies in vectorized simulators, and deployment to real arms."""

from embodied.torchvision_ops import ensure_importable as _ensure_torchvision_importable

# before any library imports torchvision (transformers, LeRobot): see embodied/torchvision_ops.py
_ensure_torchvision_importable()
