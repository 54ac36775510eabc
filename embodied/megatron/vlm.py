"""A Qwen2-VL family VLM's language model on megatron-core, inside the VLA.

A VLA on a Hugging Face VLM (``policy.vlm_path``, models/vla/hf_vlm.py) keeps that model's own
``…VLModel``: its vision tower, the merge of the image features into the token embeddings at
the image placeholders, and its 3-D (time, height, width) rotary positions. Its language model
(``language_model``, a ``Qwen2_5_VLTextModel``), the large part of the
VLA's weights, is replaced by ``MegatronTextModel``: this TP rank's shard of it, called as the
Hugging Face one is (``get_input_embeddings``; ``forward(inputs_embeds=, position_ids=,
attention_mask=)`` -> ``.last_hidden_state``).

- The embedding rows (the vocabulary) split over the ranks; each rank looks up its rows and the
  embeddings are summed over the ranks (megatron's ``VocabParallelEmbedding``).
- The transformer is megatron's (embodied/megatron/qwen2.py) with its multimodal rotary
  embedding over the positions the ``…VLModel`` computes.
- The vision tower stays whole on every rank: its input and output are the same there, so its
  gradients are too (the decoder's input gradient is summed over the ranks by megatron's
  column-parallel linears).
"""

from __future__ import annotations

import torch
from torch import nn

from embodied.megatron import parallel
from embodied.megatron.layout import qwen2_text_to_megatron
from embodied.megatron.qwen2 import Qwen2Megatron


class MegatronTextModel(nn.Module):
    """This TP rank's shard of a Qwen2-VL family's language model."""

    layout = "qwen2_text"
    shard_prefix = "lm.model."  # the names of the shard's parameters (megatron's)

    def __init__(self, text_config, dtype: torch.dtype = torch.float32, *, recompute: bool = False):
        super().__init__()
        self.lm = Qwen2Megatron(text_config, dtype, lm_head=False, recompute=recompute)
        self.pad_token_id = text_config.pad_token_id

    def shape(self) -> dict:
        lm = self.lm
        return {"layers": lm.num_layers, "heads": lm.heads, "groups": lm.groups}

    def train(self, mode: bool = True):
        # always in training mode: megatron recomputes activations (``recompute``) only there,
        # and there is no dropout to switch off (the Hugging Face VLM wrapper sets its whole
        # model to eval)
        return super().train(True)

    def get_input_embeddings(self):
        return self.embed

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """long [B, L] -> f32 [B, L, D], summed over the ranks' vocabulary slices."""
        embeddings = self.lm.model.embedding.word_embeddings(input_ids)
        if self.pad_token_id is None:
            return embeddings
        # as nn.Embedding's padding_idx: the padding token's row gets no gradient
        return torch.where(
            (input_ids == self.pad_token_id)[..., None], embeddings.detach(), embeddings
        )

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values=None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs,
    ):
        from transformers.modeling_outputs import BaseModelOutputWithPast

        if past_key_values is not None or use_cache:
            raise ValueError("the megatron language model keeps no key-value cache")
        asked = [key for key, value in kwargs.items() if value]
        if asked:
            raise ValueError(f"the megatron language model does not give {asked}")
        if inputs_embeds is None:
            inputs_embeds = self.embed(input_ids)
        batch, length = inputs_embeds.shape[:2]
        if position_ids is None:  # (as the Hugging Face model: 0.. on every axis)
            position_ids = torch.arange(length, device=inputs_embeds.device)
            position_ids = position_ids.view(1, 1, -1).expand(3, batch, -1)
        elif position_ids.ndim == 2:
            position_ids = position_ids[None].expand(3, -1, -1)
        elif position_ids.shape[0] == 4:  # (text positions first: for packed masks only)
            if attention_mask is None:
                raise ValueError("packed sequences need an attention_mask on megatron")
            position_ids = position_ids[1:]
        if attention_mask is None:
            attention_mask = torch.ones(
                batch, length, dtype=torch.long, device=inputs_embeds.device
            )
        dtype = self.lm.model.embedding.word_embeddings.weight.dtype
        hidden = self.lm.hidden_states(inputs_embeds.to(dtype), position_ids, attention_mask)
        # (the rest of the policy is float32; a bf16 run computes the language model in bf16)
        return BaseModelOutputWithPast(last_hidden_state=hidden.float())

    def load_torch_state(self, state: dict[str, torch.Tensor]) -> None:
        """This rank's shard of the Hugging Face language model's state dict."""
        shards = qwen2_text_to_megatron(state, tp=parallel.tp_size(), **self.shape())
        self.lm.load_shard(shards[parallel.tp_rank()])

    def torch_state(self, values=None) -> dict[str, torch.Tensor]:
        """The Hugging Face language model's state dict, gathered from every TP rank (every rank
        calls this). ``values``: {megatron name: this rank's tensor} to gather instead of the
        weights (e.g. their gradients)."""
        return parallel.gather_torch_state(self.layout, self.lm.model, self.shape(), values)
