"""The VLA with each action head passes the policy contract; log-probabilities are consistent and
match independent computations; normalization lives in the checkpoint; pretrained backbones load
offline."""

import math

import pytest
import torch

from embodied.checkpoint import load_checkpoint, save_checkpoint
from embodied.contract import check_policy, random_observation
from embodied.models import VLA, VLAConfig, build_policy
from embodied.schema import ActionSpec, CameraSpec, EnvSpec, NormStats, ObsSpec, UserError

SPEC = EnvSpec(
    obs=ObsSpec(
        cameras=(CameraSpec("base_camera", 64, 64), CameraSpec("hand_camera", 64, 64)),
        state_names=tuple(f"q{i}" for i in range(5)),
        privileged={"goal_pos": (3,)},
    ),
    action=ActionSpec(
        "joint_delta",
        ("j0", "j1", "j2", "gripper"),
        (-0.1, -0.1, -0.1, -0.01),
        (0.1, 0.1, 0.1, 0.04),
        gripper=3,
    ),
    max_episode_steps=20,
    instructions=("push the cube to the target", "pick up the cube"),
)
HEADS = ["gaussian", "discrete", "flow"]


def tiny(head: str, **kw) -> VLAConfig:
    """Random, small backbones of the real architectures (EfficientNet-Lite0, BERT/MiniLM)."""
    base = dict(
        head=head,
        chunk_size=3,
        d_model=32,
        layers=1,
        heads=2,
        vision_pretrained=False,
        vision_width=0.25,
        vision_depth=0.25,
        text_pretrained=False,
        text_hidden=32,
        text_layers=1,
        bins=16,
        flow_steps=4,
        privileged_keys=["goal_pos"],
    )
    return VLAConfig(**{**base, **kw})


@pytest.mark.parametrize("head", HEADS)
def test_check_policy(head):
    torch.manual_seed(0)
    policy = build_policy(SPEC, tiny(head))
    report = check_policy(
        policy, SPEC, batch_size=4
    )  # includes evaluate() == act() log-prob to 1e-5
    assert report["chunk"] == 3


@pytest.mark.parametrize("head", HEADS)
def test_logprob_levels_are_consistent(head):
    torch.manual_seed(1)
    policy = VLA(SPEC, tiny(head))
    obs = random_observation(SPEC, 5)
    with torch.no_grad():
        out = policy.act(obs)
        token, _, _ = policy.evaluate(obs, out, level="token")
        action, _, _ = policy.evaluate(obs, out, level="action")
        chunk, entropy, value = policy.evaluate(obs, out, level="chunk")
    assert token.shape == (5, 3, 4) and action.shape == (5, 3) and chunk.shape == (5,)
    torch.testing.assert_close(token, out.extras["logp_token"], atol=1e-5, rtol=0)
    torch.testing.assert_close(action, token.sum(-1), atol=1e-5, rtol=0)
    torch.testing.assert_close(chunk, out.logprob, atol=1e-5, rtol=0)
    assert value.shape == (5,) and entropy.shape == (5,)


def test_gaussian_logprob_is_the_squashed_density():
    torch.manual_seed(2)
    policy = VLA(SPEC, tiny("gaussian"))
    obs = random_observation(SPEC, 3)
    with torch.no_grad():
        out = policy.act(obs)
        ctx, _ = policy.context(obs)
        mean = policy.head.mean(ctx)
    u = out.extras["raw_actions"]
    ref = torch.distributions.Normal(mean, policy.head.log_std.exp()).log_prob(u) - torch.log(
        1 - torch.tanh(u) ** 2
    )
    torch.testing.assert_close(out.extras["logp_token"], ref, atol=1e-4, rtol=1e-5)


def test_discrete_tokens_and_their_logprob():
    torch.manual_seed(3)
    policy = VLA(SPEC, tiny("discrete", bins=8))
    obs = random_observation(SPEC, 4)
    with torch.no_grad():
        out = policy.act(obs)
        ctx, _ = policy.context(obs)
        logits = policy.head.logits(ctx).view(4, 3, 4, 8)
    tokens = out.extras["tokens"]
    ref = torch.distributions.Categorical(logits=logits).log_prob(tokens)
    torch.testing.assert_close(out.extras["logp_token"], ref, atol=1e-5, rtol=0)
    # the action is the bin centre of the sampled token, mapped onto the physical range
    centers = -1 + (2 * tokens.float() + 1) / 8
    torch.testing.assert_close(out.actions, policy.to_physical(centers))
    # tokenizing a bin centre gives the bin back
    assert torch.equal(policy.head.tokenize(centers), tokens)


def test_the_discrete_heads_first_choice_is_the_largest_raw_logit():
    """Bins 1 and 2 hold logits 0 and 1e-8: log-softmax rounds both to -log 2 (float32), where
    an argmax would take bin 1, the first of the tie. The deterministic action and the
    behaviour-cloning accuracy take bin 2, as megatron's head does across its ranks."""
    from embodied.models.vla.heads import DiscreteTokenHead

    head = DiscreteTokenHead(d_model=1, action_dim=1, bins=4)
    with torch.no_grad():
        head.logits.weight.zero_()
        head.logits.bias.copy_(torch.tensor([-100.0, 0.0, 1e-8, -100.0]))
    ctx = torch.zeros(1, 1, 1)
    logp_all = torch.log_softmax(head.logits(ctx), dim=-1)
    assert logp_all[0, 0, 1] == logp_all[0, 0, 2]  # (the tie the shift makes)
    actions, _, extras = head.sample(ctx, deterministic=True)
    assert extras["tokens"].item() == 2
    assert actions.item() == head.centers[2].item()
    mask = torch.ones(1, 1)
    _, hit = head.bc_loss(ctx, head.centers[2].view(1, 1, 1), mask)
    _, miss = head.bc_loss(ctx, head.centers[1].view(1, 1, 1), mask)
    assert hit["sft/token_accuracy"].item() == 1.0
    assert miss["sft/token_accuracy"].item() == 0.0


def test_flow_logprob_matches_an_independent_reference():
    """Recompute log p(chain) transition by transition with torch.distributions."""
    torch.manual_seed(4)
    policy = VLA(SPEC, tiny("flow", flow_steps=5, flow_noise_std=0.3))
    obs = random_observation(SPEC, 3)
    with torch.no_grad():
        out = policy.act(obs)
        ctx, _ = policy.context(obs)
        chain = out.extras["flow_chain"]  # [B, N+1, K, A]
        assert chain.shape == (3, 6, 3, 4)
        ref = torch.zeros(3)
        sigma = policy.head.log_sigma.exp()
        for i in range(5):
            x = chain[:, i]
            v = policy.head.velocity(x, torch.full((3,), i / 5), ctx)
            ref += (
                torch.distributions.Normal(x + v / 5, sigma).log_prob(chain[:, i + 1]).sum((1, 2))
            )
        # the executed action is the chain's end, clipped to [-1, 1], in physical units
        torch.testing.assert_close(out.actions, policy.to_physical(chain[:, -1].clamp(-1, 1)))
    torch.testing.assert_close(out.logprob, ref, atol=1e-4, rtol=1e-6)
    # the log-probability depends on the learned noise scale: a gradient reaches log_sigma
    logp, _, _ = policy.evaluate(obs, out)
    (g,) = torch.autograd.grad(logp.sum(), [policy.head.log_sigma])
    assert g.abs().sum() > 0


# flow's fit takes a minute on 2 cores: slow (SmolVLA's flow-matching fit runs by default)
BC_HEADS = [pytest.param(h, marks=pytest.mark.slow) if h == "flow" else h for h in HEADS]


@pytest.mark.parametrize("head", BC_HEADS)
def test_behaviour_cloning_fits_a_fixed_batch(head):
    torch.manual_seed(5)
    policy = VLA(
        SPEC, tiny(head, freeze_vision=True)
    )  # the heads and the fusion learn; fast on CPU
    obs = random_observation(SPEC, 6)
    low, high = SPEC.action.bounds()
    target = low + torch.rand(6, 3, 4) * (high - low)  # physical chunks
    flow = head == "flow"  # flow matching regresses a noisy target: a smaller step, more of them
    opt = torch.optim.Adam(policy.parameters(), lr=1e-3 if flow else 3e-3)
    losses = []
    for _ in range(300 if flow else 150):
        loss, _ = policy.bc_loss(obs, target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    # the flow loss samples noise and time: compare averages
    assert sum(losses[-10:]) < 0.3 * sum(losses[:10]), losses[::10]
    with torch.no_grad():  # deterministic actions approach the targets
        err = (policy.act(obs, deterministic=True).actions - target).abs() / (high - low)
    assert err.mean() < 0.1


@pytest.mark.parametrize("head", HEADS)
def test_the_behaviour_cloning_loss_ignores_the_steps_its_mask_drops(head):
    """A chunk's steps past its episode's end (mask 0) repeat the last action: the loss does not
    see them, whatever they hold; without the mask it would (the test can tell)."""
    torch.manual_seed(5)
    policy = VLA(SPEC, tiny(head))
    obs = random_observation(SPEC, 6)
    low, high = SPEC.action.bounds()
    target = low + torch.rand(6, 3, 4) * (high - low)  # physical chunks
    garbage = target.clone()
    garbage[:, -1] = high * 1e3  # (far outside the actions' range)
    mask = torch.ones(6, 3)
    mask[:, -1] = 0

    def loss(chunks, mask=None) -> torch.Tensor:
        torch.manual_seed(0)  # (the flow head draws its noise and time)
        return policy.bc_loss(obs, chunks, mask)[0]

    assert torch.equal(loss(garbage, mask), loss(target, mask))
    assert not torch.equal(loss(garbage), loss(target))


def assert_checkpoint_acts_alone(policy, cfg, spec, tmp_path, batch: int = 4) -> None:
    """Normalization set from data maps [-1, 1] onto the data's range; a policy rebuilt from the
    checkpoint alone (its config in meta, its weights and buffers) acts exactly as the original."""
    q01, q99 = torch.tensor([-0.05, -0.02, 0.0, 0.0]), torch.tensor([0.05, 0.02, 0.1, 0.04])
    policy.set_norm_stats(
        state=NormStats(mean=torch.full((8,), 2.0), std=torch.full((8,), 3.0)),
        action=NormStats(q01=q01, q99=q99),
    )
    obs = random_observation(spec, batch)
    with torch.no_grad():
        before = policy.act(obs, deterministic=True).actions
    assert bool(((before >= q01) & (before <= q99)).all())  # [-1, 1] maps onto the data's range
    ckpt = save_checkpoint(
        tmp_path, 1, model=policy, optimizer=None, counters={}, meta={"policy": vars(cfg)}
    )
    loaded = load_checkpoint(ckpt, with_trainer_state=False)
    torch.manual_seed(12345)  # a different random start: every weight must come from the checkpoint
    fresh = type(policy)(spec, type(cfg)(**loaded["meta"]["policy"]))
    fresh.load_state_dict(loaded["model"])
    torch.testing.assert_close(fresh.state_mean, torch.full((8,), 2.0))
    with torch.no_grad():
        torch.testing.assert_close(fresh.act(obs, deterministic=True).actions, before)


def test_checkpoint_round_trip_keeps_normalization(tmp_path):
    torch.manual_seed(6)
    cfg = tiny("gaussian")
    assert_checkpoint_acts_alone(VLA(SPEC, cfg), cfg, SPEC, tmp_path)


def test_a_constant_state_column_keeps_unit_scale_and_the_state_is_clipped():
    """A column (nearly) constant in the demos (std <= 1e-4) keeps std 1, not 1e-6, and the
    normalised state is clipped to +-10, as RunningNorm does for the actor-critic."""
    policy = VLA(SPEC, tiny("gaussian"))  # 5 state columns + goal_pos (3)
    mean = torch.tensor([0.0, 0.001, 2.0, 0.0, 0.0, 0.1, 0.1, 0.001])
    std = torch.tensor([0.5, 0.0, 1e-4, 2e-4, 1.0, 0.2, 0.2, 1e-7])
    policy.set_norm_stats(state=NormStats(mean=mean, std=std))
    expected_std = torch.tensor([0.5, 1.0, 1.0, 2e-4, 1.0, 0.2, 0.2, 1.0])
    torch.testing.assert_close(policy.state_std, expected_std)
    torch.testing.assert_close(policy.state_mean, mean)
    obs = random_observation(SPEC, 1)
    obs.state[:] = torch.tensor([[1.0, 0.0, 2.5, 0.001, -30.0]])
    obs.privileged["goal_pos"][:] = torch.tensor([[5.1, 0.2, 0.0]])  # goal z: 1 mm off the demos'
    z = policy.normalized_state(obs)
    expected = torch.tensor([[2.0, -0.001, 0.5, 5.0, -10.0, 10.0, 0.5, -0.001]])
    torch.testing.assert_close(z, expected)


def test_cached_instruction_embeddings_go_with_the_weights_they_came_from():
    """The frozen text encoder caches each instruction's embedding; loading other weights into
    it (load_state_dict copies in place) encodes again, so the policy acts as the one whose
    weights it loaded. A partial load without the text encoder keeps the cache."""
    torch.manual_seed(0)
    policy = VLA(SPEC, tiny("gaussian")).eval()
    torch.manual_seed(1)
    other = VLA(SPEC, tiny("gaussian")).eval()
    obs = random_observation(SPEC, 2)
    with torch.no_grad():
        policy.act(obs, deterministic=True)  # caches the embeddings of its own text weights
        policy.load_state_dict({"queries": other.queries}, strict=False)
        assert sorted(policy.text._cache) == sorted(set(obs.instruction))
        policy.load_state_dict(other.state_dict())
        # f32 [B, D] from the loaded weights, each instruction alone as the cache encodes it
        # (a batch pads them to one length: its last bits depend on the gemm's thread count)
        fresh = torch.stack([policy.text.encode([t])[0] for t in obs.instruction])
        torch.testing.assert_close(policy.text(obs.instruction), fresh, rtol=0, atol=0)
        torch.testing.assert_close(
            policy.act(obs, deterministic=True).actions, other.act(obs, deterministic=True).actions
        )


def test_bad_configs_are_refused():
    """The config's own values are ValueErrors (the loader names their key); what only the
    environment shows is a UserError naming the key: one line from the CLI, no traceback."""
    with pytest.raises(ValueError, match="head"):
        VLA(SPEC, tiny("diffusion"))
    with pytest.raises(ValueError, match=r"^flow_noise_std: must be > 0, got 0.0"):
        VLA(SPEC, tiny("flow", flow_noise_std=0.0))  # (its log is the head's log-std)
    no_camera = EnvSpec(obs=ObsSpec(state_names=("q",)), action=SPEC.action, max_episode_steps=5)
    with pytest.raises(UserError, match="^policy: a VLA needs camera images"):
        VLA(no_camera, tiny("gaussian"))
    sizes = (CameraSpec("base_camera", 64, 64), CameraSpec("hand_camera", 32, 32))
    two_sizes = EnvSpec(obs=ObsSpec(cameras=sizes), action=SPEC.action, max_episode_steps=5)
    with pytest.raises(UserError, match=r"^policy: .* same size .* \['32x32', '64x64'\]"):
        VLA(two_sizes, tiny("gaussian", privileged_keys=[]))
    with pytest.raises(UserError, match=r"^policy.privileged_keys: \['obj_pose'\] not among"):
        VLA(SPEC, tiny("gaussian", privileged_keys=["obj_pose"]))


def test_a_run_started_from_a_checkpoint_takes_its_configs_flow_noise(tmp_path):
    """SFT never trains the flow's noise std, so a GRPO run from its checkpoint kept SFT's
    initial one whatever ``policy.flow_noise_std`` said; the other weights are the checkpoint's.
    An RL checkpoint's noise std was trained: a run from it keeps it."""
    from types import SimpleNamespace

    from embodied.roles import init_policy

    sft = VLA(SPEC, tiny("flow", flow_noise_std=0.1))
    meta = {"config": {}, "spec": SPEC.to_dict(), "sft": {}}  # (what embodied sft writes)
    save_checkpoint(tmp_path / "sft", 1, model=sft, optimizer=None, counters={}, meta=meta)
    runner = SimpleNamespace(init_from=str(tmp_path / "sft" / "last"), resume=None)
    cfg = SimpleNamespace(policy=tiny("flow", flow_noise_std=0.3), runner=runner)
    policy = init_policy(cfg, SPEC, "cpu")
    torch.testing.assert_close(policy.head.log_sigma.exp(), torch.full((4,), 0.3))
    for name, value in sft.state_dict().items():
        if not name.endswith("log_sigma"):
            assert torch.equal(policy.state_dict()[name], value), name
    # an RL checkpoint's noise is trained: kept
    with torch.no_grad():
        sft.head.log_sigma.fill_(math.log(0.25))
    del meta["sft"]
    save_checkpoint(tmp_path / "rl", 1, model=sft, optimizer=None, counters={}, meta=meta)
    runner.init_from = str(tmp_path / "rl" / "last")
    torch.testing.assert_close(
        init_policy(cfg, SPEC, "cpu").head.log_sigma.exp(), torch.full((4,), 0.25)
    )


def test_a_random_text_encoder_of_any_width_builds():
    """text_hidden=50: 3 heads (one per 16 features) do not divide it, and BERT's ValueError
    was a traceback; 2 heads now, and a multiple of 16 keeps its heads (384: 24)."""
    from embodied.models.vla.backbones import _heads

    assert [_heads(h) for h in (50, 384, 32, 8, 17)] == [2, 24, 2, 1, 1]
    policy = VLA(SPEC, tiny("gaussian", text_hidden=50))
    assert policy.text.model.config.num_attention_heads == 2


def test_a_frozen_instructions_embedding_does_not_depend_on_the_others_beside_it():
    """Encoded in one padded batch, an instruction's embedding differed in its last bits with
    the longest one beside it (6e-8): a resumed run or `embodied eval`, whose first batch groups
    the instructions otherwise, acted on other numbers than the run it repeats."""
    from embodied.models.vla.backbones import MiniLMText

    short = "pick up the cube"
    long = "put the long red block on top of the small green plate near the bowl"
    encoders = []
    for _ in range(2):
        torch.manual_seed(0)
        encoders.append(MiniLMText(pretrained=False, hidden=32, layers=1).requires_grad_(False))
    alone, beside = encoders[0]([short])[0], encoders[1]([short, long])[0]
    assert torch.equal(alone, beside)


def test_pretrained_backbones_load_offline():
    """EfficientNet-Lite0 and all-MiniLM-L6-v2 come from their wheels, with no hub access."""
    sentence_transformers = pytest.importorskip("sentence_transformers")
    from embodied.models.vla.backbones import EfficientNetLite0, MiniLMText, minilm_path

    vision = EfficientNetLite0((64, 64), pretrained=True)
    n = sum(p.numel() for p in vision.parameters())
    assert 3.3e6 < n < 3.5e6, n  # 4.65M with the 1000-class classifier, which is dropped
    tokens = vision(torch.full((1, 64, 64, 3), 127, dtype=torch.uint8))
    assert tokens.shape == (1, 4, 1280) and torch.isfinite(tokens).all()

    text = MiniLMText(pretrained=True)
    sentences = ["push the cube to the red and white target", "pick up the cube"]
    ours = text(sentences)
    reference = sentence_transformers.SentenceTransformer(str(minilm_path()), device="cpu").encode(
        sentences, convert_to_tensor=True
    )
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-4)
    assert math.isclose(float(ours[0].detach() @ ours[0].detach()), 1.0, rel_tol=1e-5)
