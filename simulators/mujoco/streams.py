"""Seeded random streams, one per world, drawn for any subset of worlds at once on any device.

Each world's stream is a counter-based generator: draw k of world w is a hash of (w's key, k)
(``draw_hash``), so a masked reset draws for many worlds in one tensor operation (no Python loop
over worlds, no generator object per world), on the CPU or a GPU alike, and the same key gives the
same numbers on every device and backend. Reseeding a world sets its key to the seed and its
counter to 0; unseeded draws continue where the world's stream left off.

The hash is Chris Wellons' "lowbias32" finalizer. Products are split into 16-bit halves so that
every intermediate fits in int64 exactly (no reliance on signed overflow wrapping)."""

from __future__ import annotations

import numpy as np
import torch

MASK32 = 0xFFFFFFFF
_LOWBIAS = (0x7FEB352D, 0x846CA68B)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x in [0, 2**32), exactly in int64."""
    lo = x * (c & 0xFFFF)  # < 2**48
    hi = ((x * (c >> 16)) & 0xFFFF) << 16  # < 2**32
    return (lo + hi) & MASK32


def hash32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 of int64 values in [0, 2**32): a bijection on 32-bit words."""
    x = x & MASK32
    x = x ^ (x >> 16)
    x = _mul32(x, _LOWBIAS[0])
    x = x ^ (x >> 15)
    x = _mul32(x, _LOWBIAS[1])
    return x ^ (x >> 16)


class Streams:
    """``num_worlds`` random streams on ``device``; unseeded keys come from the OS's entropy, not
    from torch's global generator (drawing from it would shift a policy's samples in the same
    process, so a run would depend on where its env was built)."""

    def __init__(self, num_worlds: int, device: torch.device):
        entropy = np.random.default_rng().integers(0, 2**62, num_worlds)  # int64 [num_worlds]
        self.key = torch.from_numpy(entropy).to(device)
        self.counter = torch.zeros(num_worlds, dtype=torch.int64, device=device)

    def reseed(self, ids: torch.Tensor, seeds: torch.Tensor) -> None:
        """Worlds ``ids`` (int64 [N]) start over from ``seeds`` (int64 [N], >= 0)."""
        self.key[ids] = seeds
        self.counter.index_fill_(0, ids, 0)

    def uniform(self, ids: torch.Tensor, n: int) -> torch.Tensor:
        """The next ``n`` draws of worlds ``ids``: f32 [N, n] in [0, 1), 24 bits each (exact in
        float32, so both backends see the very same numbers)."""
        key = self.key[ids]
        k = self.counter[ids, None] + torch.arange(n, device=key.device)  # int64 [N, n]
        self.counter[ids] += n
        h = draw_hash(key, k)  # int64 [N, n] in [0, 2**32)
        return (h >> 8).to(torch.float32) * (1.0 / (1 << 24))


def draw_hash(key: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """The 32-bit word of draw ``k`` (int64 [N, n]) of the worlds keyed ``key`` (int64 [N]).

    The key's two words are hashed into two words of the world's own, ``a`` and ``b`` (each a
    bijection of the key's hash), and the draw is ``hash32(hash32(k ^ a) + b)``. The key and the
    draw index enter unalike (no symmetry between seed s's draw k and seed k's draw s), no pair
    is mapped to 0 by construction (``hash32(0) = 0``: a hash of ``seed ^ k`` alone gave 0 at
    every k = seed), and worlds whose ``a`` differ in low bits only do not share a stream: their
    ``b`` differ in every bit."""
    high = hash32((key >> 32) ^ _KEY_HIGH)  # int64 [N]: never 0 for a key below 2**32
    a = hash32((key & MASK32) ^ high)
    b = hash32(a ^ _SECOND_WORD)
    return hash32(_add32(hash32(k ^ a[:, None]), b[:, None]))


_KEY_HIGH = 0x9E3779B9  # (2**32 / golden ratio) folded into the key's high word before hashing
_SECOND_WORD = 0x85EBCA6B  # the world's second word: its first, hashed once more after this


def _add32(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """(x + y) mod 2**32 for x, y in [0, 2**32)."""
    return (x + y) & MASK32
