"""Weights between the torch layout and megatron-core's tensor-parallel shards (torch only: the
conversion runs without megatron-core or process groups).

Megatron's layout, per layer, for ``tp`` ranks:
- ``linear_qkv`` (column-parallel): the rows of each query group together, ``[q_1 .. q_r, k, v]``
  (r = heads / groups query heads of ``head_dim`` rows each), groups in order; rank j holds groups
  ``j * groups / tp`` onwards. With as many groups as heads (multi-head attention) a head's q, k
  and v rows are adjacent, where torch's ``in_proj_weight`` has all q rows, then all k, then all v.
- ``linear_proj`` (row-parallel): the input columns of rank j's heads; its bias whole on every rank
  (added once, after the all-reduce).
- ``linear_fc1`` (column-parallel): rank j's rows; ``linear_fc2`` (row-parallel): its columns.
- norms: whole on every rank.

Round trips are bit-exact: only slicing and concatenation.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor


def qkv_to_megatron(
    q: Tensor, k: Tensor, v: Tensor, *, heads: int, groups: int, tp: int
) -> list[Tensor]:
    """Per rank, Megatron's fused QKV rows from q [heads * hd, ...], k and v [groups * hd, ...]
    (weights or biases: the rows are what moves)."""
    if heads % groups or groups % tp:
        raise ValueError(f"{heads} heads in {groups} query groups do not split over TP={tp}")
    hd = q.shape[0] // heads
    per_group = heads // groups
    rest = q.shape[1:]
    q = q.reshape(groups, per_group * hd, *rest)
    k = k.reshape(groups, hd, *rest)
    v = v.reshape(groups, hd, *rest)
    fused = torch.cat([q, k, v], dim=1)  # [groups, (per_group + 2) * hd, ...]
    return [part.reshape(-1, *rest) for part in fused.chunk(tp)]


def qkv_from_megatron(
    shards: list[Tensor], *, heads: int, groups: int
) -> tuple[Tensor, Tensor, Tensor]:
    """(q, k, v) rows from the ranks' fused QKV rows: the inverse of ``qkv_to_megatron``."""
    fused = torch.cat(shards)
    per_group = heads // groups
    hd = fused.shape[0] // (groups * (per_group + 2))
    rest = fused.shape[1:]
    fused = fused.reshape(groups, (per_group + 2) * hd, *rest)
    q, k, v = fused.split([per_group * hd, hd, hd], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


# torch nn.TransformerEncoderLayer (pre-norm) name -> megatron TransformerLayer name, and how the
# tensor splits over ranks: 0 rows, 1 columns, None whole on every rank
ENCODER_LAYER = {
    "norm1.weight": ("input_layernorm.weight", None),
    "norm1.bias": ("input_layernorm.bias", None),
    "self_attn.out_proj.weight": ("self_attention.linear_proj.weight", 1),
    "self_attn.out_proj.bias": ("self_attention.linear_proj.bias", None),
    "norm2.weight": ("pre_mlp_layernorm.weight", None),
    "norm2.bias": ("pre_mlp_layernorm.bias", None),
    "linear1.weight": ("mlp.linear_fc1.weight", 0),
    "linear1.bias": ("mlp.linear_fc1.bias", 0),
    "linear2.weight": ("mlp.linear_fc2.weight", 1),
    "linear2.bias": ("mlp.linear_fc2.bias", None),
}
IN_PROJ = {"self_attn.in_proj_weight": "weight", "self_attn.in_proj_bias": "bias"}


def encoder_to_megatron(
    state: dict[str, Tensor], *, layers: int, heads: int, tp: int
) -> list[dict[str, Tensor]]:
    """An ``nn.TransformerEncoder`` state dict (keys ``layers.{i}.…``) as one megatron
    ``TransformerBlock`` state dict per TP rank."""
    shards: list[dict[str, Tensor]] = [{} for _ in range(tp)]
    for i in range(layers):
        src = f"layers.{i}."
        for name, (target, dim) in ENCODER_LAYER.items():
            tensor = state[src + name]
            parts = [tensor] * tp if dim is None else tensor.chunk(tp, dim=dim)
            for shard, part in zip(shards, parts):
                shard[src + target] = part.clone()
        for name, kind in IN_PROJ.items():
            q, k, v = state[src + name].chunk(3)
            parts = qkv_to_megatron(q, k, v, heads=heads, groups=heads, tp=tp)
            for shard, part in zip(shards, parts):
                shard[f"{src}self_attention.linear_qkv.{kind}"] = part
    return shards


def encoder_from_megatron(
    shards: list[dict[str, Tensor]], *, layers: int, heads: int
) -> dict[str, Tensor]:
    """The ``nn.TransformerEncoder`` state dict from every TP rank's block state dict."""
    state: dict[str, Tensor] = {}
    for i in range(layers):
        src = f"layers.{i}."
        for name, (target, dim) in ENCODER_LAYER.items():
            parts = [shard[src + target] for shard in shards]
            state[src + name] = parts[0].clone() if dim is None else torch.cat(parts, dim=dim)
        for name, kind in IN_PROJ.items():
            parts = [shard[f"{src}self_attention.linear_qkv.{kind}"] for shard in shards]
            state[src + name] = torch.cat(qkv_from_megatron(parts, heads=heads, groups=heads))
    return state


# --- the Qwen2 family's language model (Hugging Face Qwen2ForCausalLM / Qwen2Model) -------------
def qwen2_to_megatron(
    state: dict[str, Tensor], *, layers: int, heads: int, groups: int, tp: int, tied: bool
) -> list[dict[str, Tensor]]:
    """A Hugging Face Qwen2 state dict (``model.…``, ``lm_head.weight``) as one megatron
    ``GPTModel`` state dict per TP rank. The vocabulary (embedding and output rows) splits over
    the ranks; the MLP's gate and up rows split alike and sit on each rank as [gate; up]."""
    shards: list[dict[str, Tensor]] = [{} for _ in range(tp)]

    def put(name: str, parts) -> None:
        for shard, part in zip(shards, parts):
            shard[name] = part.clone()

    put("embedding.word_embeddings.weight", state["model.embed_tokens.weight"].chunk(tp))
    for i in range(layers):
        hf = f"model.layers.{i}."
        mg = f"decoder.layers.{i}."
        put(mg + "input_layernorm.weight", [state[hf + "input_layernorm.weight"]] * tp)
        for kind in ("weight", "bias"):
            q, k, v = (state[f"{hf}self_attn.{p}_proj.{kind}"] for p in "qkv")
            parts = qkv_to_megatron(q, k, v, heads=heads, groups=groups, tp=tp)
            put(f"{mg}self_attention.linear_qkv.{kind}", parts)
        put(
            mg + "self_attention.linear_proj.weight",
            state[hf + "self_attn.o_proj.weight"].chunk(tp, 1),
        )
        put(mg + "pre_mlp_layernorm.weight", [state[hf + "post_attention_layernorm.weight"]] * tp)
        gate = state[hf + "mlp.gate_proj.weight"].chunk(tp)
        up = state[hf + "mlp.up_proj.weight"].chunk(tp)
        put(mg + "mlp.linear_fc1.weight", [torch.cat(pair) for pair in zip(gate, up)])
        put(mg + "mlp.linear_fc2.weight", state[hf + "mlp.down_proj.weight"].chunk(tp, 1))
    put("decoder.final_layernorm.weight", [state["model.norm.weight"]] * tp)
    if not tied:
        put("output_layer.weight", state["lm_head.weight"].chunk(tp))
    return shards


def qwen2_from_megatron(
    shards: list[dict[str, Tensor]], *, layers: int, heads: int, groups: int, tied: bool
) -> dict[str, Tensor]:
    """The Hugging Face Qwen2 state dict from every TP rank's ``GPTModel`` state dict."""

    def cat(name: str, dim: int = 0) -> Tensor:
        return torch.cat([shard[name] for shard in shards], dim=dim)

    def whole(name: str) -> Tensor:
        return shards[0][name].clone()

    state = {"model.embed_tokens.weight": cat("embedding.word_embeddings.weight")}
    for i in range(layers):
        hf = f"model.layers.{i}."
        mg = f"decoder.layers.{i}."
        state[hf + "input_layernorm.weight"] = whole(mg + "input_layernorm.weight")
        for kind in ("weight", "bias"):
            parts = [shard[f"{mg}self_attention.linear_qkv.{kind}"] for shard in shards]
            q, k, v = qkv_from_megatron(parts, heads=heads, groups=groups)
            for p, tensor in zip("qkv", (q, k, v)):
                state[f"{hf}self_attn.{p}_proj.{kind}"] = tensor
        state[hf + "self_attn.o_proj.weight"] = cat(mg + "self_attention.linear_proj.weight", 1)
        state[hf + "post_attention_layernorm.weight"] = whole(mg + "pre_mlp_layernorm.weight")
        halves = [shard[mg + "mlp.linear_fc1.weight"].chunk(2) for shard in shards]
        state[hf + "mlp.gate_proj.weight"] = torch.cat([gate for gate, _ in halves])
        state[hf + "mlp.up_proj.weight"] = torch.cat([up for _, up in halves])
        state[hf + "mlp.down_proj.weight"] = cat(mg + "mlp.linear_fc2.weight", 1)
    state["model.norm.weight"] = whole("decoder.final_layernorm.weight")
    if tied:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    else:
        state["lm_head.weight"] = cat("output_layer.weight")
    return state


def qwen2_text_to_megatron(
    state: dict[str, Tensor], *, layers: int, heads: int, groups: int, tp: int
) -> list[dict[str, Tensor]]:
    """A Qwen2-VL family's language model state dict (Hugging Face ``…TextModel``:
    ``embed_tokens.weight``, ``layers.{i}.…``, ``norm.weight``) as one megatron ``GPTModel``
    state dict per TP rank, without output weights."""
    state = {f"model.{name}": tensor for name, tensor in state.items()}
    return qwen2_to_megatron(state, layers=layers, heads=heads, groups=groups, tp=tp, tied=True)


def qwen2_text_from_megatron(
    shards: list[dict[str, Tensor]], *, layers: int, heads: int, groups: int
) -> dict[str, Tensor]:
    """The language model's state dict from every TP rank's: ``qwen2_text_to_megatron``'s
    inverse."""
    state = qwen2_from_megatron(shards, layers=layers, heads=heads, groups=groups, tied=True)
    prefix = "model."
    return {name[len(prefix) :]: t for name, t in state.items() if name.startswith(prefix)}


# --- the VLA's discrete action head (models/vla/heads.py ``DiscreteTokenHead``) -----------------
def discrete_head_to_megatron(
    state: dict[str, Tensor], *, actions: int, bins: int, tp: int
) -> list[dict[str, Tensor]]:
    """The head's state dict (``logits.weight`` [actions * bins, d], ``logits.bias``, rows by
    action dimension, then bin) as one ``ColumnParallelLinear`` state dict per TP rank: rank j
    holds bins ``j * bins / tp`` onwards of every dimension, its share of each vocabulary."""
    if bins % tp:
        raise ValueError(f"{bins} bins do not split over TP={tp}")
    shards: list[dict[str, Tensor]] = [{} for _ in range(tp)]
    for name, tensor in state.items():
        rest = tensor.shape[1:]
        per_dimension = tensor.reshape(actions, bins, *rest)
        for shard, part in zip(shards, per_dimension.chunk(tp, dim=1)):
            shard[name] = part.reshape(-1, *rest).clone()
    return shards


def discrete_head_from_megatron(
    shards: list[dict[str, Tensor]], *, actions: int, bins: int
) -> dict[str, Tensor]:
    """The head's state dict from every TP rank's: ``discrete_head_to_megatron``'s inverse."""
    state = {}
    for name in shards[0]:
        rest = shards[0][name].shape[1:]
        parts = [shard[name].reshape(actions, -1, *rest) for shard in shards]
        state[name] = torch.cat(parts, dim=1).reshape(actions * bins, *rest)
    return state


# layout name (meta.json's "shards") -> (torch state -> per-rank shards, shards -> torch state)
LAYOUTS = {
    "transformer_encoder": (encoder_to_megatron, encoder_from_megatron),
    "qwen2_text": (qwen2_text_to_megatron, qwen2_text_from_megatron),
    "discrete_head": (discrete_head_to_megatron, discrete_head_from_megatron),
}


def to_megatron(layout: str, state: dict[str, Tensor], *, tp: int, **shape) -> list[dict]:
    """A module's torch-layout state dict as one megatron state dict per TP rank."""
    return LAYOUTS[layout][0](state, tp=tp, **shape)


def from_megatron(layout: str, shards: list[dict], **shape) -> dict[str, Tensor]:
    """The module's torch-layout state dict from every TP rank's: ``to_megatron``'s inverse."""
    return LAYOUTS[layout][1](shards, **shape)
