"""The Megatron-core backend: the torch <-> megatron weight layout (bit-exact, by hand), and the
fusion transformer on megatron-core against the torch one at TP=1 and TP=2 (processes over
gloo on the CPU)."""

import contextlib
import os
import socket
import subprocess
import sys

import pytest
import torch
from torch import nn

from embodied.megatron.layout import (
    discrete_head_from_megatron,
    discrete_head_to_megatron,
    encoder_from_megatron,
    encoder_to_megatron,
    qkv_from_megatron,
    qkv_to_megatron,
)

D, HEADS, LAYERS = 32, 4, 2


def torch_fusion(seed: int = 0) -> nn.TransformerEncoder:
    """The VLA's fusion transformer (models/vla/policy.py) at test size."""
    torch.manual_seed(seed)
    layer = nn.TransformerEncoderLayer(
        D, HEADS, 4 * D, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
    )
    return nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def tp_process(rank: int, tp: int, port: int):
    """This process as TP rank ``rank`` of ``tp`` over gloo, megatron's groups set up."""
    import torch.distributed as dist

    from embodied.megatron import parallel

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=tp)
    try:
        parallel.initialize(tp, seed=0)
        yield
        parallel.destroy()
    finally:
        dist.destroy_process_group()


def fusion_rank(rank: int, tp: int, out: str) -> None:
    """One TP rank: the megatron fusion loaded from the torch one; its output, input gradient
    and weight gradients (gathered, in the torch layout) saved for the test to compare."""
    from embodied.megatron.fusion import MegatronFusion

    reference = torch_fusion()
    fusion = MegatronFusion(D, HEADS, LAYERS)
    fusion.load_torch_state(reference.state_dict())
    torch.manual_seed(1)
    x = torch.randn(3, 7, D, requires_grad=True)
    pad = torch.zeros(3, 7, dtype=torch.bool)
    pad[1, 5:] = True  # sample 1 ends two tokens early
    y = fusion(x, src_key_padding_mask=pad)
    (y * torch.linspace(-1, 1, D)).square().sum().backward()
    grads = {k: p.grad for k, p in fusion.block.named_parameters()}
    result = {
        "output": y.detach(),
        "input_grad": x.grad,
        "grads": fusion.torch_state(grads),
        "weights": fusion.torch_state(),
    }
    torch.save(result, f"{out}/rank{rank}.pt")


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


def torch_head():
    """The VLA's discrete head at test size: 3 action dimensions of 8 bins, logits of size ~6
    (a peaked softmax, bins far from uniform)."""
    from embodied.models.vla.heads import DiscreteTokenHead

    torch.manual_seed(2)
    head = DiscreteTokenHead(D, 3, 8)
    nn.init.normal_(head.logits.weight, std=1.0)
    nn.init.normal_(head.logits.bias, std=1.0)
    return head


def head_inputs():
    """Context tokens f32 [4, 2, D] (requiring their gradient), bins long [4, 2, 3] and the
    weights of a loss over log-probabilities f32 [4, 2, 3] and entropies f32 [4]."""
    generator = torch.Generator().manual_seed(3)
    ctx = torch.randn(4, 2, D, generator=generator).requires_grad_()
    tokens = torch.randint(0, 8, (4, 2, 3), generator=generator)
    return (
        ctx,
        tokens,
        torch.randn(4, 2, 3, generator=generator),
        torch.randn(4, generator=generator),
    )


def head_outputs(head, ctx, tokens, weigh_logp, weigh_entropy, grads_of) -> dict:
    """The head's log-probabilities of ``tokens``, entropies, the gradients of a loss over both
    (context and weights), its behaviour-cloning loss and token accuracy towards targets half of
    which are its most likely bins, and its deterministic sample."""
    logp, entropy = head.log_prob(ctx, {"tokens": tokens})
    ((logp * weigh_logp).sum() + (entropy * weigh_entropy).sum()).backward()
    out = {"logp": logp.detach(), "entropy": entropy.detach(), "ctx_grad": ctx.grad}
    out["grads"] = grads_of(head)
    with torch.no_grad():
        actions, sampled_logp, extras = head.sample(ctx, deterministic=True)
        target = torch.where(torch.arange(3) < 2, actions, head.centers[tokens])
        mask = torch.ones(4, 2)
        loss, metrics = head.bc_loss(ctx, target, mask)
    out.update(actions=actions, sampled_logp=sampled_logp, tokens=extras["tokens"])
    out.update(bc_loss=loss, accuracy=metrics["sft/token_accuracy"])
    return out


def head_rank(rank: int, tp: int, out: str) -> None:
    """One TP rank: the megatron discrete head loaded from the torch one (``head_outputs``,
    the weight gradients gathered into the torch layout); and its argmax over the ranks on
    hand-built logits."""
    from embodied.megatron.heads import MegatronDiscreteHead

    head = MegatronDiscreteHead(D, 3, 8)
    head.load_torch_state(torch_head().state_dict())
    result = head_outputs(
        head,
        *head_inputs(),
        lambda h: h.torch_state({k: p.grad for k, p in h.named_parameters()}),
    )
    # the largest logit twice, at bins 1 and 6 (ranks 0 and 1 at TP=2), then once at bin 4;
    # then 0 at bin 3 and 1e-8 at bin 4, which log-softmax would round equal
    logits = torch.tensor(
        [[0.0, 5, 1, 2, 3, 4, 5, 0], [0, 1, 2, 3, 9, 4, 5, 6], [-9, -9, -9, 0, 1e-8, -9, -9, -9]]
    ).view(1, 1, 3, 8)
    mine = logits.chunk(tp, dim=-1)[rank]
    result["argmax"] = head._argmax(mine)
    # the deterministic action on the same logits, as the head's biases (no weights)
    tie = torch_head()
    with torch.no_grad():
        tie.logits.weight.zero_()
        tie.logits.bias.copy_(logits.view(-1))
    head.load_torch_state(tie.state_dict())
    _, _, extras = head.sample(torch.zeros(1, 1, D), deterministic=True)
    result["deterministic"] = extras["tokens"]
    torch.save(result, f"{out}/head{rank}.pt")


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


def test_nothing_of_megatron_is_imported_by_the_torch_backend():
    code = (
        "import sys, embodied.cli, embodied.runner, embodied.sft, embodied.models.vla\n"
        "print([m for m in sys.modules if m.split('.')[0] == 'megatron'])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# --- the update: one PPO and one GRPO step on megatron against the torch engine ---------------
def vla_samples(name: str, vlm: str = "", head: str = "gaussian"):
    """(tiny VLA, algorithm, prepared samples): one round of the test task (8 environments,
    cameras and state), the fusion transformer 2 layers of 2 heads, the action ``head``; with
    ``vlm``, on that Qwen2.5-VL directory, trained (``tiny_vl``'s weights)."""
    from scripted_envs import TINY_VLA, PushRightEnv, prepared_samples

    from embodied.env_group import EnvGroup
    from embodied.grpo import GRPO, GRPOConfig
    from embodied.models.vla import VLA, VLAConfig
    from embodied.ppo import PPO, PPOConfig

    torch.manual_seed(0)
    envs = EnvGroup(PushRightEnv(8))
    config = {**TINY_VLA, "layers": 2, "value_head": name == "ppo", "head": head}
    if vlm:
        config.update(vlm_path=vlm, freeze_vlm=False)
    policy = VLA(envs.spec, VLAConfig(**config)).eval()
    if vlm:
        perturb_biases_and_norms(policy.vlm.model.language_model)
    if name == "ppo":
        ppo = PPOConfig(num_steps=3, logprob_level="token", vf_clip=0.2, ent_coef=0.01)
        algorithm = PPO(ppo, seed=0, num_envs=envs.num_envs)
    else:
        grpo = GRPOConfig(group_size=4, kl_coef=0.1, logprob_level="action")
        algorithm = GRPO(
            grpo,
            seed=100,
            task_of_env=envs.task_of_env,
            chunk_size=1,
            max_episode_steps=3,
            policy=policy,
        )
    samples = prepared_samples(envs, policy, algorithm)
    return policy.train(), algorithm, samples


def two_steps(engine, algorithm, samples, grads_of) -> dict:
    """Two clipped steps on the two halves of ``samples``: the first's loss, gradients and norm,
    the second's norm, the weights after both (Adam is nearly blind to a gradient's scale in
    its first step; the second shows a wrong clip)."""
    out = {}
    rows = torch.arange(len(samples))
    for step, half in enumerate(rows.chunk(2)):
        engine.set_lr(1e-3 / (1 + step))  # (annealed, as the runner does)
        loss, _ = algorithm.loss(engine, samples.index(half, half))
        engine.backward(loss)
        if step == 0:
            out.update(loss=loss.item(), grads=grads_of(engine))
        out[f"grad_norm{step}"] = engine.step().item()
    return out


NAMES = ("ppo", "grpo")
# "_vlm": the VLA on a Qwen2.5-VL (its language model sharded); "_discrete": the discrete head
# (its bins sharded)
VARIANTS = ("", "_vlm", "_discrete")
CASES = [(name, variant) for variant in VARIANTS for name in NAMES]


def variant_samples(name: str, variant: str, out):
    """``vla_samples`` of a case."""
    if variant == "_vlm":
        return vla_samples(name, f"{out}/vlm")
    return vla_samples(name, head="discrete" if variant == "_discrete" else "gaussian")


def engine_rank(rank: int, tp: int, out: str) -> None:
    """One TP rank: PPO's and GRPO's two steps on megatron, saved in the torch layout (and
    GRPO's on the VLM with activation recomputation)."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from embodied.megatron.engine import MegatronEngine

    cases = [(name, vlm, False) for name, vlm in CASES] + [("grpo", "_vlm", True)]
    for name, vlm, recompute in cases:
        policy, algorithm, samples = variant_samples(name, vlm, out)
        engine = MegatronEngine(
            policy,
            learning_rate=1e-3,
            max_grad_norm=0.5,
            with_value=algorithm.has_critic,
            recompute=recompute,
        )
        sharded = {"": [], "_vlm": ["vlm.model.language_model"], "_discrete": ["head"]}[vlm]
        assert list(engine.parts) == ["fusion", *sharded]
        policy.eval()
        policy.train()  # (as the learner does before an update)
        layers = [m for m in policy.modules() if isinstance(m, TransformerLayer)]
        calls = []
        for layer in layers:
            layer.register_forward_hook(lambda *_, calls=calls: calls.append(1))
        result = two_steps(engine, algorithm, samples, lambda e: e.torch_grads())
        result["state"] = engine.torch_state()
        result["layer_calls"] = len(calls) / len(layers)
        suffix = "_recompute" if recompute else ""
        torch.save(result, f"{out}/{name}{vlm}{suffix}{rank}.pt")


def bf16_rank(rank: int, tp: int, out: str) -> None:
    """One TP rank: GRPO's two steps of the tiny VLA with the discrete head, its shards (the
    fusion, the head) in bf16: their dtypes, the optimizer's main weights before and after
    (gathered, torch layout), the weights after, the loss and the norms."""
    from embodied.megatron.engine import MegatronEngine

    policy, algorithm, samples = vla_samples("grpo", head="discrete")
    engine = MegatronEngine(
        policy, learning_rate=1e-3, max_grad_norm=0.5, with_value=False, dtype=torch.bfloat16
    )
    trained = [(name, p) for name, p in policy.named_parameters() if p.requires_grad]

    def main_weights():
        mains = {n: engine._main_param(p).detach().clone().view(p.shape) for n, p in trained}
        return engine._torch_layout(mains)

    result = {"dtypes": {name: p.dtype for name, p in policy.named_parameters()}}
    result["main_before"] = main_weights()
    result.update(two_steps(engine, algorithm, samples, lambda e: {}))
    result["main_after"] = main_weights()
    result["weights_after"] = engine.torch_state()
    torch.save(result, f"{out}/bf16{rank}.pt")


def test_bf16_shards_keep_float32_main_weights_and_follow_the_float32_update(ranks):
    """Mixed precision at TP=1 and TP=2 (bf16 on the CPU here; a GPU run's default): the
    sharded modules' linear weights are bf16, everything else float32. The optimizer's main weights
    start at the float32 values (not their bf16 rounding) and stay float32: after two Adam
    steps they hold what bf16 cannot, and the bf16 weights are their rounding. The loss and
    norms are the float32 run's to bf16's precision, and so are the weights after."""
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
        for name, main in got["main_after"].items():
            # (two Adam steps of at most 1e-3 each; a gradient near 0 may take either sign)
            torch.testing.assert_close(main, after[name], rtol=0, atol=2.1e-3)
            weight = got["weights_after"][name]  # (bf16 or float32: main, rounded)
            assert torch.equal(weight.float(), main.to(weight.dtype).float()), name
        qkv = got["main_after"]["fusion.layers.0.self_attn.in_proj_weight"]
        below_bf16 = qkv != qkv.to(torch.bfloat16).float()
        assert below_bf16.float().mean() > 0.9  # (float32 main weights, not bf16's)


def bc_steps(backend: str, head: str = "gaussian") -> dict:
    """SFT's learner (``BCLearner``) on ``backend``: two clipped AdamW steps (weight decay 0.1,
    the clip at 0.05: both steps clip) of the tiny VLA's behaviour-cloning loss on the test
    task's observations -> each step's loss and gradient norm, the weights after both."""
    from embodied.learner import TrainerConfig
    from embodied.models.vla import VLAConfig
    from embodied.sft import BCLearner, SFTConfig

    policy, _, samples = vla_samples("grpo", head=head)
    obs = samples.obs
    actions = torch.rand(len(samples), 1, 2, generator=torch.Generator().manual_seed(1)) * 2 - 1
    mask = torch.ones(len(samples), 1, dtype=torch.bool)
    cfg = SFTConfig(
        policy=policy.cfg,
        weight_decay=0.1,
        max_grad_norm=0.05,
        trainer=TrainerConfig(backend=backend),
    )
    assert isinstance(cfg.policy, VLAConfig)
    norm_data = {"state": obs.state, "privileged": {}, "actions": actions[:, 0]}
    torch.manual_seed(0)
    learner = BCLearner(cfg, policy.spec, norm_data, torch.device("cpu"))
    out = {}
    for step in range(2):
        metrics = learner.bc_step(obs, actions, mask, None, 1e-3 / (1 + step))
        out[f"loss{step}"] = metrics["sft/loss"].item()
        out[f"grad_norm{step}"] = metrics["sft/grad_norm"].item()
        out[f"accuracy{step}"] = metrics.get("sft/token_accuracy", torch.tensor(0.0)).item()
    learner.refresh()
    out["state"] = learner.engine.torch_policy.state_dict()
    return out


def bc_rank(rank: int, tp: int, out: str) -> None:
    for head in BC_HEADS:
        torch.save(bc_steps("megatron", head), f"{out}/bc_{head}{rank}.pt")


BC_HEADS = ("gaussian", "discrete")


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
        for key in ("loss0", "loss1", "grad_norm0", "grad_norm1", "accuracy0", "accuracy1"):
            assert got[key] == pytest.approx(want[key], rel=1e-5), key
        # (to 1e-5: with eps 1e-8, Adam scales a gradient near 0 by its own size, so its
        # rounding moves a weight by up to 1.2e-6 here)
        for name, value in want["state"].items():
            torch.testing.assert_close(got["state"][name], value, rtol=1e-5, atol=1e-5)


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


# --- the Qwen2 family's language model ----------------------------------------------------------
def tiny_qwen2(tied: bool = False):
    """A random Qwen2 language model built here: 2 layers, 4 query heads in 2 key-value groups,
    a vocabulary of 64; biases and norms drawn away from their initial zeros and ones."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rope_theta=5000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tied,
    )
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.1)
            elif "norm" in name:
                param.normal_(1.0, 0.1)
    return model


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


def qwen2_inputs():
    """Token ids long [3, 9] and their mask: sample 1 is padded after 6 tokens."""
    torch.manual_seed(2)
    ids = torch.randint(0, 64, (3, 9))
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[1, 6:] = 0
    return ids, mask


def qwen2_rank(rank: int, tp: int, out: str) -> None:
    import torch.distributed as dist

    from embodied.megatron import parallel
    from embodied.megatron.qwen2 import Qwen2Megatron

    results = {}
    for tied in (False, True):
        hf = tiny_qwen2(tied)
        model = Qwen2Megatron(hf.config)
        model.load_hf_state(hf.state_dict())
        ids, mask = qwen2_inputs()
        logits = model(ids, mask).detach()  # [B, L, V / tp]
        gathered = [torch.empty_like(logits) for _ in range(tp)]
        dist.all_gather(gathered, logits, group=parallel.tp_group())
        targets = ids.roll(-1, dims=1)
        results[tied] = {
            "logits_slice": logits,
            "logits": torch.cat(gathered, dim=-1),
            "logprobs": model.token_logprobs(ids, mask, targets).detach(),
            "state": model.hf_state(),
        }
    torch.save(results, f"{out}/qwen{rank}.pt")


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


# --- a Qwen2.5-VL's language model inside the VLA -------------------------------------------------
# 2 layers of 4 query heads in 2 key-value groups (head size 8: 4 rotary frequencies, turned by
# the time, height and width positions 2, 1 and 1)
QWEN_VL_TEXT = {
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rope_parameters": {"rope_type": "default", "mrope_section": [2, 1, 1], "rope_theta": 1000.0},
}


def tiny_qwen2_5_vl(path):
    from tiny_vlms import qwen2_5_vl

    return qwen2_5_vl(path, text=QWEN_VL_TEXT)


def perturb_biases_and_norms(model: nn.Module) -> None:
    """Biases and norms away from their initial zeros and ones (a mapping that mixed them up
    would pass with those), the same draw on every rank."""
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                noise = torch.randn(param.shape, generator=generator) * 0.1
                param.add_(noise)


def vl_inputs() -> tuple[list[torch.Tensor], list[str]]:
    """Two cameras' images for 3 samples and instructions of different lengths (padding)."""
    generator = torch.Generator().manual_seed(4)
    images = [torch.randint(0, 256, (3, 32, 32, 3), generator=generator, dtype=torch.uint8)]
    images.append(torch.randint(0, 256, (3, 32, 32, 3), generator=generator, dtype=torch.uint8))
    return images, ["push the cube", "pick the red cube to the white target", "a"]


def vl_forward(vlm) -> tuple[torch.Tensor, torch.Tensor]:
    """The VLM's last hidden states and mask, and a loss (a mean over the tokens)
    backpropagated."""
    hidden, mask = vlm(*vl_inputs())
    weights = torch.linspace(-1, 1, hidden.shape[-1])
    loss = ((hidden * weights).square() * mask[..., None]).sum() / mask.sum()
    loss.backward()
    return hidden.detach(), mask


def vlm_rank(rank: int, tp: int, out: str) -> None:
    """One TP rank: the VLM with its language model on megatron; its hidden states, every
    gradient (the language model's gathered into the Hugging Face layout) and weights."""
    from embodied.megatron.vlm import MegatronTextModel
    from embodied.models.vla.hf_vlm import HFVisionLanguage

    vlm = HFVisionLanguage(f"{out}/vlm", freeze=False)
    original = vlm.model.language_model
    perturb_biases_and_norms(original)
    text = MegatronTextModel(original.config)
    text.load_torch_state(original.state_dict())
    vlm.model.language_model = text
    hidden, mask = vl_forward(vlm)
    grads = {k: p.grad for k, p in text.lm.model.named_parameters()}
    result = {
        "hidden": hidden,
        "mask": mask,
        "text_grads": text.torch_state(grads),
        "vision_grads": {k: p.grad for k, p in vlm.model.visual.named_parameters()},
        "text_weights": text.torch_state(),
        "vocabulary_slice": text.lm.model.embedding.word_embeddings.weight.shape[0],
    }
    torch.save(result, f"{out}/vl{rank}.pt")


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


def rank_main(rank: int, tp: int, port: int, out: str) -> None:
    """One TP rank's part of every test above (one process group: megatron is imported and
    set up once per TP size)."""
    with tp_process(rank, tp, port):
        fusion_rank(rank, tp, out)
        head_rank(rank, tp, out)
        engine_rank(rank, tp, out)
        bf16_rank(rank, tp, out)
        bc_rank(rank, tp, out)
        qwen2_rank(rank, tp, out)
        vlm_rank(rank, tp, out)


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def ranks(request, tmp_path_factory):
    """(TP size, the directory its ranks saved their results in)."""
    pytest.importorskip("megatron.core")
    tp = request.param
    out = tmp_path_factory.mktemp(f"tp{tp}")
    tiny_qwen2_5_vl(out / "vlm")
    torch.multiprocessing.spawn(rank_main, args=(tp, free_port(), str(out)), nprocs=tp)
    return tp, out


# --- the runner on the megatron backend ---------------------------------------------------------
E2E_POLICY = {"layers": 2}  # (over the tests' tiny VLA)
E2E_ITERATIONS = 3


def e2e_run(
    run_dir,
    trainer: dict | None,
    resume: str | None = None,
    *,
    policy: dict | None = None,
    iterations: int = E2E_ITERATIONS,
) -> dict:
    """GRPO on the test task, one round per update, a checkpoint per iteration; ``policy``
    over the tiny VLA's config."""
    from scripted_envs import GRPO, TINY_VLA, PushRightEnv, run_on

    torch.manual_seed(0)  # (as ``train`` seeds before it builds the roles)
    return run_on(
        PushRightEnv(8),
        run_dir,
        total_env_steps=8 * 3 * iterations,
        policy={**TINY_VLA, **E2E_POLICY, **(policy or {})},
        algorithm={**GRPO, "max_rounds": 1, "dynamic_sampling": False},
        save_every=1,
        trainer=trainer,
        resume=resume,
    )


def resume_copy(tmp_path, source: str, name: str, iteration: int = 2) -> str:
    """A copy of the run ``source`` as ``name``, its rows after ``iteration`` dropped (as
    ``train`` does when it resumes); the checkpoint of that iteration to resume from."""
    import shutil

    from embodied.run import trim_metrics

    shutil.copytree(tmp_path / source, tmp_path / name, symlinks=True)
    trim_metrics(tmp_path / name, iteration)
    return str(tmp_path / name / "checkpoints" / f"iter_{iteration:06d}")


def e2e_child(rank: int, tmp_path) -> None:
    """In a process of their own (the backend makes this process a process group): the
    megatron run at TP=1, the run at TP=2 (its second rank a process the runner starts), and
    the TP=2 run resumed at TP=1 after iteration 2."""
    torch.set_num_threads(1)
    e2e_run(tmp_path / "megatron", {"backend": "megatron"})
    e2e_run(tmp_path / "megatron_tp2", {"backend": "megatron", "tensor_parallel": 2})
    again = resume_copy(tmp_path, "megatron_tp2", "tp2_then_tp1")
    e2e_run(tmp_path / "tp2_then_tp1", {"backend": "megatron"}, resume=again)


def metric_table(run_dir) -> list[dict]:
    import json

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]


def assert_rows_close(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b)
    for row_a, row_b in zip(a, b):
        assert row_a.keys() == row_b.keys()
        for key in row_a:
            if key in ("minutes", "eval/policy_ms", "eval/env_steps_per_s"):
                continue
            assert row_a[key] == pytest.approx(row_b[key], rel=1e-5, abs=1e-6), key


def test_a_run_on_megatron_follows_the_torch_run_and_resumes_at_any_tp_or_on_torch(tmp_path):
    """GRPO on the tiny VLA, 3 iterations: every logged number of the megatron runs at TP=1
    and TP=2 equals the torch run's to 1e-5. Their checkpoints hold the fusion as one shard per
    TP rank, which loading joins into the torch layout: the weights and Adam's state equal the
    torch run's, the TP=2 run resumed after iteration 2 at TP=1, and the TP=1 run resumed on
    torch, run the third iteration the same again."""
    pytest.importorskip("megatron.core")
    from safetensors.torch import load_file

    from embodied.checkpoint import load_checkpoint

    torch.set_num_threads(1)
    e2e_run(tmp_path / "torch", None)
    torch.multiprocessing.spawn(e2e_child, args=(tmp_path,), nprocs=1)
    want = metric_table(tmp_path / "torch")
    assert len([r for r in want if "policy/loss" in r]) == E2E_ITERATIONS
    assert_rows_close(metric_table(tmp_path / "megatron"), want)
    # the checkpoint: the torch layout's weights and Adam state, as the torch run's
    saved = load_checkpoint(tmp_path / "megatron" / "checkpoints" / "iter_000002")
    reference = load_checkpoint(tmp_path / "torch" / "checkpoints" / "iter_000002")
    assert saved["model"].keys() == reference["model"].keys()
    for key, value in reference["model"].items():
        torch.testing.assert_close(saved["model"][key], value, rtol=1e-5, atol=1e-5)
    moments = saved["optimizer"]["state"]
    assert moments.keys() == reference["optimizer"]["state"].keys()
    for index, entry in reference["optimizer"]["state"].items():
        assert moments[index]["step"] == entry["step"] == 8  # 2 iterations of 2 x 2 minibatches
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(moments[index][key], entry[key], rtol=1e-4, atol=1e-8)
    # TP=2: the fusion in one file per rank, the rest whole; the same numbers once joined
    sharded = tmp_path / "megatron_tp2" / "checkpoints" / "iter_000002"
    assert sorted(p.name for p in sharded.glob("model*")) == [
        "model-tp00-of-02.safetensors",
        "model-tp01-of-02.safetensors",
        "model.safetensors",
    ]
    assert not [k for k in load_file(sharded / "model.safetensors") if k.startswith("fusion.")]
    joined = load_checkpoint(sharded)
    for key, value in saved["model"].items():
        torch.testing.assert_close(joined["model"][key], value, rtol=1e-5, atol=1e-6)
    # resumed at TP=1, and on torch, the same again
    again = resume_copy(tmp_path, "megatron", "again_torch")
    e2e_run(tmp_path / "again_torch", None, resume=again)
    for name in ("megatron_tp2", "tp2_then_tp1", "again_torch"):
        assert_rows_close(metric_table(tmp_path / name), want)


def records_child(rank: int, tmp_path) -> None:
    """In a process of its own: GRPO and PPO on megatron at TP=1 and TP=2, every iteration
    recorded, then every recorded update replayed at its run's TP size; by run and iteration,
    what differs (nothing, bit for bit) and how many metrics were compared, in replays.json."""
    import json

    from scripted_envs import GRPO, PPO, TINY_VLA, PushRightEnv, run_on

    from embodied.replay import differences, replay

    torch.set_num_threads(1)
    algorithms = {
        "grpo": ({**GRPO, "max_rounds": 1, "dynamic_sampling": False}, {}),
        "ppo": ({**PPO, "num_steps": 3}, {"value_head": True}),
    }
    found = {}
    for name, (algorithm, policy) in algorithms.items():
        for tp in (1, 2):
            run_dir = tmp_path / f"{name}_tp{tp}"
            torch.manual_seed(0)
            run_on(
                PushRightEnv(8),
                run_dir,
                total_env_steps=8 * 3 * 2,
                policy={**TINY_VLA, **E2E_POLICY, **policy},
                algorithm=algorithm,
                trainer={"backend": "megatron", "tensor_parallel": tp},
                record_rollouts=1,
            )
            for iteration in (1, 2):
                record, metrics, digest = replay(run_dir, iteration)
                weights = (record.meta["digest_after"], digest)
                differ = differences(record.meta["metrics"], metrics, 0.0, weights)
                found[f"{name}_tp{tp}_{iteration}"] = {"differ": differ, "metrics": len(metrics)}
    (tmp_path / "replays.json").write_text(json.dumps(found))


def test_megatron_updates_replay_bit_for_bit_from_their_records_at_tp_1_and_2(tmp_path):
    """record -> replay on the megatron backend (PPO and GRPO, TP=1 and TP=2, CPU): the
    losses, KL, clip fraction, gradient norm and the weights after the update as the run's. A
    TP=2 record holds the whole state in the torch layout, the fusion's Adam moments gathered
    from both ranks: they equal the TP=1 run's."""
    pytest.importorskip("megatron.core")
    import json

    from embodied.recording import read_record

    torch.multiprocessing.spawn(records_child, args=(tmp_path,), nprocs=1)
    found = json.loads((tmp_path / "replays.json").read_text())
    assert sorted(found) == [
        f"{a}_tp{tp}_{i}" for a in ("grpo", "ppo") for tp in (1, 2) for i in (1, 2)
    ]
    assert all(r["differ"] == [] and r["metrics"] >= 7 for r in found.values()), found
    whole = read_record(tmp_path / "grpo_tp1", 2)
    sharded = read_record(tmp_path / "grpo_tp2", 2)
    assert any(k.startswith("fusion.") for k in sharded.model)
    assert sharded.model.keys() == whole.model.keys()
    state = sharded.optimizer["state"]
    assert state.keys() == whole.optimizer["state"].keys() and len(state) > 0
    for index, entry in whole.optimizer["state"].items():
        assert state[index]["step"] == entry["step"] == 4  # 1 iteration of 2 epochs x 2 minibatches
        for key in ("exp_avg", "exp_avg_sq"):
            assert state[index][key].shape == entry[key].shape
            torch.testing.assert_close(state[index][key], entry[key], rtol=1e-4, atol=1e-8)


def vlm_e2e_child(rank: int, tmp_path) -> None:
    """The VLA on a Qwen2.5-VL, trained and frozen, at TP=2; the trained run resumed at TP=1."""
    torch.set_num_threads(1)
    for frozen in (False, True):
        policy = {"vlm_path": str(tmp_path / "vlm"), "freeze_vlm": frozen}
        trainer = {"backend": "megatron", "tensor_parallel": 2}
        e2e_run(tmp_path / f"megatron{frozen}", trainer, policy=policy, iterations=2)
    again = resume_copy(tmp_path, "megatronFalse", "again", iteration=1)
    policy = {"vlm_path": str(tmp_path / "vlm"), "freeze_vlm": False}
    e2e_run(tmp_path / "again", {"backend": "megatron"}, again, policy=policy, iterations=2)


@pytest.mark.slow  # (31 s; the update's parity with the language model sharded is in the suite)
def test_a_vla_on_a_qwen2_5_vl_trains_on_megatron_as_on_torch(tmp_path):
    """GRPO of the VLA on a tiny Qwen2.5-VL, 2 iterations at TP=2, its VLM trained and frozen:
    every logged number equals the torch run's to 1e-5. Trained, the checkpoint's shard files
    hold the fusion and the language model (model.safetensors neither); frozen, the language
    model is saved whole with the frozen weights. Joined, the weights equal the torch run's; the
    trained run resumed at TP=1 after iteration 1 gives iteration 2 again."""
    pytest.importorskip("megatron.core")
    from safetensors.torch import load_file

    from embodied.checkpoint import load_checkpoint

    torch.set_num_threads(1)
    tiny_qwen2_5_vl(tmp_path / "vlm")
    for frozen in (False, True):
        policy = {"vlm_path": str(tmp_path / "vlm"), "freeze_vlm": frozen}
        e2e_run(tmp_path / f"torch{frozen}", None, policy=policy, iterations=2)
    torch.multiprocessing.spawn(vlm_e2e_child, args=(tmp_path,), nprocs=1)
    for frozen in (False, True):
        want = metric_table(tmp_path / f"torch{frozen}")
        assert_rows_close(metric_table(tmp_path / f"megatron{frozen}"), want)
        last = tmp_path / f"megatron{frozen}" / "checkpoints" / "iter_000002"
        shard = load_file(last / "model-tp01-of-02.safetensors")
        text = "weight/vlm.model.language_model/decoder.layers.1.mlp.linear_fc2.weight"
        assert (text in shard) == (not frozen)
        assert "weight/fusion/layers.1.mlp.linear_fc2.weight" in shard
        whole = load_file(last / "model.safetensors")
        assert not [k for k in whole if k.startswith(("fusion.", "vlm.model.language_model."))]
        saved = load_checkpoint(last)["model"]
        reference = load_checkpoint(tmp_path / f"torch{frozen}" / "last")["model"]
        assert saved.keys() == reference.keys()
        for key, value in reference.items():
            torch.testing.assert_close(saved[key], value, rtol=1e-5, atol=1e-5)
    assert_rows_close(metric_table(tmp_path / "again"), metric_table(tmp_path / "torchFalse"))


def discrete_e2e_child(rank: int, tmp_path) -> None:
    """The VLA with the discrete head at TP=2, and resumed at TP=1 after iteration 1."""
    torch.set_num_threads(1)
    policy = {"head": "discrete"}
    trainer = {"backend": "megatron", "tensor_parallel": 2}
    e2e_run(tmp_path / "megatron", trainer, policy=policy, iterations=2)
    again = resume_copy(tmp_path, "megatron", "again", iteration=1)
    e2e_run(tmp_path / "again", {"backend": "megatron"}, again, policy=policy, iterations=2)


@pytest.mark.slow  # (19 s; the discrete head's update parity is in the suite)
def test_a_vla_with_the_discrete_head_trains_on_megatron_as_on_torch(tmp_path):
    """GRPO of the VLA with the discrete head, 2 iterations at TP=2: every logged number equals
    the torch run's to 1e-5; each rank's shard file holds half of every dimension's bins, and
    joined, the weights equal the torch run's; resumed at TP=1 after iteration 1, iteration 2
    again."""
    pytest.importorskip("megatron.core")
    from safetensors.torch import load_file

    from embodied.checkpoint import load_checkpoint
    from embodied.convert import ConvertError, _check_module_split

    torch.set_num_threads(1)
    e2e_run(tmp_path / "torch", None, policy={"head": "discrete"}, iterations=2)
    torch.multiprocessing.spawn(discrete_e2e_child, args=(tmp_path,), nprocs=1)
    want = metric_table(tmp_path / "torch")
    assert_rows_close(metric_table(tmp_path / "megatron"), want)
    last = tmp_path / "megatron" / "checkpoints" / "iter_000002"
    reference = load_checkpoint(tmp_path / "torch" / "last")["model"]
    whole = reference["head.logits.weight"]  # [2 dimensions x 256 bins, d]
    shard = load_file(last / "model-tp01-of-02.safetensors")["weight/head/logits.weight"]
    assert shard.shape == (2 * 128, whole.shape[1])
    torch.testing.assert_close(shard[:128], whole[128:256], rtol=1e-5, atol=1e-5)
    assert not [k for k in load_file(last / "model.safetensors") if k.startswith("head.")]
    saved = load_checkpoint(last)["model"]
    assert saved.keys() == reference.keys()
    for key, value in reference.items():
        torch.testing.assert_close(saved[key], value, rtol=1e-5, atol=1e-5)
    assert_rows_close(metric_table(tmp_path / "again"), want)
    # the torch run's checkpoint -> TP=2 shards: the run's files' layout; joined, bit-exact
    source = tmp_path / "torch" / "last"
    assert convert_cli(source, "--to", "megatron", "--tensor-parallel", 2, tmp_path / "mg")[0] == 0
    converted = load_file(tmp_path / "mg" / "model-tp01-of-02.safetensors")
    torch.testing.assert_close(converted["weight/head/logits.weight"][:128], whole[128:256])
    assert_same_checkpoint(load_checkpoint(tmp_path / "mg"), load_checkpoint(source))
    # (the fusion's 2 heads split over no TP size that 256 bins do not: the check alone)
    head = {"module": "head", "layout": "discrete_head", "actions": 2, "bins": 256}
    with pytest.raises(ConvertError, match="^--tensor-parallel 3: the discrete head's 256 bins"):
        _check_module_split(head, 3, {})


def bf16_e2e_child(rank: int, tmp_path) -> None:
    """A bf16 run at TP=2, and the same resumed at TP=2 after iteration 1."""
    torch.set_num_threads(1)
    trainer = {"backend": "megatron", "tensor_parallel": 2, "precision": "bf16"}
    e2e_run(tmp_path / "bf16", trainer, iterations=2)
    again = resume_copy(tmp_path, "bf16", "again", iteration=1)
    e2e_run(tmp_path / "again", trainer, again, iterations=2)


@pytest.mark.slow  # (22 s; bf16's update is in the suite)
def test_a_bf16_run_saves_its_float32_main_weights_and_resumes_to_the_same_numbers(tmp_path):
    """`trainer.precision=bf16` at TP=2: the shard files hold the float32 main weights (not
    bf16-representable), and the run resumed after iteration 1 logs iteration 2 again to
    1e-5: the main weights come back exact (resumed from their bf16 rounding, it would not)."""
    pytest.importorskip("megatron.core")
    from safetensors.torch import load_file

    torch.set_num_threads(1)
    torch.multiprocessing.spawn(bf16_e2e_child, args=(tmp_path,), nprocs=1)
    last = tmp_path / "bf16" / "checkpoints" / "iter_000002"
    qkv = load_file(last / "model-tp01-of-02.safetensors")[
        "weight/fusion/layers.0.self_attention.linear_qkv.weight"
    ]
    assert qkv.dtype == torch.float32
    assert (qkv != qkv.to(torch.bfloat16).float()).float().mean() > 0.9
    assert_rows_close(metric_table(tmp_path / "again"), metric_table(tmp_path / "bf16"))


def failing_child(rank: int, tmp_path) -> None:
    """A TP=2 run whose rank 0 fails inside its second update, while its helper rank waits in
    a collective; writes the error it ended with and how many child processes are left."""
    torch.set_num_threads(1)
    import multiprocessing

    from embodied.grpo import GRPO

    calls = []
    loss = GRPO.loss

    def failing(self, learner, minibatch):
        calls.append(1)
        if len(calls) == 5:  # (4 minibatch steps an update)
            raise RuntimeError("rank 0 fails")
        return loss(self, learner, minibatch)

    GRPO.loss = failing
    try:
        e2e_run(tmp_path / "fails", {"backend": "megatron", "tensor_parallel": 2})
    except RuntimeError as error:
        (tmp_path / "fails" / "error.txt").write_text(str(error))
    finally:
        GRPO.loss = loss
    (tmp_path / "fails" / "left.txt").write_text(str(len(multiprocessing.active_children())))


@pytest.mark.slow  # (13 s: the failure path; the parity runs above are in the default suite)
def test_a_tp2_run_that_fails_on_rank_0_ends_with_its_error_and_no_rank_left(tmp_path):
    pytest.importorskip("megatron.core")
    torch.multiprocessing.spawn(failing_child, args=(tmp_path,), nprocs=1)
    assert (tmp_path / "fails" / "error.txt").read_text() == "rank 0 fails"
    assert (tmp_path / "fails" / "left.txt").read_text() == "0"


# --- embodied convert --------------------------------------------------------------------------
def convert_cli(*args) -> tuple[int, str]:
    """``embodied convert ARGS`` in this process: (exit code, its error line)."""
    import io

    from embodied.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["convert", *map(str, args)])
    return code, err.getvalue()


def assert_same_checkpoint(a: dict, b: dict) -> None:
    assert a["model"].keys() == b["model"].keys()
    assert all(torch.equal(a["model"][k], v) for k, v in b["model"].items())
    assert a["optimizer"]["state"].keys() == b["optimizer"]["state"].keys()
    for index, entry in b["optimizer"]["state"].items():
        assert all(torch.equal(a["optimizer"]["state"][index][k], v) for k, v in entry.items())
    assert a["counters"] == b["counters"]


def test_convert_shards_a_checkpoint_by_tp_rank_and_joins_it_bit_exact(tmp_path):
    """A torch run's checkpoint -> megatron shards at TP=2 (the files a TP=2 run writes) ->
    the torch layout again: weights, Adam state and counters bit for bit."""
    from safetensors.torch import load_file
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
