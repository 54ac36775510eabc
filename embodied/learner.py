"""The learner role (``TrainEngine``): log-probabilities of stored samples under the current
weights, backward, optimizer step, state. ``TorchEngine`` is the one-process torch implementation;
the Megatron backend is a second implementation of the same interface."""

from __future__ import annotations

from typing import Protocol

import torch

from embodied.rollout import Samples, logprob_at


class TrainEngine(Protocol):
    def logprob(
        self, samples: Samples, level: str
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(log-probability at ``level``: f32 [N] chunk (valid actions only), [N, K] action or
        [N, K, A] token; entropy f32 [N]; value f32 [N] or None) under the current weights."""

    def backward(self, loss: torch.Tensor) -> None: ...

    def step(self) -> torch.Tensor:
        """Clip the gradient, apply it, clear it; returns the gradient norm (a 0-dim tensor)."""

    def set_lr(self, lr: float) -> None: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class TorchEngine:
    """Adam over the policy's trainable parameters, gradient clipping by global norm."""

    def __init__(self, policy: torch.nn.Module, *, learning_rate: float, max_grad_norm: float):
        self.policy = policy
        self.params = [p for p in policy.parameters() if p.requires_grad]
        self.optimizer = torch.optim.Adam(self.params, lr=learning_rate, eps=1e-5)
        self.max_grad_norm = max_grad_norm

    def logprob(self, samples: Samples, level: str):
        # ask the policy for per-dimension log-probabilities: the chunk level sums the valid
        # actions only (an action run after its episode ended belongs to no episode)
        token, entropy, value = self.policy.evaluate(samples.obs, samples.output, level="token")
        return logprob_at(token, level, samples.valid), entropy, value

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> torch.Tensor:
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def state_dict(self) -> dict:
        return {"model": self.policy.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.policy.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
