"""The Megatron-core backend against torch at TP=1 and TP=2 (processes over gloo on the CPU):
the fusion transformer, the discrete head, the PPO, GRPO and SFT updates (bf16 too), a Qwen2
language model and a Qwen2.5-VL's, to float rounding."""

import pytest
import torch
from megatron_cases import (
    BC_HEADS,
    CASES,
    D,
    bc_steps,
    head_inputs,
    head_outputs,
    perturb_biases_and_norms,
    qwen2_inputs,
    tiny_qwen2,
    tiny_qwen2_5_vl,
    torch_fusion,
    torch_head,
    two_steps,
    variant_samples,
    vl_forward,
    vla_samples,
)
from megatron_ranks import rank_main


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def ranks(request, tmp_path_factory):
    """(TP size, the directory its ranks saved their results in)."""
    pytest.importorskip("megatron.core")
    tp = request.param
    out = tmp_path_factory.mktemp(f"tp{tp}")
    tiny_qwen2_5_vl(out / "vlm")
    torch.multiprocessing.spawn(rank_main, args=(tp, str(out)), nprocs=tp)
    return tp, out


def test_the_megatron_fusion_gives_the_torch_fusion_outputs_and_gradients(ranks):
    tp, tmp_path = ranks
    reference = torch_fusion()
    torch.manual_seed(1)
    x = torch.randn(3, 7, D, requires_grad=True)
    pad = torch.zeros(3, 7, dtype=torch.bool)
    pad[1, 5:] = True
    y = reference(x, src_key_padding_mask=pad)
    (y * torch.linspace(-1, 1, D)).square().sum().backward()
    want = {k: p.grad for k, p in reference.named_parameters()}
    for rank in range(tp):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        torch.testing.assert_close(got["output"], y.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got["input_grad"], x.grad, rtol=1e-5, atol=1e-5)
        assert got["grads"].keys() == want.keys()
        for name, grad in want.items():
            torch.testing.assert_close(got["grads"][name], grad, rtol=1e-5, atol=1e-5)
        # the shards gathered back are the torch weights, bit for bit
        state = reference.state_dict()
        assert all(torch.equal(got["weights"][k], state[k]) for k in state)


def test_the_megatron_discrete_head_gives_the_torch_heads_numbers(ranks):
    """At TP=1 and TP=2, each rank holding its share of every dimension's bins: the
    log-probabilities (megatron's vocabulary-parallel cross-entropy), the entropies, the
    gradients of both (context, weights) to 1e-5; the behaviour-cloning loss and accuracy, the
    deterministic sample; and the first of tied largest logits, as torch's argmax."""
    tp, tmp_path = ranks
    head = torch_head()
    want = head_outputs(
        head,
        *head_inputs(),
        lambda h: {k: p.grad for k, p in h.named_parameters()},
    )
    assert 2 / 3 <= want["accuracy"] < 1  # (two dimensions of three hit; the third by chance)
    for rank in range(tp):
        got = torch.load(tmp_path / f"head{rank}.pt")
        assert torch.equal(got["argmax"], torch.tensor([[[1, 4, 4]]]))
        assert torch.equal(got["deterministic"], torch.tensor([[[1, 4, 4]]]))
        assert torch.equal(got["tokens"], want["tokens"])
        assert got["accuracy"] == want["accuracy"]
        for key in ("logp", "entropy", "ctx_grad", "actions", "sampled_logp", "bc_loss"):
            torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-5)
        assert got["grads"].keys() == want["grads"].keys()
        for name, grad in want["grads"].items():
            torch.testing.assert_close(got["grads"][name], grad, rtol=1e-5, atol=1e-5)


def test_bf16_shards_keep_float32_main_weights_and_follow_the_float32_update(ranks):
    """Mixed precision at TP=1 and TP=2 (bf16 on the CPU here; a GPU run's default): the
    sharded modules' linear weights are bf16, everything else float32. The optimizer's main weights
    start at the float32 values (not their bf16 rounding) and stay float32: after two Adam
    steps they hold what bf16 cannot, and the bf16 weights are their rounding. The loss and
    norms are the float32 run's to bf16's precision, and so is each weight's update."""
    from embodied.learner import TorchEngine

    tp, tmp_path = ranks
    policy, algorithm, samples = vla_samples("grpo", head="discrete")
    start = {k: v.clone() for k, v in policy.state_dict().items()}
    want = two_steps(
        TorchEngine(policy, learning_rate=1e-3, max_grad_norm=0.5), algorithm, samples, lambda e: {}
    )
    after = policy.state_dict()
    sharded = ("fusion.", "head.")
    for rank in range(tp):
        got = torch.load(tmp_path / f"bf16{rank}.pt")
        for name, dtype in got["dtypes"].items():
            if not name.startswith(sharded):
                assert dtype == torch.float32, name
            elif "linear" in name or "logits" in name:  # (megatron keeps its norms float32)
                assert dtype == torch.bfloat16, name
        assert got["main_before"].keys() == {
            n for n, p in policy.named_parameters() if p.requires_grad
        }
        for name, value in got["main_before"].items():
            assert value.dtype == torch.float32 and torch.equal(value, start[name]), name
        # (GRPO's first loss is near 0: its ratios are 1 and its advantages centred)
        assert got["loss"] == pytest.approx(want["loss"], rel=2e-2, abs=1e-3)
        for step in ("grad_norm0", "grad_norm1"):
            assert got[step] == pytest.approx(want[step], rel=5e-2), step
        assert_the_same_update(got["main_after"], start, after)
        for name, main in got["main_after"].items():
            weight = got["weights_after"][name]  # (bf16 or float32: main, rounded)
            assert torch.equal(weight.float(), main.to(weight.dtype).float()), name
        qkv = got["main_after"]["fusion.layers.0.self_attn.in_proj_weight"]
        below_bf16 = qkv != qkv.to(torch.bfloat16).float()
        assert below_bf16.float().mean() > 0.9  # (float32 main weights, not bf16's)
    assert_shards_keep_what_acted_and_the_main_weights(tmp_path, got)


def assert_shards_keep_what_acted_and_the_main_weights(tmp_path, got: dict) -> None:
    """A bf16 run's shard files, joined: the weights are those that acted (the bf16 ones, as
    float32: what an evaluation loads), the main weights the optimizer's float32 ones (what a
    resumed run continues from)."""
    from embodied.checkpoint import read_shards
    from embodied.megatron.shards import join

    info = got["shards"]
    files = read_shards(tmp_path / "bf16_shards", info)
    model, mains = {}, {}
    join(files, info, model, None, mains)
    assert model.keys() == mains.keys()
    assert {k.split(".")[0] for k in model} == {"fusion", "head"}
    for name, weight in model.items():
        assert weight.dtype == torch.float32
        assert torch.equal(weight, got["weights_after"][name].float()), name
        assert torch.equal(mains[name], got["main_after"][name]), name
    assert not torch.equal(model["head.logits.weight"], mains["head.logits.weight"])
    assert got["engine_mains"].keys() == mains.keys()  # (gathered: the same at any TP size)
    assert all(torch.equal(got["engine_mains"][k], v) for k, v in mains.items())
    asked_none = {}
    join(files, info, asked_none, None)  # (what an evaluation does: no main weights)
    assert asked_none.keys() == model.keys()


def assert_the_same_update(mains: dict, start: dict, after: dict) -> None:
    """Each weight's update in the bf16 run (its main weights ``mains`` less ``start``) is the
    float32 run's (``after`` less ``start``) to bf16's precision. (The weights themselves cannot
    tell: two Adam steps move each by at most 1.5e-3, so a step that did nothing is close too.)"""
    updates = []
    for name, main in mains.items():
        want = after[name] - start[name]
        have = main - start[name]
        # (at most 0.17 of the float32 update's norm here; a step that did nothing: 1)
        assert (have - want).norm() <= 0.3 * want.norm(), name
        updates.append((have.flatten(), want.flatten()))
    have, want = (torch.cat(parts) for parts in zip(*updates))
    clear = want.abs() > 2e-4  # (a gradient near 0 may take either sign)
    assert clear.sum() > 10_000  # (27,699 of the 84,608 weights here)
    assert (have[clear].sign() == want[clear].sign()).float().mean() > 0.99  # (0.9994 here)


@pytest.mark.parametrize("head", BC_HEADS)
def test_sft_steps_on_megatron_are_the_torch_steps(ranks, head):
    """SFT's AdamW (decay on every weight, biases and norms too), clipped: the same losses,
    gradient norms and weights at TP=1 and TP=2; with the Gaussian head and with the discrete
    head (its bins sharded: cross-entropy over the ranks' logits)."""
    tp, out = ranks
    want = bc_steps("torch", head)
    assert want["grad_norm0"] > 0.05 and want["grad_norm1"] > 0.05  # (both steps clip)
    for rank in range(tp):
        got = torch.load(f"{out}/bc_{head}{rank}.pt")
        for key in (
            f"{metric}{step}" for metric in ("loss", "grad_norm", "accuracy") for step in range(3)
        ):
            assert got[key] == pytest.approx(want[key], rel=1e-5), key
        # (to 1e-5: with eps 1e-8, Adam scales a gradient near 0 by its own size, so its
        # rounding moves a weight by up to 1.2e-6 here)
        for name, value in want["state"].items():
            torch.testing.assert_close(got["state"][name], value, rtol=1e-5, atol=1e-5)


def test_a_learner_on_the_cpu_of_a_machine_with_a_gpu_takes_the_cpu_path(tmp_path):
    """SFT's learner is on the CPU whatever the machine has (so are the TP ranks of one run):
    in a process where CUDA is available, megatron's buffers, scratch and random states follow
    the learner, and its steps are the torch steps. They followed the machine: the weights moved
    into a CUDA buffer, and the first step failed (here, with no driver to give one)."""
    import subprocess
    import sys
    from pathlib import Path

    tests = Path(__file__).parent
    script = (
        "import sys, torch\n"
        "torch.cuda.is_available = lambda: True  # (a machine with a GPU)\n"
        "from megatron_cases import bc_steps\n"
        "torch.save(bc_steps('megatron'), sys.argv[1])\n"
    )
    out = tmp_path / "steps.pt"
    done = subprocess.run(
        [sys.executable, "-c", script, str(out)], cwd=tests, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    got = torch.load(out)
    want = bc_steps("torch")
    for key in ("loss0", "loss1", "grad_norm0", "grad_norm1"):
        assert got[key] == pytest.approx(want[key], rel=1e-5), key
    for name, value in want["state"].items():
        torch.testing.assert_close(got["state"][name], value, rtol=1e-5, atol=1e-5)


def assert_equal_states(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert torch.equal(got[name], value), name


@pytest.mark.parametrize("adam", ["torch", "fused"])
def test_sft_resumed_on_megatron_takes_the_uninterrupted_runs_step(ranks, adam):
    """SFT (AdamW, weight decay 0.1) saved after its second step and loaded by a new megatron
    learner: its weights, float32 main weights and torch copy are the checkpoint's and its Adam
    state the checkpoint's, bit for bit (megatron's dummy step that makes the state decayed
    every weight by lr x wd); the third step is the uninterrupted run's, bit for bit. "fused":
    with an Adam that counts steps per parameter group, as TE's and Apex's FusedAdam (torch's
    per weight): the same checkpoint, load and step."""
    tp, out = ranks
    suffix = "_fused" if adam == "fused" else ""
    whole = torch.load(f"{out}/bc_gaussian0.pt")  # (the uninterrupted run's, on megatron)
    for rank in range(tp):
        got = torch.load(f"{out}/bc_resume{suffix}{rank}.pt")
        saved = got["checkpoint"]
        for key in ("loaded_engine", "loaded_copy"):
            assert_equal_states(got[key], saved["model"])
        trained = got["loaded_main"]
        assert_equal_states(trained, {k: saved["model"][k] for k in trained})
        assert saved["optimizer"]["state"][0]["step"] == 2
        assert got["loaded_adam"]["state"].keys() == saved["optimizer"]["state"].keys()
        for index, entry in saved["optimizer"]["state"].items():
            assert_equal_states(got["loaded_adam"]["state"][index], entry)
            # (a weight no loss reaches, the Gaussian head's log-std in SFT, keeps its count)
            assert got["adam"]["state"][index]["step"] == (3 if entry["step"] == 2 else 1)
        assert got["loss2"] == whole["loss2"] and got["grad_norm2"] == whole["grad_norm2"]
        assert_equal_states(got["state"], whole["state"])


def torch_grads(engine) -> dict[str, torch.Tensor]:
    return {
        name: torch.zeros_like(p) if p.grad is None else p.grad.clone()
        for name, p in engine.policy.named_parameters()
        if p.requires_grad
    }


@pytest.mark.parametrize("name,vlm", CASES, ids=[name + vlm for name, vlm in CASES])
def test_megatron_updates_are_the_torch_updates(ranks, name, vlm):
    """PPO and GRPO, of the tiny VLA, of one on a tiny Qwen2.5-VL trained with it (its
    language model sharded too) and of one with the discrete head (its bins sharded): the same
    loss, gradients (to 1e-5) and gradient norms, and the same weights after two clipped Adam
    steps, at TP=1 and TP=2 (two processes)."""
    from embodied.learner import TorchEngine

    tp, tmp_path = ranks
    policy, algorithm, samples = variant_samples(name, vlm, tmp_path)
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    engine = TorchEngine(policy, learning_rate=1e-3, max_grad_norm=0.5)
    want = two_steps(engine, algorithm, samples, torch_grads)
    want["state"] = policy.state_dict()
    assert min(want["grad_norm0"], want["grad_norm1"]) > 0.5  # both steps are clipped
    moving = ["fusion.layers.1.linear2.weight"]
    if vlm == "_discrete":
        moving += ["head.logits.weight"]
    if vlm == "_vlm":  # (and the language model's, the vision tower's)
        text = "vlm.model.language_model."
        moving += [f"{text}layers.1.self_attn.q_proj.bias", f"{text}embed_tokens.weight"]
        moving += ["vlm.model.visual.blocks.0.mlp.up_proj.weight"]
    for key in moving:
        assert (want["state"][key] - before[key]).abs().max() > 1e-4, key
    runs = [f"{name}{vlm}{rank}" for rank in range(tp)]
    if name + vlm == "grpo_vlm":  # (with activation recomputation too)
        runs += [f"{name}{vlm}_recompute{rank}" for rank in range(tp)]
        plain = torch.load(tmp_path / f"{name}{vlm}0.pt")["layer_calls"]
        recomputed = torch.load(tmp_path / f"{name}{vlm}_recompute0.pt")["layer_calls"]
        assert (plain, recomputed) == (2, 4)  # (each layer's forward again in the backward)
    for run in runs:
        got = torch.load(tmp_path / f"{run}.pt")
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5, abs=1e-6)
        for step in ("grad_norm0", "grad_norm1"):
            assert got[step] == pytest.approx(want[step], rel=1e-5), step
        assert got["grads"].keys() == want["grads"].keys()
        for key, grad in want["grads"].items():
            torch.testing.assert_close(got["grads"][key], grad, rtol=1e-5, atol=1e-5)
        assert got["state"].keys() == want["state"].keys()
        for key, value in want["state"].items():
            torch.testing.assert_close(got["state"][key], value, rtol=1e-5, atol=1e-5)


def test_megatron_qwen2_gives_the_hugging_face_logits(ranks):
    """At TP=1 and TP=2: the converted model's logits equal the Hugging Face forward's to 1e-5
    (at every token of a padded batch), each rank holds only its slice of the vocabulary, the
    vocabulary-parallel log-probabilities of the next tokens equal log_softmax's, and the weights
    gathered back are the Hugging Face ones, bit for bit."""
    tp, tmp_path = ranks
    ids, mask = qwen2_inputs()
    valid = mask.bool()
    for tied in (False, True):
        hf = tiny_qwen2(tied)
        with torch.no_grad():
            want = hf(input_ids=ids, attention_mask=mask).logits  # [B, L, V]
        logp = want.log_softmax(-1).gather(-1, ids.roll(-1, dims=1)[..., None])[..., 0]
        state = hf.state_dict()
        for rank in range(tp):
            got = torch.load(tmp_path / f"qwen{rank}.pt")[tied]
            assert got["logits_slice"].shape == (3, 9, 64 // tp)
            torch.testing.assert_close(got["logits"][valid], want[valid], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got["logprobs"][valid], logp[valid], rtol=1e-5, atol=1e-5)
            assert got["state"].keys() == state.keys()
            assert all(torch.equal(got["state"][k], state[k]) for k in state)


def test_a_qwen2_5_vl_language_model_on_megatron_gives_the_hugging_face_states(ranks):
    """At TP=1 and TP=2: images and instructions through the VLM with its language model on
    megatron (3-D rotary positions over the images' patches) give the Hugging Face model's last
    hidden states and the same gradients, for the language model (each rank holding half the
    vocabulary at TP=2) and for the vision tower, to 1e-5; the weights gather back bit for bit."""
    from embodied.models.vla.hf_vlm import HFVisionLanguage

    tp, out = ranks
    vlm = HFVisionLanguage(out / "vlm", freeze=False)
    text = vlm.model.language_model
    perturb_biases_and_norms(text)
    hidden, mask = vl_forward(vlm)
    assert mask.sum(1).tolist() == [15, 20, 13]  # (two images' 4 tokens each, marks, words)
    vocabulary = text.embed_tokens.weight.shape[0]
    for rank in range(tp):
        got = torch.load(out / f"vl{rank}.pt")
        assert torch.equal(got["mask"], mask)
        torch.testing.assert_close(got["hidden"][mask], hidden[mask], rtol=1e-5, atol=1e-5)
        assert torch.isfinite(got["hidden"]).all()
        assert got["vocabulary_slice"] == vocabulary // tp
        want = {k: p.grad for k, p in text.named_parameters()}
        assert got["text_grads"].keys() == want.keys()
        for name, grad in want.items():
            torch.testing.assert_close(got["text_grads"][name], grad, rtol=1e-5, atol=1e-5)
        for name, param in vlm.model.visual.named_parameters():
            torch.testing.assert_close(got["vision_grads"][name], param.grad, rtol=1e-5, atol=1e-5)
        assert all(torch.equal(got["text_weights"][k], v) for k, v in text.state_dict().items())
