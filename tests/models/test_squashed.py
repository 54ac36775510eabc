"""The squashed Gaussian's entropy estimate (``models/squashed.py``) against the entropy of
tanh(u) by quadrature, and the gradient an entropy bonus gives."""

import math

import pytest
import torch

from embodied.models.squashed import squashed_entropy

# -integral of p log p for a = tanh(u), u ~ N(mean, exp(log_std)^2), by the trapezoid rule over
# u in mean +- 12 std (400,001 points; log p_a = log N(u) + 2 log cosh u, a route of its own)
QUADRATURE = {
    (0.0, -2.0): -0.5992133190703333,
    (0.0, 0.0): 0.6698041182217968,
    (0.0, 1.0): -0.7653820001355556,
    (0.0, 2.0): -7.074344539535891,
    (0.5, 0.0): 0.5202421552668957,
    (0.5, 2.0): -7.101129765100442,
}


@pytest.mark.parametrize("mean, log_std", list(QUADRATURE))
def test_the_estimate_averages_to_the_entropy_of_the_squashed_actions(mean, log_std):
    generator = torch.Generator().manual_seed(0)
    n = 200_000
    means = torch.full((n, 1), mean, dtype=torch.float64)
    log_stds = torch.tensor([log_std], dtype=torch.float64)
    u = means + math.exp(log_std) * torch.randn(n, 1, generator=generator, dtype=torch.float64)
    estimate = squashed_entropy(means, log_stds, u)  # f64 [n]
    assert estimate.shape == (n,)
    # (standard error: 0.002 at log_std 0, 0.02 at 2)
    assert estimate.mean().item() == pytest.approx(QUADRATURE[(mean, log_std)], abs=0.08)


def test_a_bonus_widens_a_narrow_gaussian_and_narrows_one_whose_actions_saturate():
    # the Gaussian's own entropy has d/dlog_std = 1 at any width: as a bonus it drove
    # actions onto the bounds (log_std 2: 72% of them beyond |a| = 0.99)
    generator = torch.Generator().manual_seed(1)
    for log_std, sign in ((-2.0, 1.0), (2.0, -1.0)):
        log_stds = torch.tensor([log_std, log_std], requires_grad=True)
        means = torch.zeros(50_000, 2, requires_grad=True)
        u = means.detach() + math.exp(log_std) * torch.randn(50_000, 2, generator=generator)
        squashed_entropy(means, log_stds, u).mean().backward()
        assert (log_stds.grad * sign > 0.5).all(), (log_std, log_stds.grad)
    # the estimate is taken at the given samples: its value is theirs, not a new draw's
    u = torch.tensor([[0.3, -2.0]])
    value = squashed_entropy(torch.zeros(1, 2), torch.zeros(2), u)
    expected = 2 * (0.5 + 0.5 * math.log(2 * math.pi)) + sum(
        math.log(1 - math.tanh(x) ** 2) for x in (0.3, -2.0)
    )
    assert value.item() == pytest.approx(expected, rel=1e-6)
