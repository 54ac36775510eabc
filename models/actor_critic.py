"""Gaussian actor-critic on state/privileged vectors and (optionally) camera images.

Action bounds: a squashed Gaussian. The network's Gaussian over ``u`` lives in a normalized space;
the action is ``tanh(u)`` mapped affinely from [-1, 1] onto [low, high] of the ActionSpec, so
every action is within bounds and the deterministic action ``tanh(mean)`` is the median of the
stochastic policy's actions (their mean lies nearer 0). Clipping an unbounded sample instead let
the mean drift far outside the bounds: stochastic success 0.35, deterministic 0.0 on PushCube.
``u`` is kept in ``extras['raw_actions']`` so ``evaluate`` scores exactly what was sampled; the
log-probability includes the tanh Jacobian (it cancels in PPO's ratio). The squashed
distribution's entropy has no closed form: ``evaluate`` estimates it at the sampled ``u``
(``squashed_entropy``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from embodied.models.config import PolicyConfig
from embodied.models.encoders import CNNEncoder, StateEncoder
from embodied.models.levels import logprob_at_level
from embodied.models.squashed import gaussian_logpdf, squashed_entropy, tanh_log_det
from embodied.schema import EnvSpec, Observation, PolicyOutput, check_at_least

ACTIVATIONS = {"tanh": nn.Tanh, "relu": nn.ReLU, "elu": nn.ELU, "gelu": nn.GELU}


@dataclass
class ActorCriticConfig(PolicyConfig):
    """A Gaussian MLP actor-critic (with a CNN per camera when the observation has images)."""

    name: str = "actor_critic"
    hidden_sizes: list[int] = field(default_factory=lambda: [256, 256, 256])  # per MLP layer
    activation: str = "tanh"  # tanh | relu | elu | gelu
    init_log_std: float = -0.5  # initial log standard deviation in normalized action units
    chunk_size: int = 1  # K: actions per policy call
    use_privileged: bool = True  # feed simulator-only state (object/goal poses) to actor and critic
    # with use_privileged, only these keys (e.g. [goal_pos]: a goal a user gives a real arm);
    # None: all of the environment's
    privileged_keys: list[str] | None = None
    use_images: bool = True  # encode the spec's cameras with a CNN (if it has any)
    normalize_obs: bool = True  # running mean/std normalization of the state vector
    image_features: int = 256  # CNN output size per camera

    def validate(self) -> None:
        if self.activation not in ACTIVATIONS:
            raise ValueError(
                f"activation: must be one of {sorted(ACTIVATIONS)}, got {self.activation!r}"
            )
        check_at_least(self, 1, "chunk_size", "image_features")
        if not self.hidden_sizes or min(self.hidden_sizes) < 1:
            raise ValueError("hidden_sizes: must be a non-empty list of positive sizes")
        if self.privileged_keys is not None and not self.use_privileged:
            raise ValueError("privileged_keys: the policy reads them only with use_privileged=true")

    def read_privileged(self, spec: EnvSpec) -> tuple[str, ...]:
        """The privileged keys of ``spec`` the policy reads."""
        if not self.use_privileged:
            return ()
        if self.privileged_keys is None:
            return tuple(spec.obs.privileged)
        return tuple(self.privileged_keys)


def _mlp(sizes: list[int], activation: str, out_std: float) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        lin = nn.Linear(a, b)
        last = i == len(sizes) - 2
        nn.init.orthogonal_(lin.weight, out_std if last else math.sqrt(2))
        nn.init.zeros_(lin.bias)
        layers += [lin] if last else [lin, ACTIVATIONS[activation]()]
    return nn.Sequential(*layers)


class ActorCritic(nn.Module):
    def __init__(self, spec: EnvSpec, cfg: ActorCriticConfig):
        super().__init__()
        cfg.validate()
        self.spec = spec
        self.cfg = cfg
        self.K = cfg.chunk_size
        self.A = spec.action.dim
        self.state_encoder = StateEncoder(spec, cfg.read_privileged(spec), cfg.normalize_obs)
        cams = spec.obs.cameras if cfg.use_images else ()
        self.cnns = nn.ModuleDict(
            {c.name: CNNEncoder(c.height, c.width, cfg.image_features) for c in cams}
        )
        feat = self.state_encoder.dim + cfg.image_features * len(cams)
        self.actor = _mlp(
            [feat, *cfg.hidden_sizes, self.K * self.A], cfg.activation, out_std=0.01 * math.sqrt(2)
        )
        self.critic = _mlp([feat, *cfg.hidden_sizes, 1], cfg.activation, out_std=1.0)
        self.log_std = nn.Parameter(torch.full((self.K * self.A,), cfg.init_log_std))
        low, high = spec.action.bounds()
        self.register_buffer("action_low", low)  # f32 [A]
        self.register_buffer("action_high", high)  # f32 [A]

    @property
    def privileged_inputs(self) -> tuple[str, ...]:
        """The privileged (simulator-only) keys the policy reads: none means it can run on a
        robot."""
        return self.state_encoder.keys

    # --- features -------------------------------------------------------------------------
    def features(self, obs: Observation) -> torch.Tensor:
        parts = [self.state_encoder(obs)] + [
            cnn(obs.images[name]) for name, cnn in self.cnns.items()
        ]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)  # f32 [B, F]

    @torch.no_grad()
    def update_normalizer(self, obs: Observation) -> None:
        """Fold a batch of (possibly time-major [T, B, ...]) observations into the running stats."""
        if self.state_encoder.norm is not None:
            self.state_encoder.norm.update(self.state_encoder.raw(obs))

    def to_physical(self, u: torch.Tensor) -> torch.Tensor:
        """Gaussian sample u (f32 [B, K, A]) -> physical actions within [low, high]."""
        return self.action_low + (torch.tanh(u) + 1.0) * 0.5 * (self.action_high - self.action_low)

    def _logprob(self, mean: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """log pi(tanh(u)) in normalized units per action dimension: the Gaussian log-density
        minus log|d tanh/du|. mean, u: f32 [B, K*A] -> f32 [B, K, A]. Written out rather than
        through torch.distributions: this runs once per rollout step."""
        logp = gaussian_logpdf(u, mean, self.log_std) - tanh_log_det(u)
        return logp.view(-1, self.K, self.A)

    # --- Policy ---------------------------------------------------------------------------
    has_critic = True

    def act(self, obs: Observation, *, deterministic: bool = False) -> PolicyOutput:
        feats = self.features(obs)
        mean = self.actor(feats)  # f32 [B, K*A], pre-squash
        if deterministic:
            u = mean  # f32 [B, K*A]; no draw from the RNG (evaluation must not move it)
        else:
            u = mean + self.log_std.exp() * torch.randn_like(mean)
        raw = u.view(-1, self.K, self.A)  # f32 [B, K, A]
        logp = self._logprob(mean, u)  # f32 [B, K, A]
        return PolicyOutput(
            actions=self.to_physical(raw),
            logprob=logp.sum((1, 2)),
            value=self.critic(feats).squeeze(-1),
            extras={"raw_actions": raw, "logp_token": logp},
        )

    def evaluate(self, obs: Observation, output: PolicyOutput, *, level: str = "chunk"):
        """(logprob f32 [B] (chunk), [B, K] (action) or [B, K, A] (token); entropy [B];
        value [B]) of the stored raw actions under the current weights."""
        feats = self.features(obs)
        u = output.extras["raw_actions"].reshape(feats.shape[0], -1)
        mean = self.actor(feats)  # f32 [B, K*A]
        logp = self._logprob(mean, u)  # f32 [B, K, A]
        return (
            logprob_at_level(logp, level),
            squashed_entropy(mean, self.log_std, u),
            self.critic(feats).squeeze(-1),
        )

    def value(self, obs: Observation) -> torch.Tensor:
        """V(obs): f32 [B]."""
        return self.critic(self.features(obs)).squeeze(-1)
