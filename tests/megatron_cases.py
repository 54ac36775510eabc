"""The cases of the megatron tests, built alike on both sides: as the torch reference in the
test, and on megatron-core in each TP rank's process (megatron_ranks.py)."""

import contextlib

import torch
from torch import nn

D, HEADS, LAYERS = 32, 4, 2


def torch_fusion(seed: int = 0) -> nn.TransformerEncoder:
    """The VLA's fusion transformer (models/vla/policy.py) at test size."""
    torch.manual_seed(seed)
    layer = nn.TransformerEncoderLayer(
        D, HEADS, 4 * D, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
    )
    return nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)


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


def bc_setup(backend: str, head: str = "gaussian"):
    """(a new SFT learner ``BCLearner`` on ``backend``, its data: observations, actions, mask)
    for the tiny VLA with ``head``: AdamW with weight decay 0.1, the clip at 0.05."""
    from embodied.sft import BCLearner

    cfg, spec, norm_data, data = bc_parts(backend, head)
    torch.manual_seed(0)
    return BCLearner(cfg, spec, norm_data, torch.device("cpu")), data


def bc_parts(backend: str, head: str = "gaussian", tensor_parallel: int = 1):
    """(SFT's config, the spec, the normaliser's data, the data) of ``bc_setup``."""
    from embodied.learner import TrainerConfig
    from embodied.models.vla import VLAConfig
    from embodied.sft import SFTConfig

    policy, _, samples = vla_samples("grpo", head=head)
    obs = samples.obs
    actions = torch.rand(len(samples), 1, 2, generator=torch.Generator().manual_seed(1)) * 2 - 1
    mask = torch.ones(len(samples), 1, dtype=torch.bool)
    cfg = SFTConfig(
        policy=policy.cfg,
        weight_decay=0.1,
        max_grad_norm=0.05,
        trainer=TrainerConfig(backend=backend, tensor_parallel=tensor_parallel),
    )
    assert isinstance(cfg.policy, VLAConfig)
    norm_data = {"state": obs.state, "privileged": {}, "actions": actions[:, 0]}
    return cfg, policy.spec, norm_data, (obs, actions, mask)


def bc_step(learner, data, step: int, out: dict) -> None:
    """SFT's step ``step`` (0, 1, 2: its learning rate) into ``out``: loss, norm, accuracy."""
    metrics = learner.bc_step(*data, None, 1e-3 / (1 + step))
    out[f"loss{step}"] = metrics["sft/loss"].item()
    out[f"grad_norm{step}"] = metrics["sft/grad_norm"].item()
    out[f"accuracy{step}"] = metrics.get("sft/token_accuracy", torch.tensor(0.0)).item()


def bc_steps(backend: str, head: str = "gaussian") -> dict:
    """SFT's learner (``bc_setup``) on ``backend``: three clipped AdamW steps of the tiny VLA's
    behaviour-cloning loss on the test task's observations -> each step's loss and gradient
    norm, the weights after the three."""
    learner, data = bc_setup(backend, head)
    out = {}
    for step in range(3):
        bc_step(learner, data, step, out)
    learner.refresh()
    out["state"] = learner.engine.torch_policy.state_dict()
    return out


BC_HEADS = ("gaussian", "discrete")


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


def qwen2_inputs():
    """Token ids long [3, 9] and their mask: sample 1 is padded after 6 tokens."""
    torch.manual_seed(2)
    ids = torch.randint(0, 64, (3, 9))
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[1, 6:] = 0
    return ids, mask


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
