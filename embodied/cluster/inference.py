"""The inference copies seen from the driver: rollout workers (or env workers that infer), the
weights' version they hold."""

from __future__ import annotations

import torch


class RemoteInference:
    """The inference copies: the workers that hold them, in their role ("env": the copies live
    in the env workers), and the weights' version they were last sent."""

    def __init__(self, workers: list, has_critic: bool, role: str = "rollout"):
        self.workers = workers
        self.role = role
        self.version = 0
        self.has_critic = has_critic
        self.device = torch.device("cpu")  # (what the driver keeps of a round is on its host)
