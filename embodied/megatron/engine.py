"""The learner on megatron-core (``TrainEngine``): the VLA's fusion transformer sharded over the
tensor-parallel ranks, the update through megatron-core's own data-parallel wrapper and
optimizer.

- The policy's torch fusion is replaced by ``MegatronFusion`` holding this rank's shard of the
  same weights; every other module stays whole on every rank (design note 49).
- ``DistributedDataParallel`` (megatron's) keeps the gradients in contiguous buffers and
  averages them over the data-parallel ranks; the optimizer is megatron's Adam with the
  distributed optimizer (its state sharded over the data-parallel ranks), gradient clipping by
  the norm over every rank's shard (a weight whole on every TP rank counted once), and loss
  scaling where the parameters are fp16.
- Every rank of a TP group scores the same minibatch; the data-parallel ranks each take their
  share of it (``rank``, ``world_size``), as with the torch engine.

``torch.distributed`` and ``parallel.initialize`` come first (the process launcher's job).
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

from embodied.learner import Evaluate, LearningRate, average_over
from embodied.megatron.cpu import cuda_corners
from embodied.megatron.fusion import MegatronFusion
from embodied.rollout import Samples, logprob_at


def shard_fusion(policy: torch.nn.Module, dtype: torch.dtype = torch.float32) -> MegatronFusion:
    """Replace ``policy.fusion`` (torch) by this TP rank's shard of the same weights."""
    cfg = policy.cfg
    device = next(policy.fusion.parameters()).device
    fusion = MegatronFusion(cfg.d_model, cfg.heads, cfg.layers, dtype).to(device)
    fusion.load_torch_state(policy.fusion.state_dict())
    policy.fusion = fusion
    return fusion


class MegatronEngine(LearningRate):
    def __init__(
        self,
        policy: torch.nn.Module,
        *,
        learning_rate: float,
        max_grad_norm: float,
        with_value: bool = True,
    ):
        self.policy = policy
        self.fusion = shard_fusion(policy)
        config = self.fusion.config
        with cuda_corners():
            self.model = DistributedDataParallel(
                config,
                DistributedDataParallelConfig(
                    grad_reduce_in_fp32=True,
                    overlap_grad_reduce=False,
                    use_distributed_optimizer=True,
                ),
                Evaluate(policy, with_value),
            )
            self.optimizer = get_megatron_optimizer(
                OptimizerConfig(
                    optimizer="adam",
                    lr=learning_rate,
                    adam_eps=1e-5,  # as the torch engine's Adam
                    weight_decay=0.0,
                    clip_grad=max_grad_norm,
                    bf16=config.bf16,
                    params_dtype=config.params_dtype,
                    use_distributed_optimizer=True,
                ),
                [self.model],
            )
        self.params = [p for p in policy.parameters() if p.requires_grad]
        self.rank = parallel_state.get_data_parallel_rank()
        self.world_size = parallel_state.get_data_parallel_world_size()
        self.model.zero_grad_buffer()

    def logprob(self, samples: Samples, level: str):
        token, entropy, value = self.model(samples.obs, samples.output)
        return logprob_at(token, level, samples.valid), entropy, value

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()  # (megatron's hooks add each gradient into its buffer)

    def step(self) -> torch.Tensor:
        """Average the gradients over the data-parallel ranks, clip by the global norm, apply
        Adam, clear the buffers; the norm before clipping."""
        with cuda_corners():
            self.model.finish_grad_sync()
            _, grad_norm, _ = self.optimizer.step()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        return torch.tensor(float("nan") if grad_norm is None else grad_norm)

    def average(self, values: torch.Tensor) -> torch.Tensor:
        group = parallel_state.get_data_parallel_group()
        return average_over(values, group, self.world_size)

    def torch_state(self) -> dict[str, torch.Tensor]:
        """The whole policy's state dict in the torch layout (the fusion gathered from every TP
        rank; every rank calls this): what a rollout copy or the torch backend loads."""
        fusion = self.fusion.torch_state()
        state = {}
        for name, tensor in self.policy.state_dict().items():
            if not name.startswith("fusion."):
                state[name] = tensor.detach().clone()
        state.update({f"fusion.{name}": tensor for name, tensor in fusion.items()})
        return state

    def torch_grads(self) -> dict[str, torch.Tensor]:
        """The trainable weights' gradients since the last step, in the torch layout (gathered
        as ``torch_state``); zeros for a weight the loss did not reach."""
        grads = {
            name: param.main_grad.detach().clone()
            for name, param in self.policy.named_parameters()
            if param.requires_grad
        }
        prefix = "fusion.block."
        fusion = {k[len(prefix) :]: v for k, v in grads.items() if k.startswith(prefix)}
        out = {k: v for k, v in grads.items() if not k.startswith("fusion.")}
        gathered = self.fusion.torch_state(fusion)
        out.update({f"fusion.{name}": tensor for name, tensor in gathered.items()})
        return out
