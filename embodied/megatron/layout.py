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
