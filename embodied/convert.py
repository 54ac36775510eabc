"""``embodied convert SOURCE --to FORMAT OUT``: weights between our checkpoints, megatron's
tensor-parallel shards and Hugging Face directories (torch and safetensors only: no process
groups, no megatron-core).

SOURCE is one of
- an embodied checkpoint (a run directory, ``RUN/last`` or a checkpoint directory; sharded or
  not): ``--to torch`` writes it whole in the torch layout, ``--to megatron`` with its fusion
  in one shard file per TP rank (as a megatron run saves it), ``--to hf`` the policy's
  Hugging Face VLM (``policy.vlm_path``) with the checkpoint's weights;
- a Hugging Face directory of the Qwen2 family (config.json and safetensors weights):
  ``--to megatron`` writes megatron ``GPTModel`` shards, one file per TP rank;
- such a megatron directory (megatron.json): ``--to hf`` writes the Hugging Face directory
  back, ``--to megatron`` reshards it.

Every output is written into a hidden sibling directory, synced and renamed into place: an
interrupted conversion (a machine's crash included) leaves no half-written OUT.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from embodied.schema import UserError

FORMATS = ("torch", "megatron", "hf")
MEGATRON_META = "megatron.json"
QWEN2_FAMILY = ("qwen2",)  # Hugging Face model_type values the Qwen2 mapping covers


class ConvertError(UserError):
    pass


def convert(source: str | Path, to: str, out: str | Path, *, tensor_parallel: int = 1) -> Path:
    """Convert ``source`` (see the module's text) to ``to`` at ``out``; returns ``out``."""
    source = Path(source)
    out = Path(out)
    if to not in FORMATS:
        raise ConvertError(f"--to: one of {', '.join(FORMATS)}, got {to!r}")
    if tensor_parallel < 1:
        raise ConvertError(f"--tensor-parallel: at least 1, got {tensor_parallel}")
    if to != "megatron" and tensor_parallel != 1:
        raise ConvertError("--tensor-parallel applies to --to megatron only")
    if out.exists():
        raise ConvertError(f"{out} exists; give a new directory")
    if not source.exists():
        raise ConvertError(f"{source}: no such file or directory")
    if (source / MEGATRON_META).is_file():
        write = _from_megatron_dir(source, to, tensor_parallel)
    elif (source / "config.json").is_file() and not (source / "meta.json").is_file():
        write = _from_hf_dir(source, to, tensor_parallel)
    else:
        _require_checkpoint(source)
        write = _from_checkpoint(source, to, tensor_parallel)
    from embodied.checkpoint import fsync

    staging = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        write(staging)
        for path in sorted(staging.rglob("*")):  # (the rename may reach the disk before them)
            fsync(path)
        fsync(staging)
        os.replace(staging, out)
        fsync(out.parent)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


# --- embodied checkpoints --------------------------------------------------------------------
def _require_checkpoint(source: Path) -> None:
    """A ConvertError naming what ``source`` is not, when it is none of the formats."""
    from embodied.checkpoint import resolve_checkpoint

    try:
        resolve_checkpoint(source)
    except FileNotFoundError as e:
        raise ConvertError(
            f"{e}; nor is it a Hugging Face model directory (config.json) or a megatron one "
            f"({MEGATRON_META})"
        ) from None


def _from_checkpoint(source: Path, to: str, tp: int):
    from embodied.checkpoint import load_policy_checkpoint
    from embodied.demos import load_policy

    try:
        ckpt = load_policy_checkpoint(source, with_trainer_state=to != "hf")
    except FileNotFoundError as e:  # (a frozen-weights file not copied along, say)
        raise ConvertError(str(e)) from None
    meta = {k: v for k, v in ckpt["meta"].items() if k not in ("shards", "frozen")}
    if to == "hf":
        return lambda out: _vlm_to_hf(ckpt, out)
    if to == "megatron":  # (the trainable names, in the optimizer's order; --to torch needs no
        # policy, nor its policy.vlm_path: the checkpoint holds every weight)
        policy, cfg = load_policy(ckpt)
        trainable = [n for n, p in policy.named_parameters() if p.requires_grad]
    model = ckpt["model"]
    optimizer = ckpt.get("optimizer")
    trainer = {"optimizer": optimizer, "rng": ckpt.get("rng"), "counters": ckpt.get("counters")}
    if ckpt.get("main_weights"):  # (a bf16 run's float32 weights: kept for a resumed run)
        trainer["main_weights"] = ckpt["main_weights"]

    def write(out: Path) -> None:
        from embodied.checkpoint import write_shard
        from embodied.megatron import shards

        nonlocal model
        if to == "megatron":
            modules = shards.trainable_modules(policy)
            if not modules:
                raise ConvertError(
                    f"{source}: the policy has nothing the megatron backend shards "
                    f"(policy.name={cfg.policy.name!r}: a 'vla' policy's fusion transformer or "
                    "Qwen2-VL language model, trained)"
                )
            for module in modules:
                _check_module_split(module, tp, model)
            info = shards.shard_info(modules, tp=tp, trainable=trainable)
            model, trainer["optimizer"], files = shards.split(model, optimizer, info)
            for rank, tensors in enumerate(files):
                write_shard(out, rank, tp, tensors)
            meta["shards"] = info
        save_file({k: v.contiguous() for k, v in model.items()}, str(out / "model.safetensors"))
        torch.save(trainer, out / "trainer.pt")
        (out / "meta.json").write_text(json.dumps({**meta, "frozen": None}, indent=2))

    return write


def _vlm_to_hf(ckpt: dict, out: Path) -> None:
    """The VLA's Hugging Face VLM (policy.vlm_path) with the checkpoint's weights: the model
    directory's files, its weights replaced."""
    from transformers import AutoModelForImageTextToText

    policy = ckpt["meta"]["config"].get("policy", {})
    path = Path(policy.get("vlm_path") or "")
    prefix = "vlm.model."
    if policy.get("name") != "vla" or not policy.get("vlm_path"):
        raise ConvertError(
            f"{ckpt['path']}: the policy holds no Hugging Face model (a 'vla' policy with "
            "policy.vlm_path); --to torch writes the whole policy"
        )
    if not (path / "config.json").is_file():
        raise ConvertError(
            f"{ckpt['path']}: its policy.vlm_path {path} is not here; the directory supplies "
            "the model's config and processor files"
        )
    import embodied  # noqa: F401  (transformers' vision models need its torchvision workaround)

    weights = {k[len(prefix) :]: v for k, v in ckpt["model"].items() if k.startswith(prefix)}
    try:
        full = AutoModelForImageTextToText.from_pretrained(
            path, local_files_only=True, dtype=torch.float32
        )
        full.model.load_state_dict(weights)
    except (OSError, ValueError, RuntimeError) as e:  # (another model there now)
        said = " ".join(str(e).split()) or type(e).__name__  # (torch's: a header, then why)
        raise ConvertError(
            f"{ckpt['path']}: its policy.vlm_path {path} does not take its weights: {said[:300]}"
        ) from None
    _copy_side_files(path, out)
    full.save_pretrained(out)


# --- Hugging Face and megatron directories (the Qwen2 family) -----------------------------------
def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConvertError(f"{path}: not valid JSON ({e.msg}, line {e.lineno})") from None
    if not isinstance(value, dict):
        raise ConvertError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def _require(values: dict, keys, where: str) -> None:
    """A ConvertError naming the first of ``keys`` missing from ``values`` (read from
    ``where``)."""
    missing = [key for key in keys if key not in values]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ConvertError(f"{where}: no {missing[0]!r}{more}")


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path))
    except Exception as e:  # (SafetensorError, or an OSError)
        raise ConvertError(f"{path}: cannot be read ({e}); the file is damaged") from None


def _qwen2_layout(config: dict, path: Path) -> dict:
    text = config.get("text_config", config)
    if config.get("model_type") not in QWEN2_FAMILY:
        raise ConvertError(
            f"model_type {config.get('model_type')!r}: the megatron mapping covers "
            f"{', '.join(QWEN2_FAMILY)} (the Qwen2 family's language models)"
        )
    _require(text, ("num_hidden_layers", "num_attention_heads"), str(path))
    return {
        "layers": text["num_hidden_layers"],
        "heads": text["num_attention_heads"],
        "groups": text.get("num_key_value_heads", text["num_attention_heads"]),
        "tied": bool(config.get("tie_word_embeddings", False)),
    }


def _check_module_split(module: dict, tp: int, model: dict) -> None:
    """A sharded module of a checkpoint (shards.modules) splits over ``tp`` ranks."""
    if module["layout"] == "qwen2_text":
        prefix = module["module"] + "."
        state = {f"model.{k[len(prefix) :]}": v for k, v in model.items() if k.startswith(prefix)}
        _check_split(module, tp, state)
    elif module["layout"] == "discrete_head":
        if module["bins"] % tp:
            raise ConvertError(
                f"--tensor-parallel {tp}: the discrete head's {module['bins']} bins must split "
                "evenly over the ranks"
            )
    elif module["heads"] % tp:
        raise ConvertError(
            f"--tensor-parallel {tp}: the {module['module']} transformer's {module['heads']} "
            "heads must split evenly over the ranks"
        )


def _check_split(layout: dict, tp: int, state: dict) -> None:
    vocab = state["model.embed_tokens.weight"].shape[0]
    ffn = state["model.layers.0.mlp.up_proj.weight"].shape[0]
    if layout["groups"] % tp or vocab % tp or ffn % tp:
        raise ConvertError(
            f"--tensor-parallel {tp}: key-value groups {layout['groups']}, a vocabulary of {vocab} "
            f"and an MLP of {ffn} must split evenly over the ranks"
        )


def _hf_weights(source: Path) -> dict[str, torch.Tensor]:
    files = sorted(source.glob("*.safetensors"))
    if not files:
        raise ConvertError(f"{source}: no *.safetensors weights (save_pretrained writes them)")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(_read_safetensors(file))
    return state


def _require_qwen2_weights(state: dict, layout: dict, source: Path) -> None:
    """Every weight of a Qwen2 ``…ForCausalLM`` (keys under "model."; lm_head unless tied)."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    for i in range(layout["layers"]):
        hf = f"model.layers.{i}."
        names += [hf + "input_layernorm.weight", hf + "post_attention_layernorm.weight"]
        names += [f"{hf}self_attn.{p}_proj.{kind}" for p in "qkv" for kind in ("weight", "bias")]
        names += [hf + "self_attn.o_proj.weight"]
        names += [f"{hf}mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
    if not layout["tied"]:
        names.append("lm_head.weight")
    where = f"{source}: its safetensors weights (a Qwen2ForCausalLM's, keys under 'model.')"
    _require(state, names, where)


def _from_hf_dir(source: Path, to: str, tp: int):
    from embodied.megatron.layout import qwen2_to_megatron

    if to != "megatron":
        raise ConvertError(f"{source} is a Hugging Face directory: convert it --to megatron")
    config = _read_json(source / "config.json")
    layout = _qwen2_layout(config, source / "config.json")

    def write(out: Path) -> None:
        state = _hf_weights(source)
        _require_qwen2_weights(state, layout, source)
        if layout["tied"]:
            state.setdefault("lm_head.weight", state["model.embed_tokens.weight"])
        _check_split(layout, tp, state)
        _write_megatron_dir(out, qwen2_to_megatron(state, tp=tp, **layout), layout, source)

    return write


def _from_megatron_dir(source: Path, to: str, tp: int):
    from embodied.megatron.layout import qwen2_from_megatron, qwen2_to_megatron
    from embodied.megatron.shards import check_same_shapes

    info = _read_json(source / MEGATRON_META)
    _require(info, ("layers", "heads", "groups", "tied", "files"), str(source / MEGATRON_META))
    layout = {k: info[k] for k in ("layers", "heads", "groups", "tied")}
    if to == "torch":
        raise ConvertError(f"{source} holds a language model: convert it --to hf or --to megatron")

    def write(out: Path) -> None:
        files = []
        for name in info["files"]:
            if not (source / name).is_file():
                raise ConvertError(f"{source}: the shard {name} is missing")
            files.append(_read_safetensors(source / name))
        try:
            check_same_shapes(files, info["files"])
            state = qwen2_from_megatron(files, **layout)
        except (ValueError, KeyError, RuntimeError) as e:
            raise ConvertError(f"{source}: its shards do not fit {MEGATRON_META} ({e})") from None
        if to == "megatron":
            _check_split(layout, tp, state)
            _write_megatron_dir(out, qwen2_to_megatron(state, tp=tp, **layout), layout, source)
            return
        if layout["tied"]:  # (Hugging Face saves the shared matrix once)
            del state["lm_head.weight"]
        _copy_side_files(source, out, skip=(MEGATRON_META,))
        save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})

    return write


def _write_megatron_dir(out: Path, files: list[dict], layout: dict, source: Path) -> None:
    from embodied.megatron.shards import shard_file

    tp = len(files)
    names = [shard_file(rank, tp) for rank in range(tp)]
    for name, tensors in zip(names, files):
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / name))
    _copy_side_files(source, out, skip=(MEGATRON_META,))
    info = {"family": "qwen2", "tensor_parallel": tp, "files": names, **layout}
    (out / MEGATRON_META).write_text(json.dumps(info, indent=2))


def _copy_side_files(source: Path, out: Path, skip: tuple[str, ...] = ()) -> None:
    """The directory's files other than weights (config, tokenizer, processor)."""
    for path in source.iterdir():
        weights = path.suffix in (".safetensors", ".bin") or path.name.endswith(".index.json")
        if path.is_file() and not weights and path.name not in skip:
            shutil.copy2(path, out / path.name)
