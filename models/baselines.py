"""Baseline policies for benchmarks: uniformly random actions and the zero action (hold still).
They have no weights; the benchmark builds them for each task's ``EnvSpec``."""

from __future__ import annotations

import torch
from torch import nn

from embodied.models.levels import logprob_at_level
from embodied.schema import EnvSpec, Observation, PolicyOutput


class RandomPolicy(nn.Module):
    """Actions uniform within the action bounds, one per call (K = 1), from its own seeded
    generator: the same seed gives the same actions. ``deterministic=True`` gives the centre of
    the bounds (a uniform has no mode); benchmarks sample it."""

    has_critic = False

    def __init__(self, spec: EnvSpec, seed: int = 0):
        super().__init__()
        low, high = spec.action.bounds()
        self.register_buffer("low", low)  # f32 [A]
        self.register_buffer("high", high)
        self.generator = torch.Generator().manual_seed(seed)
        # log-density of the uniform, per action dimension: f32 [A]
        self.register_buffer("logp_dim", -torch.log(high - low))

    def _logp(self, batch: int, device) -> torch.Tensor:
        return self.logp_dim.to(device).expand(batch, 1, -1).clone()  # f32 [B, 1, A]

    def act(self, obs: Observation, *, deterministic: bool = False) -> PolicyOutput:
        B = len(obs.instruction)
        A = self.low.shape[0]
        if deterministic:
            u = torch.full((B, 1, A), 0.5)
        else:  # (drawn on the CPU: the same actions on any device)
            u = torch.rand(B, 1, A, generator=self.generator)  # f32 [B, 1, A] in [0, 1)
        device = obs.state.device
        u = u.to(self.low.device)  # (the bounds follow the module: a GPU simulator's bench)
        actions = (self.low + u * (self.high - self.low)).to(device)
        logp = self._logp(B, device)
        return PolicyOutput(actions=actions, logprob=logp.sum((1, 2)), extras={"logp_token": logp})

    def evaluate(self, obs: Observation, output: PolicyOutput, *, level: str = "chunk"):
        B = output.actions.shape[0]
        logp = self._logp(B, output.actions.device)
        return logprob_at_level(logp, level), -logp.sum((1, 2)), None


class ZeroPolicy(nn.Module):
    """The zero action (no motion for delta action spaces), clamped into the bounds, K = 1."""

    has_critic = False

    def __init__(self, spec: EnvSpec):
        super().__init__()
        low, high = spec.action.bounds()
        self.register_buffer("action", torch.zeros_like(low).clamp(low, high))  # f32 [A]

    def act(self, obs: Observation, *, deterministic: bool = False) -> PolicyOutput:
        B = len(obs.instruction)
        device = obs.state.device
        actions = self.action.expand(B, 1, -1).clone().to(device)  # f32 [B, 1, A]
        logp = torch.zeros_like(actions)  # a point mass: log-probability taken as 0
        return PolicyOutput(actions=actions, logprob=logp.sum((1, 2)), extras={"logp_token": logp})

    def evaluate(self, obs: Observation, output: PolicyOutput, *, level: str = "chunk"):
        logp = torch.zeros_like(output.actions)
        return logprob_at_level(logp, level), logp.sum((1, 2)), None


BASELINES = {"random": RandomPolicy, "zero": ZeroPolicy}
