"""The per-world random streams of the MuJoCo backends (simulators/mujoco/streams.py): the hash is
lowbias32 (checked against a plain-integer reference), a world's draws depend only on its seed and
how many it has drawn, and they are uniform."""

import torch

from embodied.simulators.mujoco.streams import Streams, hash32


def _lowbias32(x: int) -> int:
    """Reference: Chris Wellons' lowbias32 on Python integers (unbounded, masked by hand)."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_hash_is_lowbias32_exactly_on_the_whole_32_bit_range():
    words = [0, 1, 2, 0xFFFF, 0x10000, 0x7FFFFFFF, 0x80000000, 0xDEADBEEF, 0xFFFFFFFF]
    got = hash32(torch.tensor(words, dtype=torch.int64)).tolist()
    assert got == [_lowbias32(w) for w in words]


def test_a_worlds_draws_depend_on_its_seed_and_count_only():
    a = Streams(4, torch.device("cpu"))
    b = Streams(4, torch.device("cpu"))
    a.reseed(torch.tensor([0, 1, 2, 3]), torch.tensor([7, 7, 8, 2**40 + 7]))
    b.reseed(torch.tensor([2]), torch.tensor([7]))
    first = a.uniform(torch.tensor([0, 1, 2, 3]), 5)  # f32 [4, 5]
    assert torch.equal(first[0], first[1])  # equal seeds, equal draws (GRPO's groups)
    assert not torch.equal(first[0], first[2])
    assert not torch.equal(first[0], first[3])  # the seed's high word counts
    assert torch.equal(b.uniform(torch.tensor([2]), 5)[0], first[0])  # whatever world it is
    split = torch.cat([b.uniform(torch.tensor([2]), 2), b.uniform(torch.tensor([2]), 3)], 1)
    again = a.uniform(torch.tensor([0]), 5)
    assert torch.equal(split, again)  # draws 5-9, in two calls or one
    a.reseed(torch.tensor([0]), torch.tensor([7]))
    assert torch.equal(a.uniform(torch.tensor([0]), 5)[0], first[0])  # reseeding starts over


def test_draws_are_uniform_on_the_unit_interval():
    s = Streams(1000, torch.device("cpu"))
    s.reseed(torch.arange(1000), torch.arange(1000))
    u = s.uniform(torch.arange(1000), 200).double()  # 200k draws
    assert 0.0 <= u.min() and u.max() < 1.0
    assert abs(u.mean().item() - 0.5) < 0.003  # sd of the mean: 0.29 / sqrt(2e5) = 0.00065
    assert abs(u.var().item() - 1 / 12) < 0.002
    histogram = torch.histc(u, bins=10, min=0.0, max=1.0)
    assert (histogram - 20_000).abs().max() < 600  # sd per bin: sqrt(2e5 * 0.09) = 134
    lag = torch.corrcoef(torch.stack([u[:, :-1].reshape(-1), u[:, 1:].reshape(-1)]))[0, 1]
    assert abs(lag.item()) < 0.01  # consecutive draws uncorrelated


def test_worlds_draw_independently_of_each_other():
    """Seeds 0..999 (a reset of consecutive seeds: PPO's iteration 0), 200 draws each. The seed
    and the draw index enter the hash unalike: seed a's draw b is not seed b's draw a, no draw is
    exactly 0 (a hash of ``seed ^ k`` gave 0 at every k = seed: world w's joint w sat at its
    range's end), neighbouring worlds are uncorrelated draw for draw, and no world's stream is
    another's shifted (values that coincide, as 24-bit draws do by chance, are not followed by
    the same next value)."""
    s = Streams(1000, torch.device("cpu"))
    s.reseed(torch.arange(1000), torch.arange(1000))
    u = s.uniform(torch.arange(1000), 200)  # f32 [1000, 200]: world = seed, draw index
    square = u[:200, :200]
    mirrored = (square == square.T) & ~torch.eye(200, dtype=torch.bool)
    assert mirrored.sum().item() == 0
    assert (u == 0).sum().item() == 0  # (a 24-bit draw is 0 with probability 6e-8: 0.01 here)
    diagonal = square.diagonal().double()
    assert abs(diagonal.mean().item() - 0.5) < 0.07  # sd of the mean: 0.29 / sqrt(200) = 0.02
    pairs = torch.stack([u[:-1].reshape(-1), u[1:].reshape(-1)]).double()
    assert abs(torch.corrcoef(pairs)[0, 1].item()) < 0.01  # world s vs s + 1, draw for draw
    rows = torch.corrcoef(u.double())  # [1000, 1000]: world against world over 200 draws
    off = rows[~torch.eye(1000, dtype=torch.bool)]
    assert off.abs().max().item() < 0.45  # sd 0.07; the largest of 500k pairs: ~5 sd, 0.35
    values, order = u[:, :-1].reshape(-1).sort()  # draws 0-198 of every world
    same = (values[1:] == values[:-1]).nonzero()[:, 0]  # coinciding draws
    assert 1000 < len(same) < 1400  # by chance: 199k^2 / 2 / 2^24 = 1180 (sd 34)
    first, second = order[same], order[same + 1]  # positions in the [1000, 199] grid
    following = u[:, 1:].reshape(-1)  # the draw after each
    assert (following[first] == following[second]).sum().item() == 0
