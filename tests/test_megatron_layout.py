"""The torch <-> megatron weight layout, bit-exact and checked by hand: the fusion, the
discrete head, a Qwen2, a checkpoint sharded by TP rank, ``embodied convert``; and what the
torch backend never imports."""

import json
import shutil
import subprocess
import sys

import pytest
import torch
from megatron_cases import (
    HEADS,
    LAYERS,
    D,
    assert_same_checkpoint,
    convert_cli,
    tiny_qwen2,
    tiny_qwen2_5_vl,
    torch_fusion,
)
from torch import nn

from embodied.megatron.layout import (
    discrete_head_from_megatron,
    discrete_head_to_megatron,
    encoder_from_megatron,
    encoder_to_megatron,
    qkv_from_megatron,
    qkv_to_megatron,
)


def test_qkv_rows_are_grouped_per_query_group_and_split_by_group():
    """4 query heads in 2 groups, head size 1, over 2 ranks: rank 0 holds group 0's rows
    [q0, q1, k0, v0], rank 1 group 1's [q2, q3, k1, v1]; and back."""
    q = torch.tensor([[0.0], [1.0], [2.0], [3.0]])  # [heads * hd, 1]: q row h = h
    k = torch.tensor([[10.0], [11.0]])
    v = torch.tensor([[20.0], [21.0]])
    ranks = qkv_to_megatron(q, k, v, heads=4, groups=2, tp=2)
    assert [r.flatten().tolist() for r in ranks] == [[0, 1, 10, 20], [2, 3, 11, 21]]
    back = qkv_from_megatron(ranks, heads=4, groups=2)
    assert all(torch.equal(a, b) for a, b in zip(back, (q, k, v)))
    # multi-head attention (a group per head), head size 2: a head's q, k, v rows adjacent
    q, k, v = torch.arange(12.0).view(3, 4, 1).unbind(0)  # q 0-3, k 4-7, v 8-11
    (whole,) = qkv_to_megatron(q, k, v, heads=2, groups=2, tp=1)
    assert whole.flatten().tolist() == [0, 1, 4, 5, 8, 9, 2, 3, 6, 7, 10, 11]
    with pytest.raises(ValueError, match="do not split over TP=4"):
        qkv_to_megatron(q, k, v, heads=2, groups=2, tp=4)


def test_the_fusion_converts_to_megatron_shards_and_back_bit_exact():
    state = torch_fusion().state_dict()
    for tp in (1, 2, 4):
        shards = encoder_to_megatron(state, layers=LAYERS, heads=HEADS, tp=tp)
        # column-parallel rows and row-parallel columns split; norms and row biases whole
        qkv = shards[0]["layers.0.self_attention.linear_qkv.weight"]
        assert qkv.shape == (3 * D // tp, D)
        assert shards[0]["layers.1.mlp.linear_fc2.weight"].shape == (D, 4 * D // tp)
        assert shards[-1]["layers.1.mlp.linear_fc2.bias"].shape == (D,)
        # rank 0's first head: its q, k, v rows of the torch in_proj, in that order
        hd = D // HEADS
        in_proj = state["layers.0.self_attn.in_proj_weight"]
        assert torch.equal(qkv[:hd], in_proj[:hd])
        assert torch.equal(qkv[hd : 2 * hd], in_proj[D : D + hd])
        assert torch.equal(qkv[2 * hd : 3 * hd], in_proj[2 * D : 2 * D + hd])
        back = encoder_from_megatron(shards, layers=LAYERS, heads=HEADS)
        assert back.keys() == state.keys()
        assert all(torch.equal(back[k], state[k]) for k in state)


def test_the_discrete_heads_bins_split_over_the_ranks_dimension_by_dimension():
    """2 action dimensions of 4 bins (rows 0-3, 4-7) over 2 ranks: rank 0 holds bins 0-1 of each
    dimension [0, 1, 4, 5], rank 1 bins 2-3 [2, 3, 6, 7], for the weight and the bias; and back
    bit for bit. 4 bins do not split over 3 ranks."""
    state = {"logits.weight": torch.arange(8.0).view(8, 1), "logits.bias": torch.arange(8.0)}
    shards = discrete_head_to_megatron(state, actions=2, bins=4, tp=2)
    for name in state:
        assert [s[name].flatten().tolist() for s in shards] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    back = discrete_head_from_megatron(shards, actions=2, bins=4)
    assert all(torch.equal(back[k], v) for k, v in state.items())
    with pytest.raises(ValueError, match="4 bins do not split over TP=3"):
        discrete_head_to_megatron(state, actions=2, bins=4, tp=3)


class FusionPolicy(nn.Module):
    """A head before the fusion and a frozen encoder after it: the fusion's Adam entries sit
    between others in the optimizer's order."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(3, 2)
        self.fusion = torch_fusion()
        self.encoder = nn.Linear(2, 2).requires_grad_(False)


def adam_state(policy: nn.Module) -> dict:
    """Adam's state dict after one step of a random loss."""
    params = [p for p in policy.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(params, lr=1e-3)
    sum((p * torch.randn_like(p)).sum() for p in params).backward()
    optimizer.step()
    return optimizer.state_dict()


def test_a_checkpoint_sharded_by_tp_rank_loads_as_the_torch_layout(tmp_path):
    """Sharded at TP=2: each rank's file holds half of the fusion's QKV rows and their Adam
    moments under megatron's names, model.safetensors and trainer.pt hold the rest; loading
    joins them into the torch layout bit for bit."""
    from embodied.checkpoint import CheckpointError, load_checkpoint, save_checkpoint, write_shard
    from embodied.megatron import shards

    torch.manual_seed(0)
    policy = FusionPolicy()
    optimizer_state = adam_state(policy)
    trainable = [n for n, p in policy.named_parameters() if p.requires_grad]
    modules = shards.modules(policy)
    assert modules == [
        {"module": "fusion", "layout": "transformer_encoder", "layers": LAYERS, "heads": HEADS}
    ]
    info = shards.shard_info(modules, tp=2, trainable=trainable)

    class Saved:  # (what an engine hands the checkpoint: its optimizer's state_dict)
        def state_dict(self):
            return rest_optimizer

    state = policy.state_dict()
    rest, rest_optimizer, files = shards.split(state, optimizer_state, info)
    assert not any(k.startswith("fusion.") for k in rest)
    fusion_indices = {i for i, n in enumerate(trainable) if n.startswith("fusion.")}
    assert rest_optimizer["state"].keys() == optimizer_state["state"].keys() - fusion_indices
    qkv = "fusion/layers.0.self_attention.linear_qkv.weight"
    assert files[1][f"weight/{qkv}"].shape == (3 * D // 2, D)
    assert files[1][f"exp_avg_sq/{qkv}"].shape == (3 * D // 2, D)
    assert files[0]["step"].item() == 1

    def write(directory):
        for rank, tensors in enumerate(files):
            write_shard(directory, rank, 2, tensors)
        return info

    path = save_checkpoint(
        tmp_path, 1, model=policy, optimizer=Saved(), counters={}, meta={}, shards=write
    )
    assert sorted(p.name for p in path.glob("model*")) == [
        "model-tp00-of-02.safetensors",
        "model-tp01-of-02.safetensors",
        "model.safetensors",
    ]
    loaded = load_checkpoint(tmp_path)
    assert loaded["model"].keys() == state.keys()
    assert all(torch.equal(loaded["model"][k], v) for k, v in state.items())
    entries = loaded["optimizer"]["state"]
    assert entries.keys() == optimizer_state["state"].keys()
    for index, entry in optimizer_state["state"].items():
        for key, value in entry.items():
            assert torch.equal(entries[index][key], value), (trainable[index], key)
    # a checkpoint of the first sharded format (one module, its names without the module's)
    # loads the same
    legacy = {"module": "fusion", "layout": "transformer_encoder", "layers": LAYERS}
    legacy.update(heads=HEADS, tensor_parallel=2, files=info["files"], trainable=trainable)
    legacy_files = [{k.replace("/fusion/", "/"): v for k, v in f.items()} for f in files]
    model = dict(rest)
    optimizer = {**rest_optimizer, "state": dict(rest_optimizer["state"])}
    shards.join(legacy_files, legacy, model, optimizer)
    assert all(torch.equal(model[k], v) for k, v in state.items())
    for index, entry in optimizer_state["state"].items():
        assert all(torch.equal(optimizer["state"][index][k], v) for k, v in entry.items())
    (path / "model-tp01-of-02.safetensors").unlink()
    with pytest.raises(CheckpointError, match="shard model-tp01-of-02.safetensors is missing"):
        load_checkpoint(tmp_path)


def test_nothing_of_megatron_is_imported_by_the_torch_backend():
    code = (
        "import sys, embodied.cli, embodied.runner, embodied.sft, embodied.models.vla\n"
        "print([m for m in sys.modules if m.split('.')[0] == 'megatron'])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("tied", [False, True])
def test_qwen2_converts_to_megatron_shards_and_back_bit_exact(tied):
    from embodied.megatron.layout import qwen2_from_megatron, qwen2_to_megatron

    state = tiny_qwen2(tied).state_dict()
    sizes = dict(layers=2, heads=4, groups=2, tied=tied)
    for tp in (1, 2):
        shards = qwen2_to_megatron(state, tp=tp, **sizes)
        # each rank's first MLP rows: its share of the gate's rows, then of the up rows
        fc1 = shards[-1]["decoder.layers.0.mlp.linear_fc1.weight"]
        gate = state["model.layers.0.mlp.gate_proj.weight"]
        up = state["model.layers.0.mlp.up_proj.weight"]
        assert torch.equal(fc1, torch.cat([gate.chunk(tp)[-1], up.chunk(tp)[-1]]))
        assert shards[0]["embedding.word_embeddings.weight"].shape == (64 // tp, 32)
        assert ("output_layer.weight" in shards[0]) == (not tied)
        back = qwen2_from_megatron(shards, **sizes)
        assert back.keys() == state.keys()
        assert all(torch.equal(back[k], state[k]) for k in state)


def test_a_partly_frozen_language_model_is_a_one_line_error(tmp_path):
    """Megatron shards a module whole: trained or frozen, not half of each."""
    pytest.importorskip("megatron.core")
    from scripted_envs import TINY_VLA, PushRightEnv

    from embodied.env_group import EnvGroup
    from embodied.megatron.engine import shard_policy
    from embodied.models.vla import VLA, VLAConfig

    config = VLAConfig(**{**TINY_VLA, "vlm_path": str(tiny_qwen2_5_vl(tmp_path / "vlm"))})
    policy = VLA(EnvGroup(PushRightEnv(2)).spec, config)
    policy.requires_grad_(True)
    policy.vlm.model.language_model.norm.weight.requires_grad_(False)
    with pytest.raises(ValueError, match="^vlm.model.language_model: a module partly frozen"):
        shard_policy(policy)
    assert isinstance(policy.fusion, nn.TransformerEncoder)  # (nothing swapped before the error)


def test_convert_shards_a_checkpoint_by_tp_rank_and_joins_it_bit_exact(tmp_path):
    """A torch run's checkpoint -> megatron shards at TP=2 (the files a TP=2 run writes) ->
    the torch layout again: weights, Adam state and counters bit for bit."""
    from safetensors.torch import load_file, save_file
    from scripted_envs import GRPO, TINY_VLA, PushRightEnv, run_on

    from embodied.checkpoint import load_checkpoint

    torch.manual_seed(0)
    run_on(
        PushRightEnv(8),
        tmp_path / "run",
        total_env_steps=8 * 3,
        policy={**TINY_VLA, "layers": 2},
        algorithm={**GRPO, "max_rounds": 1, "dynamic_sampling": False},
        save_every=1,
    )
    original = load_checkpoint(tmp_path / "run")
    assert original["optimizer"]["state"]  # (an update ran: there are moments to move)
    assert (
        convert_cli(tmp_path / "run", "--to", "megatron", "--tensor-parallel", 2, tmp_path / "mg")[
            0
        ]
        == 0
    )
    rank1 = load_file(tmp_path / "mg" / "model-tp01-of-02.safetensors")
    fc1 = original["model"]["fusion.layers.1.linear1.weight"]
    assert torch.equal(rank1["weight/fusion/layers.1.mlp.linear_fc1.weight"], fc1.chunk(2)[1])
    assert "exp_avg/fusion/layers.1.mlp.linear_fc1.weight" in rank1
    whole = load_file(tmp_path / "mg" / "model.safetensors")
    assert not [k for k in whole if k.startswith("fusion.")] and "queries" in whole
    assert_same_checkpoint(load_checkpoint(tmp_path / "mg"), original)
    assert convert_cli(tmp_path / "mg", "--to", "torch", tmp_path / "back")[0] == 0
    assert "fusion.layers.0.linear1.weight" in load_file(tmp_path / "back" / "model.safetensors")
    assert_same_checkpoint(load_checkpoint(tmp_path / "back"), original)
    # one-line errors: an existing output, heads that do not split, no Hugging Face model
    code, err = convert_cli(tmp_path / "run", "--to", "torch", tmp_path / "back")
    assert code == 2 and "back exists; give a new directory" in err
    code, err = convert_cli(
        tmp_path / "run", "--to", "megatron", "--tensor-parallel", 3, tmp_path / "x"
    )
    assert code == 2 and "--tensor-parallel 3: the fusion transformer's 2 heads" in err
    code, err = convert_cli(tmp_path / "run", "--to", "hf", tmp_path / "x")
    assert code == 2 and "the policy holds no Hugging Face model" in err
    assert not (tmp_path / "x").exists()
    # --to torch rebuilds no policy: a policy.vlm_path moved since is not needed
    meta = json.loads((tmp_path / "mg" / "meta.json").read_text())
    meta["config"]["policy"]["vlm_path"] = str(tmp_path / "moved")
    (tmp_path / "mg" / "meta.json").write_text(json.dumps(meta))
    assert convert_cli(tmp_path / "mg", "--to", "torch", tmp_path / "whole")[0] == 0
    # a readable shard file of another size: every reader (load_checkpoint) names it
    shard = tmp_path / "mg" / "model-tp01-of-02.safetensors"
    tensors = load_file(shard)
    tensors[qkv := "weight/fusion/layers.0.self_attention.linear_qkv.weight"] = fc1[:5]
    save_file(tensors, shard)
    code, err = convert_cli(tmp_path / "mg", "--to", "torch", tmp_path / "x")
    assert code == 2 and err.count("\n") == 1, err
    assert f"model-tp01-of-02.safetensors: {qkv} is [5, {fc1.shape[1]}]" in err


@pytest.mark.parametrize("tied", [False, True])
def test_convert_takes_a_hugging_face_qwen2_to_megatron_shards_and_back_bit_exact(tmp_path, tied):
    """Hugging Face -> megatron TP=2 (the shards of the layout's mapping) -> TP=1 -> Hugging
    Face: the weights bit for bit, and the model loads and gives the same logits."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from embodied.megatron.layout import qwen2_to_megatron

    model = tiny_qwen2(tied)
    model.save_pretrained(tmp_path / "hf")
    state = model.state_dict()
    assert (
        convert_cli(tmp_path / "hf", "--to", "megatron", "--tensor-parallel", 2, tmp_path / "tp2")[
            0
        ]
        == 0
    )
    want = qwen2_to_megatron(state, layers=2, heads=4, groups=2, tp=2, tied=tied)
    for rank in range(2):
        got = load_file(tmp_path / "tp2" / f"model-tp{rank:02d}-of-02.safetensors")
        assert got.keys() == want[rank].keys()
        assert all(torch.equal(got[k], v) for k, v in want[rank].items())
    assert convert_cli(tmp_path / "tp2", "--to", "megatron", tmp_path / "tp1")[0] == 0
    assert convert_cli(tmp_path / "tp1", "--to", "hf", tmp_path / "back")[0] == 0
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "back", local_files_only=True).eval()
    assert back.state_dict().keys() == state.keys()
    assert all(torch.equal(back.state_dict()[k], v) for k, v in state.items())
    tokens = torch.tensor([[1, 5, 9, 33, 2]])
    with torch.no_grad():
        assert torch.equal(back(tokens).logits, model(tokens).logits)
    code, err = convert_cli(
        tmp_path / "tp1", "--to", "megatron", "--tensor-parallel", 4, tmp_path / "x"
    )
    assert code == 2 and "key-value groups 2, a vocabulary of 64 and an MLP of 48 must" in err


def test_a_conversion_is_on_disk_before_it_is_renamed_into_place(tmp_path, monkeypatch):
    """Staged and renamed, never synced: after a machine's crash OUT could stand complete with
    its files cut short (a conversion is often the last step before its source is deleted)."""
    import os

    from embodied.convert import convert

    tiny_qwen2(False).save_pretrained(tmp_path / "hf")
    synced = []
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(os.readlink(f"/proc/self/fd/{fd}")))
    out = convert(tmp_path / "hf", "megatron", tmp_path / "tp1")
    staged = str(tmp_path / ".tp1.tmp")
    written = sorted(p.name for p in out.iterdir())
    assert sorted(s.rsplit("/", 1)[1] for s in synced if s.startswith(staged + "/")) == written
    assert synced[-2:] == [staged, str(tmp_path)] and len(written) >= 2


def test_convert_names_the_file_or_key_of_a_bad_hugging_face_or_megatron_input(tmp_path):
    """One line, exit 2, naming what is wrong: a Qwen2Model's weights (no "model." prefix), an
    untied model without lm_head, a damaged config.json or one without a layer count, a
    damaged megatron.json or one without its files, a truncated shard, a shard of another
    size."""
    from safetensors.torch import load_file, save_file

    def bad(name: str, to: str, *said: str) -> None:
        code, err = convert_cli(tmp_path / name, "--to", to, tmp_path / f"{name}_out")
        assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
        assert err.startswith("embodied: error: ") and all(s in err for s in said), err

    tiny_qwen2(False).save_pretrained(tmp_path / "hf")
    weights = load_file(tmp_path / "hf" / "model.safetensors")
    for name, state in {
        "bare": {k.removeprefix("model."): v for k, v in weights.items()},
        "headless": {k: v for k, v in weights.items() if k != "lm_head.weight"},
    }.items():
        shutil.copytree(tmp_path / "hf", tmp_path / name)
        save_file(state, tmp_path / name / "model.safetensors", metadata={"format": "pt"})
    bad("bare", "megatron", "no 'model.embed_tokens.weight'", "keys under 'model.'")
    bad("headless", "megatron", "headless: its safetensors", "no 'lm_head.weight'")

    def edited(source: str, file: str, edits: dict[str, str]) -> None:
        for name, text in edits.items():  # (a copy of ``source`` whose ``file`` reads ``text``)
            shutil.copytree(tmp_path / source, tmp_path / name)
            (tmp_path / name / file).write_text(text)

    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    layerless = json.dumps({k: v for k, v in config.items() if k != "num_hidden_layers"})
    edited("hf", "config.json", {"damaged": "{not json", "layerless": layerless})
    bad("damaged", "megatron", "damaged/config.json: not valid JSON")
    bad("layerless", "megatron", "layerless/config.json: no 'num_hidden_layers'")
    assert (
        convert_cli(tmp_path / "hf", "--to", "megatron", "--tensor-parallel", 2, tmp_path / "mg")[0]
        == 0
    )
    meta = json.loads((tmp_path / "mg" / "megatron.json").read_text())
    fileless = json.dumps({k: v for k, v in meta.items() if k != "files"})
    edited("mg", "megatron.json", {"mg_damaged": "{", "mg_fileless": fileless})
    bad("mg_damaged", "hf", "mg_damaged/megatron.json: not valid JSON")
    bad("mg_fileless", "hf", "mg_fileless/megatron.json: no 'files'")
    shutil.copytree(tmp_path / "mg", tmp_path / "mg_cut")
    shard = tmp_path / "mg_cut" / "model-tp01-of-02.safetensors"
    shard.write_bytes(shard.read_bytes()[:200])
    bad("mg_cut", "hf", "model-tp01-of-02.safetensors: cannot be read")
    shutil.copytree(tmp_path / "mg", tmp_path / "mg_resized")
    shard = tmp_path / "mg_resized" / "model-tp01-of-02.safetensors"
    tensors = load_file(shard)
    fc2 = "decoder.layers.1.mlp.linear_fc2.weight"
    tensors[fc2] = tensors[fc2][:, :3].contiguous()
    save_file(tensors, shard)
    bad("mg_resized", "hf", "do not fit megatron.json", f"model-tp01-of-02.safetensors: {fc2} is")


@pytest.mark.slow  # (8 s; the conversions' bit-exactness is tested in the default suite above)
def test_convert_writes_a_vlas_hugging_face_model_with_the_trained_weights(tmp_path):
    """A VLA on a Qwen2.5-VL directory, trained one update with the VLM unfrozen -> --to hf:
    the directory loads with transformers and holds the checkpoint's VLM weights (not the
    original's), with the processor files beside them."""
    from safetensors.torch import load_file
    from scripted_envs import GRPO, TINY_VLA, PushRightEnv, run_on
    from tiny_vlms import qwen2_5_vl
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    from embodied.checkpoint import load_checkpoint

    vlm = qwen2_5_vl(tmp_path / "vlm")
    torch.manual_seed(0)
    run_on(
        PushRightEnv(8),
        tmp_path / "run",
        total_env_steps=8 * 3,
        policy={**TINY_VLA, "vlm_path": str(vlm), "freeze_vlm": False},
        algorithm={**GRPO, "max_rounds": 1, "dynamic_sampling": False},
        save_every=1,
    )
    assert convert_cli(tmp_path / "run", "--to", "hf", tmp_path / "hf")[0] == 0
    load = AutoModelForImageTextToText.from_pretrained
    converted = load(tmp_path / "hf", local_files_only=True).model.state_dict()
    original = load(vlm, local_files_only=True).model.state_dict()
    trained = load_checkpoint(tmp_path / "run")["model"]
    assert converted.keys() == original.keys()
    assert all(torch.equal(converted[k], trained[f"vlm.model.{k}"]) for k in converted)
    assert any(not torch.equal(converted[k], original[k]) for k in converted)
    assert (
        AutoTokenizer.from_pretrained(tmp_path / "hf").vocab
        == AutoTokenizer.from_pretrained(vlm).vocab
    )
    # to megatron shards (the fusion and the language model), and from them to hf the same
    code, err = convert_cli(
        tmp_path / "run", "--to", "megatron", "--tensor-parallel", 2, tmp_path / "mg2"
    )
    assert code == 2 and "--tensor-parallel 2: key-value groups 1," in err
    assert convert_cli(tmp_path / "run", "--to", "megatron", tmp_path / "mg")[0] == 0
    shard = load_file(tmp_path / "mg" / "model-tp00-of-01.safetensors")
    assert "weight/vlm.model.language_model/embedding.word_embeddings.weight" in shard
    assert convert_cli(tmp_path / "mg", "--to", "hf", tmp_path / "hf2")[0] == 0
    again = load(tmp_path / "hf2", local_files_only=True).model.state_dict()
    assert again.keys() == converted.keys()
    assert all(torch.equal(again[k], converted[k]) for k in converted)
