"""``policy.compile_act``: the rollout's act through torch.compile samples what the eager act
samples from the same stream (up to float rounding), follows the weights as an update changes
them, and leaves deterministic actions eager. Compiling takes about 11 s on a CPU: slow there;
on a GPU (inductor's triton kernels) it is a ``gpu`` test. Without a compiler: one line."""

import pytest
import torch

from embodied.inference import InferencePolicy
from embodied.models import ActorCritic, ActorCriticConfig
from embodied.simulators.mujoco import MuJoCoConfig, make_env
from embodied.streams import Stream

DEVICES = [
    pytest.param("cpu", marks=pytest.mark.slow),
    pytest.param("cuda", marks=pytest.mark.gpu),
]


def assert_same_output(a, b):
    for name in ("actions", "logprob", "value"):
        torch.testing.assert_close(getattr(a, name), getattr(b, name), atol=1e-5, rtol=1e-5)
    for key in a.extras:
        torch.testing.assert_close(a.extras[key], b.extras[key], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_a_compiled_act_samples_what_eager_samples_and_follows_the_weights(device):
    env = make_env(MuJoCoConfig(task="push", num_envs=8))
    obs = env.reset(seed=0).map(lambda t: t.to(device))
    env.close()
    torch.manual_seed(0)
    policy = ActorCritic(env.spec, ActorCriticConfig(hidden_sizes=[32, 32])).to(device)
    eager = InferencePolicy(policy, stream=Stream.derived(0, "rollout", 0))
    compiled = InferencePolicy(policy, stream=Stream.derived(0, "rollout", 0), compile_act=True)
    first = [compiled.act(obs), compiled.act(obs)]
    assert_same_output(first[0], eager.act(obs))
    assert_same_output(first[1], eager.act(obs))
    # the second call drew new numbers from the stream
    assert not torch.allclose(first[0].actions, first[1].actions)
    # an update changes the weights in place; the compiled act sees it
    optimizer = torch.optim.Adam(policy.parameters(), lr=0.1)
    logprob, _, value = policy.evaluate(obs, first[0])
    (logprob.mean() + value.pow(2).mean()).backward()
    optimizer.step()
    after = compiled.act(obs)
    assert_same_output(after, eager.act(obs))
    assert not torch.allclose(after.value, first[0].value)
    # deterministic actions (evaluation) stay eager and draw nothing
    assert_same_output(compiled.act(obs, deterministic=True), eager.act(obs, deterministic=True))


def test_a_compiled_act_without_a_compiler_is_a_one_line_error(monkeypatch):
    from embodied.schema import UserError

    env = make_env(MuJoCoConfig(task="reach", num_envs=2))
    policy = ActorCritic(env.spec, ActorCriticConfig(hidden_sizes=[8]))
    env.close()
    monkeypatch.setenv("CXX", "no-such-compiler++")
    with pytest.raises(UserError, match=r"^policy.compile_act on a CPU needs a C\+\+ compiler"):
        InferencePolicy(policy, compile_act=True)
    monkeypatch.delenv("CXX")
    assert InferencePolicy(policy, compile_act=True).act  # g++ is here: built, compiles later
