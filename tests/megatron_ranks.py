"""The TP ranks' side of the megatron parity tests (test_megatron.py): each rank, a process
of its own over gloo, builds every case on megatron-core and saves its results for the test to
compare with the torch reference."""

import contextlib
from pathlib import Path

import torch
from megatron_cases import (
    BC_HEADS,
    CASES,
    HEADS,
    LAYERS,
    D,
    bc_steps,
    head_inputs,
    head_outputs,
    perturb_biases_and_norms,
    qwen2_inputs,
    tiny_qwen2,
    torch_fusion,
    torch_head,
    two_steps,
    variant_samples,
    vl_forward,
    vla_samples,
)
from megatron_resume import resume_rank


@contextlib.contextmanager
def tp_process(rank: int, tp: int, rendezvous: str):
    """This process as TP rank ``rank`` of ``tp`` over gloo, megatron's groups set up; the ranks
    meet at the file ``rendezvous`` (no port that another process could take in between)."""
    import torch.distributed as dist

    from embodied.megatron import parallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=tp)
    try:
        parallel.initialize(tp, seed=0, device=torch.device("cpu"))
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
    (gathered, torch layout), the weights after, the loss and the norms; its shard files."""
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
    result["engine_mains"] = engine.main_weights()  # (what a record keeps)
    if rank == 0:  # (the checkpoint's shard files: rank 0 makes their directory)
        Path(out, "bf16_shards").mkdir()
    result["shards"] = engine.write_shards(Path(out, "bf16_shards"))
    torch.save(result, f"{out}/bf16{rank}.pt")


def bc_rank(rank: int, tp: int, out: str) -> None:
    for head in BC_HEADS:
        torch.save(bc_steps("megatron", head), f"{out}/bc_{head}{rank}.pt")


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


def rank_main(rank: int, tp: int, out: str) -> None:
    """One TP rank's part of every test above (one process group: megatron is imported and
    set up once per TP size; the ranks meet at the file ``out``/rendezvous)."""
    with tp_process(rank, tp, f"{out}/rendezvous"):
        fusion_rank(rank, tp, out)
        head_rank(rank, tp, out)
        engine_rank(rank, tp, out)
        bf16_rank(rank, tp, out)
        bc_rank(rank, tp, out)
        resume_rank(rank, tp, out)
        qwen2_rank(rank, tp, out)
        vlm_rank(rank, tp, out)
