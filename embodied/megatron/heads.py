"""The VLA's discrete action head on megatron-core: each action dimension's bins split over the
tensor-parallel ranks (its vocabulary, as megatron splits a language model's), the log-softmax
taken across the ranks without gathering the logits.

The torch head (models/vla/heads.py ``DiscreteTokenHead``) is one linear from the context token
to ``actions * bins`` logits. Here it is a ``ColumnParallelLinear`` whose rank j holds bins
``j * bins / tp`` onwards of every dimension (embodied/megatron/layout.py). The log-probability
of a bin is megatron's vocabulary-parallel cross-entropy; the entropy is the same all-reduces
(megatron-core has none), with its gradient written out.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import ModelParallelConfig, parallel_state
from megatron.core.tensor_parallel import ColumnParallelLinear, vocab_parallel_cross_entropy
from torch import nn

from embodied.megatron import parallel
from embodied.megatron.layout import discrete_head_to_megatron
from embodied.models.vla.heads import action_bins, masked_mean


class VocabParallelEntropy(torch.autograd.Function):
    """The entropy f32 [...] of the softmax over logits split over the TP ranks (this rank's
    f32 [..., V / tp]); every rank gets the whole of it, and the gradient of its own logits."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor) -> torch.Tensor:
        group = parallel.tp_group()
        logits = logits.float()
        top = logits.max(-1).values
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - top.unsqueeze(-1)
        exp = shifted.exp()
        total = exp.sum(-1)
        dist.all_reduce(total, group=group)
        logp = shifted - total.log().unsqueeze(-1)  # f32 [..., V / tp]
        entropy = -(logp.exp() * logp).sum(-1)
        dist.all_reduce(entropy, group=group)
        ctx.save_for_backward(logp, entropy)  # (p is exp(log p): one copy of the logits kept)
        return entropy

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        # dH/dz_v = -p_v (log p_v + H); the gradient of H is the same on every rank
        logp, entropy = ctx.saved_tensors
        return -grad.unsqueeze(-1) * logp.exp() * (logp + entropy.unsqueeze(-1))


class MegatronDiscreteHead(nn.Module):
    """This TP rank's share of the discrete head's bins; ``sample``, ``log_prob`` and
    ``bc_loss`` as ``DiscreteTokenHead``'s (models/vla/heads.py)."""

    layout = "discrete_head"
    shard_prefix = ""  # the names of the shard's parameters (``logits.weight``, ``logits.bias``)

    def __init__(self, d_model: int, actions: int, bins: int, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.A = actions
        self.bins = bins
        config = ModelParallelConfig(
            tensor_model_parallel_size=parallel.tp_size(),
            params_dtype=dtype,
            bf16=dtype == torch.bfloat16,
            use_cpu_initialization=parallel.on_cpu(),
            gradient_accumulation_fusion=False,
            # (initialised, then overwritten by ``load_torch_state``: megatron marks a parallel
            # linear's weight as sharded only where it initialises it, and the gradient norm
            # needs that mark)
            perform_initialization=True,
        )
        self.logits = ColumnParallelLinear(
            d_model, actions * bins, config=config, init_method=nn.init.zeros_, bias=True
        )
        self.register_buffer(
            "centers", torch.linspace(-1 + 1 / bins, 1 - 1 / bins, bins), persistent=False
        )

    def shape(self) -> dict:
        return {"actions": self.A, "bins": self.bins}

    def _logits(self, ctx: torch.Tensor) -> torch.Tensor:
        """ctx f32 [B, K, d] -> this rank's logits f32 [B, K, A, bins / tp] (computed in the
        weights' dtype)."""
        logits, _ = self.logits(ctx.to(self.logits.weight.dtype))  # (bf16 runs)
        return logits.float().view(*ctx.shape[:2], self.A, -1)

    def _argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """The first bin of the largest logit over the ranks long [B, K, A], as torch's argmax."""
        local = logits.shape[-1]
        index = logits.argmax(-1)
        value = logits.gather(-1, index.unsqueeze(-1)).squeeze(-1)
        top = value.clone()
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=parallel.tp_group())
        index = torch.where(value == top, index + parallel.tp_rank() * local, self.bins)
        dist.all_reduce(index, op=dist.ReduceOp.MIN, group=parallel.tp_group())
        return index

    @torch.no_grad()
    def sample(self, ctx, deterministic=False):
        """As the torch head's, over the logits gathered from every rank, without gradient
        (rollouts run on the torch copy: this is for completeness, not the update's path)."""
        # (rank j's bins follow rank j - 1's in each dimension: the gather is the bin order)
        shards = parallel.gather_shards({"logits": self._logits(ctx)})
        logits = torch.cat([shard["logits"] for shard in shards], dim=-1)  # f32 [B, K, A, bins]
        logp_all = torch.log_softmax(logits, dim=-1)
        if deterministic:
            tokens = logits.argmax(-1)  # (the raw logits, as the torch head)
        else:
            flat = logp_all.exp().view(-1, self.bins)
            tokens = torch.multinomial(flat, 1).view(logp_all.shape[:-1])
            # (every rank acts on TP rank 0's draw, whatever their generators hold)
            source = parallel_state.get_tensor_model_parallel_src_rank()
            dist.broadcast(tokens, src=source, group=parallel.tp_group())
        logp = logp_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)  # f32 [B, K, A]
        return self.centers[tokens], logp, {"tokens": tokens}

    def log_prob(self, ctx, extras):
        logits = self._logits(ctx)
        # (megatron's cross-entropy works in place on its input)
        logp = -vocab_parallel_cross_entropy(logits.clone(), extras["tokens"])  # f32 [B, K, A]
        entropy = VocabParallelEntropy.apply(logits).sum((1, 2))  # f32 [B]
        return logp, entropy

    def bc_loss(self, ctx, target, mask):
        logits = self._logits(ctx)
        tokens = action_bins(target, self.bins)  # long [B, K, A]
        nll = vocab_parallel_cross_entropy(logits.clone(), tokens)
        loss = masked_mean(nll, mask)
        hits = self._argmax(logits.detach()) == tokens
        accuracy = masked_mean(hits.float(), mask)
        return loss, {"sft/ce": loss.detach(), "sft/token_accuracy": accuracy.detach()}

    def load_torch_state(self, state: dict[str, torch.Tensor]) -> None:
        """This rank's share of a torch head's state dict (``logits.weight``, ``logits.bias``)."""
        shards = discrete_head_to_megatron(state, tp=parallel.tp_size(), **self.shape())
        parallel.load_shard(self, shards[parallel.tp_rank()], "the discrete head does not fit")

    def torch_state(self, values=None) -> dict[str, torch.Tensor]:
        """The whole head in the torch layout, gathered from every TP rank (every rank calls
        this). ``values``: {name: this rank's tensor} to gather instead of the weights."""
        return parallel.gather_torch_state(self.layout, self, self.shape(), values)
