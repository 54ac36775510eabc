"""Megatron's Adam state as torch's (``MegatronEngine``'s checkpoint side): read per weight from
megatron's distributed optimizer, written out as ``torch.optim.Adam``'s state dict over the torch
copy's trainable weights, and loaded back at any TP size.

Adam's step count lives where the optimizer keeps it: torch's Adam (megatron's fallback on a
machine without Transformer Engine or Apex) counts per weight, their FusedAdam per parameter
group (``group["step"]``, one count for the group); both read and write here as the one count
a checkpoint holds."""

from __future__ import annotations

import torch

MOMENTS = ("exp_avg", "exp_avg_sq")


class AdamStates:
    """What ``MegatronEngine`` mixes in: ``optimizer`` is megatron's (chained) optimizer."""

    def _holder(self, param: torch.nn.Parameter):
        """The one of megatron's chained optimizers that holds ``param``."""
        for optimizer in self.optimizer.chained_optimizers:
            if param in optimizer.model_param_group_index_map:
                return optimizer
        raise KeyError("a trainable parameter the optimizer does not hold")

    def _adam_state(self, param: torch.nn.Parameter) -> dict[str, torch.Tensor] | None:
        """Megatron's Adam state of ``param`` (this data-parallel rank's range: all of it with
        one rank) and its "step" (float32, 0-dim, as torch's Adam), or None before the first
        step."""
        optimizer = self._holder(param)
        if not optimizer.optimizer.state:
            return None
        tensors = dict(optimizer._get_main_param_and_optimizer_states(param))
        if "step" not in tensors:  # (FusedAdam: the group's count)
            group, _ = optimizer.model_param_group_index_map[param]
            step = optimizer.optimizer.param_groups[group]["step"]
            tensors["step"] = torch.as_tensor(step, dtype=torch.float32).detach().cpu().clone()
        return tensors

    def _set_adam_state(self, param: torch.nn.Parameter, tensors: dict) -> None:
        """Set ``param``'s main weight and Adam moments (``_adam_state``'s keys; a per-weight
        step too where the optimizer keeps one)."""
        self._holder(param)._set_main_param_and_optimizer_states(param, tensors)

    def _set_steps(self, step: torch.Tensor) -> None:
        """Every parameter group's step count where the optimizer keeps it there (FusedAdam;
        torch's Adam takes it per weight: ``_set_adam_state``)."""
        for optimizer in self.optimizer.chained_optimizers:
            for group in optimizer.optimizer.param_groups:
                if "step" not in group:
                    continue
                if isinstance(group["step"], torch.Tensor):
                    group["step"].copy_(step)
                else:
                    group["step"] = int(step.item())

    def optimizer_state_dict(self) -> dict:
        """Megatron's Adam state as ``torch.optim.Adam``'s state dict over the torch copy's
        trainable parameters, without the sharded modules' (this rank's shards of those go into
        its shard file: ``write_shards``). Weights whole on every rank have the same state there,
        so this needs no collective."""
        if self.world_size > 1:
            raise NotImplementedError("checkpoints of data-parallel megatron ranks")
        out = self._adam_template()
        index = {name: i for i, name in enumerate(self.trainable)}
        sharded = tuple(self.shard_prefixes.values())
        for name, param in self.policy.named_parameters():
            if not param.requires_grad or name.startswith(sharded):
                continue
            state = self._adam_state(param)
            if state is None:
                return out  # (no step yet: no state, as torch's Adam)
            out["state"][index[name]] = {
                "step": state["step"].clone(),
                **{key: state[key].detach().view(param.shape).clone() for key in MOMENTS},
            }
        return out

    def whole_optimizer_state(self) -> dict:
        """``optimizer_state_dict`` with the sharded modules' moments too, gathered from the TP
        ranks into the torch layout (every rank calls this): the whole state, which
        ``load_state_dict`` takes at any TP size (what a rollout record keeps)."""
        if self.world_size > 1:
            raise NotImplementedError("records of data-parallel megatron ranks")
        out = self._adam_template()
        states = {
            name: (param, self._adam_state(param))
            for name, param in self.policy.named_parameters()
            if param.requires_grad
        }
        if any(state is None for _, state in states.values()):
            return out  # (no step yet: no state, as torch's Adam; the same on every rank)
        step = next(iter(states.values()))[1]["step"]
        moments = {
            kind: self._torch_layout(
                {name: state[kind].detach().view(p.shape) for name, (p, state) in states.items()}
            )
            for kind in MOMENTS
        }
        for index, name in enumerate(self.trainable):
            # (a weight whole on every rank: its own count, as optimizer_state_dict's)
            own = states[name][1]["step"] if name in states else step
            out["state"][index] = {
                "step": own.clone(),
                **{kind: moments[kind][name].clone() for kind in MOMENTS},
            }
        return out

    def _adam_template(self) -> dict:
        """torch's Adam state dict over the torch copy's trainable weights, without state."""
        adam = torch.optim.AdamW if self.adam["weight_decay"] else torch.optim.Adam
        template = adam(
            [p for p in self.torch_policy.parameters() if p.requires_grad], lr=self.lr, **self.adam
        )
        return template.state_dict()

    @torch.no_grad()
    def load_state_dict(self, checkpoint: dict) -> None:
        """Weights (torch layout) and the optimizer state ``optimizer_state_dict`` wrote, at
        this run's TP size. The optimizer's float32 main weights take the checkpoint's values,
        not the (bf16) weights'."""
        state = checkpoint["optimizer"]["state"]
        if state:
            # megatron makes Adam's state by a step with zero gradients: it moves the weights
            # (weight decay), so it comes before they are set
            for optimizer in self.optimizer.chained_optimizers:
                if not optimizer.optimizer.state:
                    optimizer._init_optimizer_states_with_dummy_values()
        self._load_weights(checkpoint["model"])
        if not state:
            return
        by_name = {self.trainable[index]: entry for index, entry in state.items()}
        # (the sharded modules' weights step together; a weight no loss reached keeps its count)
        step = next(iter(state.values()))["step"]
        moments = {
            kind: self._rank_layout({k: e[kind] for k, e in by_name.items()}) for kind in MOMENTS
        }
        self._set_steps(step)
        for name, param in self.policy.named_parameters():
            if not param.requires_grad:
                continue
            own = by_name[name]["step"] if name in by_name else step
            tensors = {"param": self._main_param(param).clone(), "step": own.clone()}
            for kind in MOMENTS:
                # (torch's Adam keeps none for a weight no loss reached: GRPO's critic)
                value = moments[kind].get(name, torch.zeros_like(param, dtype=torch.float32))
                tensors[kind] = value.reshape(-1)
            self._set_adam_state(param, tensors)

    def _load_weights(self, model: dict[str, torch.Tensor]) -> None:
        """The torch-layout weights ``model`` into the torch copy, this rank's shards and the
        optimizer's main weights."""
        self.torch_policy.load_state_dict(model)
        for name, part in self.parts.items():
            start = f"{name}."
            part.load_torch_state(
                {k[len(start) :]: v for k, v in model.items() if k.startswith(start)}
            )
        rest = {k: v for k, v in model.items() if not k.startswith(self.part_prefixes)}
        loaded = self.policy.load_state_dict(rest, strict=False)
        if loaded.unexpected_keys or [
            k for k in loaded.missing_keys if not k.startswith(self.part_prefixes)
        ]:
            raise ValueError(f"the checkpoint does not fit the policy: {loaded}")
        self._set_main_params(model)
        self._round_torch_copy()


class TorchLayoutOptimizer:
    """What a checkpoint saves as the optimizer: ``MegatronEngine.optimizer_state_dict`` (the
    sharded modules' moments go into the shard files)."""

    def __init__(self, engine):
        self.engine = engine

    def state_dict(self) -> dict:
        return self.engine.optimizer_state_dict()
