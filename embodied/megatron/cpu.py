"""Megatron-core on the CPU (tests, laptops): the two corners of megatron-core that assume CUDA.

- ``GlobalMemoryBuffer.get_tensor`` allocates its scratch buffers (the attention scores of
  ``DotProductAttention``, the all-gather buffer of sequence parallelism) on
  ``torch.cuda.current_device()``; here they are plain CPU tensors.
- The RNG tracker (``tensor_parallel.get_cuda_rng_tracker``) keeps named CUDA generator states,
  forked around dropout in tensor-parallel regions so that each rank drops out its own shard
  differently and the replicated parts alike. ``CPURNGStatesTracker`` keeps the same named
  states of the CPU generator.

- Megatron's ``DistributedDataParallel`` and optimizer make their buffers and scalars with
  ``device=torch.cuda.current_device()`` or ``device="cuda"``, move state with ``.cuda()`` and
  assert ``grad.type() == "torch.cuda.FloatTensor"``. ``CudaOnCPU`` is a torch function mode
  that answers those on the CPU while megatron's own code runs (``cuda_corners()``: building
  the wrapper and the optimizer, the gradient sync, the step); the forward and backward run
  outside it, at full speed.

- ``RotaryEmbedding.get_emb`` moves its frequencies to ``torch.cuda.current_device()`` on its
  first call: ``rotary_on_cpu(model)`` runs it in ``cuda_corners()`` (once per sequence length:
  megatron caches the result).

- Activation recomputation (``tensor_parallel.checkpoint``) saves the CPU, the CUDA and the
  tracker's RNG states before a layer's forward and restores them before it runs again in the
  backward. The CUDA state is read and set by two module functions that call CUDA; without a
  GPU there is none to keep, and they read an empty state and set nothing.

``use_cpu_corners()`` installs the first two and the last; the process group set-up calls it
when the learner is on the CPU (``parallel.initialize``), so tests and CPU runs take the same
path, on a machine with a GPU too (SFT, TP ranks in one run). A learner on a GPU uses none of
this.
"""

from __future__ import annotations

import contextlib

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel import random as megatron_random
from megatron.core.utils import GlobalMemoryBuffer
from torch.overrides import TorchFunctionMode

# whether this process's megatron ranks run on the CPU (``use_cpu_corners`` says so; until then,
# whether the machine has no GPU): the corners below follow the learner, not the machine
_on_cpu = not torch.cuda.is_available()


def on_cpu() -> bool:
    return _on_cpu


class CPUMemoryBuffer(GlobalMemoryBuffer):
    """Megatron's named scratch buffers, on the CPU (one allocation per name, grown as needed)."""

    def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
        numel = 1
        for size in tensor_shape:
            numel *= size
        buffer = self.buffer.get((name, dtype))
        if buffer is None or buffer.numel() < numel:
            buffer = torch.empty(numel, dtype=dtype)
            self.buffer[(name, dtype)] = buffer
        return buffer[:numel].view(*tensor_shape)


class CPURNGStatesTracker(megatron_random.CudaRNGStatesTracker):
    """Megatron's named RNG states over the CPU generator: ``fork(name)`` runs its block from
    that name's state and keeps where it ended, leaving the default stream as it was."""

    def add(self, name, seed):
        if seed in self.seeds_:
            raise ValueError(f"seed {seed} already exists")
        if name in self.states_:
            raise ValueError(f"rng state {name} already exists")
        self._is_initialized = True
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name=megatron_random._MODEL_PARALLEL_RNG_TRACKER_NAME):
        if name not in self.states_:
            raise ValueError(f"rng state {name} is not added")
        outside = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outside)


def use_cpu_corners(seed: int) -> None:
    """Install the CPU buffer and the CPU RNG tracker (after ``initialize_model_parallel``),
    the model-parallel RNG state seeded as megatron seeds it: ``seed + 2718 + tp_rank``."""
    global _on_cpu
    _on_cpu = True
    parallel_state._GLOBAL_MEMORY_BUFFER = CPUMemoryBuffer()
    tracker = CPURNGStatesTracker()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tracker.add(megatron_random._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    megatron_random._CUDA_RNG_STATE_TRACKER = tracker
    megatron_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    # (activation recomputation keeps the CUDA generator's state: there is none)
    megatron_random._get_cuda_rng_state = _no_cuda_rng_state
    megatron_random._set_cuda_rng_state = _set_no_cuda_rng_state


# megatron's own CUDA RNG state functions, put back for a learner on a GPU
_CUDA_RNG_STATE_FUNCTIONS = (
    megatron_random._get_cuda_rng_state,
    megatron_random._set_cuda_rng_state,
)


def use_cuda_path() -> None:
    """Take out what ``use_cpu_corners`` installed (a CPU learner earlier in this process, SFT
    say): a learner on a GPU would have its weights moved into CPU buffers by ``CudaOnCPU``.
    The RNG tracker is made anew by ``model_parallel_cuda_manual_seed`` after this."""
    global _on_cpu
    _on_cpu = False
    get_state, set_state = _CUDA_RNG_STATE_FUNCTIONS
    megatron_random._get_cuda_rng_state = get_state
    megatron_random._set_cuda_rng_state = set_state
    megatron_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = False


def _no_cuda_rng_state(*args, **kwargs) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8)


def _set_no_cuda_rng_state(*args, **kwargs) -> None:
    return None


def _is_cuda(device) -> bool:
    if isinstance(device, int):  # an index: what torch.cuda.current_device() answers
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


class CudaOnCPU(TorchFunctionMode):
    """Tensors megatron-core asks for on a CUDA device are made on the CPU; ``.cuda()`` leaves
    a tensor where it is; ``tensor.type()`` names a CPU float tensor as its CUDA twin (the
    gradient-clipping assertion)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _is_cuda(kwargs.get("device")):
            kwargs = {**kwargs, "device": "cpu"}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if ".cuda." in name else name.replace("torch.", "torch.cuda.", 1)
        return func(*args, **kwargs)


@contextlib.contextmanager
def cuda_corners():
    """Around megatron-core's DDP and optimizer calls: nothing on a GPU, ``CudaOnCPU`` (and a
    ``torch.cuda.current_device`` that answers device 0 instead of raising) on a CPU."""
    if not _on_cpu:
        yield
        return
    current_device = torch.cuda.current_device
    torch.cuda.current_device = lambda: 0
    try:
        with CudaOnCPU():
            yield
    finally:
        torch.cuda.current_device = current_device


def rotary_on_cpu(model: torch.nn.Module) -> None:
    """Run every rotary embedding's ``get_emb`` of ``model`` in ``cuda_corners()`` (a learner
    on the CPU)."""
    if not _on_cpu:
        return
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.get_emb = _in_corners(module.get_emb)


def _in_corners(function):
    def run(*args, **kwargs):
        with cuda_corners():
            return function(*args, **kwargs)

    return run
