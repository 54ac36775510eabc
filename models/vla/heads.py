"""Action heads: context tokens f32 [B, K, d] (one per chunk step) -> a distribution over action
chunks in the normalized action space [-1, 1]^(K x A).

Every head implements
  ``sample(ctx, deterministic) -> (actions f32 [B, K, A] in [-1, 1], logp f32 [B, K, A], extras)``
  ``log_prob(ctx, extras) -> (logp f32 [B, K, A], entropy f32 [B])``  (scores what ``sample`` drew)
  ``bc_loss(ctx, target f32 [B, K, A], mask f32 [B, K]) -> (loss, metrics)``  (supervised training)
``logp`` is per action dimension ("token" level); summing over A gives the action level and
over K and A the chunk level, which is what ``PolicyOutput.logprob`` carries.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from embodied.models.squashed import (
    HALF_LOG_2PI,
    gaussian_logpdf,
    squashed_entropy,
    tanh_log_det,
)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of x f32 [B, K, ...] over the entries whose chunk step is valid (mask f32 [B, K])."""
    m = mask.view(*mask.shape, *([1] * (x.dim() - 2))).expand_as(x)
    return (x * m).sum() / m.sum().clamp(min=1.0)


class GaussianChunkHead(nn.Module):
    """(a) Continuous chunk decoded in parallel (OpenVLA-OFT style): one linear readout per chunk
    step gives the mean of a Gaussian over u; the action is tanh(u), so it stays in [-1, 1].
    State-independent log-std. Supervised loss: L1 between tanh(mean) and the target."""

    def __init__(self, d_model: int, action_dim: int, init_log_std: float = -1.0):
        super().__init__()
        self.mean = nn.Linear(d_model, action_dim)
        nn.init.normal_(self.mean.weight, std=0.01)
        nn.init.zeros_(self.mean.bias)
        self.log_std = nn.Parameter(torch.full((action_dim,), init_log_std))

    def _logp(self, mean: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        return gaussian_logpdf(u, mean, self.log_std) - tanh_log_det(u)  # f32 [B, K, A]

    def sample(self, ctx, deterministic=False):
        mean = self.mean(ctx)  # f32 [B, K, A]
        u = mean if deterministic else mean + self.log_std.exp() * torch.randn_like(mean)
        return torch.tanh(u), self._logp(mean, u), {"raw_actions": u}

    def log_prob(self, ctx, extras):
        mean = self.mean(ctx)
        u = extras["raw_actions"]
        return self._logp(mean, u), squashed_entropy(mean, self.log_std, u)

    def bc_loss(self, ctx, target, mask):
        pred = torch.tanh(self.mean(ctx))
        loss = masked_mean((pred - target).abs(), mask)
        return loss, {"sft/l1": loss.detach()}


def action_bins(a: torch.Tensor, bins: int) -> torch.Tensor:
    """Normalized actions f32 [...] -> the indices long [...] of their bins among ``bins``
    uniform bins over [-1, 1]."""
    return ((a.clamp(-1, 1) + 1) * 0.5 * bins).long().clamp(0, bins - 1)


class DiscreteTokenHead(nn.Module):
    """(b) Discrete action tokens (OpenVLA style): each dimension of each chunk step is one of
    ``bins`` uniform bins over [-1, 1]; the action is the bin centre. Supervised loss:
    cross-entropy."""

    def __init__(self, d_model: int, action_dim: int, bins: int = 256):
        super().__init__()
        self.A = action_dim
        self.bins = bins
        self.logits = nn.Linear(d_model, action_dim * bins)
        nn.init.normal_(self.logits.weight, std=0.01)
        nn.init.zeros_(self.logits.bias)
        self.register_buffer(
            "centers", torch.linspace(-1 + 1 / bins, 1 - 1 / bins, bins), persistent=False
        )

    def _logits(self, ctx):
        B, K, _ = ctx.shape
        return self.logits(ctx).view(B, K, self.A, self.bins)  # f32 [B, K, A, bins]

    def _log_softmax(self, ctx):
        return torch.log_softmax(self._logits(ctx), dim=-1)  # f32 [B, K, A, bins]

    def tokenize(self, a: torch.Tensor) -> torch.Tensor:
        return action_bins(a, self.bins)

    def sample(self, ctx, deterministic=False):
        logits = self._logits(ctx)
        logp_all = torch.log_softmax(logits, dim=-1)
        if deterministic:
            # (the raw logits: log-softmax's shift can round two near-equal logits equal)
            tokens = logits.argmax(-1)
        else:
            tokens = torch.multinomial(logp_all.exp().view(-1, self.bins), 1).view(
                logp_all.shape[:-1]
            )
        logp = logp_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)  # f32 [B, K, A]
        return self.centers[tokens], logp, {"tokens": tokens}

    def log_prob(self, ctx, extras):
        logp_all = self._log_softmax(ctx)
        logp = logp_all.gather(-1, extras["tokens"].unsqueeze(-1)).squeeze(-1)
        entropy = -(logp_all.exp() * logp_all).sum(-1).sum((1, 2))  # f32 [B]
        return logp, entropy

    def bc_loss(self, ctx, target, mask):
        logits = self._logits(ctx)
        tokens = self.tokenize(target)  # long [B, K, A]
        nll = -torch.log_softmax(logits, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        loss = masked_mean(nll, mask)
        acc = masked_mean((logits.argmax(-1) == tokens).float(), mask)
        return loss, {"sft/ce": loss.detach(), "sft/token_accuracy": acc.detach()}


def sample_flow_chain(
    step_mean, x0: torch.Tensor, log_sigma: torch.Tensor, steps: int, deterministic: bool
):
    """Run a stochastic flow from x0 f32 [B, K, A]: x_{i+1} = step_mean(x_i, i) + sigma * eps
    (no noise when deterministic).
    -> (x_N, log p of the transitions f32 [B, K, A], chain f32 [B, N+1, K, A])."""
    x = x0
    chain = [x0]
    logp = torch.zeros_like(x0)  # f32 [B, K, A]
    for i in range(steps):
        mean = step_mean(x, i)
        x = mean if deterministic else mean + log_sigma.exp() * torch.randn_like(mean)
        logp = logp + gaussian_logpdf(x, mean, log_sigma)
        chain.append(x)
    return x, logp, torch.stack(chain, dim=1)


def flow_entropy(log_sigma: torch.Tensor, steps: int, chunk: int) -> torch.Tensor:
    """Entropy of the injected noise of one chain (scalar): N steps x K actions x A dimensions.
    Not the actions': it ignores the clip of x_N to [-1, 1], and its gradient in log_sigma is
    the constant N * K, so an entropy bonus (ent_coef > 0) widens sigma without bound and pushes
    actions onto their bounds (design note 6; the default ent_coef is 0)."""
    return (0.5 + HALF_LOG_2PI + log_sigma).sum() * steps * chunk


def _time_embedding(tau: torch.Tensor, dim: int) -> torch.Tensor:
    """Sinusoidal embedding of flow time tau f32 [N] in [0, 1] -> f32 [N, dim]."""
    freqs = torch.exp(torch.linspace(0.0, math.log(1000.0), dim // 2, device=tau.device))
    angles = tau[:, None] * freqs[None] * math.pi
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


class FlowMatchingHead(nn.Module):
    """(c) Flow matching (pi0 / SmolVLA style) made trainable by RL through a stochastic flow.

    A velocity network v(x, tau, ctx) carries noise x_0 to an action chunk x_N in ``steps`` Euler
    steps. Supervised training regresses v onto x_1 - x_0 along straight paths (rectified flow).
    For RL every step adds Gaussian noise with a learned per-dimension std sigma (Flow-Noise, as
    in pi-RL): x_{i+1} = x_i + v(x_i, tau_i) / N + sigma * eps, so the chain x_0 -> x_N is a
    sequence of Gaussian transitions and log p(chain) = sum_i log N(x_{i+1}; x_i + v_i / N, sigma^2)
    (x_0 ~ N(0, I) does not depend on the weights and is left out). The chain is kept in
    ``extras['flow_chain']`` f32 [B, N+1, K, A]; the action is x_N clipped to [-1, 1].
    Deterministic: x_0 = 0 and no injected noise (the ODE from the prior's mean).
    """

    def __init__(
        self,
        d_model: int,
        action_dim: int,
        *,
        steps: int = 5,
        hidden: int = 256,
        time_dim: int = 32,
        init_noise_std: float = 0.1,
    ):
        super().__init__()
        self.steps = steps
        self.time_dim = time_dim
        self.net = nn.Sequential(
            nn.Linear(action_dim + time_dim + d_model, hidden),
            nn.GELU(),
            nn.Linear(hidden, hidden),
            nn.GELU(),
            nn.Linear(hidden, action_dim),
        )
        self.log_sigma = nn.Parameter(torch.full((action_dim,), math.log(init_noise_std)))

    def velocity(self, x: torch.Tensor, tau: torch.Tensor, ctx: torch.Tensor) -> torch.Tensor:
        """x f32 [B, K, A], tau f32 [B], ctx f32 [B, K, d] -> f32 [B, K, A]."""
        t = _time_embedding(tau, self.time_dim)[:, None].expand(-1, x.shape[1], -1)
        return self.net(torch.cat([x, t, ctx], dim=-1))

    def sample(self, ctx, deterministic=False):
        B, K, _ = ctx.shape
        A = self.log_sigma.shape[0]
        x0 = ctx.new_zeros(B, K, A) if deterministic else torch.randn(B, K, A, device=ctx.device)

        def step_mean(x, i):
            return x + self.velocity(x, ctx.new_full((B,), i / self.steps), ctx) / self.steps

        x, logp, chain = sample_flow_chain(step_mean, x0, self.log_sigma, self.steps, deterministic)
        return x.clamp(-1, 1), logp, {"flow_chain": chain}

    def log_prob(self, ctx, extras):
        chain = extras["flow_chain"]  # f32 [B, N+1, K, A]
        B, N1, K, A = chain.shape
        N = N1 - 1
        x = chain[:, :-1].reshape(B * N, K, A)  # all transitions at once
        tau = (torch.arange(N, device=ctx.device, dtype=ctx.dtype) / N).repeat(B)  # f32 [B*N]
        ctx_n = ctx.repeat_interleave(N, dim=0)  # f32 [B*N, K, d]
        mean = (x + self.velocity(x, tau, ctx_n) / N).view(B, N, K, A)
        logp = gaussian_logpdf(chain[:, 1:], mean, self.log_sigma).sum(1)  # f32 [B, K, A]
        return logp, flow_entropy(self.log_sigma, N, K).expand(B)

    def bc_loss(self, ctx, target, mask):
        B = ctx.shape[0]
        tau = torch.rand(B, device=ctx.device)
        x0 = torch.randn_like(target)
        x_tau = (1 - tau[:, None, None]) * x0 + tau[:, None, None] * target
        loss = masked_mean((self.velocity(x_tau, tau, ctx) - (target - x0)) ** 2, mask)
        return loss, {"sft/flow_mse": loss.detach()}


HEADS = {"gaussian": GaussianChunkHead, "discrete": DiscreteTokenHead, "flow": FlowMatchingHead}
