"""Tiny random Hugging Face vision-language models saved to a local directory, one per family we
support (PaliGemma, Qwen2.5-VL, SmolVLM2), each with a processor whose tokenizer is built here:
the same files a real checkpoint directory has, a few hundred kilobytes, no hub."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

WORDS = (
    "push pull pick the cube to red and white target back up move goal a an of it on in "
    "stack green blue place"
).split()
IMAGE = 32  # pixels per side; patches of 8


def _tokenizer(special: list[str], **named) -> PreTrainedTokenizerFast:
    vocab = {t: i for i, t in enumerate(["<pad>", "<unk>", "<bos>", "<eos>", *special, *WORDS])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        unk_token="<unk>",
        bos_token="<bos>",
        eos_token="<eos>",
        extra_special_tokens=named or None,
    )
    tok.add_special_tokens({"additional_special_tokens": special})
    return tok


def _vision(**kw) -> dict:
    return dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, **kw
    )


def _text(vocab: int, **kw) -> dict:
    return dict(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=3,
        **kw,
    )


def paligemma(path: Path) -> Path:
    from transformers import (
        PaliGemmaConfig,
        PaliGemmaForConditionalGeneration,
        PaliGemmaProcessor,
        SiglipImageProcessorPil,
    )

    tok = _tokenizer(["<image>"])
    image_seq = (IMAGE // 8) ** 2
    proc = PaliGemmaProcessor(
        image_processor=SiglipImageProcessorPil(
            size={"height": IMAGE, "width": IMAGE}, image_seq_length=image_seq
        ),
        tokenizer=tok,
    )
    cfg = PaliGemmaConfig(
        vision_config=_vision(
            image_size=IMAGE, patch_size=8, model_type="siglip_vision_model", projection_dim=32
        ),
        text_config=_text(len(proc.tokenizer), head_dim=16, model_type="gemma"),
        image_token_index=proc.image_token_id,
        projection_dim=32,
    )
    cfg.text_config.num_image_tokens = image_seq
    PaliGemmaForConditionalGeneration(cfg).save_pretrained(path)
    proc.save_pretrained(path)
    return path


def qwen2_5_vl(path: Path, *, text: dict | None = None) -> Path:
    """A Qwen2.5-VL directory; ``text`` overrides the language model's config (its sizes, its
    rotary sections)."""
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLImageProcessorPil,
    )

    tok = _tokenizer(["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"])
    image = Qwen2VLImageProcessorPil(
        min_pixels=IMAGE * IMAGE,
        max_pixels=IMAGE * IMAGE,
        patch_size=8,
        merge_size=2,
        temporal_patch_size=2,
    )
    ids = {
        k: tok.convert_tokens_to_ids(t)
        for k, t in [
            ("image_token_id", "<|image_pad|>"),
            ("video_token_id", "<|video_pad|>"),
            ("vision_start_token_id", "<|vision_start|>"),
            ("vision_end_token_id", "<|vision_end|>"),
        ]
    }
    cfg = Qwen2_5_VLConfig(
        vision_config=dict(
            depth=1,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            patch_size=8,
            spatial_merge_size=2,
            temporal_patch_size=2,
            out_hidden_size=32,
            window_size=16,
            fullatt_block_indexes=[0],
        ),
        text_config={
            **_text(
                len(tok),
                rope_parameters={
                    "rope_type": "default",
                    "mrope_section": [2, 3, 3],
                    "rope_theta": 10000.0,
                },
            ),
            **(text or {}),
        },
        **ids,
    )
    Qwen2_5_VLForConditionalGeneration(cfg).save_pretrained(path)
    # Qwen2_5_VLProcessor cannot be built without torchvision (its video half): save its two parts,
    # the files a real checkpoint directory has
    tok.save_pretrained(path)
    image.save_pretrained(path)
    return path


def smolvlm(
    path: Path,
    *,
    image: int = IMAGE,
    patch: int = 8,
    scale: int = 2,
    vision: dict | None = None,
    text: dict | None = None,
    weights: bool = True,
    tiles: bool = False,
) -> Path:
    """A SmolVLM2 directory; tiny by default. ``vision`` / ``text`` override the towers' sizes,
    ``weights=False`` writes the config alone (for SmolVLA's ``load_vlm_weights: false``) and
    ``tiles=True`` an image processor that tiles, as SmolVLM2's files do (2x2 crops here)."""
    from transformers import (
        SmolVLMConfig,
        SmolVLMForConditionalGeneration,
        SmolVLMImageProcessorPil,
        SmolVLMProcessor,
    )
    from transformers.models.smolvlm.video_processing_smolvlm import SmolVLMVideoProcessor

    # the named tokens a SmolVLM2 tokenizer carries (LeRobot's SmolVLA reads the fake and global
    # ones)
    tok = _tokenizer(
        ["<image>", "<fake_token_around_image>", "<global-img>", "<end_of_utterance>"],
        image_token="<image>",
        fake_image_token="<fake_token_around_image>",
        global_image_token="<global-img>",
        end_of_utterance_token="<end_of_utterance>",
    )
    processor = SmolVLMImageProcessorPil(
        do_image_splitting=tiles,
        size={"longest_edge": 2 * image if tiles else image},
        max_image_size={"longest_edge": image},
    )
    cfg = SmolVLMConfig(
        vision_config={**_vision(image_size=image, patch_size=patch), **(vision or {})},
        text_config={**_text(len(tok), model_type="llama"), **(text or {})},
        scale_factor=scale,
        image_token_id=tok.convert_tokens_to_ids("<image>"),
    )
    if weights:
        SmolVLMForConditionalGeneration(cfg).save_pretrained(path)
    else:
        cfg.save_pretrained(path)
    SmolVLMProcessor(
        image_processor=processor,
        tokenizer=tok,
        video_processor=SmolVLMVideoProcessor(),
        image_seq_len=(image // patch) ** 2 // scale**2,
    ).save_pretrained(path)
    return path


def not_a_vlm(path: Path) -> Path:
    """A model directory of another kind: a tiny BERT (config.json and weights), which
    transformers' AutoModelForImageTextToText does not load."""
    from transformers import BertConfig, BertModel

    cfg = BertConfig(
        vocab_size=len(WORDS) + 4,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
    )
    BertModel(cfg).save_pretrained(path)
    return path


FAMILIES = {"paligemma": paligemma, "qwen2_5_vl": qwen2_5_vl, "smolvlm": smolvlm}
