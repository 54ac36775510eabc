"""The actor-critic passes the policy contract; normalization statistics are exact and saved."""

import math

import pytest
import torch

from embodied.contract import check_policy, random_observation
from embodied.models import ActorCritic, ActorCriticConfig, RunningNorm
from embodied.schema import ActionSpec, CameraSpec, EnvSpec, ObsSpec, UserError

STATE_SPEC = EnvSpec(
    obs=ObsSpec(state_names=("q0", "q1", "q2"), privileged={"goal": (3,), "pose": (7,)}),
    action=ActionSpec(
        "joint_delta", ("a0", "a1", "g"), (-0.1, -0.1, -0.01), (0.1, 0.1, 0.04), gripper=2
    ),
    max_episode_steps=10,
    instructions=("push the cube",),
)
RGB_SPEC = EnvSpec(
    obs=ObsSpec(cameras=(CameraSpec("base_camera", 64, 64),), state_names=("q0", "q1")),
    action=STATE_SPEC.action,
    max_episode_steps=10,
    instructions=("pick the cube",),
)


@pytest.mark.parametrize("spec", [STATE_SPEC, RGB_SPEC], ids=["state", "rgb"])
@pytest.mark.parametrize("chunk", [1, 4])
def test_check_policy(spec, chunk):
    torch.manual_seed(0)
    policy = ActorCritic(spec, ActorCriticConfig(hidden_sizes=[32, 32], chunk_size=chunk))
    report = check_policy(policy, spec, batch_size=4)
    assert report["chunk"] == chunk


def test_actions_are_squashed_into_physical_bounds():
    policy = ActorCritic(
        STATE_SPEC, ActorCriticConfig(hidden_sizes=[16], init_log_std=2.0)
    )  # wide: many saturate
    out = policy.act(random_observation(STATE_SPEC, 256))
    low, high = STATE_SPEC.action.bounds()
    assert bool((out.actions >= low).all() and (out.actions <= high).all())
    u = out.extras["raw_actions"]
    torch.testing.assert_close(out.actions, low + (torch.tanh(u) + 1) / 2 * (high - low))
    # u = 0 maps to the middle of the range, large |u| to the bounds
    torch.testing.assert_close(
        policy.to_physical(torch.tensor([[[-50.0, 0.0, 50.0]]])),
        torch.tensor([[[-0.1, 0.0, 0.04]]]),
    )


def test_squashed_logprob_matches_change_of_variables():
    torch.manual_seed(1)
    policy = ActorCritic(STATE_SPEC, ActorCriticConfig(hidden_sizes=[16], chunk_size=2))
    obs = random_observation(STATE_SPEC, 5)
    out = policy.act(obs)
    feats = policy.features(obs)
    mean, std = policy.actor(feats), policy.log_std.exp()
    u = out.extras["raw_actions"].reshape(5, -1).double()
    gauss = torch.distributions.Normal(mean.double(), std.double()).log_prob(u)
    expected = (gauss - torch.log1p(-(torch.tanh(u) ** 2))).sum(
        -1
    )  # log p(a) = log p(u) - log|da/du|
    torch.testing.assert_close(out.logprob.double(), expected, rtol=1e-5, atol=1e-4)


def test_running_norm_matches_batch_statistics():
    g = torch.Generator().manual_seed(0)
    chunks = [torch.randn(n, 5, generator=g) * 3 + 2 for n in (7, 100, 1, 40)]
    norm = RunningNorm(5)
    for c in chunks:
        norm.update(c)
    data = torch.cat(chunks)
    torch.testing.assert_close(norm.mean, data.mean(0), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(norm.var, data.var(0, unbiased=False), rtol=1e-4, atol=1e-4)
    assert float(norm.count) == 148
    # the statistics are part of the state dict, hence of every checkpoint
    fresh = RunningNorm(5)
    fresh.load_state_dict(norm.state_dict())
    x = torch.randn(3, 5)
    torch.testing.assert_close(fresh(x), norm(x))


def test_a_feature_constant_at_the_first_reset_starts_at_unit_variance_and_inputs_are_clipped():
    """Design note 35: the first batch sets the statistics, but a feature constant across it
    (velocities at rest) keeps variance 1, not 0 (every later value was blown up to the clip);
    later batches merge by Welford's rule; normalized inputs are clipped to +-10."""
    norm = RunningNorm(2)
    norm.update(torch.tensor([[0.0, 1.0], [0.0, 3.0]]))
    assert norm.mean.tolist() == [0.0, 2.0] and norm.var.tolist() == [1.0, 1.0]
    norm.update(torch.tensor([[0.5, 2.0]]))  # n = 1 onto count 2: delta (0.5, 0)
    expected_var = [(2 * 1 + 0.5**2 * 2 * 1 / 3) / 3, 2 * 1 / 3]
    torch.testing.assert_close(norm.var, torch.tensor(expected_var))
    torch.testing.assert_close(norm.mean, torch.tensor([0.5 / 3, 2.0]))
    out = norm(torch.tensor([[1e6, 0.0]]))
    assert out[0, 0] == 10.0
    torch.testing.assert_close(out[0, 1], torch.tensor(-2.0 / (2 / 3 + 1e-8) ** 0.5))


def test_normalizer_update_accepts_time_major_observations():
    policy = ActorCritic(STATE_SPEC, ActorCriticConfig(hidden_sizes=[8]))
    obs = random_observation(STATE_SPEC, 6).map(
        lambda t: t.view(2, 3, *t.shape[1:])
    )  # [T=2, B=3, ...]
    policy.update_normalizer(obs)
    assert float(policy.state_encoder.norm.count) == 6


def test_entropy_is_the_squashed_actions_and_falls_where_they_saturate():
    # the Gaussian's over u rose with its width without bound (2 * 6 * 0.5 nats from log_std
    # 0 to 1 over this chunk), though the actions pile onto their bounds
    torch.manual_seed(0)
    obs = random_observation(STATE_SPEC, 4096)
    mean_entropy = {}
    for log_std in (0.0, 1.0, 2.0):
        config = ActorCriticConfig(hidden_sizes=[8], chunk_size=2, init_log_std=log_std)
        policy = ActorCritic(STATE_SPEC, config)
        out = policy.act(obs)
        _, ent, _ = policy.evaluate(obs, out)  # f32 [B]
        u = out.extras["raw_actions"].reshape(4096, -1)
        mean = policy.actor(policy.features(obs))
        log_det = -2 * (u.abs() + torch.log1p(torch.exp(-2 * u.abs())) - math.log(2)).sum(1)
        gaussian = torch.distributions.Normal(mean, torch.full((6,), log_std).exp())
        torch.testing.assert_close(ent, gaussian.entropy().sum(1) + log_det, atol=1e-4, rtol=0)
        mean_entropy[log_std] = ent.mean().item()
    # 6 dimensions of the quadrature's 0.670, -0.765, -7.074 per dimension (mean near 0)
    assert mean_entropy[0.0] == pytest.approx(6 * 0.670, abs=0.1)
    assert mean_entropy[1.0] == pytest.approx(6 * -0.765, abs=0.2)
    assert mean_entropy[2.0] == pytest.approx(6 * -7.074, abs=1.0)


def test_images_smaller_than_the_cnn_takes_are_a_user_error_naming_env_image_size():
    """The CNN's convolutions (8/4, 4/2, 3/1) need 36 pixels a side: a smaller camera is a
    UserError (one line from the CLI) before conv2d's RuntimeError; 36 acts."""

    def rgb(side: int) -> EnvSpec:
        cams = (CameraSpec("base_camera", side, side),)
        return EnvSpec(
            obs=ObsSpec(cameras=cams, state_names=("q0",)),
            action=STATE_SPEC.action,
            max_episode_steps=10,
        )

    cfg = ActorCriticConfig(hidden_sizes=[8])
    with pytest.raises(UserError, match=r"^env.image_size: .* at least 36x36 pixels, got 35x35"):
        ActorCritic(rgb(35), cfg)
    out = ActorCritic(rgb(36), cfg).act(random_observation(rgb(36), 2))
    assert out.actions.shape == (2, 1, 3)
