"""The inference role: a copy of the policy at a known weight version, acting on observation
batches. In one process it shares the learner's module (``sync`` only records the version); a
distributed runner holds a copy in another process and receives the learner's weights."""

from __future__ import annotations

from contextlib import nullcontext

import torch

from embodied.compiling import compiled
from embodied.schema import Observation, PolicyOutput
from embodied.streams import Stream


def compiled_act(policy: torch.nn.Module):
    """``policy.act`` through torch.compile (embodied.compiling): a stream's actions stay its
    own (eager's random draws). One graph per batch size."""
    return compiled(policy.act, next(policy.parameters()).device, "policy.compile_act")


class InferencePolicy:
    """``compile_act``: sampled actions (rollouts) go through ``compiled_act``, a graph per batch
    size; deterministic ones (evaluation) stay eager."""

    def __init__(
        self,
        policy: torch.nn.Module,
        version: int = 0,
        stream: Stream | None = None,
        compile_act: bool = False,
    ):
        self.policy = policy
        self.version = version  # the learner update that produced these weights
        self.stream = stream  # what sampled actions draw from (None: the process's generators)
        self.has_critic = getattr(policy, "has_critic", True)
        self._sample = compiled_act(policy) if compile_act else policy.act

    @property
    def device(self) -> torch.device:
        return next(self.policy.parameters()).device

    @torch.no_grad()
    def act(self, obs: Observation, *, deterministic: bool = False) -> PolicyOutput:
        """A chunk for every row; ``value`` is zeros f32 [B] for policies without a critic.
        Sampled actions draw from the stream; deterministic ones draw nothing."""
        sampling = self.stream is not None and not deterministic
        with self.stream.drawing(self.device) if sampling else nullcontext():
            if deterministic:
                out = self.policy.act(obs, deterministic=True)
            else:
                out = self._sample(obs, deterministic=False)
        if out.value is None:
            out.value = torch.zeros_like(out.logprob)
        return out

    @torch.no_grad()
    def value(self, obs: Observation) -> torch.Tensor:
        """V(obs) f32 [B] (zeros without a critic, computed without a forward pass)."""
        if not self.has_critic:
            return torch.zeros(obs.batch_size, device=self.device)
        return self.policy.value(obs)

    def sync(self, state: dict[str, torch.Tensor] | None, version: int) -> None:
        """Take the learner's weights (None: the module is shared, nothing to copy)."""
        if state is not None:
            self.policy.load_state_dict(state, strict=False)
        self.version = version
