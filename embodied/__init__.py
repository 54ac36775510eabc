"""embodied: RL fine-tuning of robot policies in vectorized simulators, and deployment to real
arms."""

from embodied.torchvision_ops import install_hook as _install_torchvision_hook

# before any library looks for torchvision (transformers, LeRobot): see embodied/torchvision_ops.py
_install_torchvision_hook()
