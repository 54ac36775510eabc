"""The learner on megatron-core (``TrainEngine``): the VLA's transformers sharded over the
tensor-parallel ranks, the update through megatron-core's own data-parallel wrapper and
optimizer.

- The policy's sharded modules (embodied/megatron/shards.py ``modules``) are replaced by this
  rank's shards of the same weights: the torch fusion by ``MegatronFusion``, a Qwen2-VL family
  VLM's language model by ``MegatronTextModel``, the discrete action head by
  ``MegatronDiscreteHead``; every other module stays whole on every rank (design note 49).
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

import copy
from pathlib import Path

import torch
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

from embodied.learner import Evaluate, LearningRate, average_over, gather_over
from embodied.megatron import parallel
from embodied.megatron.adam_state import MOMENTS, AdamStates, TorchLayoutOptimizer
from embodied.megatron.cpu import cuda_corners
from embodied.megatron.fusion import MegatronFusion
from embodied.megatron.heads import MegatronDiscreteHead
from embodied.megatron.layout import to_megatron
from embodied.megatron.shards import modules, shard_info, trainable_modules
from embodied.megatron.vlm import MegatronTextModel
from embodied.rollout import Samples, logprob_at
from embodied.schema import UserError


def shard_policy(
    policy: torch.nn.Module, dtype: torch.dtype = torch.float32, *, recompute: bool = False
) -> dict:
    """Replace the policy's sharded modules (torch) by this TP rank's shards of the same weights,
    trainable as they were: {module path: shard}. A shard's ``shard_prefix`` names the module
    holding its megatron parameters; ``torch_state`` / ``load_torch_state`` give / take the
    torch layout."""
    sharded = modules(policy)
    if "fusion" not in [info["module"] for info in sharded]:
        raise ValueError("the megatron backend trains the VLA policy (its fusion transformer)")
    for info in sharded:
        trainable = [p.requires_grad for p in policy.get_submodule(info["module"]).parameters()]
        if any(trainable) != all(trainable):
            raise ValueError(f"{info['module']}: a module partly frozen cannot be sharded")
    parts = {}
    for info in sharded:
        name = info["module"]
        original = policy.get_submodule(name)
        trained = _trained(original)
        device = next(original.parameters()).device
        if info["layout"] == "transformer_encoder":
            shape = (policy.cfg.d_model, info["heads"], info["layers"])
            shard = MegatronFusion(*shape, dtype, recompute=recompute)
        elif info["layout"] == "qwen2_text":
            shard = MegatronTextModel(original.config, dtype, recompute=recompute)
        else:
            shape = (policy.cfg.d_model, info["actions"], info["bins"])
            shard = MegatronDiscreteHead(*shape, dtype)
        shard = shard.to(device)
        shard.load_torch_state(original.state_dict())
        shard.requires_grad_(trained)
        parent, _, attribute = name.rpartition(".")
        setattr(policy.get_submodule(parent), attribute, shard)
        parts[name] = shard
    return parts


def check_current_device(device: torch.device) -> None:
    """Megatron allocates its buffers (gradients, the distributed optimizer's, attention
    scratch) on the current CUDA device: a learner on another one is a one-line error (setting
    it moved the simulator's index-less "cuda" tensors with it)."""
    if device.type != "cuda" or device.index in (None, torch.cuda.current_device()):
        return
    current = torch.cuda.current_device()
    raise UserError(
        f"runner.device={device}: the megatron backend trains on the current CUDA device "
        f"(cuda:{current}); use runner.device=cuda, or CUDA_VISIBLE_DEVICES={device.index} to "
        "make that GPU the current one"
    )


def join_ranks(policy: torch.nn.Module, cfg) -> None:
    """This process in megatron's groups: a group of one if it is in none yet (the embedded
    run at TP=1); with TP ranks, every rank takes rank 0's initial weights (before anything is
    built from them: GRPO's reference policy)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as state

    device = next(policy.parameters()).device
    check_current_device(device)
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    if not state.model_parallel_is_initialized():
        parallel.initialize(cfg.trainer.tensor_parallel, seed=cfg.seed, device=device)
    if dist.get_world_size() > 1:
        weights = [policy.state_dict() if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(weights, src=0)
        policy.load_state_dict(weights[0])


def _wrapped(evaluate: Evaluate, config, adam: OptimizerConfig):
    """(megatron's DDP around the policy's evaluation, its distributed optimizer over it)."""
    with cuda_corners():
        model = DistributedDataParallel(
            config,
            DistributedDataParallelConfig(
                grad_reduce_in_fp32=True,
                overlap_grad_reduce=False,
                use_distributed_optimizer=True,
            ),
            evaluate,
        )
        # decay on every weight, as the torch engine (megatron skips biases and norms by
        # default)
        optimizer = get_megatron_optimizer(adam, [model], config_overrides={})
    return model, optimizer


class MegatronEngine(AdamStates, LearningRate):
    def __init__(
        self,
        policy: torch.nn.Module,
        *,
        learning_rate: float,
        max_grad_norm: float,
        with_value: bool = True,
        weight_decay: float = 0.0,
        adam_eps: float = 1e-5,
        recompute: bool = False,
        dtype: torch.dtype = torch.float32,
    ):
        self.policy = policy
        # the policy in the torch layout, whole: what inference, checkpoints and weight syncs
        # read (``refresh`` after every change)
        self.torch_policy = copy.deepcopy(policy)
        with torch.random.fork_rng(devices=[]):  # (megatron draws initial weights: not ours)
            self.parts = shard_policy(policy, dtype, recompute=recompute)
        # the megatron parameters' names in the policy, per sharded module
        self.shard_prefixes = {
            name: f"{name}.{part.shard_prefix}" for name, part in self.parts.items()
        }
        # the sharded modules' state-dict prefixes in the torch layout
        self.part_prefixes = tuple(f"{name}." for name in self.parts)
        # the torch copy's trainable parameters in optimizer order (Adam's state is by position)
        self.trainable = [n for n, p in self.torch_policy.named_parameters() if p.requires_grad]
        config = self.parts["fusion"].config
        adam = OptimizerConfig(
            optimizer="adam",
            lr=learning_rate,
            adam_eps=adam_eps,
            weight_decay=weight_decay,  # (decoupled, as torch's AdamW)
            clip_grad=max_grad_norm,
            bf16=config.bf16,
            params_dtype=config.params_dtype,
            use_distributed_optimizer=True,
        )
        self.model, self.optimizer = _wrapped(Evaluate(policy, with_value), config, adam)
        self._set_main_params(self.torch_policy.state_dict())
        self.dtype = dtype
        self._round_torch_copy()
        self.adam = {"eps": adam_eps, "weight_decay": weight_decay}
        self.params = [p for p in policy.parameters() if p.requires_grad]
        # torch's AdamW skips a weight without a gradient, decay included; megatron's gradient
        # buffers cannot tell (a zero): the weights the loss reached are recorded here
        self.reached: set[int] = set()
        for param in self.params:
            param.register_post_accumulate_grad_hook(lambda p: self.reached.add(id(p)))
        self.checkpoint_optimizer = TorchLayoutOptimizer(self)
        self.checkpoint_shards = self.write_shards
        self.rank = parallel_state.get_data_parallel_rank()
        self.world_size = parallel_state.get_data_parallel_world_size()
        self.tp_rank = parallel.tp_rank()
        self.model.zero_grad_buffer()

    def logprob(self, samples: Samples, level: str):
        token, entropy, value = self.model(samples.obs, samples.output)
        return logprob_at(token, level, samples.valid), entropy, value

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()  # (megatron's hooks add each gradient into its buffer)

    def step(self) -> torch.Tensor:
        """Average the gradients over the data-parallel ranks, clip by the global norm, apply
        Adam, clear the buffers; the norm before clipping."""
        # a weight without gradient keeps its value, Adam moments and step, as in torch's Adam
        # (megatron would decay it, and move it by moments of earlier steps)
        # (per process: with data-parallel ranks a weight reached on one rank's share only
        # would need the ranks' union; their checkpoints are not built either)
        unreached = [p for p in self.params if id(p) not in self.reached]
        kept = []
        for param in unreached:
            state = self._adam_state(param)
            saved = None if state is None else {k: t.clone() for k, t in state.items()}
            kept.append((param.detach().clone(), saved))
        with cuda_corners():
            self.model.finish_grad_sync()
            _, grad_norm, _ = self.optimizer.step()
        with torch.no_grad():
            for param, (value, state) in zip(unreached, kept):
                param.copy_(value)
                if state is not None:
                    self._set_adam_state(param, state)
        self.reached.clear()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        return torch.tensor(float("nan") if grad_norm is None else grad_norm)

    def average(self, values: torch.Tensor) -> torch.Tensor:
        group = parallel_state.get_data_parallel_group()
        return average_over(values, group, self.world_size)

    def gather_shares(self, part: torch.Tensor, total: int) -> torch.Tensor:
        group = parallel_state.get_data_parallel_group()
        return gather_over(part, total, group, self.world_size)

    def torch_state(self) -> dict[str, torch.Tensor]:
        """The whole policy's state dict in the torch layout (every rank calls this): what a
        rollout copy or the torch backend loads. Outside the shards the tensors are the live
        ones (``load_state_dict`` copies them)."""
        state = self._changing_state()
        frozen = self._frozen_prefixes()
        if frozen:  # (the torch copy holds the same weights: nothing to gather)
            copy_state = self.torch_policy.state_dict()
            state.update({k: v for k, v in copy_state.items() if k.startswith(frozen)})
        return state

    def _frozen_prefixes(self) -> tuple[str, ...]:
        """The state-dict prefixes of the sharded modules nothing trains."""
        return tuple(f"{name}." for name, part in self.parts.items() if not _trained(part))

    def _changing_state(self) -> dict[str, torch.Tensor]:
        """``torch_state`` without the frozen sharded modules (every rank calls this)."""
        state = {
            k: v
            for k, v in self.policy.state_dict().items()
            if not k.startswith(self.part_prefixes)
        }
        for name, part in self.parts.items():
            if _trained(part):
                for key, param in part.named_parameters():
                    state[f"{name}.{key}"] = param.detach()
        return self._torch_layout(state)

    def torch_grads(self) -> dict[str, torch.Tensor]:
        """The trainable weights' gradients since the last step, in the torch layout (gathered
        as ``torch_state``); zeros for a weight the loss did not reach."""
        grads = {
            name: param.main_grad.detach().clone()
            for name, param in self.policy.named_parameters()
            if param.requires_grad
        }
        return self._torch_layout(grads)

    def _torch_layout(self, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``values`` named as this policy's parameters (the sharded modules' this rank's shards)
        in the torch layout: the shards gathered from every TP rank (every rank calls this)."""
        out = {k: v for k, v in values.items() if not k.startswith(self.part_prefixes)}
        for name, part in self.parts.items():
            start = self.shard_prefixes[name]
            shard = {k[len(start) :]: v for k, v in values.items() if k.startswith(start)}
            if not shard:  # (the gradients of a frozen module)
                continue
            gathered = part.torch_state(shard)
            out.update({f"{name}.{key}": tensor for key, tensor in gathered.items()})
        return out

    def close(self) -> None:
        """Leave megatron's groups and the process group (every rank calls this at the end)."""
        import torch.distributed as dist

        parallel.destroy()
        dist.destroy_process_group()

    def refresh(self) -> None:
        """The torch copy gets the current weights and buffers (every TP rank calls this); a
        frozen sharded module's weights are there already (a VLM's: not copied onto themselves
        after every update)."""
        loaded = self.torch_policy.load_state_dict(self._changing_state(), strict=False)
        frozen = self._frozen_prefixes()
        missing = [k for k in loaded.missing_keys if not k.startswith(frozen)]
        if missing or loaded.unexpected_keys:
            raise ValueError(f"the torch copy does not fit: {missing + loaded.unexpected_keys}")

    def write_shards(self, directory: Path) -> dict:
        """This TP rank's shards of the trained sharded modules (weights, Adam moments, step, a
        bf16 run's main weights) as its file in ``directory``, which TP rank 0 makes; every TP
        rank calls this. Returns meta.json's "shards" (embodied/megatron/shards.py)."""
        import torch.distributed as dist

        from embodied.checkpoint import write_shard
        from embodied.megatron.shards import shard_files, shard_tensors

        if self.world_size > 1:
            raise NotImplementedError("checkpoints of data-parallel megatron ranks")
        trained = trainable_modules(self.torch_policy)
        weights = {}
        mains = {} if self.dtype != torch.float32 else None
        moments = {key: {} for key in MOMENTS}
        step = None
        for info in trained:
            name = info["module"]
            part = self.parts[name]
            for key, param in part.named_parameters():
                key = f"{name}/{key[len(part.shard_prefix) :]}"
                # what acted (a bf16 run's: the rounding of its float32 main weights, kept too)
                weights[key] = param.detach().float()
                if mains is not None:
                    # (a copy: a float32 norm's main weight is the weight itself)
                    mains[key] = self._main_param(param).detach().view(param.shape).clone()
                state = self._adam_state(param)
                if state is not None:
                    step = state["step"]
                    for kind in MOMENTS:
                        moments[kind][key] = state[kind].detach().view(param.shape)
        group = parallel.tp_group()
        dist.barrier(group=group)  # (rank 0 has made the directory)
        tp = parallel.tp_size()
        tensors = shard_tensors(weights, None if step is None else moments, step, mains)
        write_shard(directory, parallel.tp_rank(), tp, tensors)
        dist.barrier(group=group)  # (every file is written)
        # rank 0 looks: it commits the directory next (another rank looking raced its rename)
        missing = [name for name in shard_files(tp) if not (directory / name).is_file()]
        if parallel.tp_rank() == 0 and missing:  # (ranks on nodes sharing no file system)
            raise OSError(  # (the save's error: the checkpoint is not written, one line)
                f"{directory}: the shard files {missing} of other TP ranks are not here; the "
                "ranks of a megatron run need a file system they share with the run directory"
            )
        return shard_info(trained, tp=tp, trainable=self.trainable)

    def main_weights(self) -> dict[str, torch.Tensor]:
        """A bf16 run's float32 main weights of the trained sharded modules in the torch layout
        (every TP rank calls this: gathered); {} in a float32 run, whose weights they are."""
        if self.dtype == torch.float32:
            return {}
        sharded = tuple(self.shard_prefixes.values())
        mains = {
            name: self._main_param(param).detach().view(param.shape)
            for name, param in self.policy.named_parameters()
            if param.requires_grad and name.startswith(sharded)
        }
        return self._torch_layout(mains)

    def _round_torch_copy(self) -> None:
        """In a bf16 run, the torch copy (what acts) holds the bf16 weights, as after every
        update, not the float32 values it was loaded with (every rank calls this)."""
        if self.dtype != torch.float32:
            self.refresh()

    def _rank_layout(self, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Torch-layout ``values`` (named as the torch copy's parameters) as this rank's: named as
        this policy's parameters, the sharded modules' in megatron's layout, this rank's shard
        (``_torch_layout``'s inverse; no collective)."""
        out = {k: v for k, v in values.items() if not k.startswith(self.part_prefixes)}
        tp = parallel.tp_size()
        for name, part in self.parts.items():
            start = f"{name}."
            own = {k[len(start) :]: v for k, v in values.items() if k.startswith(start)}
            if not own:  # (a frozen module)
                continue
            mine = to_megatron(part.layout, own, tp=tp, **part.shape())[parallel.tp_rank()]
            out.update({self.shard_prefixes[name] + key: t for key, t in mine.items()})
        return out

    def _main_param(self, param: torch.nn.Parameter) -> torch.Tensor:
        """The optimizer's float32 copy of ``param``, flat (the weight itself when it is
        float32; with one data-parallel rank, all of it)."""
        optimizer = self._holder(param)
        # (as ``_get_main_param_and_optimizer_states``, which would also add an empty Adam state
        # for it: the optimizer would seem to have stepped)
        group, order = optimizer.model_param_group_index_map[param]
        return optimizer.optimizer.param_groups[group]["params"][order]

    @torch.no_grad()
    def _set_main_params(self, model: dict[str, torch.Tensor]) -> None:
        """Every trainable weight's main copy from the torch-layout state ``model`` (float32):
        a bf16 run starts from, and resumes at, the float32 values, not their bf16 rounding."""
        trainable = set(self.trainable)
        values = self._rank_layout({k: v for k, v in model.items() if k in trainable})
        for name, param in self.policy.named_parameters():
            if param.requires_grad:
                self._main_param(param).copy_(values[name].reshape(-1))


def _trained(module: torch.nn.Module) -> bool:
    return any(p.requires_grad for p in module.parameters())
