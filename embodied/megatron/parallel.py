"""Megatron-core's process groups over this process's ``torch.distributed`` group."""

from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

from embodied.megatron.cpu import use_cpu_corners


def initialize(tensor_parallel: int, seed: int) -> None:
    """Tensor-parallel groups of ``tensor_parallel`` consecutive ranks of the default group
    (initialised: gloo on CPU, NCCL on GPUs); the rest of the world is data-parallel."""
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel)
    if torch.cuda.is_available():
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
