"""A Hugging Face vision-language model from a local directory as the VLA's image + instruction
encoder (PaliGemma, Qwen2.5-VL, SmolVLM2 and other image-text-to-text families, through
transformers' Auto classes).

The camera images and the instruction go through the model's own processor and backbone (vision
tower, projector, language model; the LM head is dropped); the language model's last hidden
states, with their attention mask, become fusion tokens. Nothing is fetched: the directory holds
config.json, the weights and the processor files, as ``save_pretrained`` writes them.

Each camera image is one whole image: SmolVLM's processor would otherwise tile a large image into
crops, each with its own tokens (SmolVLM2's files: up to 17 images' tokens per camera).
Without torchvision transformers cannot build the video half of some processors (Qwen2.5-VL's,
SmolVLM's); images need no torchvision, so such a processor is replaced by its tokenizer and image
processor and the image placeholders are expanded here, as the family's processor does it: the
same token ids either way (tests/models/test_hf_vlm.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from torch import nn

from embodied.schema import UserError


def whole_images(image_processor) -> dict:
    """The option that makes ``image_processor`` take each image whole: SmolVLM's and
    Idefics3's would tile a large one into crops, each with its own tokens; others take it so."""
    return {"do_image_splitting": False} if hasattr(image_processor, "do_image_splitting") else {}


class ImagesOnlyProcessor:
    """Tokenizer + image processor of a VLM directory: ``__call__(text, images)`` expands each
    image placeholder in ``text`` into the number of tokens the model expects for that image."""

    def __init__(self, path: Path):
        from transformers import AutoImageProcessor, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.image_processor = AutoImageProcessor.from_pretrained(path, local_files_only=True)
        extra = (
            json.loads((path / "processor_config.json").read_text())
            if (path / "processor_config.json").exists()
            else {}
        )
        self.image_token = getattr(self.tokenizer, "image_token", None) or extra.get("image_token")
        if self.image_token is None:
            for candidate in ("<|image_pad|>", "<image>"):
                if self.tokenizer.convert_tokens_to_ids(candidate) != self.tokenizer.unk_token_id:
                    self.image_token = candidate
                    break
        if self.image_token is None:
            raise ValueError(
                f"{path}: cannot tell this model's image placeholder token; "
                "install its full processor"
            )
        self.image_seq_length = getattr(
            self.image_processor, "image_seq_length", None
        ) or extra.get("image_seq_len")
        self.options = whole_images(self.image_processor)
        # SmolVLM and Idefics3 (the processors that tile) mark a whole image as their processors
        # do: fake, global, fake
        self.image_prefix, self.image_suffix = "", ""
        if self.options:
            fake = getattr(self.tokenizer, "fake_image_token", None) or "<fake_token_around_image>"
            whole = getattr(self.tokenizer, "global_image_token", None) or "<global-img>"
            self.image_prefix, self.image_suffix = fake + whole, fake

    def _tokens_per_image(self, image_inputs, n_images: int) -> list[int]:
        if "image_grid_thw" in image_inputs:  # Qwen2-VL family: one token per merged patch
            merge = getattr(self.image_processor, "merge_size", 2)
            return (image_inputs["image_grid_thw"].prod(-1) // (merge * merge)).tolist()
        if self.image_seq_length:
            return [int(self.image_seq_length)] * n_images
        raise ValueError(
            "cannot tell how many tokens an image takes for this model; install its full processor"
        )

    def _image_tokens(self, count: int) -> str:
        return self.image_prefix + self.image_token * count + self.image_suffix

    def __call__(
        self,
        *,
        text: list[str],
        images: list[list[np.ndarray]],
        return_tensors: str = "pt",
        padding=True,
        do_image_splitting: bool = False,
    ):
        if do_image_splitting:
            raise ValueError("ImagesOnlyProcessor takes each image whole, not in tiles")
        flat = [im for sample in images for im in sample]
        image_inputs = self.image_processor(
            images=flat, return_tensors=return_tensors, **self.options
        )
        counts = iter(self._tokens_per_image(image_inputs, len(flat)))
        expanded = []
        for prompt in text:
            parts = prompt.split(self.image_token)
            images_then_text = (self._image_tokens(next(counts)) + p for p in parts[1:])
            expanded.append(parts[0] + "".join(images_then_text))
        text_inputs = self.tokenizer(expanded, return_tensors=return_tensors, padding=padding)
        return {**text_inputs, **image_inputs}


def load_processor(path: Path):
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(path, local_files_only=True)
    except (ImportError, AttributeError):  # a video processor that needs torchvision
        return ImagesOnlyProcessor(path)


class VLMNotFound(UserError, FileNotFoundError):
    """``policy.vlm_path`` is not a model directory (a checkpoint's, moved since), or not one
    that transformers can load as a vision-language model: one line."""


def missing_vlm(path: str | Path) -> str:
    return (
        f"vlm_path: {path} is not a model directory (config.json, weights and processor files, "
        "as save_pretrained writes them)"
    )


def unloadable_vlm(path: str | Path, error: Exception) -> VLMNotFound:
    """A directory with a config.json that transformers cannot load as a vision-language model
    (another kind of model: ValueError "Unrecognized configuration class"; no weights: OSError),
    named with the first line of transformers' message."""
    first = (str(error).strip().splitlines() or [type(error).__name__])[0]
    return VLMNotFound(
        f"policy.vlm_path: {path} cannot be loaded as a vision-language model: {first}"
    )


def check_loaded(path: Path, loading: dict) -> None:
    """A VLMNotFound where the directory's weights are not its config's: transformers starts the
    missing ones at random (frozen, by default: they stay random) and drops the unexpected ones,
    saying so only in a report on stderr."""
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        keys = sorted(loading.get(kind) or ())
        if keys:
            what = kind.replace("_keys", "")
            raise VLMNotFound(
                f"policy.vlm_path: {path}'s weights do not fit its config.json: {len(keys)} "
                f"{what}, first {keys[0]} (a directory of another model's weights?)"
            )


class HFVisionLanguage(nn.Module):
    """(camera images, instruction) -> the VLM's last hidden states f32 [B, L, D] + mask
    bool [B, L]."""

    def __init__(self, path: str | Path, *, freeze: bool = True):
        super().__init__()
        from transformers import AutoModelForImageTextToText

        path = Path(path)
        if not (path / "config.json").is_file():
            raise VLMNotFound(f"policy.{missing_vlm(path)}")
        try:
            self.processor = load_processor(path)
            full, loading = AutoModelForImageTextToText.from_pretrained(
                path, local_files_only=True, dtype=torch.float32, output_loading_info=True
            )
        except (ValueError, OSError, RuntimeError) as e:  # (RuntimeError: weights' sizes)
            raise unloadable_vlm(path, e) from e
        check_loaded(path, loading)
        self.model = full.model  # without the LM head: hidden states only
        self.out_dim = full.config.get_text_config().hidden_size
        self.image_token = self.processor.image_token
        # Qwen-VL families mark where each image starts and ends; without the marks two cameras'
        # image tokens run together and the model's 3-D positions count them as one image
        tok = getattr(self.processor, "tokenizer", self.processor)
        marks = ("<|vision_start|>", "<|vision_end|>")
        known = all(tok.convert_tokens_to_ids(m) not in (None, tok.unk_token_id) for m in marks)
        self.image_prompt = marks[0] + self.image_token + marks[1] if known else self.image_token
        # one whole image per camera, not SmolVLM's tiles (their tokens grow with the resize)
        self.image_options = whole_images(getattr(self.processor, "image_processor", None))
        self.freeze = freeze
        self.requires_grad_(not freeze)
        self.model.eval()

    def train(self, mode: bool = True):
        super().train(mode)
        self.model.eval()  # no dropout: act() and evaluate() must agree
        return self

    def forward(
        self, images: list[torch.Tensor], instructions: list[str]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """images: one uint8 [B, H, W, 3] per camera; instructions: B strings."""
        device = images[0].device
        frames = [cam.cpu().numpy() for cam in images]  # the processors take host images
        prompts = [self.image_prompt * len(images) + text for text in instructions]
        per_sample = [[f[b] for f in frames] for b in range(len(instructions))]
        inputs = self.processor(
            text=prompts, images=per_sample, return_tensors="pt", padding=True, **self.image_options
        )
        inputs = {
            k: v.to(device)
            for k, v in dict(inputs).items()
            if k != "labels" and isinstance(v, torch.Tensor)
        }
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.freeze):
            hidden = self.model(**inputs).last_hidden_state  # [B, L, D]
        return hidden.float(), inputs["attention_mask"].bool()
