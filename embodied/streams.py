"""Random streams per worker: each role's shard draws from a stream of its own, derived from
(seed, role, rank), in every layout.

The learner (``actor/0``: the policy's initial weights, minibatch shuffles) and each inference
copy (``rollout/<rank>``: sampled actions) hold one, and so does SFT's learner (``sft/0``: its
batches' frames). The embedded run holds ``actor/0`` and
``rollout/0``, the streams a Ray run with one worker per role holds, so the two draw the same
numbers; a fixed worker count gives a reproducible run. Data-parallel actor ranks are one
learner shard: they share ``actor/0`` and so draw the same minibatch permutations.

A stream is swapped into torch's generators (the CPU's, and once the process uses CUDA that of
the CUDA device its role draws on) while its role draws, and out again afterwards, so that roles
sharing a process (the embedded run) never draw from each other's stream. Deterministic actions draw
nothing (every policy here), so evaluations leave the streams where they are.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

ROLE_CODES = {"actor": 1, "rollout": 2, "sft": 3}  # (part of the derivation: never renumber)


def stream_seed(seed: int, role: str, rank: int, start: int = 0) -> int:
    """A 63-bit seed for the stream of ``role``'s worker ``rank`` in a run seeded ``seed``;
    ``start``: the iteration a stream restarts at (0 for a fresh run)."""
    entropy = [seed % 2**64, ROLE_CODES[role], rank, start]
    words = np.random.SeedSequence(entropy).generate_state(2, np.uint32)
    return (int(words[0]) << 31) ^ int(words[1])


def stream_key(role: str, rank: int) -> str:
    return f"{role}/{rank}"


@dataclass
class Stream:
    """One worker's generator states, outside torch's global generators between draws."""

    key: str  # "role/rank"
    seed: int  # what its CUDA generator starts from, the first time the process uses CUDA
    cpu: torch.Tensor  # torch's CPU generator state (uint8 [5056])
    cuda: torch.Tensor | None = None  # its CUDA device's generator state, once used

    @classmethod
    def derived(cls, seed: int, role: str, rank: int, start: int = 0) -> Stream:
        value = stream_seed(seed, role, rank, start)
        cpu = torch.Generator().manual_seed(value).get_state()
        return cls(stream_key(role, rank), value, cpu)

    @contextmanager
    def drawing(self, device: torch.device | str | None = None):
        """Torch's generators are this stream's inside the block, the process's outside: the
        CPU's and, once the process uses CUDA, that of ``device`` where it is a CUDA device (the
        one the role draws on), else the current CUDA device's."""
        outside_cpu = torch.get_rng_state()
        cuda = _cuda_index(device)
        outside_cuda = None if cuda is None else torch.cuda.get_rng_state(cuda)
        torch.set_rng_state(self.cpu)
        if cuda is not None:
            if self.cuda is None:
                torch.cuda.default_generators[cuda].manual_seed(self.seed)
            else:
                torch.cuda.set_rng_state(self.cuda, cuda)
        try:
            yield self
        finally:
            self.cpu = torch.get_rng_state()
            torch.set_rng_state(outside_cpu)
            if cuda is not None:
                self.cuda = torch.cuda.get_rng_state(cuda)
                torch.cuda.set_rng_state(outside_cuda, cuda)

    def state(self) -> dict:
        """What a checkpoint stores (and a restarted worker takes back with ``load``)."""
        cuda = None if self.cuda is None else self.cuda.clone()
        return {"seed": self.seed, "cpu": self.cpu.clone(), "cuda": cuda}

    def load(self, state: dict) -> None:
        self.seed = state["seed"]
        self.cpu = state["cpu"].clone()
        self.cuda = None if state["cuda"] is None else state["cuda"].clone()


def saved_streams(rng: dict | None) -> dict[str, dict] | None:
    """The stream states a checkpoint's ``rng`` holds; None for a checkpoint written before
    streams per worker (one generator state for the whole run)."""
    if not rng or "streams" not in rng:
        return None
    return rng["streams"]


def resumed(stream: Stream, rng: dict | None, seed: int, iteration: int) -> None:
    """``stream`` as a resumed run continues it: the checkpoint's state, or (a checkpoint
    without it: written before streams per worker, or by fewer workers) a stream derived afresh
    with the checkpoint's ``iteration`` folded in, so it does not repeat the run's first draws."""
    states = saved_streams(rng) or {}
    if stream.key in states:
        stream.load(states[stream.key])
        return
    role, rank = stream.key.split("/")
    stream.load(Stream.derived(seed, role, int(rank), start=iteration).state())


def _cuda_index(device: torch.device | str | None) -> int | None:
    """The index of the CUDA device whose generator a stream drawing on ``device`` swaps; None
    while the process has not used CUDA."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None
    device = None if device is None else torch.device(device)
    if device is not None and device.type == "cuda" and device.index is not None:
        return device.index
    return torch.cuda.current_device()
