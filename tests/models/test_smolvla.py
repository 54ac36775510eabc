"""LeRobot's SmolVLA behind our Policy, built from a tiny random SmolVLM2 directory (made here, no
hub): the contract with act/evaluate log-probabilities equal to 1e-5; the deterministic flow is
LeRobot's own sampler; the stochastic chain's log-probability matches a reference computed with
torch.distributions; LeRobot's flow-matching loss fits a batch; a checkpoint acts alone; GRPO
through the stochastic flow raises success; the VLM stays frozen."""

import math
import re

import pytest
import torch
from test_hf_vlm import SPEC32
from test_vla import assert_checkpoint_acts_alone
from tiny_vlms import not_a_vlm, smolvlm

from embodied.contract import check_policy, random_observation
from embodied.models import SmolVLA, SmolVLAConfig, build_policy
from embodied.models.vla.hf_vlm import VLMNotFound
from embodied.models.vla.smolvla import lerobot_smolvla
from embodied.schema import UserError


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    return str(smolvlm(tmp_path_factory.mktemp("smolvlm")))


def tiny(vlm_dir: str, **kw) -> SmolVLAConfig:
    return SmolVLAConfig(
        **{
            "vlm_path": vlm_dir,
            "chunk_size": 3,
            "flow_steps": 4,
            "privileged_keys": ["goal_pos"],
            **kw,
        }
    )


def test_check_policy(vlm_dir):
    torch.manual_seed(0)
    policy = build_policy(SPEC32, tiny(vlm_dir))
    assert (
        isinstance(policy, SmolVLA)
        and type(policy.smolvla).__module__ == "lerobot.policies.smolvla.modeling_smolvla"
    )
    report = check_policy(
        policy, SPEC32, batch_size=3
    )  # includes evaluate() == act() log-prob to 1e-5
    assert report["chunk"] == 3


def test_deterministic_flow_is_lerobots_sampler(vlm_dir):
    torch.manual_seed(1)
    policy = SmolVLA(SPEC32, tiny(vlm_dir)).eval()
    obs = random_observation(SPEC32, 2)
    obs.instruction = ["push the cube", "pull the cube back to the red and white target"]
    with torch.no_grad():
        ours = policy.act(obs, deterministic=True)
        images, image_masks, tokens, token_masks, state = policy._inputs(obs)
        theirs = policy.smolvla.model.sample_actions(
            images, image_masks, tokens, token_masks, state, noise=torch.zeros(2, 3, 4)
        )  # LeRobot's Euler loop from x_0 = 0
    torch.testing.assert_close(ours.extras["flow_chain"][:, -1], theirs, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours.actions, policy.to_physical(theirs.clamp(-1, 1)))


def test_flow_logprob_matches_an_independent_reference(vlm_dir):
    torch.manual_seed(2)
    policy = SmolVLA(SPEC32, tiny(vlm_dir, flow_noise_std=0.3)).eval()
    obs = random_observation(SPEC32, 2)
    with torch.no_grad():
        out = policy.act(obs)
        chain = out.extras["flow_chain"]  # f32 [B, N+1, K, A]
        assert chain.shape == (2, 5, 3, 4)
        images, image_masks, tokens, token_masks, state = policy._inputs(obs)
        model, make_att_2d_masks = policy.smolvla.model, lerobot_smolvla().make_att_2d_masks
        prefix, pad, att = model.embed_prefix(images, image_masks, tokens, token_masks, state=state)
        _, cache = model.vlm_with_expert.forward(
            attention_mask=make_att_2d_masks(pad, att),
            position_ids=pad.cumsum(1) - 1,
            past_key_values=None,
            inputs_embeds=[prefix, None],
            use_cache=True,
            fill_kv_cache=True,
        )
        reference = torch.zeros(2)
        for i in range(
            4
        ):  # LeRobot's Euler step at t_i = 1 - i / N, plus Gaussian noise of std 0.3
            v = model.denoise_step(pad, cache, chain[:, i], torch.full((2,), 1 - i / 4))
            reference += (
                torch.distributions.Normal(chain[:, i] - v / 4, 0.3)
                .log_prob(chain[:, i + 1])
                .sum((1, 2))
            )
    torch.testing.assert_close(out.logprob, reference, atol=1e-4, rtol=1e-5)
    with torch.no_grad():
        token, entropy, value = policy.evaluate(obs, out, level="token")
    assert token.shape == (2, 3, 4) and value is None
    torch.testing.assert_close(
        entropy, torch.full((2,), 4 * 3 * 4 * (0.5 + 0.5 * math.log(2 * math.pi) + math.log(0.3)))
    )


def test_flow_matching_loss_fits_a_fixed_batch_and_the_vlm_stays_frozen(vlm_dir):
    torch.manual_seed(3)
    policy = SmolVLA(SPEC32, tiny(vlm_dir))
    vlm_before = {
        k: v.clone() for k, v in policy.smolvla.model.vlm_with_expert.vlm.state_dict().items()
    }
    assert not any(p.requires_grad for p in policy.smolvla.model.vlm_with_expert.vlm.parameters())
    obs = random_observation(SPEC32, 4)
    low, high = SPEC32.action.bounds()
    target = low + torch.rand(4, 3, 4) * (high - low)  # physical chunks
    with torch.no_grad():
        err_before = (policy.act(obs, deterministic=True).actions - target).abs() / (high - low)
    opt = torch.optim.Adam([p for p in policy.parameters() if p.requires_grad], lr=3e-3)
    losses = []
    for _ in range(300):
        loss, metrics = policy.bc_loss(obs, target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    # the loss samples noise and time: compare averages
    assert sum(losses[-20:]) < 0.5 * sum(losses[:20]), losses[
        ::20
    ]  # noise near t = 0 is not predictable
    with torch.no_grad():  # deterministic actions approach the targets
        err = (policy.act(obs, deterministic=True).actions - target).abs() / (high - low)
    assert err.mean() < 0.5 * err_before.mean(), (err_before.mean(), err.mean())
    for k, v in policy.smolvla.model.vlm_with_expert.vlm.state_dict().items():
        assert torch.equal(v, vlm_before[k]), k


def test_checkpoint_acts_alone_with_its_normalization(vlm_dir, tmp_path):
    torch.manual_seed(4)
    cfg = tiny(vlm_dir)
    assert_checkpoint_acts_alone(SmolVLA(SPEC32, cfg), cfg, SPEC32, tmp_path, batch=2)


def test_bad_configs_are_refused(vlm_dir, tmp_path):
    """The config's own values are ValueErrors naming their field (the loader adds `policy.`);
    what the environment or the VLM directory shows is a UserError naming its key: one line
    from the CLI, not LeRobot's or transformers' traceback."""
    with pytest.raises(ValueError, match="vlm_path"):
        SmolVLA(SPEC32, SmolVLAConfig())
    # (a checkpoint's directory moved since: its config is not validated by the loader)
    with pytest.raises(VLMNotFound, match=f"^policy.vlm_path: {tmp_path} is not a model dir"):
        SmolVLA(SPEC32, SmolVLAConfig(vlm_path=str(tmp_path)))
    with pytest.raises(ValueError, match="^expert_width_multiplier: must be > 0, got -0.5$"):
        SmolVLA(SPEC32, tiny(vlm_dir, expert_width_multiplier=-0.5))
    with pytest.raises(ValueError, match="flow_noise_std"):
        SmolVLA(SPEC32, tiny(vlm_dir, flow_noise_std=0.0))
    with pytest.raises(ValueError, match="^flow_steps: must be >= 1, got 0$"):
        SmolVLA(SPEC32, tiny(vlm_dir, flow_steps=0))
    with pytest.raises(ValueError, match="^chunk_size: must be >= 1, got 0$"):
        SmolVLA(SPEC32, tiny(vlm_dir, chunk_size=0))
    with pytest.raises(ValueError, match="^image_size: must be >= 0, got -1$"):
        SmolVLA(SPEC32, tiny(vlm_dir, image_size=-1))
    no_camera = SPEC32.__class__(
        obs=SPEC32.obs.__class__(state_names=("q",)), action=SPEC32.action, max_episode_steps=5
    )
    with pytest.raises(UserError, match="^policy: SmolVLA needs camera images"):
        SmolVLA(no_camera, tiny(vlm_dir, privileged_keys=[]))
    with pytest.raises(UserError, match=r"^policy.privileged_keys: \['obj_pose'\] not among"):
        SmolVLA(SPEC32, tiny(vlm_dir, privileged_keys=["obj_pose"]))
    # the tiny VLM has one text layer: 2 expert layers cannot share it (LeRobot asserts)
    with pytest.raises(UserError, match="^policy.num_expert_layers: 2 does not divide the 1 VLM"):
        SmolVLA(SPEC32, tiny(vlm_dir, num_expert_layers=2))
    for path, cause in {
        not_a_vlm(tmp_path / "bert"): "Unrecognized configuration class",
        smolvlm(tmp_path / "bare", weights=False): "Error no file named model.safetensors",
    }.items():
        line = f"policy.vlm_path: {path} cannot be loaded as a vision-language model: {cause}"
        with pytest.raises(VLMNotFound, match=f"^{re.escape(line)}"):
            SmolVLA(SPEC32, tiny(str(path)))
