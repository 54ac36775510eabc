"""The Qwen2 family's language model on megatron-core: ``GPTModel`` with megatron's local layer
spec, RMSNorm, a SwiGLU MLP, rotary position embeddings, grouped-query attention with biased
QKV and unbiased other linears, as the Hugging Face config says. The vocabulary is split over
the TP ranks (embedding rows, output rows): log-probabilities of given tokens come from the
vocabulary-parallel cross-entropy, without gathering the vocabulary on any rank.

Weights come from a Hugging Face state dict (``load_hf_state``) and go back to one
(``hf_state``); embodied/megatron/layout.py holds the mapping.
"""

from __future__ import annotations

import contextlib

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig
from torch import nn

from embodied.megatron import parallel
from embodied.megatron.cpu import cuda_corners, rotary_on_cpu
from embodied.megatron.layout import qwen2_from_megatron, qwen2_to_megatron


def qwen2_config(
    hf_config, dtype: torch.dtype = torch.float32, recompute: bool = False
) -> TransformerConfig:
    """A Hugging Face ``Qwen2Config`` (or a Qwen2-VL family's text config) in megatron's terms,
    over this process's TP group."""
    text = hf_config.get_text_config()
    heads = text.num_attention_heads
    parameters = getattr(text, "rope_parameters", None) or {}
    if parameters.get("rope_type", "default") != "default":
        raise ValueError(f"rotary scaling {parameters['rope_type']!r} is not supported on megatron")
    if getattr(text, "use_sliding_window", False):
        raise ValueError("sliding-window attention is not supported on megatron")
    return parallel.transformer_config(
        dtype,
        recompute,
        num_layers=text.num_hidden_layers,
        hidden_size=text.hidden_size,
        num_attention_heads=heads,
        num_query_groups=text.num_key_value_heads,
        kv_channels=getattr(text, "head_dim", None) or text.hidden_size // heads,
        ffn_hidden_size=text.intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=text.rms_norm_eps,
        gated_linear_unit=True,  # SwiGLU: silu(gate) * up
        activation_func=nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=True,
        mrope_section=mrope_section(text),
    )


def rope_theta(text_config) -> float:
    """The rotary base (transformers 5 keeps it in ``rope_parameters``)."""
    parameters = getattr(text_config, "rope_parameters", None) or {}
    return float(parameters.get("rope_theta", getattr(text_config, "rope_theta", 10000.0)))


def mrope_section(text_config) -> list[int] | None:
    """The Qwen2-VL families' multimodal rotary sections (temporal, height, width: how many of
    a head's rotary frequencies each position axis turns), None for a text-only Qwen2."""
    parameters = getattr(text_config, "rope_parameters", None) or {}
    section = parameters.get("mrope_section")
    return None if section is None else [int(n) for n in section]


class Qwen2Megatron(nn.Module):
    """This TP rank's shard of a Qwen2 language model (or a Qwen2-VL family's, with its
    multimodal rotary embedding). ``lm_head=False``: the transformer without output weights
    (``hidden_states``; a VLA reads the last hidden states)."""

    def __init__(
        self,
        hf_config,
        dtype: torch.dtype = torch.float32,
        *,
        lm_head: bool = True,
        recompute: bool = False,
    ):
        super().__init__()
        text = hf_config.get_text_config()
        self.config = qwen2_config(hf_config, dtype, recompute)
        self.heads = text.num_attention_heads
        self.groups = text.num_key_value_heads
        self.num_layers = text.num_hidden_layers
        # (without a head, "tied" makes no output weight: GPTModel would reuse the embedding)
        self.tied = bool(getattr(text, "tie_word_embeddings", False)) or not lm_head
        self.mrope = self.config.mrope_section is not None
        tp = parallel.tp_size()
        if text.vocab_size % tp:
            raise ValueError(
                f"a vocabulary of {text.vocab_size} tokens does not split over TP={tp}"
            )
        if self.groups % tp:
            raise ValueError(f"{self.groups} key-value heads do not split over TP={tp}")
        # (megatron's multimodal rotary embedding makes its frequencies on the current CUDA
        # device when it is built)
        with cuda_corners() if self.mrope else contextlib.nullcontext():
            self.model = GPTModel(
                self.config,
                get_gpt_layer_local_spec(normalization="RMSNorm"),
                vocab_size=text.vocab_size,
                max_sequence_length=text.max_position_embeddings,
                share_embeddings_and_output_weights=self.tied,
                position_embedding_type="mrope" if self.mrope else "rope",
                rotary_base=rope_theta(text),
                parallel_output=True,  # logits stay split over the vocabulary
            )
        rotary_on_cpu(self.model)

    @staticmethod
    def attention_mask(mask: torch.Tensor) -> torch.Tensor:
        """bool [B, 1, L, L], True where a query may not look (a later token, or padding) from
        the tokens' mask (1 = token, 0 = padding) [B, L]."""
        L = mask.shape[1]
        later = torch.ones(L, L, dtype=torch.bool, device=mask.device).triu(1)
        return later[None, None] | ~mask.bool()[:, None, None, :]

    def positions(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token positions 0.. long [B, L] ([3, B, L] with the multimodal rotary embedding: a
        text token has the same position on every axis)."""
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        positions = positions[None].expand_as(input_ids)
        return positions[None].expand(3, -1, -1) if self.mrope else positions

    def forward(self, input_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """input_ids long [B, L], mask [B, L] (1 = token) -> this rank's vocabulary slice of the
        logits f32 [B, L, V / tp]."""
        return self.model(input_ids, self.positions(input_ids), self.attention_mask(mask))

    def hidden_states(
        self, embeddings: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """The last hidden states (after the final norm) f32 [B, L, D] of input embeddings
        [B, L, D] (the image features already in place), positions long [3, B, L] (multimodal;
        a text-only model takes 0.. at every sample, ``positions``), mask [B, L] (1 = token)."""
        model = self.model
        if self.mrope:
            rotary = model.rotary_pos_emb(positions, model.mrope_section)  # [L, B, 1, hd]
        else:  # (text only: positions 0.., as ``positions`` makes them)
            rotary = model.rotary_pos_emb(embeddings.shape[1])  # [L, 1, 1, hd]
        hidden = model.decoder(
            hidden_states=embeddings.transpose(0, 1).contiguous(),  # megatron's [L, B, D]
            attention_mask=self.attention_mask(mask),
            rotary_pos_emb=rotary,
        )
        return hidden.transpose(0, 1)

    def token_logprobs(
        self, input_ids: torch.Tensor, mask: torch.Tensor, targets: torch.Tensor
    ) -> torch.Tensor:
        """log p(targets[b, t] | input_ids[b, :t+1]) f32 [B, L], the softmax over the whole
        vocabulary taken across the ranks without gathering it."""
        # with labels, GPTModel returns the vocabulary-parallel cross-entropy [B, L]
        mask = self.attention_mask(mask)
        return -self.model(input_ids, self.positions(input_ids), mask, labels=targets)

    def load_hf_state(self, state: dict[str, torch.Tensor]) -> None:
        """This rank's shard of a Hugging Face Qwen2 state dict."""
        shards = qwen2_to_megatron(
            state,
            layers=self.num_layers,
            heads=self.heads,
            groups=self.groups,
            tp=parallel.tp_size(),
            tied=self.tied,
        )
        self.load_shard(shards[parallel.tp_rank()])

    def load_shard(self, shard: dict[str, torch.Tensor]) -> None:
        """This rank's ``GPTModel`` state dict (every weight of it)."""
        parallel.load_shard(self.model, shard, "Qwen2 weights do not fit")

    def hf_state(self) -> dict[str, torch.Tensor]:
        """The Hugging Face state dict, gathered from every TP rank (every rank calls this)."""
        shards = parallel.gather_shards({k: p.detach() for k, p in self.model.named_parameters()})
        return qwen2_from_megatron(
            shards, layers=self.num_layers, heads=self.heads, groups=self.groups, tied=self.tied
        )
