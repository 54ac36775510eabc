"""The inference copies seen from the driver: rollout workers (or env workers that infer) as one
``InferencePolicy``, for evaluations stepped from here."""

from __future__ import annotations

import time

import torch

from embodied.cluster.calls import Traffic, get
from embodied.cluster.wire import from_wire, to_wire, wire_bytes
from embodied.schema import Observation, PolicyOutput


class RemoteInference:
    """The rollout workers as one ``InferencePolicy``: a batch is split across them by rows."""

    def __init__(self, workers: list, has_critic: bool, role: str = "rollout"):
        self.workers = workers
        self.role = role  # "env": the inference copies live in the env workers
        self.version = 0
        self.device = torch.device("cpu")  # (evaluations step from the driver's host)
        self.has_critic = has_critic
        self.traffic = Traffic()

    def _call(self, method: str, obs: Observation, **kw):
        t0 = time.perf_counter()
        n = len(self.workers)
        B = obs.batch_size
        cuts = [B * i // n for i in range(n + 1)]
        parts = [
            (worker, to_wire(obs.index(slice(lo, hi)) if n > 1 else obs))
            for worker, lo, hi in zip(self.workers, cuts, cuts[1:])
            if hi > lo
        ]
        refs = [getattr(worker, method).remote(wired, **kw) for worker, wired in parts]
        answers = get(refs, self.role)
        self.traffic.wait_s += time.perf_counter() - t0
        self.traffic.bytes += wire_bytes([wired for _, wired in parts]) + wire_bytes(answers)
        self.traffic.rows += B
        return [from_wire(a) for a in answers]

    def act(self, obs: Observation, *, deterministic: bool = False) -> PolicyOutput:
        outs = self._call("act", obs, deterministic=deterministic)
        if len(outs) == 1:
            return outs[0]
        return PolicyOutput(
            actions=torch.cat([o.actions for o in outs]),
            logprob=torch.cat([o.logprob for o in outs]),
            value=torch.cat([o.value for o in outs]),
            extras={k: torch.cat([o.extras[k] for o in outs]) for k in outs[0].extras},
        )

    def value(self, obs: Observation) -> torch.Tensor:
        if not self.has_critic:
            return torch.zeros(obs.batch_size)
        return torch.cat(self._call("value", obs))
