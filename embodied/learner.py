"""The learner role (``TrainEngine``): log-probabilities of stored samples under the current
weights, backward, optimizer step, state. ``TorchEngine`` is the one-process torch implementation;
the Megatron backend is a second implementation of the same interface."""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Protocol

import torch

from embodied.rollout import Samples, logprob_at, share_bounds

BACKENDS = ("torch", "megatron")


PRECISIONS = ("auto", "bf16", "fp32")


def check_grad_norm(max_grad_norm: float) -> None:
    """The gradient norm the engines clip to: 0 would zero every gradient."""
    if max_grad_norm <= 0:
        raise ValueError(f"max_grad_norm: must be > 0 (.inf: no clipping), got {max_grad_norm}")


@dataclass
class TrainerConfig:
    """Which implementation of the learner trains the policy."""

    # torch: one process (DDP across actor workers); megatron: the VLA's transformer on
    # megatron-core (embodied/megatron/), the same updates
    backend: str = "torch"
    tensor_parallel: int = 1  # megatron: the ranks the transformer is sharded over
    # megatron: recompute each transformer layer's activations in the backward instead of
    # keeping them (less memory, one more forward); the same numbers
    recompute: bool = False
    # megatron: the sharded modules' weights and compute in bf16 (float32 main weights and
    # gradients in the optimizer) or float32; auto: bf16 on GPUs, float32 on the CPU
    precision: str = "auto"

    def validate(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend: must be one of {list(BACKENDS)}, got {self.backend!r}")
        if self.tensor_parallel < 1:
            raise ValueError(f"tensor_parallel: must be >= 1, got {self.tensor_parallel}")
        if self.tensor_parallel > 1 and self.backend != "megatron":
            raise ValueError("tensor_parallel: > 1 needs backend=megatron")
        if self.recompute and self.backend != "megatron":
            raise ValueError("recompute: needs backend=megatron")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision: must be one of {PRECISIONS}, got {self.precision!r}")
        if self.precision == "bf16" and self.backend != "megatron":
            raise ValueError("precision: bf16 needs backend=megatron (torch trains in float32)")

    def dtype(self, device: torch.device) -> torch.dtype:
        """The megatron shards' dtype on ``device``."""
        if self.precision == "bf16" or (self.precision == "auto" and device.type == "cuda"):
            return torch.bfloat16
        return torch.float32


class TrainEngine(Protocol):
    rank: int  # this process's data-parallel rank (0 when alone)
    world_size: int  # how many ranks share each minibatch (1 when alone)
    tp_rank: int  # this process's tensor-parallel rank (0 when alone)

    def logprob(
        self, samples: Samples, level: str
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(log-probability at ``level``: f32 [N] chunk (valid actions only), [N, K] action or
        [N, K, A] token; entropy f32 [N]; value f32 [N] or None) under the current weights."""

    def backward(self, loss: torch.Tensor) -> None: ...

    def step(self) -> torch.Tensor:
        """Clip the gradient, apply it, clear it; returns the gradient norm (a 0-dim tensor)."""

    def average(self, values: torch.Tensor) -> torch.Tensor:
        """The mean of ``values`` over the data-parallel ranks (itself when alone)."""

    def gather_shares(self, part: torch.Tensor, total: int) -> torch.Tensor:
        """Every data-parallel rank's ``part``, its contiguous share of ``total`` rows (as
        ``Samples.shard`` splits them), joined in rank order on every rank (itself when
        alone)."""

    def set_lr(self, lr: float) -> None: ...

    # the policy whole, in the torch layout: what inference, checkpoints and syncs read
    torch_policy: torch.nn.Module
    checkpoint_optimizer: object  # its state_dict() is what a checkpoint saves
    # None, or (directory) -> meta.json's "shards": writes this rank's shard files of the
    # weights kept sharded (every rank calls it; embodied/megatron/shards.py)
    checkpoint_shards: object

    def refresh(self) -> None:
        """Bring ``torch_policy`` up to date after the weights or buffers changed."""

    def load_state_dict(self, state: dict) -> None: ...

    def whole_optimizer_state(self) -> dict:
        """A copy of the optimizer's state over every trainable weight, as torch's Adam state
        dict over ``torch_policy`` (every TP rank calls it: sharded state is gathered); what a
        rollout record keeps, and ``load_state_dict`` takes back."""

    def main_weights(self) -> dict[str, torch.Tensor]:
        """The optimizer's float32 copies of weights that act in another precision, in the torch
        layout (every TP rank calls it); {} where the weights are float32 (what a record keeps
        beside ``torch_policy``'s state, and ``load_state_dict`` takes back in its model)."""

    def close(self) -> None:
        """Release what the engine holds across processes (at the run's end)."""


def average_over(values: torch.Tensor, group, world_size: int) -> torch.Tensor:
    """The mean of ``values`` over the ``world_size`` ranks of ``group`` (itself when alone)."""
    if world_size == 1:
        return values
    import torch.distributed as dist

    values = values.clone()
    dist.all_reduce(values, op=dist.ReduceOp.SUM, group=group)
    return values / world_size


def gather_over(part: torch.Tensor, total: int, group, world_size: int) -> torch.Tensor:
    """The ``world_size`` ranks' contiguous shares of ``total`` rows, joined in rank order on
    every rank of ``group`` (``part`` itself when alone)."""
    if world_size == 1:
        return part
    import torch.distributed as dist

    # every rank knows every share's size: all-gather takes equal shapes, so pad to the largest
    bounds = [share_bounds(total, rank, world_size) for rank in range(world_size)]
    sizes = [end - first for first, end in bounds]
    padded = part.new_zeros((max(sizes), *part.shape[1:]))
    padded[: len(part)] = part
    gathered = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(gathered, padded, group=group)
    return torch.cat([rows[:size] for rows, size in zip(gathered, sizes)])


class Evaluate(torch.nn.Module):
    """The policy's ``evaluate`` as a module's forward: what ``DistributedDataParallel`` wraps
    (it averages the gradients of the parameters that forward reaches). The value is left out
    when the algorithm has no critic: a parameter that forward reaches and the loss does not
    would leave DDP waiting for its gradient."""

    def __init__(self, policy: torch.nn.Module, with_value: bool = True):
        super().__init__()
        self.policy = policy
        self.with_value = with_value

    def forward(self, obs, output):
        token, entropy, value = self.policy.evaluate(obs, output, level="token")
        return token, entropy, (value if self.with_value else None)


class LearningRate:
    """``set_lr`` and ``lr`` over an engine's ``optimizer`` (torch's, or megatron's)."""

    optimizer: torch.optim.Optimizer

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]


class TorchEngine(LearningRate):
    """Adam (AdamW with weight decay) over the policy's trainable parameters, gradient clipping
    by global norm; across processes after ``distribute`` (torch DDP: every rank holds the whole
    model and optimizer, gradients are averaged during backward)."""

    def __init__(
        self,
        policy: torch.nn.Module,
        *,
        learning_rate: float,
        max_grad_norm: float,
        weight_decay: float = 0.0,
        adam_eps: float = 1e-5,
    ):
        self.policy = policy
        self.params = [p for p in policy.parameters() if p.requires_grad]
        # (decoupled weight decay on every trainable weight: SFT's AdamW)
        adam = torch.optim.AdamW if weight_decay else torch.optim.Adam
        self.optimizer = adam(
            self.params, lr=learning_rate, eps=adam_eps, weight_decay=weight_decay
        )
        self.max_grad_norm = max_grad_norm
        self.forward: torch.nn.Module = Evaluate(policy)
        self.torch_policy = policy  # (the policy itself: already whole, in the torch layout)
        self.checkpoint_optimizer = self.optimizer
        self.checkpoint_shards = None
        self.rank = 0
        self.world_size = 1
        self.tp_rank = 0
        self.process_group = None

    def distribute(self, process_group, with_value: bool) -> None:
        """Average gradients over ``process_group`` (torch.distributed, initialised; every rank
        calls this). Rank 0's weights and buffers are copied to the others here."""
        import inspect

        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        self.process_group = process_group
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        # the normaliser's buffers: every rank folds in the same observations, so they are not
        # synced after the start (the argument was renamed in torch 2.13)
        renamed = "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
        no_buffer_sync = {"forward_sync_buffers" if renamed else "broadcast_buffers": False}
        self.forward = DistributedDataParallel(
            Evaluate(self.policy, with_value),
            process_group=process_group,
            # the parameters that get gradients are the same every step; DDP learns which in
            # the first backward (a critic GRPO does not use, a text encoder's unused pooler)
            static_graph=True,
            **no_buffer_sync,
        )

    def logprob(self, samples: Samples, level: str):
        # ask the policy for per-dimension log-probabilities: the chunk level sums the valid
        # actions only (an action run after its episode ended belongs to no episode)
        token, entropy, value = self.forward(samples.obs, samples.output)
        return logprob_at(token, level, samples.valid), entropy, value

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> torch.Tensor:
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def average(self, values: torch.Tensor) -> torch.Tensor:
        return average_over(values, self.process_group, self.world_size)

    def gather_shares(self, part: torch.Tensor, total: int) -> torch.Tensor:
        return gather_over(part, total, self.process_group, self.world_size)

    def offload_optimizer(self) -> int:
        """The optimizer's state (Adam's two moments: twice the trainable parameters) to host
        memory, freeing the device for the rollout (``cluster.offload_optimizer``); returns the
        bytes moved off a device."""
        moved = self._move_optimizer_state(lambda param: torch.device("cpu"))
        if moved and torch.cuda.is_available():
            torch.cuda.empty_cache()  # to the other processes on the device (collocated roles)
        return moved

    def restore_optimizer(self) -> int:
        """The optimizer's state back beside its parameters, before an update; returns the bytes
        moved onto a device."""
        return self._move_optimizer_state(lambda param: param.device)

    def _move_optimizer_state(self, where) -> int:
        moved = 0
        for param in self.params:
            state = self.optimizer.state.get(param, {})
            for key, value in state.items():
                # per-parameter tensors only: Adam's step count stays a host scalar
                if not torch.is_tensor(value) or value.dim() == 0:
                    continue
                target = where(param)
                if value.device != target:
                    moved += value.numel() * value.element_size()
                    state[key] = value.to(target)
        return moved

    def refresh(self) -> None:
        pass  # (inference and checkpoints read the policy itself)

    def close(self) -> None:
        pass  # (a data-parallel group belongs to the actor worker that joined it)

    def whole_optimizer_state(self) -> dict:
        buffer = io.BytesIO()
        torch.save(self.optimizer.state_dict(), buffer)  # (a deep host copy)
        buffer.seek(0)
        return torch.load(buffer, map_location="cpu", weights_only=True)

    def main_weights(self) -> dict[str, torch.Tensor]:
        return {}  # (float32 weights: they are their own)

    def load_state_dict(self, state: dict) -> None:
        self.policy.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
