"""The VLA's fusion transformer on megatron-core, sharded over the tensor-parallel ranks.

The torch fusion (models/vla/policy.py) is an ``nn.TransformerEncoder`` of pre-norm layers:
LayerNorm, multi-head self-attention with biased projections over every token (a key padding
mask, no causal mask), LayerNorm, a GELU MLP of 4 d. ``MegatronFusion`` is the same function
built from megatron-core's ``TransformerConfig``, ``TransformerBlock`` and its local layer spec
(no Transformer Engine: it runs on CPUs too), with the QKV and first MLP linears column-parallel
and the output and second MLP linears row-parallel. It is called as the torch fusion is, so the
VLA swaps one for the other (``VLA.fusion``) and keeps every other module whole on every rank:
the encoders, projections and heads are a small part of the VLA's weights and their inputs and
outputs are the same on every TP rank.
"""

from __future__ import annotations

import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_block import TransformerBlock
from torch import nn

from embodied.megatron import parallel
from embodied.megatron.layout import encoder_to_megatron


def fusion_config(
    d_model: int, heads: int, layers: int, dtype: torch.dtype, recompute: bool = False
) -> TransformerConfig:
    """nn.TransformerEncoderLayer(d, heads, 4 d, dropout=0, gelu, norm_first) in megatron's
    terms, over this process's TP group."""
    return parallel.transformer_config(
        dtype,
        recompute,
        num_layers=layers,
        hidden_size=d_model,
        num_attention_heads=heads,
        ffn_hidden_size=4 * d_model,
        normalization="LayerNorm",
        layernorm_epsilon=1e-5,
        activation_func=nn.functional.gelu,
        add_bias_linear=True,
        # (initialised, then overwritten by ``load_torch_state``: megatron marks the weights of
        # its parallel linears as sharded only where it initialises them, and the optimizer's
        # gradient norm needs that mark)
        perform_initialization=True,
    )


def fusion_spec():
    """Megatron's local GPT layer, its attention over every token (a padding mask only)."""
    spec = get_gpt_layer_local_spec()
    spec.submodules.self_attention.params["attn_mask_type"] = AttnMaskType.padding
    return spec


class MegatronFusion(nn.Module):
    """This TP rank's shard of the fusion transformer; ``forward`` as ``nn.TransformerEncoder``'s
    with ``batch_first=True``."""

    layout = "transformer_encoder"
    shard_prefix = "block."  # the names of the shard's parameters (megatron's)

    def __init__(
        self,
        d_model: int,
        heads: int,
        layers: int,
        dtype: torch.dtype = torch.float32,
        *,
        recompute: bool = False,
    ):
        super().__init__()
        self.heads = heads
        self.num_layers = layers
        self.config = fusion_config(d_model, heads, layers, dtype, recompute)
        self.block = TransformerBlock(self.config, fusion_spec(), post_layer_norm=False)

    def shape(self) -> dict:
        return {"layers": self.num_layers, "heads": self.heads}

    def forward(self, x: torch.Tensor, src_key_padding_mask: torch.Tensor | None = None):
        """x f32 [B, N, d]; src_key_padding_mask bool [B, N], True at padding -> f32 [B, N, d]."""
        # megatron masks where the mask is True, over [B, heads, N (queries), N (keys)]
        mask = None if src_key_padding_mask is None else src_key_padding_mask[:, None, None, :]
        inputs = x.to(self.config.params_dtype).transpose(0, 1).contiguous()  # (bf16 runs)
        hidden = self.block(inputs, attention_mask=mask)  # [N, B, d]
        return hidden.transpose(0, 1).to(x.dtype)

    def load_torch_state(self, state: dict[str, torch.Tensor]) -> None:
        """This rank's shard of a torch fusion's state dict (``layers.{i}.…``)."""
        shards = encoder_to_megatron(
            state, layers=self.num_layers, heads=self.heads, tp=parallel.tp_size()
        )
        self.block.load_state_dict(shards[parallel.tp_rank()])

    def torch_state(self, values=None) -> dict[str, torch.Tensor]:
        """The whole fusion in the torch layout, gathered from every TP rank (every rank calls
        this). ``values``: {megatron name: this rank's tensor} to gather instead of the weights
        (e.g. their gradients)."""
        return parallel.gather_torch_state(self.layout, self.block, self.shape(), values)
