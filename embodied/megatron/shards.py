"""Tensor-parallel checkpoint shards on disk (torch and safetensors only: every tool reads them
without megatron-core or process groups).

A checkpoint of the megatron backend keeps the sharded modules (the VLA's fusion transformer;
the language model of a Qwen2-VL family VLM, when trained; the discrete head) as one file per
TP rank, in megatron's layout, written by that rank::

    iter_000010/model-tp00-of-02.safetensors   rank 0's shards: weight/<module>/<name>,
    iter_000010/model-tp01-of-02.safetensors   exp_avg/<module>/<name>, exp_avg_sq/...
                                               (after the first step), step; main/...
                                               (a bf16 run: its float32 main weights)
    iter_000010/model.safetensors              everything else, whole, in the torch layout
    iter_000010/trainer.pt                     Adam's state of everything else
    iter_000010/meta.json                      "shards": what ``join`` needs (below)

``join`` puts the shards back into the torch layout, so a sharded checkpoint loads as any other
(``load_checkpoint``) at any TP size or on the torch backend. A bf16 run's ``weight/`` tensors
are what acted (the bf16 weights, as float32); its optimizer's float32 main weights (``main/``)
are what a resumed run continues from, and are joined only with the trainer state. ``split``
makes the shards of a torch-layout state (``embodied convert --to megatron``). The files are
written and read by embodied/checkpoint.py (``write_shard``, ``read_shards``).
"""

from __future__ import annotations

import torch
from torch import nn

from embodied.megatron.layout import from_megatron, to_megatron
from embodied.models.vla.heads import DiscreteTokenHead

KINDS = ("weight", "exp_avg", "exp_avg_sq")
MAIN = "main"  # (a bf16 run's float32 main weights)
# the VLM language models megatron shards (Qwen2-VL's is the same model: untested, not listed)
TEXT_FAMILIES = ("qwen2_5_vl_text",)


def shard_file(rank: int, size: int) -> str:
    return f"model-tp{rank:02d}-of-{size:02d}.safetensors"


def shard_files(size: int) -> list[str]:
    """Every TP rank's file name."""
    return [shard_file(rank, size) for rank in range(size)]


def modules(policy: nn.Module) -> list[dict]:
    """What the megatron backend shards of a torch ``policy``: per module, its state-dict prefix
    and the shape its layout needs (embodied/megatron/layout.py): the VLA's fusion transformer,
    the language model of a Qwen2-VL family VLM, and the discrete action head."""
    out = []
    fusion = getattr(policy, "fusion", None)
    if isinstance(fusion, nn.TransformerEncoder):
        layer = fusion.layers[0]
        out.append(
            {
                "module": "fusion",
                "layout": "transformer_encoder",
                "layers": len(fusion.layers),
                "heads": layer.self_attn.num_heads,
            }
        )
    vlm = getattr(policy, "vlm", None)
    text = getattr(getattr(vlm, "model", None), "language_model", None)
    config = getattr(text, "config", None)
    if getattr(config, "model_type", None) in TEXT_FAMILIES:
        out.append(
            {
                "module": "vlm.model.language_model",
                "layout": "qwen2_text",
                "layers": config.num_hidden_layers,
                "heads": config.num_attention_heads,
                "groups": config.num_key_value_heads,
            }
        )
    head = getattr(policy, "head", None)
    if isinstance(head, DiscreteTokenHead):
        out.append(
            {"module": "head", "layout": "discrete_head", "actions": head.A, "bins": head.bins}
        )
    return out


def trainable_modules(policy: nn.Module) -> list[dict]:
    """``modules(policy)`` with trainable weights: what a checkpoint's shard files hold (frozen
    weights are saved whole, once, as every frozen weight is)."""

    def trainable(module: str) -> bool:
        return any(p.requires_grad for p in policy.get_submodule(module).parameters())

    return [info for info in modules(policy) if trainable(info["module"])]


def shape_of(info: dict) -> dict:
    """A module's shape as its layout's functions take it."""
    return {k: v for k, v in info.items() if k not in ("module", "layout")}


def shard_info(modules: list[dict], *, tp: int, trainable: list[str]) -> dict:
    """meta.json's "shards": the sharded modules (``modules``), the TP size, the files, and the
    names of the torch policy's trainable parameters in optimizer order (Adam's state is indexed
    by position)."""
    return {
        "modules": modules,
        "tensor_parallel": tp,
        "files": shard_files(tp),
        "trainable": trainable,
    }


def module_prefixes(info: dict) -> list[str]:
    """The state-dict prefixes of the sharded modules (what model.safetensors leaves out)."""
    return [module["module"] + "." for module, _ in _modules(info)]


def _modules(info: dict) -> list[tuple[dict, str]]:
    """(module, its key prefix in a file after "<kind>/") per sharded module of meta.json's
    "shards" (a checkpoint of one sharded module, the fusion, names its tensors "<kind>/<name>")."""
    if "module" in info:
        module = {k: info[k] for k in ("module", "layers", "heads")}
        return [({**module, "layout": info["layout"]}, "")]
    return [(module, module["module"] + "/") for module in info["modules"]]


def shard_tensors(
    weights: dict[str, torch.Tensor],
    moments: dict[str, dict[str, torch.Tensor]] | None,
    step: torch.Tensor | None,
    mains: dict[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """One rank's file content from its weights, Adam moments ({"exp_avg": {name: ..},
    "exp_avg_sq": ..}; None before the first step) and main weights (a bf16 run's), keyed
    "<module>/<megatron name>"."""
    out = {f"weight/{name}": tensor for name, tensor in weights.items()}
    out.update({f"{MAIN}/{name}": tensor for name, tensor in (mains or {}).items()})
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
    tp = info["tensor_parallel"]
    index = {name: i for i, name in enumerate(info["trainable"])}
    state = optimizer["state"] if optimizer is not None else {}
    step = next(iter(state.values()))["step"] if state else None
    weights = [{} for _ in range(tp)]
    moments = [{kind: {} for kind in KINDS[1:]} for _ in range(tp)]
    sharded = set()
    for module, key in _modules(info):
        prefix = module["module"] + "."
        own = {k[len(prefix) :]: v for k, v in model.items() if k.startswith(prefix)}
        model = {k: v for k, v in model.items() if not k.startswith(prefix)}
        shape = shape_of(module)
        for rank, part in enumerate(to_megatron(module["layout"], own, tp=tp, **shape)):
            weights[rank].update({key + name: t for name, t in part.items()})
        if not state:
            continue
        for kind in KINDS[1:]:
            values = {name: state[index[prefix + name]][kind] for name in own}
            for rank, part in enumerate(to_megatron(module["layout"], values, tp=tp, **shape)):
                moments[rank][kind].update({key + name: t for name, t in part.items()})
        sharded.update(index[prefix + name] for name in own)
    if state:
        rest = {i: entry for i, entry in state.items() if i not in sharded}
        optimizer = {**optimizer, "state": rest}
    files = [
        shard_tensors(weights[rank], moments[rank] if state else None, step) for rank in range(tp)
    ]
    return model, optimizer, files


def join(
    files: list[dict[str, torch.Tensor]],
    info: dict,
    model: dict,
    optimizer: dict | None,
    mains: dict | None = None,
) -> None:
    """Put every rank's shards back into the torch-layout ``model`` state and, when given,
    ``optimizer``'s state and ``mains`` (a bf16 run's main weights; in place): ``split``'s
    inverse."""
    check_same_shapes(files, info["files"])
    index = {name: i for i, name in enumerate(info["trainable"])}
    with_moments = optimizer is not None and "step" in files[0]
    kinds = KINDS if with_moments else KINDS[:1]
    if mains is not None and any(key.startswith(f"{MAIN}/") for key in files[0]):
        kinds += (MAIN,)
    for module, key in _modules(info):
        prefix = module["module"] + "."
        joined = {}
        for kind in kinds:
            start = f"{kind}/{key}"
            parts = [
                {k[len(start) :]: v for k, v in f.items() if k.startswith(start)} for f in files
            ]
            try:
                joined[kind] = from_megatron(module["layout"], parts, **shape_of(module))
            except (KeyError, RuntimeError, IndexError) as e:
                raise ValueError(
                    f'the shards of {module["module"]} do not fit meta.json\'s "shards" '
                    f"({type(e).__name__}: {e})"
                ) from None
        model.update({prefix + name: tensor for name, tensor in joined["weight"].items()})
        if MAIN in joined:
            mains.update({prefix + name: tensor for name, tensor in joined[MAIN].items()})
        if not with_moments:
            continue
        for name in joined["weight"]:
            optimizer["state"][index[prefix + name]] = {
                "step": files[0]["step"].clone(),
                **{kind: joined[kind][name] for kind in KINDS[1:]},
            }


def check_same_shapes(files: list[dict[str, torch.Tensor]], names: list[str]) -> None:
    """Every rank's file (``names``) holds the same tensors in the same shapes, as the layouts
    split them (evenly): a ValueError naming the file and tensor that differ from rank 0's."""
    first = files[0]
    for name, tensors in zip(names[1:], files[1:]):
        for key in first.keys() ^ tensors.keys():
            raise ValueError(f"{name}: {key} is in one of {names[0]} and {name} only")
        for key, tensor in tensors.items():
            if tensor.shape != first[key].shape:
                raise ValueError(
                    f"{name}: {key} is {list(tensor.shape)}, {list(first[key].shape)} in "
                    f"{names[0]} (the ranks' shards of a tensor have one shape)"
                )
