"""LeRobot's SmolVLA as one of our policies, fine-tunable with RL through a stochastic flow.

SmolVLA (LeRobot 0.4.4, ``lerobot.policies.smolvla``) is a SmolVLM2 backbone whose first layers
encode the camera images, the instruction and the proprioception into a key/value cache, and an
action expert that denoises an action chunk from that cache by flow matching (time runs from 1,
noise, to 0, actions: x <- x - v(x, t) / N). Everything below runs LeRobot's own modules:
its image preprocessing (resize with padding, [-1, 1]), ``embed_prefix``, the VLM-with-expert
forward that fills the cache and ``denoise_step``. What this adapter adds:

- the contract: our ``Observation`` in, physical action chunks ``[B, K, A]`` out, with
  normalization statistics in the module's buffers (models/vla/normalization.py) instead of
  LeRobot's separate processor files, so one checkpoint acts;
- RL: every denoising step adds Gaussian noise with a learned per-dimension std (Flow-Noise, as
  in pi-RL and our ``FlowMatchingHead``), so the chain x_0 -> x_N has a Gaussian log-probability
  that ``evaluate`` recomputes from the stored chain; deterministic acting starts from x_0 = 0
  and adds no noise;
- supervised training: LeRobot's own flow-matching loss (``VLAFlowMatching.forward``) on chunks
  normalized to [-1, 1], masked past an episode's end.

The SmolVLM2 directory is local (``vlm_path``: config.json, weights, tokenizer and processor
files, as ``save_pretrained`` writes them); with ``load_vlm_weights: false`` only its config is
read and the backbone starts random, as LeRobot does when it trains the expert from scratch.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch
from torch import nn

from embodied.models.config import PolicyConfig
from embodied.models.levels import logprob_at_level
from embodied.models.vla.heads import (
    flow_entropy,
    gaussian_logpdf,
    sample_flow_chain,
)
from embodied.models.vla.hf_vlm import VLMNotFound, missing_vlm, unloadable_vlm
from embodied.models.vla.normalization import NormalizedVLA
from embodied.schema import EnvSpec, Observation, PolicyOutput, UserError, check_at_least


@dataclass
class SmolVLAConfig(PolicyConfig):
    """LeRobot's SmolVLA built from a local SmolVLM2 directory; sizes are LeRobot's defaults."""

    needs_cameras: ClassVar[bool] = True

    name: str = "smolvla"
    vlm_path: str = ""  # local SmolVLM2 directory (required)
    load_vlm_weights: bool = True  # false: the backbone's config only, random weights
    chunk_size: int = 4  # K actions per policy call
    flow_steps: int = 10  # denoising steps (LeRobot's num_steps)
    flow_noise_std: float = 0.1  # initial std of the noise injected per denoising step (RL)
    image_size: int = (
        0  # side the images are resized (with padding) to; 0: the VLM's own image size
    )
    num_vlm_layers: int = 16  # first layers of the VLM kept
    num_expert_layers: int = -1  # <= 0: as many as the VLM layers kept
    expert_width_multiplier: float = 0.75
    train_expert_only: bool = (
        True  # the VLM stays frozen; the expert, projections and noise std train
    )
    freeze_vision_encoder: bool = True
    tokenizer_max_length: int = 48
    use_state: bool = True
    privileged_keys: list[str] = field(default_factory=list)  # as VLAConfig.privileged_keys

    def has_critic(self) -> bool:
        return False  # no value head: GRPO

    def has_gaussian(self) -> bool:
        return False  # (a flow: its noise is policy.flow_noise_std)

    def validate(self) -> None:
        if not self.vlm_path:
            raise ValueError(
                "vlm_path: SmolVLA needs a local SmolVLM2 directory (nothing is downloaded)"
            )
        check_at_least(self, 1, "chunk_size", "flow_steps", "tokenizer_max_length")
        check_at_least(self, 0, "image_size")
        if self.flow_noise_std <= 0:
            raise ValueError(f"flow_noise_std: must be > 0, got {self.flow_noise_std}")
        if not self.expert_width_multiplier > 0:  # (the expert's width: the VLM's times this)
            raise ValueError(
                f"expert_width_multiplier: must be > 0, got {self.expert_width_multiplier}"
            )

    def check_files(self) -> None:
        if not (Path(self.vlm_path) / "config.json").is_file():
            raise ValueError(missing_vlm(self.vlm_path))


def lerobot_smolvla():
    """LeRobot's ``modeling_smolvla`` module. ``lerobot/policies/__init__.py`` imports every policy
    LeRobot ships, and GR00T's needs diffusers and fails under transformers 5; SmolVLA's modules
    need none of that, so the package is entered without running its ``__init__``."""
    if "lerobot.policies" not in sys.modules:
        import lerobot

        spec = importlib.util.spec_from_loader("lerobot.policies", loader=None, is_package=True)
        spec.submodule_search_locations = [str(Path(lerobot.__file__).parent / "policies")]
        sys.modules["lerobot.policies"] = lerobot.policies = importlib.util.module_from_spec(spec)
    from lerobot.policies.smolvla import modeling_smolvla

    return modeling_smolvla


def check_expert_layers(cfg: SmolVLAConfig) -> None:
    """A UserError where ``num_expert_layers`` does not divide the VLM layers LeRobot keeps (the
    first ``num_vlm_layers`` of the VLM's text layers, read from its config.json), before
    LeRobot's AssertionError."""
    from transformers import AutoConfig

    if cfg.num_expert_layers <= 0:
        return
    try:
        config = AutoConfig.from_pretrained(cfg.vlm_path, local_files_only=True)
    except (ValueError, OSError) as e:
        raise unloadable_vlm(cfg.vlm_path, e) from e
    layers = getattr(config.get_text_config(), "num_hidden_layers", None)
    if layers is None:
        return  # (not a VLM that LeRobot can load: said when it tries)
    kept = min(cfg.num_vlm_layers, layers) if cfg.num_vlm_layers > 0 else layers
    if kept % cfg.num_expert_layers:
        raise UserError(
            f"policy.num_expert_layers: {cfg.num_expert_layers} does not divide the {kept} VLM "
            f"layers kept (policy.num_vlm_layers={cfg.num_vlm_layers}, the VLM has {layers}); "
            f"use a divisor of {kept}, or -1 for as many expert layers"
        )


class SmolVLA(NormalizedVLA):
    """One ``Policy``: observation -> SmolVLA's stochastic flow -> physical action chunk
    [B, K, A]."""

    def __init__(self, spec: EnvSpec, cfg: SmolVLAConfig):
        cfg.validate()
        if not (Path(cfg.vlm_path) / "config.json").is_file():  # (a checkpoint's, moved since)
            raise VLMNotFound(f"policy.{missing_vlm(cfg.vlm_path)}")
        if not spec.obs.cameras:
            raise UserError(
                "policy: SmolVLA needs camera images: use an obs_mode with cameras "
                "(e.g. env.obs_mode=rgb)"
            )
        super().__init__(spec, use_state=cfg.use_state, privileged_keys=cfg.privileged_keys)
        check_expert_layers(cfg)
        self.spec = spec
        self.cfg = cfg
        self.K = cfg.chunk_size
        self.A = spec.action.dim
        self.steps = cfg.flow_steps
        self.camera_names = tuple(c.name for c in spec.obs.cameras)
        lerobot = lerobot_smolvla()
        from lerobot.configs.types import FeatureType, PolicyFeature
        from lerobot.policies.smolvla.configuration_smolvla import (
            SmolVLAConfig as LeRobotSmolVLAConfig,
        )

        state_width = max(self.state_dim, 1)  # SmolVLA always embeds a state token
        features = {
            f"observation.images.{c.name}": PolicyFeature(
                FeatureType.VISUAL, (3, c.height, c.width)
            )
            for c in spec.obs.cameras
        }
        features["observation.state"] = PolicyFeature(FeatureType.STATE, (state_width,))
        lerobot_cfg = LeRobotSmolVLAConfig(
            vlm_model_name=cfg.vlm_path,
            load_vlm_weights=cfg.load_vlm_weights,
            chunk_size=self.K,
            n_action_steps=self.K,
            num_steps=self.steps,
            max_state_dim=state_width,
            max_action_dim=self.A,
            num_vlm_layers=cfg.num_vlm_layers,
            num_expert_layers=cfg.num_expert_layers,
            expert_width_multiplier=cfg.expert_width_multiplier,
            train_expert_only=cfg.train_expert_only,
            freeze_vision_encoder=cfg.freeze_vision_encoder,
            tokenizer_max_length=cfg.tokenizer_max_length,
            input_features=features,
            output_features={"action": PolicyFeature(FeatureType.ACTION, (self.A,))},
            device="cpu",
        )
        try:
            self.smolvla = lerobot.SmolVLAPolicy(lerobot_cfg)
        except (ValueError, OSError) as e:  # (LeRobot loading the VLM directory)
            raise unloadable_vlm(cfg.vlm_path, e) from e
        side = cfg.image_size or self.smolvla.model.vlm_with_expert.config.vision_config.image_size
        lerobot_cfg.resize_imgs_with_padding = (side, side)
        self._make_att_2d_masks = lerobot.make_att_2d_masks
        self.tokenizer = self.smolvla.model.vlm_with_expert.processor.tokenizer
        self.log_sigma = nn.Parameter(
            torch.full((self.A,), math.log(cfg.flow_noise_std))
        )  # f32 [A]

    @property
    def caches_image_features(self) -> bool:
        return False  # the images enter the VLM with the instruction: nothing to cache per frame

    # --- SmolVLA's inputs -------------------------------------------------------------------------
    def _inputs(self, obs: Observation):
        """-> (images [-1, 1] f32 [B, 3, S, S] per camera, their masks, tokens long [B, L], token
        mask bool [B, L], normalized state f32 [B, S']) as LeRobot's SmolVLA takes them."""
        batch = {
            f"observation.images.{n}": obs.images[n].permute(0, 3, 1, 2).float() / 255.0
            for n in self.camera_names
        }  # uint8 [B, H, W, 3] -> f32 [B, 3, H, W] in [0, 1]
        images, image_masks = self.smolvla.prepare_images(batch)
        # LeRobot's SmolVLA processor ends every task with a newline before tokenizing
        text = [t if t.endswith("\n") else t + "\n" for t in obs.instruction]
        tokens = self.tokenizer(
            text,
            padding="longest",
            truncation=True,
            max_length=self.cfg.tokenizer_max_length,
            return_tensors="pt",
        ).to(obs.device)
        state = (
            self.normalized_state(obs)
            if self.state_dim
            else torch.zeros(obs.batch_size, 1, device=obs.device)
        )  # f32 [B, S']
        return images, image_masks, tokens["input_ids"], tokens["attention_mask"].bool(), state

    def _prefix(self, obs: Observation):
        """Encode images, instruction and state once: -> (prefix padding mask, key/value cache)."""
        model = self.smolvla.model
        images, image_masks, tokens, token_masks, state = self._inputs(obs)
        embs, pad, att = model.embed_prefix(images, image_masks, tokens, token_masks, state=state)
        _, cache = model.vlm_with_expert.forward(
            attention_mask=self._make_att_2d_masks(pad, att),
            position_ids=torch.cumsum(pad, dim=1) - 1,
            past_key_values=None,
            inputs_embeds=[embs, None],
            use_cache=True,
            fill_kv_cache=True,
        )
        return pad, cache

    def _step_mean(self, pad, cache):
        """The Euler step of SmolVLA's flow from the prefix: x_i -> x_i - v(x_i, t_i) / N,
        t_i = 1 - i / N."""

        def step_mean(x: torch.Tensor, i: int) -> torch.Tensor:
            t = torch.full((x.shape[0],), 1.0 - i / self.steps, device=x.device)  # f32 [B]
            return x - self.smolvla.model.denoise_step(pad, cache, x, t) / self.steps

        return step_mean

    # --- Policy -----------------------------------------------------------------------------------
    def act(self, obs: Observation, *, deterministic: bool = False) -> PolicyOutput:
        pad, cache = self._prefix(obs)
        shape = (obs.batch_size, self.K, self.A)
        x0 = (
            torch.zeros(shape, device=obs.device)
            if deterministic
            else torch.randn(shape, device=obs.device)
        )
        x, logp, chain = sample_flow_chain(
            self._step_mean(pad, cache), x0, self.log_sigma, self.steps, deterministic
        )
        return PolicyOutput(
            actions=self.to_physical(x.clamp(-1, 1)),
            logprob=logp.sum((1, 2)),
            value=None,
            extras={"flow_chain": chain, "logp_token": logp},
        )

    def evaluate(self, obs: Observation, output: PolicyOutput, *, level: str = "chunk"):
        """(logprob, entropy [B], None): log p of the stored chain under the current weights;
        logprob f32 [B] (chunk), [B, K] (action) or [B, K, A] (token)."""
        chain = output.extras["flow_chain"]  # f32 [B, N+1, K, A]
        step_mean = self._step_mean(*self._prefix(obs))
        logp = sum(
            gaussian_logpdf(chain[:, i + 1], step_mean(chain[:, i], i), self.log_sigma)
            for i in range(self.steps)
        )  # f32 [B, K, A]
        # the injected noise's entropy, blind to the clip: ent_coef > 0 widens sigma without bound
        entropy = flow_entropy(self.log_sigma, self.steps, self.K).expand(obs.batch_size)
        return logprob_at_level(logp, level), entropy, None

    has_critic = False

    def value(self, obs: Observation) -> torch.Tensor:
        """No critic (GRPO): zeros f32 [B]."""
        return torch.zeros(obs.batch_size, device=obs.device)

    def bc_loss(
        self,
        obs: Observation,
        actions: torch.Tensor,
        mask: torch.Tensor | None = None,
        features: torch.Tensor | None = None,
    ):
        """LeRobot's flow-matching loss on demonstrated chunks: actions f32 [B, K, A] physical, mask
        f32 [B, K] (0 past the episode's end). -> (loss, metrics)."""
        images, image_masks, tokens, token_masks, state = self._inputs(obs)
        losses = self.smolvla.model.forward(
            images, image_masks, tokens, token_masks, state, self.to_normalized(actions)
        )  # f32 [B, K, A]
        mask = torch.ones(actions.shape[:2], device=actions.device) if mask is None else mask
        loss = (losses * mask[..., None]).sum() / (mask.sum() * self.A).clamp(min=1.0)
        return loss, {"sft/flow_mse": loss.detach()}
