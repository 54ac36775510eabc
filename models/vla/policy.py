"""``VLA``: vision encoder + language encoder + fusion transformer + action head (+ value head),
one ``Policy``.

Tokens: each camera's EfficientNet feature grid (projected, with position and camera
embeddings), one instruction embedding (MiniLM), one proprioception token, K learned action
queries and a value query. A pre-norm transformer encoder fuses them; the head reads the K query
outputs (one per chunk step), the value MLP reads the value query.

With ``vlm_path`` set, a Hugging Face vision-language model from that local directory replaces
both encoders: its last hidden states over (image tokens, instruction) are projected into the
fusion transformer in place of the image and instruction tokens (models/vla/hf_vlm.py).

Normalization lives in the module's buffers, so in every checkpoint (models/vla/normalization.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch
from torch import nn

from embodied.models.config import PolicyConfig
from embodied.models.levels import logprob_at_level
from embodied.models.vla.backbones import EfficientNetLite0, MiniLMText
from embodied.models.vla.heads import (
    HEADS,
    DiscreteTokenHead,
    FlowMatchingHead,
    GaussianChunkHead,
)
from embodied.models.vla.hf_vlm import HFVisionLanguage, missing_vlm
from embodied.models.vla.normalization import NormalizedVLA
from embodied.schema import (
    EnvSpec,
    Observation,
    PolicyOutput,
    UserError,
    check_at_least,
)


@dataclass
class VLAConfig(PolicyConfig):
    """A vision-language-action policy; sizes default to what trains on a 2-core CPU."""

    needs_cameras: ClassVar[bool] = True

    name: str = "vla"
    head: str = (
        "gaussian"  # gaussian (continuous chunk) | discrete (256-bin tokens) | flow (flow matching)
    )
    chunk_size: int = 4  # K actions per policy call
    d_model: int = 256  # fusion transformer width
    layers: int = 2  # fusion transformer depth
    heads: int = 4  # attention heads
    value_head: bool = True  # PPO needs it; GRPO does not
    use_state: bool = True  # proprioception token
    # simulator-only keys to feed (e.g. [goal_pos] where the goal is invisible to the cameras, as in
    # PickCube); a real robot has none, so a deployable policy uses goal inputs it can be given
    privileged_keys: list[str] = field(default_factory=list)
    vision_pretrained: bool = True  # ImageNet EfficientNet-Lite0 weights from its package
    vision_width: float = (
        1.0  # < 1 with vision_pretrained=false builds a small random encoder (tests)
    )
    vision_depth: float = 1.0
    freeze_vision: bool = False  # no gradients into the image encoder (faster updates on CPU)
    text_pretrained: bool = True  # all-MiniLM-L6-v2 from its package
    text_hidden: int = 384  # random text encoder size when text_pretrained=false (tests)
    text_layers: int = 6
    freeze_text: bool = True  # frozen: embeddings cached per instruction
    # a local Hugging Face VLM directory (PaliGemma, Qwen2.5-VL, SmolVLM2, ...): replaces both
    # encoders above
    vlm_path: str = ""
    freeze_vlm: bool = True
    init_log_std: float = -1.0  # gaussian head
    bins: int = 256  # discrete head
    flow_steps: int = 5  # flow head: denoising steps
    flow_noise_std: float = 0.1  # flow head: initial std (> 0) of the noise injected per step

    def has_critic(self) -> bool:
        return self.value_head

    def has_gaussian(self) -> bool:
        return self.head == "gaussian"

    def validate(self) -> None:
        if self.head not in HEADS:
            raise ValueError(f"head: must be one of {sorted(HEADS)}, got {self.head!r}")
        check_at_least(self, 1, "chunk_size", "d_model", "layers", "heads")  # (a fusion layer)
        if self.d_model % self.heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by heads ({self.heads})")
        check_at_least(self, 1, "flow_steps", "text_hidden", "text_layers")
        check_at_least(self, 2, "bins")
        for key in ("vision_width", "vision_depth"):
            if not getattr(self, key) > 0:
                raise ValueError(f"{key}: must be > 0, got {getattr(self, key)}")
        sizes = (self.vision_width, self.vision_depth)
        if self.vision_pretrained and sizes != (1.0, 1.0):
            key = "vision_width" if self.vision_width != 1.0 else "vision_depth"
            raise ValueError(
                f"{key}: the pretrained EfficientNet-Lite0 (vision_pretrained=true) has "
                f"width and depth 1.0, got {sizes[0]} and {sizes[1]} (a smaller encoder: "
                "vision_pretrained=false)"
            )
        if not self.flow_noise_std > 0:  # (the flow head starts from its log)
            raise ValueError(f"flow_noise_std: must be > 0, got {self.flow_noise_std}")

    def check_files(self) -> None:
        if self.vlm_path and not (Path(self.vlm_path) / "config.json").is_file():
            raise ValueError(missing_vlm(self.vlm_path))


class VLA(NormalizedVLA):
    def __init__(self, spec: EnvSpec, cfg: VLAConfig):
        cfg.validate()
        cams = spec.obs.cameras
        if not cams:
            raise UserError(
                "policy: a VLA needs camera images: use an obs_mode with cameras "
                "(e.g. env.obs_mode=rgb)"
            )
        if len({(c.height, c.width) for c in cams}) > 1:
            sizes = sorted({f"{c.height}x{c.width}" for c in cams})
            raise UserError(
                f"policy: a VLA's cameras must all have the same size (one shared image "
                f"encoder), got {sizes}"
            )
        super().__init__(spec, use_state=cfg.use_state, privileged_keys=cfg.privileged_keys)
        self.spec = spec
        self.cfg = cfg
        self.K = cfg.chunk_size
        self.A = spec.action.dim
        d = cfg.d_model
        self.camera_names = tuple(c.name for c in cams)
        if cfg.vlm_path:
            self.vlm = HFVisionLanguage(cfg.vlm_path, freeze=cfg.freeze_vlm)
            self.vlm_proj = nn.Linear(self.vlm.out_dim, d)
        else:
            self.vlm = None
            self.vision = EfficientNetLite0(
                (cams[0].height, cams[0].width),
                pretrained=cfg.vision_pretrained,
                width=cfg.vision_width,
                depth=cfg.vision_depth,
            )
            self.vision.requires_grad_(not cfg.freeze_vision)
            with torch.no_grad():
                n_patch = self.vision(
                    torch.zeros(1, cams[0].height, cams[0].width, 3, dtype=torch.uint8)
                ).shape[1]
            self.text = MiniLMText(
                pretrained=cfg.text_pretrained, hidden=cfg.text_hidden, layers=cfg.text_layers
            )
            self.text.requires_grad_(not cfg.freeze_text)
            self.vision_proj = nn.Linear(self.vision.out_dim, d)
            self.patch_pos = nn.Parameter(torch.randn(n_patch, d) * 0.02)
            self.camera_emb = nn.Parameter(torch.randn(len(cams), d) * 0.02)
            self.text_proj = nn.Linear(self.text.out_dim, d)
        self.state_proj = nn.Linear(self.state_dim, d) if self.state_dim else None
        self.queries = nn.Parameter(
            torch.randn(self.K + 1, d) * 0.02
        )  # K action queries + 1 value query
        layer = nn.TransformerEncoderLayer(
            d, cfg.heads, 4 * d, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
        )
        self.fusion = nn.TransformerEncoder(layer, cfg.layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        if cfg.head == "gaussian":
            self.head = GaussianChunkHead(d, self.A, cfg.init_log_std)
        elif cfg.head == "discrete":
            self.head = DiscreteTokenHead(d, self.A, cfg.bins)
        else:
            self.head = FlowMatchingHead(
                d, self.A, steps=cfg.flow_steps, init_noise_std=cfg.flow_noise_std
            )
        self.value_mlp = (
            nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.Linear(d, 1)) if cfg.value_head else None
        )

    # --- fusion ---------------------------------------------------------------------------------
    @property
    def caches_image_features(self) -> bool:
        """True when ``image_features`` is a frozen function of the images alone (SFT caches it)."""
        return self.vlm is None and self.cfg.freeze_vision

    def image_features(self, obs: Observation) -> torch.Tensor:
        """The image encoder's tokens for every camera: f32 [C*B, P, 1280] (cameras outermost).
        Deterministic, so with a frozen encoder they can be computed once and passed to
        ``context``."""
        images = torch.cat([obs.images[n] for n in self.camera_names])  # uint8 [C*B, H, W, 3]
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.cfg.freeze_vision):
            return self.vision(images)

    def context(
        self, obs: Observation, features: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (action-query outputs f32 [B, K, d], value-query output f32 [B, d]). ``features``:
        precomputed ``image_features(obs)`` (frozen encoder only)."""
        B = obs.batch_size
        pad = None  # bool [B, N]: True where a token is padding (VLM prompts of different lengths)
        if self.vlm is not None:
            hidden, mask = self.vlm(
                [obs.images[n] for n in self.camera_names], list(obs.instruction)
            )  # [B, L, D]
            tokens = [self.vlm_proj(hidden)]
            pad = ~mask
        else:
            feats = self.image_features(obs) if features is None else features  # f32 [C*B, P, 1280]
            vis = self.vision_proj(feats) + self.patch_pos  # f32 [C*B, P, d]
            vis = (
                vis.view(len(self.camera_names), B, *vis.shape[1:]) + self.camera_emb[:, None, None]
            )
            tokens = [
                vis.transpose(0, 1).reshape(B, -1, vis.shape[-1]),
                self.text_proj(self.text(obs.instruction))[:, None],
            ]
        if self.state_proj is not None:
            tokens.append(self.state_proj(self.normalized_state(obs))[:, None])
        tokens.append(self.queries.expand(B, -1, -1))
        x = torch.cat(tokens, dim=1)
        if pad is not None:
            pad = torch.cat(
                [
                    pad,
                    torch.zeros(B, x.shape[1] - pad.shape[1], dtype=torch.bool, device=pad.device),
                ],
                1,
            )
        out = self.norm(self.fusion(x, src_key_padding_mask=pad))  # f32 [B, N, d]
        return out[:, -self.K - 1 : -1], out[:, -1]

    def _value(self, v_token: torch.Tensor) -> torch.Tensor | None:
        return self.value_mlp(v_token).squeeze(-1) if self.value_mlp is not None else None

    # --- Policy -----------------------------------------------------------------------------------
    def act(self, obs: Observation, *, deterministic: bool = False) -> PolicyOutput:
        ctx, v = self.context(obs)
        a, logp, extras = self.head.sample(ctx, deterministic)  # a f32 [B, K, A] in [-1, 1]
        extras["logp_token"] = logp  # f32 [B, K, A]: finer log-probability levels for the update
        return PolicyOutput(
            actions=self.to_physical(a),
            logprob=logp.sum((1, 2)),
            value=self._value(v),
            extras=extras,
        )

    def evaluate(self, obs: Observation, output: PolicyOutput, *, level: str = "chunk"):
        """(logprob, entropy [B], value [B] or None); logprob is f32 [B] (chunk), [B, K] (action)
        or [B, K, A] (token: one per action dimension)."""
        ctx, v = self.context(obs)
        logp, entropy = self.head.log_prob(ctx, output.extras)
        return logprob_at_level(logp, level), entropy, self._value(v)

    @property
    def has_critic(self) -> bool:
        return self.value_mlp is not None

    def value(self, obs: Observation) -> torch.Tensor:
        """V(obs) f32 [B]; zeros without a value head (GRPO does not bootstrap)."""
        if self.value_mlp is None:
            return torch.zeros(obs.batch_size, device=obs.device)
        return self._value(self.context(obs)[1])

    def bc_loss(
        self,
        obs: Observation,
        actions: torch.Tensor,
        mask: torch.Tensor | None = None,
        features: torch.Tensor | None = None,
    ):
        """Supervised loss on demonstrated chunks: actions f32 [B, K, A] physical, mask f32 [B, K]
        (0 where the chunk runs past the episode's end). -> (loss, metrics)."""
        ctx, _ = self.context(obs, features)
        mask = torch.ones(actions.shape[:2], device=actions.device) if mask is None else mask
        return self.head.bc_loss(ctx, self.to_normalized(actions), mask)
