"""Tensor-parallel checkpoint shards on disk (torch and safetensors only: every tool reads them
without megatron-core or process groups).

A checkpoint of the megatron backend keeps the sharded module (the VLA's fusion transformer)
as one file per TP rank, in megatron's layout, written by that rank::

    iter_000010/model-tp00-of-02.safetensors   rank 0's shard: weight/<name>, exp_avg/<name>,
    iter_000010/model-tp01-of-02.safetensors   exp_avg_sq/<name> (after the first step), step
    iter_000010/model.safetensors              everything else, whole, in the torch layout
    iter_000010/trainer.pt                     Adam's state of everything else
    iter_000010/meta.json                      "shards": what ``join`` needs (below)

``join`` puts the shards back into the torch layout, so a sharded checkpoint loads as any other
(``load_checkpoint``) at any TP size or on the torch backend; ``split`` makes the shards of a
torch-layout state (``embodied convert --to megatron``). The files are written and read by
embodied/checkpoint.py (``write_shard``, ``read_shards``).
"""

from __future__ import annotations

import torch

from embodied.megatron.layout import encoder_from_megatron, encoder_to_megatron

KINDS = ("weight", "exp_avg", "exp_avg_sq")


def shard_file(rank: int, size: int) -> str:
    return f"model-tp{rank:02d}-of-{size:02d}.safetensors"


def shard_info(module: str, *, layers: int, heads: int, tp: int, trainable: list[str]) -> dict:
    """meta.json's "shards": the sharded module's state-dict prefix and shape, the TP size, the
    files, and the names of the torch policy's trainable parameters in optimizer order (Adam's
    state is indexed by position)."""
    return {
        "module": module,
        "layout": "transformer_encoder",
        "layers": layers,
        "heads": heads,
        "tensor_parallel": tp,
        "files": [shard_file(rank, tp) for rank in range(tp)],
        "trainable": trainable,
    }


def shard_tensors(
    weights: dict[str, torch.Tensor],
    moments: dict[str, dict[str, torch.Tensor]] | None,
    step: torch.Tensor | None,
) -> dict[str, torch.Tensor]:
    """One rank's file content from its weights and Adam moments ({"exp_avg": {name: ..},
    "exp_avg_sq": ..}; None before the first step), keyed by megatron's names."""
    out = {f"weight/{name}": tensor for name, tensor in weights.items()}
    if moments is not None:
        for kind, values in moments.items():
            out.update({f"{kind}/{name}": tensor for name, tensor in values.items()})
        out["step"] = torch.as_tensor(step, dtype=torch.float32).reshape(())
    return out


def split(
    model: dict[str, torch.Tensor], optimizer: dict | None, info: dict
) -> tuple[dict, dict | None, list[dict[str, torch.Tensor]]]:
    """A torch-layout checkpoint's model state and optimizer state dict as (the rest of the
    model, the rest of the optimizer, one file content per rank of ``info``)."""
    prefix = info["module"] + "."
    tp = info["tensor_parallel"]
    layout = {"layers": info["layers"], "heads": info["heads"], "tp": tp}
    module = {k[len(prefix) :]: v for k, v in model.items() if k.startswith(prefix)}
    rest = {k: v for k, v in model.items() if not k.startswith(prefix)}
    weights = encoder_to_megatron(module, **layout)
    moments = [None] * tp
    step = None
    if optimizer is not None and optimizer["state"]:
        index = {name: i for i, name in enumerate(info["trainable"])}
        state = optimizer["state"]
        step = next(iter(state.values()))["step"]
        per_kind = {
            kind: encoder_to_megatron(
                {name: state[index[prefix + name]][kind] for name in module}, **layout
            )
            for kind in KINDS[1:]
        }
        moments = [{kind: per_kind[kind][rank] for kind in per_kind} for rank in range(tp)]
        sharded = {index[prefix + name] for name in module}
        optimizer = {
            **optimizer,
            "state": {i: entry for i, entry in state.items() if i not in sharded},
        }
    files = [shard_tensors(weights[rank], moments[rank], step) for rank in range(tp)]
    return rest, optimizer, files


def join(
    files: list[dict[str, torch.Tensor]], info: dict, model: dict, optimizer: dict | None
) -> None:
    """Put every rank's shard back into the torch-layout ``model`` state and, when given,
    ``optimizer``'s state (in place): ``split``'s inverse."""
    prefix = info["module"] + "."
    layout = {"layers": info["layers"], "heads": info["heads"]}

    def kind_of(kind: str) -> list[dict[str, torch.Tensor]]:
        start = kind + "/"
        return [{k[len(start) :]: v for k, v in f.items() if k.startswith(start)} for f in files]

    weights = encoder_from_megatron(kind_of("weight"), **layout)
    model.update({prefix + name: tensor for name, tensor in weights.items()})
    if optimizer is None or "step" not in files[0]:
        return
    moments = {kind: encoder_from_megatron(kind_of(kind), **layout) for kind in KINDS[1:]}
    index = {name: i for i, name in enumerate(info["trainable"])}
    step = files[0]["step"].clone()
    for name in weights:
        optimizer["state"][index[prefix + name]] = {
            "step": step.clone(),
            **{kind: moments[kind][name] for kind in KINDS[1:]},
        }
