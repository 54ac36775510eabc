"""Baseline policies for benchmarks: uniformly random actions and the zero action (hold still).
They have no weights; the benchmark builds them for each task's ``EnvSpec``."""

from __future__ import annotations

import torch
from torch import nn

from embodied.schema import EnvSpec, Observation, PolicyOutput


class RandomPolicy(nn.Module):
    """Actions uniform within the action bounds, one per call (K = 1), from its own seeded
    generator: the same seed gives the same actions. ``deterministic=True`` gives the centre of
    the bounds (a uniform has no mode); benchmarks sample it."""

    def __init__(self, spec: EnvSpec, seed: int = 0):
        super().__init__()
        low, high = spec.action.bounds()
        self.register_buffer("low", low)  # f32 [A]
        self.register_buffer("high", high)
        self.generator = torch.Generator().manual_seed(seed)
        self._logprob = -float(
            torch.log(high - low).sum()
        )  # log-density of the uniform, per action

    def act(self, obs: Observation, *, deterministic: bool = False) -> PolicyOutput:
        B, A = len(obs.instruction), self.low.shape[0]
        u = (
            torch.full((B, 1, A), 0.5)
            if deterministic
            else torch.rand(B, 1, A, generator=self.generator)
        )  # f32 [B, 1, A] in [0, 1)
        actions = (self.low + u * (self.high - self.low)).to(obs.state.device)
        return PolicyOutput(
            actions=actions, logprob=torch.full((B,), self._logprob, device=obs.state.device)
        )

    def evaluate(self, obs: Observation, output: PolicyOutput):
        B = output.actions.shape[0]
        entropy = torch.full((B,), -self._logprob, device=output.actions.device)
        return torch.full((B,), self._logprob, device=output.actions.device), entropy, None


class ZeroPolicy(nn.Module):
    """The zero action (no motion for delta action spaces), clamped into the bounds, K = 1."""

    def __init__(self, spec: EnvSpec):
        super().__init__()
        low, high = spec.action.bounds()
        self.register_buffer("action", torch.zeros_like(low).clamp(low, high))  # f32 [A]

    def act(self, obs: Observation, *, deterministic: bool = False) -> PolicyOutput:
        B = len(obs.instruction)
        actions = self.action.expand(B, 1, -1).clone().to(obs.state.device)  # f32 [B, 1, A]
        return PolicyOutput(actions=actions, logprob=torch.zeros(B, device=obs.state.device))

    def evaluate(self, obs: Observation, output: PolicyOutput):
        B = output.actions.shape[0]
        zeros = torch.zeros(B, device=output.actions.device)
        return zeros, zeros, None  # a point mass: log-probability and entropy taken as 0


BASELINES = {"random": RandomPolicy, "zero": ZeroPolicy}
