"""Megatron-core's process groups over this process's ``torch.distributed`` group."""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.transformer import TransformerConfig

from embodied.megatron.cpu import on_cpu, use_cpu_corners, use_cuda_path
from embodied.megatron.layout import from_megatron

COLLECTIVE_TIMEOUT_MINUTES = 10  # as the default group's (the lockstep and Ray process groups)


def initialize(tensor_parallel: int, seed: int, device: torch.device) -> None:
    """Tensor-parallel groups of ``tensor_parallel`` consecutive ranks of the default group
    (initialised: gloo on CPU, NCCL on GPUs); the rest of the world is data-parallel. ``device``:
    the learner's (on the CPU, megatron's CUDA corners answer there: cpu.py)."""
    # (megatron's groups would wait 30 minutes for a lost rank; the default group waits 10)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_parallel,
        distributed_timeout_minutes=COLLECTIVE_TIMEOUT_MINUTES,
    )
    if device.type == "cuda":
        use_cuda_path()
        model_parallel_cuda_manual_seed(seed)
    else:
        use_cpu_corners(seed)


def destroy() -> None:
    parallel_state.destroy_model_parallel()


def tp_group():
    return parallel_state.get_tensor_model_parallel_group()


def tp_rank() -> int:
    return parallel_state.get_tensor_model_parallel_rank()


def tp_size() -> int:
    return parallel_state.get_tensor_model_parallel_world_size()


def gather_shards(mine: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """Every TP rank's ``mine`` (the same names and shapes on every rank), by rank (every rank
    calls this)."""
    size = tp_size()
    shards: list[dict[str, torch.Tensor]] = [{} for _ in range(size)]
    for name, tensor in mine.items():
        gathered = [torch.empty_like(tensor) for _ in range(size)]
        dist.all_gather(gathered, tensor.contiguous(), group=tp_group())
        for shard, part in zip(shards, gathered):
            shard[name] = part
    return shards


def gather_torch_state(
    layout: str, module: torch.nn.Module, shape: dict, values: dict | None = None
) -> dict[str, torch.Tensor]:
    """A sharded module's whole torch-layout state dict (``layout``), gathered from every TP
    rank's ``module`` parameters (every rank calls this). ``values``: {megatron name: this
    rank's tensor} to gather instead of the weights (e.g. their gradients)."""
    mine = {k: p.detach() for k, p in module.named_parameters()}
    if values is not None:
        mine = {k: values[k] for k in mine}
    return from_megatron(layout, gather_shards(mine), **shape)


def load_shard(module: torch.nn.Module, shard: dict[str, torch.Tensor], what: str) -> None:
    """``module``'s every weight from this rank's ``shard`` (ValueError naming ``what``)."""
    loaded = module.load_state_dict(shard, strict=False)
    # (megatron's linears keep an ``_extra_state`` entry for Transformer Engine: none here)
    missing = [k for k in loaded.missing_keys if not k.endswith("._extra_state")]
    if missing or loaded.unexpected_keys:
        raise ValueError(f"{what}: {missing + loaded.unexpected_keys}")


def transformer_config(dtype: torch.dtype, recompute: bool = False, **fields) -> TransformerConfig:
    """A ``TransformerConfig`` of ``fields`` over this process's TP group, with no dropout (the
    policy's forward must be the same when it acts and when it is scored) and none of megatron's
    fused kernels, which are CUDA (or Apex) only. ``recompute``: each layer's activations are
    recomputed in the backward instead of kept (megatron's full, uniform recomputation)."""
    if recompute:
        fields.update(recompute_granularity="full", recompute_method="uniform")
        fields.update(recompute_num_layers=1)
    return TransformerConfig(
        **fields,
        tensor_model_parallel_size=tp_size(),
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=on_cpu(),
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
    )
