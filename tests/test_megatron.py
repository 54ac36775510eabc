"""The Megatron-core backend: the torch <-> megatron weight layout (bit-exact, by hand), and the
fusion transformer on megatron-core against the torch one at TP=1 and TP=2 (processes over
gloo on the CPU)."""

import os
import socket
import subprocess
import sys

import pytest
import torch
from torch import nn

from embodied.megatron.layout import (
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fusion_rank(rank: int, tp: int, port: int, out: str) -> None:
    """One TP rank: the megatron fusion loaded from the torch one; its output, input gradient
    and weight gradients (gathered, in the torch layout) saved for the test to compare."""
    import torch.distributed as dist

    from embodied.megatron import parallel
    from embodied.megatron.fusion import MegatronFusion

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=tp)
    try:
        parallel.initialize(tp, seed=0)
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
        parallel.destroy()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("tp", [1, 2])
def test_the_megatron_fusion_gives_the_torch_fusion_outputs_and_gradients(tmp_path, tp):
    pytest.importorskip("megatron.core")
    torch.multiprocessing.spawn(fusion_rank, args=(tp, free_port(), str(tmp_path)), nprocs=tp)
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


def test_nothing_of_megatron_is_imported_by_the_torch_backend():
    code = (
        "import sys, embodied.cli, embodied.runner, embodied.sft, embodied.models.vla\n"
        "print([m for m in sys.modules if m.split('.')[0] == 'megatron'])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
